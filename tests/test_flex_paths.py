"""The flex-attention paths (``ctxext.attention.flex_paths``) against the existing chunked-sdpa attention functions.

On CPU flex runs eagerly (``CTXEXT_FLEX=force``), so these compare outputs at small lengths in float32; the GPU
tests (marked ``gpu``) compare the compiled CUDA path at 4096 tokens in float32 and bfloat16. References run with
``CTXEXT_FLEX=0``, so the comparisons stay meaningful once the flex calls are wired into the existing functions.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings

import pytest
import torch
from torch import nn

from conftest import rope_kwargs

import ctxext.attention as A
import ctxext.attention.flex_functions as FF
import ctxext.attention.flex_paths as FP
import ctxext.attention.remap as R
from ctxext.attention.alibi import ALIBI_MARK
from ctxext.methods.remap import build_map

pytestmark = [
    pytest.mark.skipif(FP._flex_module() is None, reason="this torch has no flex attention"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

L0 = 64
# (method, factor, options): every map has pairs under both rotations at T = 200 (and lm-infinite masks some)
METHODS = [
    ("self-extend", 4, {}),
    ("self-extend", 4, {"group": 3, "window": 20}),
    ("rerope", 4, {}),  # clipped, log-scaled queries
    ("rerope", 4, {"leaky": 4.0, "window": 24}),
    ("lm-infinite", 4, {"window": 40, "global_tokens": 5}),
    ("streaming-llm", 4, {"sinks": 4, "window": 36}),
    ("string", None, {"shift": 40, "local": 8}),
    ("dca", 4, {}),
    ("dca", 4, {"chunk_size": 40, "local_window": 0}),
]
IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'default'}" for m, _, o in METHODS]


@pytest.fixture(autouse=True)
def _flex_on(monkeypatch, request):
    """CTXEXT_FLEX=force; afterwards, check that flex really ran (a fallback to the existing function would make
    every comparison trivially pass)."""
    monkeypatch.setenv("CTXEXT_FLEX", "force")
    FP.clear_cache()
    calls = []
    real = FP._flex_fn
    monkeypatch.setattr(FP, "_flex_fn", lambda device: calls.append(device) or real(device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    FP.clear_cache()
    if not any(word in request.node.name for word in ("flex_available", "declines")):
        assert calls, "the flex path did not run"


def _inputs(batch=2, heads=4, kv_heads=2, q_len=200, kv_len=200, dim=16, v_dim=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=gen)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    v = torch.randn(batch, kv_heads, kv_len, v_dim or dim, generator=gen)
    return q, k, v


def _padding_mask(lengths, q_len, kv_len):
    """transformers' boolean (B, 1, q_len, kv_len) mask for left-padded rows of real ``lengths`` (the queries are
    the last q_len slots), the position ids of the queries, and the real-row selector (B, q_len)."""
    batch = len(lengths)
    keep = torch.zeros(batch, kv_len, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, kv_len - n :] = True
    slots = torch.arange(kv_len - q_len, kv_len)
    causal = torch.arange(kv_len)[None, :] <= slots[:, None]
    mask = (causal[None] & keep[:, None, :])[:, None]
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, kv_len - q_len :]
    return mask, positions, keep[:, kv_len - q_len :]


def _module(pmap=None, dim=16, rotary_dim=None, scale=1.0):
    module = nn.Module()
    module.is_causal = True
    vars(module)[ALIBI_MARK] = True  # the ALiBi function runs only in a swapped model
    if pmap is not None:
        rotary_dim = rotary_dim or dim
        inv_freq = 1.0 / (500.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        setattr(module, R.STATE_ATTR, R.RemapState(pmap, inv_freq, scale))
    return module


@contextlib.contextmanager
def _flex_off():
    """The existing sdpa paths, even once the flex calls are wired into them (CTXEXT_FLEX=0)."""
    before = os.environ.get("CTXEXT_FLEX")
    os.environ["CTXEXT_FLEX"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["CTXEXT_FLEX"]
        else:
            os.environ["CTXEXT_FLEX"] = before


def existing_alibi(*args, **kw):
    with _flex_off():
        return A.alibi_attention_forward(*args, **kw)


def existing_remap(*args, **kw):
    with _flex_off():
        return R.remap_attention_forward(*args, **kw)


def _close(a, b, rows=None, atol=1e-5):
    assert a.shape == b.shape
    if rows is not None:
        a, b = a[rows], b[rows]
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------------- availability


def test_flex_available_follows_device_and_env(monkeypatch):
    monkeypatch.delenv("CTXEXT_FLEX")
    assert FP.flex_available("cpu") is False
    assert FP.flex_available("cuda") is False  # opt-in since issue 48: no default path compiles
    monkeypatch.setenv("CTXEXT_FLEX", "1")
    assert FP.flex_available("cuda") is True
    monkeypatch.setenv("CTXEXT_FLEX", "0")
    assert FP.flex_available("cuda") is False
    monkeypatch.setenv("CTXEXT_FLEX", "force")
    assert FP.flex_available("cpu") is True


# ----------------------------------------------------------------------------------------------------------- ALiBi


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("q_len,kv_len", [(200, 200), (37, 150)])
def test_alibi_matches_existing(heads, kv_heads, q_len, kv_len):
    q, k, v = _inputs(1, heads, kv_heads, q_len, kv_len)
    module = _module()
    if q_len == kv_len:
        mask = None
    else:  # chunked prefill with a cache: the queries are the last q_len keys
        mask, _, _ = _padding_mask([kv_len], q_len, kv_len)
    ref, _ = existing_alibi(module, q, k, v, mask)
    out, _ = FF.alibi_attention_forward_flex(module, q, k, v, mask)
    _close(out, ref)


@pytest.mark.parametrize("additive", [False, True])
def test_alibi_left_padded_batch(additive):
    q, k, v = _inputs(3, 4, 2, 150, 150, v_dim=8)
    mask, _, real = _padding_mask([150, 90, 33], 150, 150)
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = _module()
    ref, _ = existing_alibi(module, q, k, v, mask)
    out, _ = FF.alibi_attention_forward_flex(module, q, k, v, mask)
    _close(out, ref, real)
    assert torch.isfinite(out).all()


def test_alibi_additive_bias_mask_declines():
    """An additive mask carrying a bias (not just 0 / min) is no mask_mod: flex_alibi declines (None)."""
    q, k, v = _inputs(1, 4, 2, 100, 100)
    mask, _, _ = _padding_mask([100], 100, 100)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    additive[..., 3] += 0.5
    assert FP.flex_alibi(q, k, v, torch.ones(4), 0, additive[:, 0], None) is None
    module = _module()
    ref, _ = existing_alibi(module, q, k, v, additive)
    out, _ = FF.alibi_attention_forward_flex(module, q, k, v, additive)  # falls back to the sdpa loop
    _close(out, ref)


def test_alibi_dense_mask_fallback_sliding_window():
    """A mask that is not causal + padding (a sliding window) is looked up densely."""
    q, k, v = _inputs(2, 4, 2, 120, 120)
    mask, _, real = _padding_mask([120, 70], 120, 120)
    i = torch.arange(120)
    mask = mask & ((i[:, None] - i[None, :]) < 30)
    module = _module()
    ref, _ = existing_alibi(module, q, k, v, mask)
    out, _ = FF.alibi_attention_forward_flex(module, q, k, v, mask)
    _close(out, ref, real)


def test_alibi_bias_rounded_to_query_dtype_like_sdpa_path():
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(1, 4, 4, 160, 160))
    module = _module()
    ref, _ = existing_alibi(module, q, k, v, None)
    out, _ = FF.alibi_attention_forward_flex(module, q, k, v, None)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=0)


# ----------------------------------------------------------------------------------------------------------- remap


@pytest.mark.parametrize("method,factor,options", METHODS, ids=IDS)
def test_remap_matches_existing(method, factor, options):
    pmap = build_map(method, L0, factor, **options)
    q, k, v = _inputs(1, 4, 2, 200, 200)
    module = _module(pmap, scale=1.1)
    ref, _ = existing_remap(module, q, k, v, None)
    out, _ = FF.remap_attention_forward_flex(module, q, k, v, None)
    _close(out, ref)


@pytest.mark.parametrize("method,factor,options", METHODS, ids=IDS)
def test_remap_left_padded_batch_gqa_partial_rotary(method, factor, options):
    """Left padding with per-row position offsets, GQA 6/2, rotary on half of each head, value dim != q dim."""
    pmap = build_map(method, L0, factor, **options)
    q, k, v = _inputs(3, 6, 2, 180, 180, dim=16, v_dim=8, seed=1)
    mask, positions, real = _padding_mask([180, 131, 20], 180, 180)
    module = _module(pmap, dim=16, rotary_dim=8)
    ref, _ = existing_remap(module, q, k, v, mask, position_ids=positions)
    out, _ = FF.remap_attention_forward_flex(module, q, k, v, mask, position_ids=positions)
    _close(out, ref, real)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method,factor,options", [METHODS[i] for i in (0, 2, 6)], ids=[IDS[i] for i in (0, 2, 6)])
def test_remap_chunked_prefill_with_cache(method, factor, options):
    """Queries are the last q_len of kv_len cached keys (a second prefill chunk)."""
    pmap = build_map(method, L0, factor, **options)
    q, k, v = _inputs(2, 4, 2, 50, 190, seed=2)
    mask, positions, real = _padding_mask([190, 120], 50, 190)
    module = _module(pmap)
    ref, _ = existing_remap(module, q, k, v, mask, position_ids=positions)
    out, _ = FF.remap_attention_forward_flex(module, q, k, v, mask, position_ids=positions)
    _close(out, ref, real)


def test_block_mask_cache_never_mixes_position_maps():
    """Maps built one after another (the old one collected, so its id may be reused) get their own block masks."""
    import gc
    import weakref

    q, k, v = _inputs(1, 4, 2, 160, 160, seed=8)
    for method, factor, options in (METHODS[0], METHODS[4], METHODS[6], METHODS[5]):
        pmap = build_map(method, L0, factor, **options)
        module = _module(pmap)
        ref, _ = existing_remap(module, q, k, v, None)
        out, _ = FF.remap_attention_forward_flex(module, q, k, v, None)
        _close(out, ref)
        alive = weakref.ref(pmap)
        del module, pmap
        gc.collect()
        assert alive() is not None  # the cache holds the map its block mask was built for: its id is never reused


def test_remap_dense_mask_fallback():
    pmap = build_map("self-extend", L0, 4)
    q, k, v = _inputs(2, 4, 2, 150, 150, seed=3)
    mask, positions, real = _padding_mask([150, 100], 150, 150)
    i = torch.arange(150)
    mask = mask & ((i[:, None] - i[None, :]) < 70)  # a sliding window: not causal + padding
    module = _module(pmap)
    ref, _ = existing_remap(module, q, k, v, mask, position_ids=positions)
    out, _ = FF.remap_attention_forward_flex(module, q, k, v, mask, position_ids=positions)
    _close(out, ref, real)


@pytest.mark.parametrize("method", ["self-extend", "string"])
def test_remap_padded_head_dims(monkeypatch, method):
    """Zero-padding q/k (and v) to a power of two (as on CUDA) changes nothing: head dim 12, value dim 10."""
    monkeypatch.setattr(FP, "PAD_DIMS", True)
    pmap = build_map(method, L0, 4 if method != "string" else None,
                     **({} if method != "string" else {"shift": 40, "local": 8}))
    q, k, v = _inputs(1, 4, 2, 170, 170, dim=12, v_dim=10, seed=4)
    module = _module(pmap, dim=12)
    ref, _ = existing_remap(module, q, k, v, None)
    out, _ = FF.remap_attention_forward_flex(module, q, k, v, None)
    _close(out, ref)
    ref, _ = existing_alibi(module, q, k, v, None)
    out, _ = FF.alibi_attention_forward_flex(module, q, k, v, None)
    _close(out, ref)


def test_remap_block_mask_is_sparse():
    """Self-extend's near copy is a band and its far copy the rest of the causal triangle: the block mask holds
    about the causal blocks, not two full triangles."""
    pmap = build_map("self-extend", 256, 4, group=4, window=256)
    T = 1024
    q, k, v = _inputs(1, 2, 2, T, T, dim=16)
    module = _module(pmap)
    seen = []
    real = FP._block_mask

    def spy(*args, **kw):
        bm = real(*args, **kw)
        seen.append(bm)
        return bm

    FP._block_mask = spy
    try:
        FF.remap_attention_forward_flex(module, q, k, v, None)
    finally:
        FP._block_mask = real
    (bm,) = seen
    n = T // FP.BLOCK
    used = int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum())
    assert used <= n * (n + 1) // 2 + 2 * n  # causal blocks + the band's edge
    assert int(bm.full_kv_num_blocks.sum()) > 0


# ------------------------------------------------------------------------------------------------- whole models


def _llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 500.0}
    kw = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=L0, attn_implementation="sdpa",
              **rope_kwargs(LlamaConfig, rope))
    kw.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


class _Swap:
    """Register the flex drop-in functions under ctxext's names for the duration of a block."""

    def __enter__(self):
        from transformers import AttentionInterface

        AttentionInterface.register(A.ALIBI, FF.alibi_attention_forward_flex)
        AttentionInterface.register(R.REMAP, FF.remap_attention_forward_flex)

    def __exit__(self, *exc):
        from transformers import AttentionInterface

        AttentionInterface.register(A.ALIBI, A.alibi_attention_forward)
        AttentionInterface.register(R.REMAP, R.remap_attention_forward)


