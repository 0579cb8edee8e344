"""The ALiBi swap on CUDA without flash-attn and without compile: T / n kernel calls per layer, never a
(heads x T x T) bias.

The bias ``-slope_h * (i - j)`` depends only on i - j. Cut queries and keys into blocks of n: the tile of query
block t against key block t - m has the bias ``-slope_h * (m n + r - c)`` (r, c the rows within the blocks), the
same for every t. So all tiles at one block offset m are ONE call of CUDA's memory-efficient kernel (the only
torch kernel that takes an additive bias and returns the log-sum-exp): query blocks m .. N-1 in the batch
dimension against key blocks 0 .. N-1-m, one (heads, n, n) bias broadcast over them (stride 0); m = 0 is the
causal square. The N = T / n outputs of a query block merge by log-sum-exp. The bias is computed in float32 and
rounded to the query dtype, as ``ctxext_alibi`` hands it to sdpa. The kernel has no grouped-query attention: key
and value heads are expanded per call (a copy of the blocks it reads). n is ``BLOCK`` (4096) unless one tile bias
would pass ``BIAS_BYTES``, then halved.

Where flash-attn is installed, ``ctxext_alibi`` already makes one ``flash_attn_func(alibi_slopes=)`` call
(``ctxext.attention.optional_kernels``); this is the path without it. Refused (None): a mask, dropout, autograd,
q_len != kv_len (decoding keeps the sdpa loop, one row), no kernel (``ctxext.attention.varlen.kernels``).
"""

from __future__ import annotations

import torch

from . import varlen
from .cuda_plans import _merge

BLOCK = 4096
#: most bytes of one call's (heads, n, n) bias
BIAS_BYTES = 512 << 20
ALIGN = 16  # the memory-efficient kernel's bias rows are read at multiples of 16 elements


def block_size(T: int, heads: int, itemsize: int) -> int:
    n = BLOCK
    while n > ALIGN and heads * n * n * itemsize > BIAS_BYTES:
        n //= 2
    return min(n, -(-T // ALIGN) * ALIGN)


def alibi_plan(query, key, value, slopes, scale, attention_mask=None, dropout: float = 0.0):
    """Causal ALiBi attention of a full pass: query (B, H, T, D), key / value (B, H_kv, T, D); returns
    (B, T, H, D) in the query's dtype, or None where refused (see the module docstring)."""
    chosen = varlen.kernels(query.device)
    if chosen is None or attention_mask is not None or dropout or query.shape[2] != key.shape[2]:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return None
    if value.shape[-1] != query.shape[-1]:
        return None
    biased = chosen[2]
    batch, heads, T, dim = query.shape
    scale = dim**-0.5 if scale is None else scale
    n = block_size(T, heads, query.element_size())
    N = -(-T // n)
    pad = N * n - T
    if key.shape[1] != heads:
        key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t for t in (query, key, value))
    q, k, v = (t.view(batch, heads, N, n, dim) for t in (q, k, v))
    out = torch.zeros(batch, heads, N, n, dim, dtype=torch.float32, device=query.device)
    lse = torch.full((batch, heads, N, n), float("-inf"), dtype=torch.float32, device=query.device)
    r = torch.arange(n, device=query.device)
    within = (r[:, None] - r[None, :]).float()  # r - c
    slopes = slopes.to(device=query.device, dtype=torch.float32)[:, None, None]
    for m in range(N):
        bias = (-slopes * (within + m * n)).to(query.dtype)  # (H, n, n)
        qm = q[:, :, m:].transpose(1, 2).reshape(batch * (N - m), heads, n, dim)
        km = k[:, :, : N - m].transpose(1, 2).reshape(batch * (N - m), heads, n, dim)
        vm = v[:, :, : N - m].transpose(1, 2).reshape(batch * (N - m), heads, n, dim)
        o, l_ = biased(qm, km, vm, bias[None].expand(batch * (N - m), heads, n, n), m == 0, scale)
        o = o.view(batch, N - m, heads, n, dim).transpose(1, 2)
        l_ = l_.float().view(batch, N - m, heads, n).transpose(1, 2)
        if m == 0:
            out.copy_(o)
            lse.copy_(l_)
        else:
            part_o, part_l = out[:, :, m:], lse[:, :, m:]
            _merge(part_o, part_l, o, l_)
    out = out.view(batch, heads, N * n, dim)[:, :, :T]
    return out.transpose(1, 2).to(query.dtype)


__all__ = ["BIAS_BYTES", "BLOCK", "alibi_plan", "block_size"]
