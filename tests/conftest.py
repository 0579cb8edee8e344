"""Shared fixtures: tiny models built from configs (no hub access), and the real SmolLM2 for slow tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

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


def tiny_gpt2(seed: int = 0, **overrides):
    """GPT-2 with 12 heads (head_dim 4) and a 32-row position table."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=128,
        n_embd=48,
        n_layer=2,
        n_head=12,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    kw.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**kw)).eval()


def tiny_bloom(seed: int = 0, **overrides):
    """BLOOM with 9 heads (not a power of two; head_dim 4). BLOOM is eager-only in transformers 5.x."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=128, hidden_size=36, n_layer=2, n_head=9, bos_token_id=0, eos_token_id=1)
    kw.update(overrides)
    return BloomForCausalLM(BloomConfig(**kw)).eval()


@pytest.fixture
def gpt2():
    return tiny_gpt2()


@pytest.fixture
def bloom():
    return tiny_bloom()


SMOLLM2_TOOL = Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "smollm2.sh"


def smollm2_gguf() -> Path:
    """The real SmolLM2-135M GGUF (trained to 8192) for the slow tests; skipped where ../shared is not mounted."""
    if not SMOLLM2_TOOL.exists():
        pytest.skip(f"{SMOLLM2_TOOL} not found: the slow SmolLM2 tests need the project's shared tools")
    out = subprocess.run(["bash", str(SMOLLM2_TOOL)], capture_output=True, text=True, check=True).stdout
    return Path(out.strip().splitlines()[-1])