@pytest.mark.parametrize("method,factor,options", [("alibi", 4, {}), ("self-extend", 4, {}), ("rerope", 4, {}),
                                                   ("dca", 4, {})])
def test_patched_model_padded_batch_and_block_mask_reuse(method, factor, options, monkeypatch):
    import ctxext

    model = _llama()
    ctxext.patch(model, method, factor, **options)
    gen = torch.Generator().manual_seed(5)
    lengths = (170, 100)
    ids = torch.randint(2, 128, (2, 170), generator=gen)
    mask = torch.zeros(2, 170, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, 170 - n :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    builds = []
    real = FP._block_mask
    monkeypatch.setattr(FP, "_block_mask", lambda *a, **k: builds.append(1) or real(*a, **k))
    with torch.no_grad():
        with _flex_off():
            ref = model(ids, attention_mask=mask, position_ids=position_ids).logits
        with _Swap():
            out = model(ids, attention_mask=mask, position_ids=position_ids).logits
    assert len(builds) == 1  # one block mask for both layers
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, 170 - n :], ref[b, 170 - n :], atol=1e-5, rtol=0)


def test_patched_model_generate_uses_flex_prefill_and_matches():
    import ctxext

    model = _llama()
    ctxext.patch(model, "self-extend", 4)
    ids = torch.randint(2, 128, (1, 120), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), _flex_off():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        with _Swap():
            out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)


