"""flash-attn where installed (``ctxext.attention.optional_kernels``): the remap merge path's mask-free calls and the
ALiBi swap without padding.

No GPU and no flash-attn here: the calls are checked against a stand-in for ``flash_attn_func`` written from its
contract as flash-attn's docstring states it (q / k / v (batch, len, heads, dim), grouped keys read as they are, a
causal diagonal aligned bottom-right, ALiBi ``-slope * |i + kv_len - q_len - j|``, and with
``return_attn_probs`` the tuple (out, log-sum-exp (batch, heads, q_len) float32, probabilities)). The stand-in
counts its calls, so each test also proves which path ran. tests/test_gpu.py runs the real library where installed.
"""

from __future__ import annotations

import math

import pytest
import torch

import ctxext.attention.alibi as alibi_attention
import ctxext.attention.lse as lse_attention
from ctxext.attention import optional_kernels
from test_alibi import _Layer, reference_attention
from test_remap_lse import SHAPES, _dense, _inputs, _which


class StandIn:
    """``flash_attn_func`` from its documented contract, in float64, counting calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        self.calls += 1
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        assert dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0
        batch, q_len, heads, dim = q.shape
        kv_len, kv_heads = k.shape[1], k.shape[2]
        assert heads % kv_heads == 0 and v.shape[:3] == k.shape[:3]
        scale = dim**-0.5 if softmax_scale is None else softmax_scale
        k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))  # query head h: key head h // rep
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
        shift = torch.arange(q_len)[:, None] + kv_len - q_len - torch.arange(kv_len)[None, :]  # bottom-right
        if alibi_slopes is not None:
            assert alibi_slopes.dtype == torch.float32 and alibi_slopes.shape == (heads,)
            s = s - alibi_slopes.double()[None, :, None, None] * shift.abs()
        if causal:
            s = s.masked_fill(shift < 0, -math.inf)
        out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double()).to(q.dtype)
        return (out, s.logsumexp(-1).float(), None) if return_attn_probs else out


@pytest.fixture
def flash(monkeypatch):
    """The stand-in as flash-attn, taken for every tensor (as on CUDA in half precision)."""
    stand_in = StandIn()
    monkeypatch.setattr(optional_kernels, "_function", lambda: stand_in)
    monkeypatch.setattr(optional_kernels, "usable", lambda q, k, v: q.dtype in optional_kernels.DTYPES)
    return stand_in


def test_enabled_only_where_installed_and_not_turned_off(monkeypatch):
    monkeypatch.setattr(optional_kernels, "_function", lambda: StandIn())
    assert optional_kernels.enabled()
    monkeypatch.setenv("CTXEXT_FLASH_ATTN", "0")
    assert not optional_kernels.enabled()
    monkeypatch.delenv("CTXEXT_FLASH_ATTN")
    monkeypatch.setattr(optional_kernels, "_function", lambda: None)  # missing, too old, or failing to import
    assert not optional_kernels.enabled()


def test_not_used_on_cpu_even_where_enabled(monkeypatch):
    monkeypatch.setattr(optional_kernels, "_function", lambda: StandIn())
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert optional_kernels.enabled() and not optional_kernels.usable(q, q, q)


@pytest.mark.parametrize("causal,q_len,kv_len", [(True, 40, 40), (False, 40, 70), (False, 1, 33)])
def test_output_and_log_sum_exp_in_torchs_layout(flash, causal, q_len, kv_len):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, q_len, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 3, kv_len, 16, generator=g).bfloat16() for _ in range(2))
    out, lse = optional_kernels.attention_with_lse(q, k, v, causal, 0.3)
    assert flash.calls == 1 and out.shape == q.shape and lse.shape == (2, 6, q_len) and lse.dtype == torch.float32
    kk, vv = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) * 0.3
    if causal:
        s = s.masked_fill(torch.ones(q_len, kv_len, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(lse.double(), s.logsumexp(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), s.softmax(-1) @ vv, atol=2e-2, rtol=0)


def test_refuses_a_causal_call_that_is_not_square(flash):
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="square"):
        optional_kernels.attention_with_lse(q, torch.zeros(1, 2, 6, 8, dtype=torch.bfloat16), q, True, 0.3)


@pytest.mark.skipif(not lse_attention.available(), reason="the CPU flash op is not pinned for this torch")
@pytest.mark.parametrize("name", ["band", "band and sinks", "chunks", "random starts"])
def test_merge_path_with_flash_attn_matches_the_dense_definition(flash, name):
    # mask-free pieces go to the stand-in, masked ones (a band's near keys) to torch's kernel
    T, starts, far_keys, batch = SHAPES[name]
    near_start = starts(T)
    queries, keys, v = _inputs(7, batch, T, torch.bfloat16)
    out = lse_attention.split_attention(queries, keys, v, near_start, far_keys, 16**-0.5)
    assert flash.calls > 0 and out.dtype == torch.bfloat16
    reference = _dense(*queries, *keys, v, _which(near_start, far_keys), 16**-0.5)
    torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=0)


@pytest.mark.parametrize("q_len,kv_len", [(300, 300), (1, 300)])
def test_alibi_without_padding_is_one_flash_call(flash, q_len, kv_len):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, q_len, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 4, kv_len, 16, generator=g).bfloat16() for _ in range(2))
    out, _ = alibi_attention.alibi_attention_forward(_Layer(), q, k, v, None)
    assert flash.calls == 1 and out.shape == (2, q_len, 8, 16)
    reference = reference_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), reference.double(), atol=2e-2, rtol=0)


def test_alibi_with_padding_keeps_torchs_kernels(flash):
    q = torch.randn(2, 4, 50, 8).bfloat16()
    k = v = torch.randn(2, 4, 50, 8).bfloat16()
    mask = torch.ones(2, 1, 50, 50, dtype=torch.bool).tril()
    mask[1, :, :, :5] = False  # left padding
    alibi_attention.alibi_attention_forward(_Layer(), q, k, v, mask)
    assert flash.calls == 0
