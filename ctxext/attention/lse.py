"""Attention of a two-rotation position map on torch's fused CPU flash kernel, merged by log-sum-exp: the inference
fast path of every remap method that declares a ``KeySplit`` (``ctxext.methods.remap``): the query at i sees keys
``near_start(i) .. i`` under rotation 0 ("near") and keys ``0 .. min(near_start(i), far_keys) - 1`` under rotation
1 ("far"); the rest is masked. Self-Extend, ReRoPE and STRING are a band plus everything before it; DCA is the
query's chunk (and the previous one within its window) plus everything before; LM-Infinite and StreamingLLM are a
band plus a few leading sink keys.

Each piece is a call of ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (on CUDA: the flash kernel,
or the memory-efficient one where a call has a mask or runs in float32; ``ctxext.compat.torch``), which returns the
attention output *and* each query's log-sum-exp of scores, over a contiguous key range, mask-free wherever the range
has a shape the kernel knows (its causal flag aligns the diagonal top-left; every causal call here is square):

- a band's far keys (``0 .. i - near``, every method without ``far_keys``): one causal call over all queries from
  ``near`` on against the keys up to ``T - near``;
- runs of rows with one near start (DCA's chunks and windows; blocks follow the runs): the near keys are the causal
  square of the block plus the keys before it that every row sees, and the far keys end at the same key for all;
- otherwise (a band's near keys, the rows where sinks begin) one call per block with an additive 0 / -inf mask;
  a band's full blocks can go many to one call, in the batch dimension (``BATCHED_BAND``; for CUDA, opt-in).

Queries run in blocks of at most ``BLOCK`` rows (a band's are about as wide as the band, at least ``MIN_BLOCK``).
Disjoint key sets of one softmax merge exactly: ``out = o_a + sigmoid(lse_b - lse_a) * (o_b - o_a)``,
``lse = logaddexp(lse_a, lse_b)`` (stable: no exp of a large number). The kernel returns output 0 and
log-sum-exp 0 for a row whose keys are all masked, so such rows of a masked call are set to -inf before merging.

The CPU kernel takes grouped-query attention natively (key/value heads dividing the query heads, query head h
reading key head ``h // (heads / kv_heads)``, as transformers' ``repeat_kv`` pairs them), so keys are never expanded
there (on CUDA the flash kernel reads them as they are; masked and float32 calls, on the memory-efficient
kernel, expand their slice of them; where flash-attn is installed, the mask-free calls in half precision go through
it: ``ctxext.attention.optional_kernels``). Its
log-sum-exp output carries no gradient: callers use this without autograd only (``remap_attention_forward``
checks). The ops are private: ``available(device)`` allows them only on the torch versions ``ctxext.compat.torch``
pins (on CUDA 2.11, where the ``gpu`` tests passed; ``CTXEXT_CUDA_LSE=1`` opts in elsewhere, ``=0`` opts out).
Measured on CPU: ``benchmarks/bench_remap.py`` (see the report of issue 23).
"""

from __future__ import annotations

import os

import torch

from ..compat.torch import CPU_FLASH_TESTED as TESTED_TORCH  # the pin lives with the op
from ..compat.torch import (
    CUDA_EFFICIENT_OP,
    EFFICIENT_BIAS_ALIGN,
    ampere_or_newer,
    cpu_flash_attention,
    cpu_flash_attention_tested,
    cuda_attention_with_lse,
    cuda_fused_attention_tested,
)
from . import optional_kernels

#: most query rows per block
BLOCK = 1024
#: fewest query rows per block of a band (a band's blocks are about as wide as the band)
MIN_BLOCK = 128
#: blocks follow runs of one near start when there are at most T / MIN_RUN of them
MIN_RUN = 64
#: a band's masked near-key calls, many blocks to one kernel call (blocks in the batch dimension): None runs them so
#: on CUDA only where ``CTXEXT_BATCHED_BAND=1`` asks (written after the GPU lease that measured the one-by-one
#: calls; opt-in until a GPU run of ``tests/test_gpu.py`` passes with it), True / False everywhere / nowhere (the
#: tests force it on CPU, where it measured the same as one by one)
BATCHED_BAND: bool | None = None
#: most bytes of one batched call's mask and gathered key/value copies (the blocks' key windows overlap, so the
#: copies are larger than the keys; the bound keeps that beside a model's activations)
BATCH_BYTES = 64 << 20
#: dtypes the fused kernels run natively, per device type
DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.float32, torch.bfloat16, torch.float16)}