def test_compiled_path_leaves_dynamos_settings_as_it_found_them(monkeypatch):
    """The compiled flex path (CUDA's; here with torch.compile stood in by a recorder on CPU) runs with dynamo's
    recompile limit raised during its calls only: the process's own setting is the same afterwards."""
    import torch._dynamo.config as dynamo_config

    seen = []

    def fake_compile(fn, **kwargs):
        def call(*args, **kw):
            seen.append(dynamo_config.recompile_limit)
            return fn(*args, **kw)

        return call

    monkeypatch.setattr(dynamo_config, "recompile_limit", 8)
    monkeypatch.setattr(FP, "_compile_target", lambda device: True)
    monkeypatch.setattr(FP, "_compiled", {})
    monkeypatch.setattr(torch, "compile", fake_compile)
    q, k, v = _inputs(1, 4, 2, 200, 200)
    module = _module()
    ref, _ = existing_alibi(module, q, k, v, None)
    out, _ = FF.alibi_attention_forward_flex(module, q, k, v, None)
    _close(out, ref)
    assert seen and all(limit >= FP.RECOMPILE_LIMIT for limit in seen)  # block mask and flex, each raised
    assert dynamo_config.recompile_limit == 8


# ------------------------------------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("method", ["alibi", "self-extend", "rerope", "lm-infinite", "string", "dca"])
def test_cuda_compiled_path_matches_existing(monkeypatch, method, dtype, atol):
    monkeypatch.delenv("CTXEXT_FLEX")
    T = 4096
    q, k, v = (t.to("cuda", dtype) for t in _inputs(2, 8, 4, T, T, dim=32, seed=7))
    mask, positions, real = _padding_mask([T, T - 700], T, T)
    mask, positions, real = mask.cuda(), positions.cuda(), real.cuda()
    if method == "alibi":
        module = _module()
        ref, _ = existing_alibi(module, q, k, v, mask)
        out, _ = FF.alibi_attention_forward_flex(module, q, k, v, mask)
    else:
        options = {"shift": 600, "local": 64} if method == "string" else {}  # shift < the 1024 advertised
        pmap = build_map(method, 1024, None if method == "string" else 4, **options)
        module = _module(pmap, dim=32)
        ref, _ = existing_remap(module, q, k, v, mask, position_ids=positions)
        out, _ = FF.remap_attention_forward_flex(module, q, k, v, mask, position_ids=positions)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[real].float(), ref[real].float(), atol=atol, rtol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", ["alibi", "self-extend"])
def test_cuda_patched_model_logits(monkeypatch, method):
    import torch._dynamo.config as dynamo_config

    import ctxext

    monkeypatch.delenv("CTXEXT_FLEX")
    limit = dynamo_config.recompile_limit
    model = _llama(max_position_embeddings=1024, hidden_size=256, head_dim=32, num_attention_heads=8,
                   num_key_value_heads=4).to("cuda", torch.bfloat16)
    ctxext.patch(model, method, 4)
    ids = torch.randint(2, 128, (1, 4096), device="cuda")
    with torch.no_grad():
        with _flex_off():
            ref = model(ids).logits.float()
        with _Swap():
            out = model(ids).logits.float()
    assert math.isfinite(float(out.abs().max()))
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=0)
    assert dynamo_config.recompile_limit == limit  # compiled with a raised limit, the process's setting untouched
