"""The CUDA plans (``ctxext.attention.cuda_plans``, ``alibi_plan``) on CPU through the emulator of their kernel
contract (``ctxext.attention.varlen``): the emulator against the contract written out by hand, every method's plan
against a dense reference written from the method's definition (its ``select``, one softmax, fp32 at 1e-5) with GQA,
partial rotary, full passes and cached decoding; call counts per layer at 4k and 64k; refusals (padding, sinks);
a patched model's logits with the emulated plan equal the default CPU path's; and no default path compiles."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_llama

import ctxext.attention.flex_paths as FP
from ctxext.adapters.remap import apply_remap
from ctxext.attention import alibi_plan as AP
from ctxext.attention import cuda_plans as P
from ctxext.attention import varlen
from ctxext.attention.remap import rotate
from ctxext.methods.alibi import alibi_slopes
from ctxext.methods.remap import build_map

METHODS = [("self-extend", 4, {}), ("rerope", 4, {}), ("string", None, {"shift": 40, "local": 8}),
           ("lm-infinite", 4, {"window": 48, "global_tokens": 5}), ("streaming-llm", 4, {"sinks": 3}), ("dca", 4, {})]


# ------------------------------------------------------------------------------------------------------ emulator


def test_emulator_follows_the_contract():
    """Windows aligned bottom-right, flash's clamp, GQA, +inf log-sum-exp for rows without keys, two sequences."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(7, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    for window in [(-1, -1), (-1, 0), (1, 0), (2, 1)]:
        out, lse = varlen.varlen_reference(q, k, v, cu_q, cu_k, 4, 5, window_size=window, enable_gqa=True, scale=0.3)
        assert lse.shape == (4, 7)
        for (q0, q1), (k0, k1) in [((0, 3), (0, 5)), ((3, 7), (5, 9))]:
            sq, sk = q1 - q0, k1 - k0
            for r in range(sq):
                for h in range(4):
                    cols = [c for c in range(sk) if (window[0] < 0 or c >= r + sk - sq - window[0])
                            and (window[1] < 0 or c <= r + sk - sq + window[1])]
                    s = torch.stack([q[q0 + r, h] @ k[k0 + c, h // 2] * 0.3 for c in cols])
                    ref = torch.softmax(s, 0) @ v[[k0 + c for c in cols], h // 2]
                    torch.testing.assert_close(out[q0 + r, h], ref, atol=1e-6, rtol=0)
                    torch.testing.assert_close(lse[h, q0 + r], torch.logsumexp(s, 0), atol=1e-6, rtol=0)
    # more queries than keys: the first rows see no key (bottom-right) -> output 0, lse +inf
    out, lse = varlen.varlen_reference(q[:5], k[:3], v[:3], torch.tensor([0, 5]), torch.tensor([0, 3]), 5, 3,
                                       window_size=(-1, 0), enable_gqa=True)
    assert torch.isinf(lse[:, :2]).all() and (lse[:, :2] > 0).all() and (out[:2] == 0).all()
    assert torch.isfinite(lse[:, 2:]).all()
    with pytest.raises(ValueError, match="enable_gqa"):
        varlen.varlen_reference(q, k, v, cu_q, cu_k, 4, 5)


# ------------------------------------------------------------------------------------------- plans vs reference


def _rotated(pmap, q, k, qpos, kpos, inv_freq):
    queries = [rotate(q, r.query(qpos[None]), inv_freq) for r in pmap.rotations]
    keys = [rotate(k, r.key(kpos[None]), inv_freq) for r in pmap.rotations]
    return queries, keys


def _dense(pmap, queries, keys, v, qpos, kpos, scale):
    """From the definition: pair (i, j) scored under rotation select(i, j), masked where -1 or j > i; one softmax."""
    heads, kv_heads = queries[0].shape[1], keys[0].shape[1]
    which = pmap.select(qpos[:, None], kpos[None, :]).long()
    which = torch.where(kpos[None, :] <= qpos[:, None], which, -1)
    scores = torch.full((v.shape[0], heads, qpos.numel(), kpos.numel()), -math.inf, dtype=torch.float64)
    for c in range(len(pmap.rotations)):
        kc = keys[c].double().repeat_interleave(heads // kv_heads, dim=1)
        s = queries[c].double() @ kc.transpose(-1, -2) * scale
        scores = torch.where(which == c, s, scores)
    vv = v.double().repeat_interleave(heads // kv_heads, dim=1)
    return (scores.softmax(-1) @ vv).transpose(1, 2)


@pytest.mark.parametrize("method,factor,options", METHODS)
@pytest.mark.parametrize("q_len", [256, 1, 5])  # a full pass; cached decoding of one and of five queries
def test_plan_equals_the_definition(method, factor, options, q_len):
    L0, T, batch = 64, 256, 2
    pmap = build_map(method, L0, factor, **options)
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 16  # GQA; partial rotary: 4 of the 8 frequency pairs
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, 8, 2).float() / 8))
    q = torch.randn(batch, heads, q_len, dim, generator=g)
    k, v = torch.randn(2, batch, kv_heads, T, dim, generator=g).unbind(0)
    kpos = torch.arange(T)
    qpos = kpos[T - q_len:]
    if pmap.query_scale is not None:
        q = q * pmap.query_scale(qpos).float()[None, None, :, None]
    queries, keys = _rotated(pmap, q, k, qpos, kpos, inv_freq)
    pieces = P.plan(pmap.split, T - q_len, q_len)
    with varlen.counting() as calls:
        out = P.run(pieces, queries, keys, v, 0.25, varlen.kernels(q.device)[1])
    ref = _dense(pmap, queries, keys, v, qpos, kpos, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert 1 <= calls["varlen"] <= (3 if method != "dca" else 2 + T // pmap.options.get("chunk_size", T))


@pytest.mark.parametrize("method,factor,options", METHODS)
@pytest.mark.parametrize("T", [4096, 65536])
def test_calls_per_layer(method, factor, options, T):
    """At most 3 calls per layer (about 2 + T / chunk for DCA) at any length; counted with a kernel that computes
    nothing (the dense emulator cannot afford 64k)."""
    pmap = build_map(method, 1024, factor, **{k: v for k, v in options.items() if k not in ("shift", "local")})
    x = torch.zeros(1, 1, T, 8)
    with varlen.counting(varlen.zeros_varlen) as calls:
        P.run(P.plan(pmap.split, 0, T), [x, x], [x, x], x, 1.0, varlen.kernels(x.device)[1])
    bound = 2 + T // pmap.options["chunk_size"] if method == "dca" else 3
    assert 1 <= calls["varlen"] <= bound, calls
    if method in ("self-extend", "rerope", "string"):
        assert calls["varlen"] == 2  # LongLM's design: a window call and the shifted causal rectangle


# ------------------------------------------------------------------------------------------ through the model


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.mark.parametrize("method,factor,options", [m for m in METHODS if m[0] != "string"])
def test_patched_model_with_the_emulated_plan_equals_the_cpu_path(method, factor, options):
    model = tiny_llama()
    apply_remap(model, method, factor, options)
    ids = torch.randint(2, 128, (2, 200), generator=torch.Generator().manual_seed(3))
    ref = _logits(model, ids)
    with varlen.counting() as calls:
        out = _logits(model, ids)
    assert calls["varlen"] > 0  # the plan ran, in every layer
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_padding_is_refused_and_left_to_the_cpu_path():
    model = tiny_llama()
    apply_remap(model, "self-extend", 4, {})
    ids = torch.randint(2, 128, (2, 200), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    ref = _logits(model, ids, attention_mask=mask)
    with varlen.counting() as calls:
        out = _logits(model, ids, attention_mask=mask)
    assert calls["varlen"] == 0
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_refusals_name_their_reason():
    pmap = build_map("self-extend", 64, 4)
    x = torch.zeros(1, 2, 8, 4)
    pos = torch.arange(8)[None]
    args = (pmap, [x, x], [x, x], x, pos, pos, torch.arange(8))
    assert P.refusal(*args, None, 0.0, "emulate") is None
    assert "mask" in P.refusal(*args, torch.ones(1, 1, 8, 8, dtype=torch.bool), 0.0, "emulate")
    assert "dropout" in P.refusal(*args, None, 0.1, "emulate")
    assert "float16" in P.refusal(*args, None, 0.0, "varlen_attn")  # float32 on CUDA's FlashAttention 2
    shifted = (pmap, [x, x], [x, x], x, pos + 1, pos, torch.arange(8))
    assert "positions" in P.refusal(*shifted, None, 0.0, "emulate")


def test_kernel_choice_and_one_time_warning(monkeypatch):
    monkeypatch.delenv(varlen.ENV, raising=False)
    assert varlen.kernels(torch.device("cpu")) is None  # the CPU default path stays as it is
    monkeypatch.setenv(varlen.ENV, "emulate")
    assert varlen.kernels(torch.device("cpu"))[0] == "emulate"
    monkeypatch.setenv(varlen.ENV, "0")
    assert varlen.kernels(torch.device("cuda")) is None
    monkeypatch.delenv(varlen.ENV)
    monkeypatch.setattr(varlen, "_torch_varlen", lambda: None)
    monkeypatch.setattr(varlen, "_flash_varlen", lambda: None)
    monkeypatch.setattr(varlen, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="varlen_attn.*flash_attn_varlen_func"):
        assert varlen.kernels(torch.device("cuda")) is None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert varlen.kernels(torch.device("cuda")) is None  # once only


@pytest.mark.parametrize("takes_gqa,takes_scale", [(True, True), (False, False), (False, True)])
def test_older_varlen_attn_signatures_give_the_same_attention(monkeypatch, takes_gqa, takes_scale):
    """torch 2.11's varlen_attn may lack enable_gqa or scale: the call repeats key heads / folds the scale into the
    queries and gets what the contract asks for."""
    def old_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, window_size=(-1, -1), **kw):
        assert set(kw) <= {name for name, ok in (("enable_gqa", takes_gqa), ("scale", takes_scale)) if ok}
        out, lse = varlen.varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size, **kw)
        return out, lse

    monkeypatch.setattr(varlen, "_torch_varlen", lambda: (old_varlen, lambda lse: None, takes_gqa, takes_scale))
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(40, 4, 8, generator=g), torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    cu = torch.tensor([0, 15, 40])
    args = (q, k, v, cu, cu, 25, 25)
    ref = varlen.varlen_reference(*args, scale=0.2, window_size=(6, 0), enable_gqa=True)
    got = varlen._call_torch(*args, scale=0.2, window_size=(6, 0), enable_gqa=True)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------- ALiBi


@pytest.mark.parametrize("T,block", [(100, 32), (64, 4096)])
def test_alibi_plan_equals_the_definition(monkeypatch, T, block):
    monkeypatch.setattr(AP, "BLOCK", block)
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, batch = 4, 2, 16, 2
    q = torch.randn(batch, heads, T, dim, generator=g)
    k, v = torch.randn(2, batch, kv_heads, T, dim, generator=g).unbind(0)
    slopes = alibi_slopes(heads)
    with varlen.counting() as calls:
        out = AP.alibi_plan(q, k, v, slopes, 0.25)
    i = torch.arange(T)
    bias = (-slopes[:, None, None] * (i[:, None] - i[None, :]).float()).masked_fill(i[None, :] > i[:, None], -math.inf)
    s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.25 + bias.double()
    ref = (s.softmax(-1) @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert calls["biased"] == -(-T // AP.block_size(T, heads, 4))  # one call per block offset: about T / BLOCK


def test_alibi_plan_counts_at_64k():
    T = 65536
    x = torch.zeros(1, 1, T, 8)
    with varlen.counting(biased=varlen.zeros_biased) as calls:
        AP.alibi_plan(x, x, x, torch.ones(1), 1.0)
    assert calls["biased"] == T // 4096


# ----------------------------------------------------------------------------------------------- no compile


def test_no_default_path_compiles(monkeypatch):
    """Flex (compiled on CUDA) is opt-in: off by default on every device, and a patched model's forward on the
    default path never reaches torch.compile."""
    monkeypatch.delenv("CTXEXT_FLEX", raising=False)
    assert FP.flex_available("cuda") is False and FP.flex_available("cpu") is False
    monkeypatch.setenv("CTXEXT_FLEX", "1")
    assert FP.flex_available("cpu") is False
    monkeypatch.delenv("CTXEXT_FLEX")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("a default path called torch.compile"))
    model = tiny_llama()
    apply_remap(model, "self-extend", 4, {})
    _logits(model, torch.randint(2, 128, (1, 200)))


def test_the_alibi_swap_with_the_emulated_plan_equals_the_cpu_path():
    import ctxext

    model = tiny_llama()
    ctxext.patch(model, "alibi")
    ids = torch.randint(2, 128, (2, 200), generator=torch.Generator().manual_seed(5))
    ref = _logits(model, ids)
    with varlen.counting() as calls:
        out = _logits(model, ids)
    assert calls["biased"] > 0  # the swap's attention took the plan, in every layer
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
