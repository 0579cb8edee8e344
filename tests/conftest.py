"""Shared fixtures: tiny models built from configs (no hub access), and the real SmolLM2 for slow tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch


def _takes_rope_parameters(config_class) -> bool:
    import inspect

    return "rope_parameters" in inspect.signature(config_class.__init__).parameters


def rope_kwargs(config_class, rope: dict) -> dict:
    """Config kwargs for RoPE settings written as a 5.x ``rope_parameters`` dict, in the API ``config_class`` has:
    ``rope_parameters`` (5.x) or ``rope_theta`` / ``rotary_emb_base`` + ``partial_rotary_factor`` / ``rotary_pct``
    + ``rope_scaling`` (4.x)."""
    import inspect

    if _takes_rope_parameters(config_class):
        return {"rope_parameters": dict(rope)}
    rope = dict(rope)
    params = inspect.signature(config_class.__init__).parameters
    kw = {}
    if "rope_theta" in rope:
        kw["rope_theta" if "rope_theta" in params else "rotary_emb_base"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        kw["partial_rotary_factor" if "partial_rotary_factor" in params else "rotary_pct"] = rope.pop(
            "partial_rotary_factor")
    kw["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return kw


def rope_settings(config) -> dict:
    """A config's RoPE settings as one 5.x-style dict, whichever API the config has."""
    if _takes_rope_parameters(type(config)):
        return dict(config.rope_parameters)
    theta = getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", None)
    return {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": theta}


def set_rope(config, rope: dict) -> None:
    """Give ``config`` these RoPE settings (a 5.x ``rope_parameters`` dict, merged over its own)."""
    merged = {**rope_settings(config), **rope}
    for key, value in rope_kwargs(type(config), merged).items():
        setattr(config, key, value)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": overrides.pop("rope_theta", 500.0)}
    rope.update(overrides.pop("rope_parameters", {}))
    kw = dict(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        head_dim=16,  # head_dim != hidden / heads
        max_position_embeddings=64,
        **rope_kwargs(LlamaConfig, rope),
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
        **rope_kwargs(GPTNeoXConfig, rope),
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


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """BLOOM's own ALiBi slopes, from whichever surface this transformers has: the module-level slope function
    (5.x releases that define it) or the ALiBi tensor of one key at position 1 (every release)."""
    from transformers.models.bloom import modeling_bloom

    function = getattr(modeling_bloom, "_get_alibi_slopes", None)
    if callable(function):
        return function(num_heads, torch.device("cpu"))
    return modeling_bloom.build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]


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


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """ctxext's own cache (lm-eval's task-name index) goes to a folder of this test session, not the user's home."""
    import os

    if "CTXEXT_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["CTXEXT_CACHE_DIR"] = str(tmp_path_factory.mktemp("ctxext-cache"))
    try:
        yield
    finally:
        os.environ.pop("CTXEXT_CACHE_DIR", None)
