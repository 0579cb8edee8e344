"""Evaluation: long-context perplexity, passkey retrieval, and the `ctxext eval` engine."""

from .perplexity import perplexity, score_documents

__all__ = ["perplexity", "score_documents"]
