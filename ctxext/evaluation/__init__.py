"""Evaluation: long-context perplexity, passkey retrieval, and the `ctxext eval` engine."""

from .evaluate import evaluate
from .perplexity import perplexity, score_documents
from .request import EvalRequest
from .result_set import EvalResults

__all__ = ["EvalRequest", "EvalResults", "evaluate", "perplexity", "score_documents"]
