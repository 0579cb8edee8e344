"""The log-sum-exp path of the remap attention (``ctxext.lse_attention``, ``remap_attention.LSE_PATH``): band + far
attention on the fused CPU flash kernel for maps that declare ``band_far``.

The dense reference here is written from the definition (rotation 0 for distances below ``near``, rotation 1 from
it on, causal, one softmax) and shares nothing with the module; end to end, a patched model's logits with the path
on equal those with it off (the chunked path, itself checked against the papers' definitions in test_remap.py), and
a call counter makes sure the path was taken (or not, where it must not be).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_llama

import ctxext.lse_attention as lse_attention
import ctxext.remap_attention as remap_attention
from ctxext.adapters.remap import apply_remap
from ctxext.methods.remap import build_map

pytestmark = pytest.mark.skipif(not lse_attention.available(), reason="the CPU flash op is not pinned for this torch")

L0 = 64  # tiny_llama's trained length


def _dense(q0, q1, k0, k1, v, near, scale):
    """(batch, T, heads, dim) in float64: scores under rotation 0 for 0 <= i - j < near, rotation 1 beyond, causal."""
    q0, q1, k0, k1, v = (t.double() for t in (q0, q1, k0, k1, v))
    heads, kv_heads, T = q0.shape[1], k0.shape[1], q0.shape[2]
    rep = heads // kv_heads  # query head h reads key head h // rep (transformers' repeat_kv)
    k0, k1, v = (t.repeat_interleave(rep, dim=1) for t in (k0, k1, v))
    i = torch.arange(T)
    d = i[:, None] - i[None, :]
    s = torch.where(d < near, q0 @ k0.transpose(-1, -2), q1 @ k1.transpose(-1, -2)) * scale
    s = s.masked_fill(d < 0, -math.inf)
    return (s.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("T,near,batch", [(300, 64, 2), (517, 64, 1), (600, 250, 2), (400, 1, 1), (129, 128, 1)])
def test_band_far_matches_the_dense_definition(T, near, batch):
    g = torch.Generator().manual_seed(T + near)
    heads, kv_heads, dim = 4, 2, 16  # GQA
    q0, q1 = torch.randn(2, batch, heads, T, dim, generator=g).unbind(0)
    k0, k1, v = torch.randn(3, batch, kv_heads, T, dim, generator=g).unbind(0)
    out = lse_attention.band_far_attention((q0, q1), (k0, k1), v, near, dim**-0.5)
    assert out.shape == (batch, T, heads, dim) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), _dense(q0, q1, k0, k1, v, near, dim**-0.5), atol=1e-5, rtol=0)


def test_band_far_with_several_band_blocks_and_a_partial_last_one(monkeypatch):
    monkeypatch.setattr(lse_attention, "BAND_BLOCK", 48)
    monkeypatch.setattr(lse_attention, "MIN_BAND_BLOCK", 16)
    g = torch.Generator().manual_seed(1)
    q0, q1 = torch.randn(2, 1, 4, 333, 16, generator=g).unbind(0)
    k0, k1, v = torch.randn(3, 1, 2, 333, 16, generator=g).unbind(0)
    for near in (5, 48, 100):  # blocks of 16, 48 and 48 rows (333 is no multiple of any)
        out = lse_attention.band_far_attention((q0, q1), (k0, k1), v, near, 0.3)
        torch.testing.assert_close(out.double(), _dense(q0, q1, k0, k1, v, near, 0.3), atol=1e-5, rtol=0)


def test_band_far_bfloat16_is_close_to_the_dense_definition():
    g = torch.Generator().manual_seed(2)
    q0, q1 = torch.randn(2, 1, 4, 300, 16, generator=g).bfloat16().unbind(0)
    k0, k1, v = torch.randn(3, 1, 2, 300, 16, generator=g).bfloat16().unbind(0)
    out = lse_attention.band_far_attention((q0, q1), (k0, k1), v, 64, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _dense(q0, q1, k0, k1, v, 64, 0.25), atol=2e-2, rtol=0)


def test_the_declared_band_far_maps_have_that_shape():
    cases = {
        ("self-extend", 8, ()): True,
        ("rerope", 8, ()): True,
        ("rerope", 8, (("leaky", 4.0),)): True,
        ("string", None, ()): True,
        ("dca", 8, ()): False,
        ("lm-infinite", 8, ()): False,
        ("streaming-llm", 8, ()): False,
    }
    i = torch.arange(400)[:, None]
    j = torch.arange(400)[None, :]
    for (method, factor, options), declared in cases.items():
        pmap = build_map(method, L0, factor, **dict(options))
        assert pmap.band_far is declared, method
        if declared:
            assert len(pmap.rotations) == 2 and pmap.rotations[0].is_identity and pmap.near == int(pmap.near)
            which = pmap.select(i, j)
            d = i - j
            causal = d >= 0
            assert bool((which[causal & (d < pmap.near)] == 0).all()), method
            assert bool((which[d >= pmap.near] == 1).all()), method
    # identity settings stay identity maps, not band_far
    assert not build_map("self-extend", L0, 1).band_far


def test_is_causal_mask_check():
    T = 50
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    assert remap_attention._is_causal(causal)
    assert remap_attention._is_causal(causal.expand(3, T, T))
    padded = causal.clone()
    padded[:, :, 0] = False
    padded[:, 0, 0] = True  # row 0 still sees itself; the others miss key 0
    assert not remap_attention._is_causal(padded)
    extra = causal.clone()
    extra[0, 10, 20] = True
    assert not remap_attention._is_causal(extra)
    windowed = causal & torch.ones(T, T, dtype=torch.bool).triu(-9)
    assert not remap_attention._is_causal(windowed)
    swapped = causal.clone()  # right count per row, wrong keys
    swapped[0, 30, 3], swapped[0, 30, 31] = False, True
    assert not remap_attention._is_causal(swapped)
    batch = torch.cat([causal, padded])
    assert not remap_attention._is_causal(batch)


def _counting(monkeypatch):
    calls = []
    real = remap_attention.band_far_attention

    def counted(*args, **kwargs):
        calls.append(args[0][0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(remap_attention, "band_far_attention", counted)
    return calls


CASES = [("self-extend", 8, {}), ("rerope", 8, {}), ("rerope", 8, {"leaky": 4.0}), ("string", None, {})]


@pytest.mark.parametrize("method,factor,options", CASES)
def test_patched_model_logits_equal_the_chunked_path(monkeypatch, method, factor, options):
    monkeypatch.setattr(remap_attention, "LSE_MIN_LEN", 64)
    calls = _counting(monkeypatch)
    model = tiny_llama()
    apply_remap(model, method, factor, options)
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = model(ids).logits
        assert len(calls) == model.config.num_hidden_layers  # every layer took the new path
        monkeypatch.setattr(remap_attention, "LSE_PATH", False)
        slow = model(ids).logits
    assert len(calls) == model.config.num_hidden_layers  # and the switch turned it off
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


def test_below_the_length_threshold_the_chunked_path_runs(monkeypatch):
    calls = _counting(monkeypatch)
    model = tiny_llama()
    apply_remap(model, "self-extend", 8, {})
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 300)))
    assert remap_attention.LSE_MIN_LEN > 300 and not calls


def test_gradients_padding_and_cached_decoding_take_the_chunked_path(monkeypatch):
    monkeypatch.setattr(remap_attention, "LSE_MIN_LEN", 64)
    calls = _counting(monkeypatch)
    model = tiny_llama()
    apply_remap(model, "self-extend", 8, {})
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(4))
    # with autograd: the chunked path, whose gradients test_remap.py checks
    out = model(ids).logits
    out.sum().backward()
    assert not calls and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    with torch.no_grad():
        fast = model(ids).logits
    assert len(calls) == 2
    torch.testing.assert_close(out.detach(), fast, atol=1e-5, rtol=0)
    calls.clear()
    # left padding: positions are not 0 .. T-1 in every row
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert not calls
    # cached decoding: the prefill takes the path, the decoding steps do not
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids[:1]))
    assert len(calls) == 2 and all(shape[2] == 300 for shape in calls)


def test_methods_without_the_shape_never_take_the_path(monkeypatch):
    monkeypatch.setattr(remap_attention, "LSE_MIN_LEN", 64)
    calls = _counting(monkeypatch)
    for method in ("dca", "lm-infinite", "streaming-llm"):
        model = tiny_llama()
        apply_remap(model, method, 8, {})
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 300)))
    assert not calls


def test_the_causal_mask_check_reads_a_new_mask_anew():
    from ctxext import remap_attention as ra

    t = 6
    causal = torch.ones(1, t, t, dtype=torch.bool).tril()
    assert ra._is_causal(causal) and ra._is_causal(causal)  # the second answer from the cache
    padded = causal.clone()
    padded[0, :, 0] = False  # a left-padded row: not the causal mask
    assert not ra._is_causal(padded)
    causal[0, 3, 0] = False  # changed in place: read again
    assert not ra._is_causal(causal)
