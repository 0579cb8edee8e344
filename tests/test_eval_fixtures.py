"""Offline fixtures for the evaluator tests: a tiny BPE tokenizer and tiny saved models.

Helpers only (imported by the other test_eval_* modules), plus a check that the tokenizer round-trips.
"""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import rope_kwargs

DATA = Path(__file__).parent / "data"
CORPUS = DATA / "eval_corpus.txt"
VOCAB = 300


def build_tokenizer(directory: Path) -> Path:
    """Train a byte-level BPE on the test corpus and save it as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return directory


def save_tiny_llama(directory: Path, seed: int = 0, max_positions: int = 64) -> Path:
    """A tiny random LLaMA (rotary) with the test tokenizer, saved to ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions,
        **rope_kwargs(LlamaConfig, {"rope_type": "default", "rope_theta": 500.0}), attn_implementation="sdpa",
        eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(directory)
    build_tokenizer(directory)
    return directory


def save_tiny_gpt2(directory: Path, seed: int = 0, max_positions: int = 64) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=max_positions,
                     eos_token_id=0, bos_token_id=0, pad_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(directory)
    build_tokenizer(directory)
    return directory


def test_tokenizer_roundtrip(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = CORPUS.read_text()[:500]
    ids = tok(text)["input_ids"]
    assert 0 < len(ids) < len(text) and max(ids) < VOCAB
    assert tok.decode(ids) == text
