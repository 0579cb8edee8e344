"""Cached decoding equals a full forward pass; padded batches equal single rows; sdpa is kept."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_neox

import ctxext

L0 = 64
METHODS = [("pi", 4), ("ntk", 4), ("dynamic-ntk", 4), ("yarn", 4), ("llama3", 4), ("extrapolate", 4), (None, None)]


def _no_eos(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("method,factor", METHODS)
def test_greedy_generate_with_cache_equals_full_forward(model_fn, method, factor):
    model = _no_eos(model_fn())
    if method:
        ctxext.patch(model, method, factor)
    prompt = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    new = 40  # the sequence ends at 90 > L0
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    sequence = out.sequences
    assert sequence.shape[1] == 50 + new
    full = model(sequence).logits[0, 49:-1]  # the logits that predicted each new token
    steps = torch.cat(out.logits)
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=0)
    assert torch.equal(full.argmax(-1), sequence[0, 50:])


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
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(1, 128, (n,), generator=gen) for n in (110, 80)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):  # left padding, as for generation
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # dynamic-ntk: a batch shares one scale (from its longest row); fix it for the single rows too
    hint = ctxext.dynamic_length(model, width) if method == "dynamic-ntk" else _nullcontext()
    with hint:
        batch = model(ids, attention_mask=mask, position_ids=positions).logits
        for i, r in enumerate(rows):
            single = model(r[None]).logits[0]
            torch.testing.assert_close(batch[i, width - len(r) :], single, atol=1e-5, rtol=0)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


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