def _attend(q, k, v, causal: bool, scale: float, mask=None):
    """One fused call: (output, log-sum-exp) of q over k / v, causal (square, top-left) or with an additive mask."""
    if mask is None and optional_kernels.usable(q, k, v):  # flash-attn, where installed
        return optional_kernels.attention_with_lse(q, k, v, causal, scale)
    if q.device.type == "cuda":
        return cuda_attention_with_lse(q, k, v, causal, scale, mask)
    out = cpu_flash_attention()(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out[0], out[1]


def available(device: torch.device | str = "cpu") -> bool:
    """The private ops for ``device`` exist and this torch version is one they were tested on (on CUDA, or
    ``CTXEXT_CUDA_LSE=1`` asks for them, and not ``=0``: ``ctxext.compat.torch.CUDA_FUSED_TESTED``)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return cpu_flash_attention_tested()
    return kind == "cuda" and cuda_fused_attention_tested()


def accepts(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the fused kernels on ``device`` take ``dtype`` (``DTYPES``; bfloat16 on CUDA only from Ampere on)."""
    device = torch.device(device)
    if dtype not in DTYPES.get(device.type, ()):
        return False
    return dtype != torch.bfloat16 or ampere_or_newer(device)


def split_attention(queries, keys, value: torch.Tensor, near_start: torch.Tensor, far_keys: int | None,
                    scale: float) -> torch.Tensor:
    """Attention of a ``KeySplit`` map over a full pass (positions 0 .. T-1, causal, no padding).

    queries: (q_0, q_1), the queries rotated by rotation 0 and 1, each (batch, heads, T, head_dim); keys: (k_0, k_1),
    (batch, kv_heads, T, head_dim), kv_heads dividing heads; value: (batch, kv_heads, T, head_dim) (the kernel needs
    the value head dim equal to the query's). near_start: (T,) int64 with ``0 <= near_start[i] <= i``; far_keys:
    None or an int >= 0. Returns (batch, T, heads, head_dim), contiguous, in the queries' dtype. No gradient flows
    through it.
    """
    q0, q1 = queries
    k0, k1 = keys
    batch, heads, T, dim = q0.shape
    device = q0.device
    near_start = near_start.to(device=device, dtype=torch.long)
    rows = torch.arange(T, device=device)
    if near_start.shape != (T,) or bool((near_start < 0).any()) or bool((near_start > rows).any()):
        raise ValueError(f"split_attention needs near_start of shape ({T},) with 0 <= near_start[i] <= i")
    far_end = near_start if far_keys is None else near_start.clamp(max=int(far_keys))
    out = torch.empty(batch, T, heads, dim, dtype=torch.float32, device=device)
    out_h = out.transpose(1, 2)  # (batch, heads, T, dim) view
    # a band's far keys (0 .. i - near) are one causal triangle shifted by the band: a single call for every row
    first = T - 1 - int(far_end[-1])  # the last row without far keys, if so
    triangle = first >= -1 and torch.equal(far_end, (rows - first).clamp(min=0))
    lse_all = torch.empty(batch, heads, T, dtype=torch.float32, device=device) if triangle else None
    blocks, band = _blocks(near_start)
    for (a, b), (o, lse) in zip(blocks, _near(q0, k0, value, blocks, band, near_start, scale)):
        end = far_end[a:b]
        if triangle:
            lse_all[..., a:b] = lse
        elif int(end.max()) > 0:
            _merge(o, lse, *_keys(q1, k1, value, a, b, end, near=False, scale=scale))
        out_h[:, :, a:b] = o
    if triangle and first + 1 < T:
        keys_seen = T - first - 1
        o_far, lse_far = _attend(q1[:, :, first + 1 :], k1[:, :, :keys_seen], value[:, :, :keys_seen], True, scale)
        _merge(out_h[:, :, first + 1 :], lse_all[..., first + 1 :], o_far, lse_far)
    return out if q0.dtype == torch.float32 else out.to(q0.dtype)


def _blocks(near_start: torch.Tensor) -> tuple[list[tuple[int, int]], int | None]:
    """Blocks of query rows [(a, b), ...], and their size where they are a band's (else None). Where the near range
    starts at the same key for long runs of rows (DCA: a chunk, its window), blocks follow the runs, so that every
    call of a block is mask-free; otherwise (a band: the start moves with the row) blocks of about the near range's
    width, all of one size but the last, keep the band's masked call small."""
    T = near_start.numel()
    changes = (near_start[1:] != near_start[:-1]).nonzero().flatten() + 1
    if changes.numel() * MIN_RUN <= T:
        cuts, size, band = [0, *changes.tolist(), T], BLOCK, None
    else:
        width = int((torch.arange(T, device=near_start.device) - near_start).max()) + 1
        cuts, size = [0, T], max(MIN_BLOCK, min(BLOCK, width))
        band = size
    return [(a, min(a + size, hi)) for lo, hi in zip(cuts, cuts[1:]) for a in range(lo, hi, size)], band


def _near(q, k, v, blocks, band: int | None, near_start: torch.Tensor, scale: float):
    """(output, log-sum-exp) of each block's near keys, in the order of ``blocks``. A band's full blocks whose call
    is masked run batched, up to ``BATCH_BYTES`` at a time, where ``BATCHED_BAND`` says so; the rest one by one."""
    batched = BATCHED_BAND if BATCHED_BAND is not None else (
        q.device.type == "cuda" and os.environ.get("CTXEXT_BATCHED_BAND", "").strip().lower() in ("1", "true", "on"))
    full = near_start.numel() // band if band and batched else 0
    if full:
        starts = near_start[: full * band].view(full, band)
        lo, hi = starts.min(1).values, starts.max(1).values
        masked = (lo != hi).tolist()
        width = int((torch.arange(1, full + 1, device=q.device) * band - lo).max())  # the widest key window
        # bytes per block, about: the mask and its aligned copy, the key/value windows (on CUDA their heads
        # expanded too), the query window and the output, the float32 output, the boolean masks
        batch, heads, item = q.shape[0], q.shape[1], q.element_size()
        mask_bytes = 2 * band * (width + EFFICIENT_BIAS_ALIGN) * item + 3 * band * width
        kv_bytes = 2 * batch * (heads + k.shape[1]) * width * v.shape[-1] * item
        qo_bytes = batch * heads * band * q.shape[-1] * (2 * item + 4)
        most = max(1, BATCH_BYTES // (mask_bytes + kv_bytes + qo_bytes))
    i = 0
    while i < len(blocks):
        if i < full and masked[i]:
            j = i
            while j < min(full, i + most) and masked[j]:
                j += 1
            yield from _near_batched(q, k, v, i * band, j - i, band, near_start, scale)
            i = j
        else:
            a, b = blocks[i]
            yield _keys(q, k, v, a, b, near_start[a:b], near=True, scale=scale)
            i += 1


def _near_batched(q, k, v, first: int, count: int, size: int, near_start: torch.Tensor, scale: float):
    """The near keys of ``count`` consecutive blocks of ``size`` rows from row ``first``, in one masked kernel call:
    on CUDA a band is launch-bound otherwise (a 32k-token forward of a small LLaMA on an H100: 508 masked calls,
    8,700 launches, 215 ms of CPU time for 49 ms on the GPU). Each block's rows read its key window [b - W, b)
    (W the group's widest near range; keys before 0 clamped to key 0 and masked); blocks go to the batch dimension,
    the query batch to the heads (query head n = batch * heads + h reads key head n // (heads / kv_heads), as it
    should). Yields (output (batch, heads, size, dim), log-sum-exp), float32, per block."""
    batch, heads = q.shape[:2]
    inf = float("-inf")
    rows = torch.arange(first, first + count * size, device=q.device).view(count, size)
    starts = near_start[rows]
    ends = rows[:, -1] + 1
    width = int((ends - starts.min(1).values).max())
    j = ends[:, None] - width + torch.arange(width, device=q.device)  # (count, W) absolute key
    seen = (j[:, None, :] >= starts[..., None]) & (j[:, None, :] <= rows[..., None])  # (count, size, W)
    mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, inf)

    def windows(t, index, n):  # (batch, h, T, d) -> (count, batch * h, n, d)
        return t.index_select(2, index.flatten()).unflatten(2, (count, n)).movedim(2, 0).flatten(1, 2)

    o, lse = _attend_blocks(windows(q, rows, size), windows(k, j.clamp(min=0), width),
                            windows(v, j.clamp(min=0), width), mask, scale)
    o, lse = o.float(), lse.float()
    missed = ~seen.any(-1)[:, None]  # rows without a key: weight 0, not exp(0) (a band has none: key i is near)
    if bool(missed.any()):
        o, lse = o.masked_fill(missed[..., None], 0), lse.masked_fill(missed, inf)
    o, lse = o.view(count, batch, heads, size, -1), lse.view(count, batch, heads, size)
    yield from zip(o, lse)


def _attend_blocks(q, k, v, mask, scale: float):
    """One masked call over blocks in the batch dimension: q (n, heads, L, d), k / v (n, kv_heads, S, d), mask
    (n, L, S) additive, in q's dtype. CUDA: the memory-efficient op (``_efficient_blocks``); else the CPU flash op,
    which broadcasts a (n, 1, L, S) mask and reads grouped keys itself."""
    if q.device.type == "cuda":
        return _efficient_blocks(q, k, v, mask, scale, getattr(torch.ops.aten, CUDA_EFFICIENT_OP))
    out = cpu_flash_attention()(q, k, v, 0.0, False, attn_mask=mask[:, None], scale=scale)
    return out[0], out[1]


def _efficient_blocks(q, k, v, mask, scale: float, op):
    """CUDA's memory-efficient ``op`` as ``ctxext.compat.torch.cuda_attention_with_lse`` calls it (key/value heads
    expanded to the query heads, log-sum-exp cut back to the queries), with a mask per batch entry: the bias is
    4D, rows allocated at a multiple of ``EFFICIENT_BIAS_ALIGN`` elements, expanded over the heads."""
    n, heads, rows, _ = q.shape
    if k.shape[1] != heads:
        k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
    cols = mask.shape[-1]
    aligned = mask.new_empty(n, rows, -(-cols // EFFICIENT_BIAS_ALIGN) * EFFICIENT_BIAS_ALIGN)[..., :cols]
    bias = aligned.copy_(mask)[:, None].expand(n, heads, rows, cols)
    out = op(q, k, v, bias, True, 0.0, False, scale=scale)
    return out[0], out[1][..., :rows]


def _keys(q, k, v, a: int, b: int, bound: torch.Tensor, near: bool, scale: float):
    """Output (float32) and log-sum-exp of the queries a .. b-1 over a contiguous key range per row: near, keys
    ``bound[r] .. a + r``; far, keys ``0 .. bound[r] - 1``. Mask-free kernel calls where the range has a shape the
    kernel knows (a fixed start with the causal diagonal; a fixed end; an end moving with the row), one masked call
    otherwise. Rows with no key get log-sum-exp -inf (the kernel would say 0)."""
    n = b - a
    inf = float("-inf")
    lo, hi = int(bound.min()), int(bound.max())
    if near:
        if lo == hi:  # keys lo .. a + r: the causal square plus, before it, keys every row sees
            o, lse = _attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], True, scale)
            o, lse = o.float(), lse.float()
            if lo < a:
                _merge(o, lse, *_attend(q[:, :, a:b], k[:, :, lo:a], v[:, :, lo:a], False, scale))
            return o, lse
        j = torch.arange(lo, b, device=q.device)[None, :]
        i = torch.arange(a, b, device=q.device)[:, None]
        mask = torch.zeros(n, b - lo, dtype=q.dtype, device=q.device)
        mask.masked_fill_((j < bound[:, None]) | (j > i), inf)
        o, lse = _attend(q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], False, scale, mask)
        return o.float(), lse.float()
    o = torch.zeros(q.shape[0], q.shape[1], n, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(o.shape[:-1], inf, dtype=torch.float32, device=q.device)
    if lo > 0:  # keys every row reaches
        o_all, lse_all = _attend(q[:, :, a:b], k[:, :, :lo], v[:, :, :lo], False, scale)
        o.copy_(o_all)
        lse.copy_(lse_all)
    if hi > lo:  # keys only some rows reach
        first = n - 1 - (hi - lo)  # the last row without such keys, if the end moves one key per row
        rising = (torch.arange(n, device=q.device) - first).clamp(min=0)
        if first >= -1 and torch.equal(bound - lo, rising):  # a causal square from row first + 1 on
            o_edge, lse_edge = _attend(q[:, :, a + first + 1 : b], k[:, :, lo:hi], v[:, :, lo:hi], True, scale)
            _merge(o[:, :, first + 1 :], lse[..., first + 1 :], o_edge, lse_edge)
        else:
            j = torch.arange(lo, hi, device=q.device)[None, :]
            mask = torch.zeros(n, hi - lo, dtype=q.dtype, device=q.device)
            mask.masked_fill_(j >= bound[:, None], inf)
            o_edge, lse_edge = _attend(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], False, scale, mask)
            missed = bound <= lo  # rows whose keys were all masked: weight 0, not exp(0)
            _merge(o, lse, o_edge.masked_fill(missed[:, None], 0), lse_edge.float().masked_fill(missed, inf))
    return o, lse


def _merge(o, lse, o_other, lse_other) -> None:
    """Merge, in place into (o, lse) (float32), an attention output over other keys of the same softmax, by the two
    log-sum-exps. Rows of ``lse`` at -inf (no key yet) take the other output as it is."""
    lse_other = lse_other.float()
    # lse -inf and lse_other finite: 1; lse_other -inf: 0 (both -inf: nan -> 0, o stays)
    weight = torch.sigmoid(lse_other - lse).nan_to_num_(0.0)[..., None]
    o.add_((o_other.float() - o).mul_(weight))
    lse.copy_(torch.logaddexp(lse, lse_other))


__all__ = ["BLOCK", "TESTED_TORCH", "available", "split_attention"]
