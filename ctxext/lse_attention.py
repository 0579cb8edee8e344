"""Band + far attention on torch's fused CPU flash kernel, merged by log-sum-exp: an inference fast path for position
maps of the "band_far" shape (``ctxext.methods.remap.PositionMap.band_far``: rotation 0 for ``0 <= i - j < near``,
rotation 1 for every ``i - j >= near``, nothing masked but the future).

For a full pass over positions ``0 .. T-1`` such a map's attention is one softmax over two disjoint key sets per
query i: the band (keys ``i - near < j <= i``, scored under rotation 0) and the far keys (``j <= i - near``, under
rotation 1). Each part is computed by ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, which returns
the attention output *and* the log-sum-exp of each query's scores; the two outputs are then merged exactly:
``out = o_band + sigmoid(lse_far - lse_band) * (o_far - o_band)`` (= the softmax-weighted mix, stable: no exp of a
large number).

- Far part: one causal call of the queries ``near ..  T-1`` against the keys ``0 .. T-1-near`` (query ``near + a``
  sees key ``b`` iff ``b <= a``, i.e. ``j <= i - near``): the kernel's own causal tiling, no mask tensor.
- Band part: query blocks of ``block`` rows, each against the keys from ``start - near + 1`` to its last row, with an
  additive float mask (0 / -inf) keeping ``0 <= i - j < near``; the mask of a full block is the same for every block
  (built once and sliced for the first and last blocks).

The kernel takes grouped-query attention natively (key/value heads dividing the query heads, query head h reading
key head ``h // (heads / kv_heads)``, as transformers' ``repeat_kv`` pairs them), so keys are never expanded. Its
log-sum-exp output carries no gradient: callers use this without autograd only (``remap_attention_forward``
checks). The op is private: ``available()`` allows it only on torch versions it was tested on (``TESTED_TORCH``).
Measured on CPU: ``benchmarks/bench_remap.py`` (see the report of issue 23).
"""

from __future__ import annotations

import torch

#: torch versions (major.minor) whose private CPU flash op this module was tested against
TESTED_TORCH = ("2.13",)
#: upper bound on the rows of one band block (a block costs rows x (rows + near - 1) scores)
BAND_BLOCK = 1024
#: lower bound on the rows of one band block when ``near`` is small (fewer, larger kernel calls)
MIN_BAND_BLOCK = 128
#: dtypes the CPU flash kernel runs natively here
DTYPES = (torch.float32, torch.bfloat16)


def _op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def available() -> bool:
    """The private op exists and this torch version is one it was tested on."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return version in TESTED_TORCH and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def band_far_attention(queries, keys, value: torch.Tensor, near: int, scale: float) -> torch.Tensor:
    """Attention of a band_far map over a full pass (positions 0 .. T-1, causal, no padding).

    queries: (q_0, q_1), the queries rotated by rotation 0 and 1, each (batch, heads, T, head_dim); keys: (k_0, k_1),
    (batch, kv_heads, T, head_dim), kv_heads dividing heads; value: (batch, kv_heads, T, head_dim) (the kernel needs
    the value head dim equal to the query's). near: an int with 0 < near < T. Returns (batch, T, heads, head_dim),
    contiguous, in the queries' dtype. No gradient flows through it.
    """
    fa = _op()
    q0, q1 = queries
    k0, k1 = keys
    batch, heads, T, dim = q0.shape
    near = int(near)
    if not 0 < near < T:
        raise ValueError(f"band_far_attention needs 0 < near < T, got near={near}, T={T}")
    # far: query i against keys j <= i - near, rotation 1, one causal call
    o_far, lse_far = fa(q1[:, :, near:], k1[:, :, : T - near], value[:, :, : T - near], 0.0, True, scale=scale)
    # band: keys near - 1 back from each query block's first row to its last row, rotation 0
    block = max(min(near, BAND_BLOCK), min(MIN_BAND_BLOCK, T))
    span = block + near - 1  # keys of a full block
    qi = torch.arange(block, device=q0.device)[:, None]
    kj = torch.arange(span, device=q0.device)[None, :]
    dist = qi - kj + (near - 1)  # query row qi (at start + qi) vs key column kj (at start - near + 1 + kj)
    mask_dtype = q0.dtype
    mask = torch.zeros(block, span, dtype=mask_dtype, device=q0.device)
    mask.masked_fill_((dist < 0) | (dist >= near), float("-inf"))
    out = torch.empty(batch, T, heads, dim, dtype=torch.float32 if q0.dtype != torch.float32 else q0.dtype,
                      device=q0.device)
    out_h = out.transpose(1, 2)  # (batch, heads, T, dim) view
    lse_band = torch.empty(batch, heads, T, dtype=torch.float32, device=q0.device)
    for start in range(0, T, block):
        end = min(start + block, T)
        first = start - near + 1  # the key of mask column 0
        k_lo = max(0, first)
        m = mask[: end - start, k_lo - first : end - first]
        o, lse = fa(q0[:, :, start:end], k0[:, :, k_lo:end], value[:, :, k_lo:end], 0.0, False, attn_mask=m,
                    scale=scale)
        out_h[:, :, start:end] = o
        lse_band[:, :, start:end] = lse
    # merge the far part into queries near .. T-1
    tail = out_h[:, :, near:]
    weight = torch.sigmoid(lse_far.float() - lse_band[:, :, near:])[..., None]
    tail.add_((o_far.to(tail.dtype) - tail).mul_(weight))
    return out if out.dtype == q0.dtype else out.to(q0.dtype)


__all__ = ["BAND_BLOCK", "TESTED_TORCH", "available", "band_far_attention"]
