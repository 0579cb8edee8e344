"""Shared fixtures: tiny models built from configs (no hub access)."""

from __future__ import annotations

import pytest
import torch


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": overrides.pop("rope_theta", 500.0)}
    kw = dict(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        head_dim=16,  # head_dim != hidden / heads
        max_position_embeddings=64,
        rope_parameters=rope,
        attn_implementation="sdpa",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def tiny_neox(seed: int = 0, **overrides):
    """GPT-NeoX with partial rotary (rotary dim 8 of head_dim 16)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    rope.update(overrides.pop("rope_parameters", {}))
    cfg = GPTNeoXConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rope_parameters=rope,
        attn_implementation="sdpa",
        **overrides,
    )
    return GPTNeoXForCausalLM(cfg).eval()


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def neox():
    return tiny_neox()
