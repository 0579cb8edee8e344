"""Cached decoding equals a full forward pass; padded batches equal single rows; sdpa is kept."""

from __future__ import annotations

import contextlib

import pytest
import torch
from checks import generate_equals_full_forward, padded_batch_equals_single_rows
from conftest import tiny_llama, tiny_neox

import ctxext

L0 = 64
METHODS = [("pi", 4), ("ntk", 4), ("dynamic-ntk", 4), ("yarn", 4), ("llama3", 4), ("extrapolate", 4), (None, None)]


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("method,factor", METHODS)
def test_greedy_generate_with_cache_equals_full_forward(model_fn, method, factor):
    model = model_fn()
    if method:
        ctxext.patch(model, method, factor)
    generate_equals_full_forward(model, prompt_len=50, new=40)  # the sequence ends at 90 > L0


def test_dynamic_manual_decode_with_length_hint_equals_full_forward():
    model = tiny_llama()
    ctxext.patch(model, "dynamic-ntk", 4)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(5))
    full = model(ids).logits
    with ctxext.dynamic_length(model, 120):
        out = model(ids[:, :70], use_cache=True)
        logits = [out.logits]
        cache = out.past_key_values
        for t in range(70, 120):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_neox])
def test_a_dynamic_pass_does_not_depend_on_the_passes_before_it(model_fn):
    """The frequencies a per-sequence method starts from are a copy: on transformers 4.x original_inv_freq is the
    inv_freq buffer itself, which each pass rewrites, so a pass at 120 after one at 60 drifted (by 2e-3 here)."""
    model = model_fn()
    ctxext.patch(model, "dynamic-ntk", 4)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(5))
    first = model(ids).logits
    model(ids[:, :60])
    model(ids[:, :100])
    assert torch.equal(model(ids).logits, first)


@pytest.mark.parametrize("inner", ["generate", "dynamic_length"])
def test_a_nested_plan_hands_the_outer_length_back(inner):
    """A generate or a shorter dynamic_length inside dynamic_length(120): once it returns, the manual decode is still
    planned for 120 (the inner one's release set "no plan", and the decode drifted from the full pass by ~5)."""
    model = tiny_llama()
    ctxext.patch(model, "dynamic-ntk", 4)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(5))
    full = model(ids).logits
    with ctxext.dynamic_length(model, 120):
        if inner == "generate":
            model.generate(ids[:, :10], max_new_tokens=2, do_sample=False)
        else:
            with ctxext.dynamic_length(model, 50):
                pass
        out = model(ids[:, :70], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(70, 120):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("length", [0, -5, 2.7, True, "abc", None, float("nan")])
def test_dynamic_length_refuses_a_length_that_is_not_a_count_of_tokens(length):
    model = tiny_llama()
    ctxext.patch(model, "dynamic-ntk", 4)
    with pytest.raises(ctxext.PatchError, match="a whole number >= 1"):
        ctxext.dynamic_length(model, length).__enter__()


def test_dynamic_cache_never_mixes_rotations():
    """Without a hint the scale stays fixed at the prefill's length for the whole cached decode.

    Dynamic NTK at length L is static NTK with scale s = f * L / L0 - (f - 1), so the expected logits are a
    full pass of the same weights patched with static NTK at s(70).
    """
    model = tiny_llama()
    ctxext.patch(model, "dynamic-ntk", 4)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(6))
    out = model(ids[:, :70], use_cache=True)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(70, 120):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
    reference = tiny_llama()
    ctxext.patch(reference, "ntk", 4 * 70 / L0 - 3)
    torch.testing.assert_close(torch.cat(logits, 1), reference(ids).logits, atol=1e-4, rtol=0)
    # and a full pass over all 120 tokens uses the larger scale: different logits
    assert (model(ids).logits - reference(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("method,factor", [("pi", 4), ("yarn", 4), ("ntk", 4), ("dynamic-ntk", 4), (None, None)])
def test_padded_batch_equals_single_rows(method, factor):
    model = tiny_llama()
    if method:
        ctxext.patch(model, method, factor)
    # dynamic-ntk: a batch shares one scale (from its longest row); fix it for the single rows too
    hint = ctxext.dynamic_length(model, 110) if method == "dynamic-ntk" else contextlib.nullcontext()
    with hint:
        padded_batch_equals_single_rows(model, lengths=(110, 80))


@pytest.mark.parametrize("method", ["pi", "ntk", "dynamic-ntk", "yarn", "llama3"])
def test_patched_model_runs_sdpa_kernel(method):
    model = tiny_llama()
    ctxext.patch(model, method, 4)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 128, (1, 100))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(ids)
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names


def test_dynamic_scale_is_fixed_once_per_forward_pass_of_the_model():
    """A model may own a second rotary module that it first calls mid-pass with positions of its own starting at 0
    (DeepSeek-V4's compressors rotate entries at 0, r, 2r, ...). Every rotary module must take the scale the pass
    fixed from the sequence: the full pass equals cached decoding (which knows the total length)."""
    import copy

    model = tiny_llama()
    model.model.second_rotary = copy.deepcopy(model.model.rotary_emb)  # patched like the first
    ctxext.patch(model, "dynamic-ntk", 4)
    second = model.model.second_rotary

    def add_second_rotation(module, args, output):  # layer 0 output + the second module's rotation at 0..69
        hidden = output[0] if isinstance(output, tuple) else output
        cos, _ = second(hidden, torch.arange(70)[None])
        hidden = hidden + cos.mean()
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(7))
    extra = model.model.layers[0].register_forward_hook(add_second_rotation)
    try:
        with torch.no_grad():
            full = model(ids).logits
            with ctxext.dynamic_length(model, 200):
                out = model(ids[:, :150], use_cache=True)
                logits, cache = [out.logits], out.past_key_values
                for t in range(150, 200):
                    out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                    logits.append(out.logits)
                    cache = out.past_key_values
    finally:
        extra.remove()
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-4, rtol=0)
    # outside a pass of the patched model (a rotary module called on its own) every call still sets the scale
    second(torch.zeros(1, 70, 8), torch.arange(70)[None])
    assert second._ctxext_dynamic.sequence.length == 70


def test_dynamic_ntk_on_deepseek_v4_decodes_like_its_full_pass():
    """Its compressors have rotary modules of their own, first called mid-pass: one scale for all of them."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from ctxext import census

    (row,) = census.run_census(["deepseek_v4"], ["dynamic-ntk"])
    assert row.status == "ok", row.reason
    if any(c.startswith("cache n/a") for c in row.checks):  # e.g. 5.12: its unpatched cached decode differs already
        pytest.skip(f"this transformers' DeepSeek-V4: {row.checks}")
    assert "cache" in row.checks


@pytest.mark.parametrize("method", [None, "pi", "yarn"])
def test_dynamic_length_refuses_a_model_without_dynamic_ntk(method):
    model = tiny_llama()
    if method:
        ctxext.patch(model, method, 4)
    with pytest.raises(ctxext.PatchError, match="dynamic_length needs a model patched with method 'dynamic-ntk'"):
        with ctxext.dynamic_length(model, 100):
            pass
