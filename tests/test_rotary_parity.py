"""Rotary methods against transformers' own rope types, and the formulas where transformers has none."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import rope_settings, set_rope, tiny_llama, tiny_neox

import ctxext
from ctxext.adapters.rotary_units import rotary_modules

L0 = 64  # max_position_embeddings of the tiny models
SEQ = 200  # > 3 x L0: well past the original length


def _reference(model, rope_parameters: dict):
    """The same weights configured with transformers' own rope type (L0 as the original length)."""
    config = copy.deepcopy(model.config)
    set_rope(config, rope_parameters)
    if "original_max_position_embeddings" in rope_parameters:
        config.max_position_embeddings = 4 * L0  # transformers wants original < max
    other = type(model)(config).eval()
    other.load_state_dict(model.state_dict())
    return other


TRANSFORMERS_EQUIVALENTS = [
    ("pi", 4.0, {}, {"rope_type": "linear", "factor": 4.0}),
    ("linear", 2.5, {}, {"rope_type": "linear", "factor": 2.5}),
    ("dynamic-ntk", 4.0, {}, {"rope_type": "dynamic", "factor": 4.0}),
    ("yarn", 4.0, {}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}),
    (
        "yarn",
        8.0,
        {"beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": L0,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.3,
        },
    ),
    (
        "llama3",
        4.0,
        {},
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": L0,
        },
    ),
]

MODELS = {
    "llama-gqa-theta500": lambda: tiny_llama(),  # GQA, head_dim != hidden/heads, rope_theta 500
    "neox-partial-rotary": lambda: tiny_neox(),  # partial rotary (8 of 16 dims), rope_theta 10000
    "neox-theta25000": lambda: tiny_neox(rope_parameters={"rope_theta": 25000.0}),
}


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("method,factor,options,reference", TRANSFORMERS_EQUIVALENTS)
def test_logits_match_transformers_rope_type(model_name, method, factor, options, reference):
    model = MODELS[model_name]()
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = _reference(model, reference)(ids).logits
    ctxext.patch(model, method, factor, **options)
    got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_wrong_factor_would_be_caught():
    """The parity test can fail: a different factor gives visibly different logits."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    expected = _reference(model, {"rope_type": "linear", "factor": 4.0})(ids).logits
    ctxext.patch(model, "pi", 3.5)
    assert (model(ids).logits - expected).abs().max() > 1e-3


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
def test_ntk_matches_its_formula(model_fn, factor):
    model = model_fn()
    (_, module), *_ = rotary_modules(model)
    dim = 2 * module.inv_freq.numel()
    base = rope_settings(model.config)["rope_theta"]
    ctxext.patch(model, "ntk", factor)
    new_base = base * factor ** (dim / (dim - 2))
    expected = 1.0 / (new_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    for _, module in rotary_modules(model):
        torch.testing.assert_close(module.inv_freq.double(), expected, atol=1e-7, rtol=0)
        assert module.attention_scaling == 1.0


@pytest.mark.parametrize("method", ["pi", "ntk", "dynamic-ntk", "yarn", "llama3", "extrapolate"])
@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_neox])
def test_factor_one_is_bit_exact(model_fn, method):
    model = model_fn()
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(2))
    before = model(ids).logits
    ctxext.patch(model, method, 1)
    assert torch.equal(model(ids).logits, before)
    assert model.config.max_position_embeddings == L0


def test_yarn_sets_attention_temperature():
    model = tiny_llama()
    ctxext.patch(model, "yarn", 4)
    import math

    for _, module in rotary_modules(model):
        assert module.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)


def test_pi_divides_every_frequency():
    model = tiny_llama()
    (_, module), *_ = rotary_modules(model)
    original = module.inv_freq.clone()
    ctxext.patch(model, "pi", 4)
    torch.testing.assert_close(module.inv_freq, original / 4, atol=0, rtol=1e-7)


@pytest.mark.parametrize("method,factor,options,reference",
                         [c for c in TRANSFORMERS_EQUIVALENTS if c[0] != "dynamic-ntk"])
def test_a_model_cast_to_bfloat16_patches_bit_for_bit_like_the_native_rope_type(method, factor, options, reference):
    """``model.to(torch.bfloat16)`` rounds the rotary buffers too: the patch still recognises plain RoPE, scales the
    float32 frequencies and gives exactly what the native rope type gives after the same cast."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _reference(model, reference).to(torch.bfloat16)(ids).logits
        ctxext.patch(model.to(torch.bfloat16), method, factor, **options)
        assert torch.equal(model(ids).logits, expected)


def test_a_bfloat16_model_at_factor_1_and_after_unpatch_is_unchanged():
    model = tiny_llama().to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        ctxext.patch(model, "yarn", 1.0)
        assert torch.equal(model(ids).logits, before)
        ctxext.unpatch(model)
        ctxext.patch(model, "ntk", 4.0)
        assert not torch.equal(model(ids).logits, before)
        ctxext.unpatch(model)
        assert torch.equal(model(ids).logits, before)



def test_an_unknown_float32_frequency_formula_is_still_called_unknown():
    model = tiny_llama()
    for _, module in rotary_modules(model):
        module.inv_freq.mul_(1.01)
        module.original_inv_freq.mul_(1.01)
    with pytest.raises(ctxext.PatchError, match="does not know this rotary variant"):
        ctxext.patch(model, "ntk", 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_cast_to_half_and_back_is_refused_naming_the_cast_where_the_cast_rounded_its_frequencies(dtype):
    """``.to(bfloat16).float()``: transformers 5.x keeps the original frequencies in a buffer, which the cast rounds
    for good; the refusal names the cast (it said "unknown rotary variant") and changes nothing. 4.x keeps them in a
    plain attribute the cast leaves alone, and the patch starts from those."""
    model = tiny_llama().to(dtype).float()
    (_, module), *_ = rotary_modules(model)
    fresh = dict(rotary_modules(tiny_llama()))
    rounded = not torch.equal(module.original_inv_freq, next(iter(fresh.values())).original_inv_freq)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        if not rounded:
            ctxext.patch(model, "ntk", 4)
            assert ctxext.describe(model)["method"] == "ntk"
            return
        name = str(dtype).removeprefix("torch.")
        with pytest.raises(ctxext.PatchError, match=f"rounded to {name}: the model was cast to {name} and back"):
            ctxext.patch(model, "ntk", 4)
        assert ctxext.describe(model) is None and torch.equal(model(ids).logits, before)
