"""flash-attn (Dao et al.), used where it is installed (``pip install ctxext[flash]``), never required.

Two calls take it on CUDA in float16 / bfloat16:

- a mask-free piece of the remap merge path (``ctxext.attention.lse``): ``flash_attn_func(...,
  return_attn_probs=True)`` returns the output *and* each query's log-sum-exp, which the merge needs;
- the ALiBi swap over a full pass or a decoding step without padding: ``flash_attn_func(..., causal=True,
  alibi_slopes=)`` adds ``-slope_h * |i + kv_len - q_len - j|`` to the scores, which is the swap's
  ``-slope_h * (i - j)`` with the queries as the last ``q_len`` keys, in one call and no bias tensor.

Everything else (a mask, float32, a head dim over 256, another device) keeps torch's kernels. flash-attn's contract,
as its ``flash_attn_interface.flash_attn_func`` docstring states it (2.x): q (batch, q_len, heads, dim), k / v
(batch, kv_len, kv_heads, dim) with kv_heads dividing heads (query head h reads key head h // (heads / kv_heads)),
a causal diagonal aligned bottom-right, and with ``return_attn_probs`` the tuple (out, softmax_lse (batch, heads,
q_len) float32, S_dmask). ``CTXEXT_FLASH_ATTN=0`` turns it off. No GPU was lent while this was written: the calls are
checked against a stand-in written from that contract (tests/test_optional_kernels.py); tests/test_gpu.py compares
the real library with torch's kernels where both are installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os

import torch

from ..compat.torch import ampere_or_newer

#: the oldest flash-attn whose ``flash_attn_func`` takes ``alibi_slopes`` and returns the log-sum-exp as above
MIN_VERSION = (2, 4)
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def _function():
    """flash-attn's ``flash_attn_func``, or None where it is missing, too old or fails to import."""
    try:
        version = importlib.metadata.version("flash-attn")
        if tuple(int(p) for p in version.split(".")[:2]) < MIN_VERSION:
            return None
        return importlib.import_module("flash_attn").flash_attn_func
    except Exception:  # not installed, or built for another torch / CUDA: torch's kernels do the work
        return None


def enabled() -> bool:
    """flash-attn is installed (``MIN_VERSION`` or newer, importable) and ``CTXEXT_FLASH_ATTN=0`` does not turn it off."""
    if os.environ.get("CTXEXT_FLASH_ATTN", "").strip().lower() in ("0", "false", "off", "no"):
        return False
    return _function() is not None


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """flash-attn is enabled and takes these tensors ((batch, heads, len, dim) layouts). The device is checked first:
    on CPU this runs once per fused call of the merge path."""
    return (q.device.type == "cuda" and q.dtype in DTYPES and k.dtype == v.dtype == q.dtype
            and q.shape[-1] == k.shape[-1] == v.shape[-1] <= MAX_HEAD_DIM and q.shape[1] % k.shape[1] == 0
            and ampere_or_newer(q.device) and enabled())


def attention_with_lse(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (batch, heads, q_len, dim), log-sum-exp (batch, heads, q_len) float32) of one mask-free call; q
    (batch, heads, q_len, dim), k / v (batch, kv_heads, kv_len, dim); ``causal`` only for a square call (the merge
    path's causal calls are; flash-attn's bottom-right diagonal is then torch's top-left one)."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("a causal fused call must be square (the kernels disagree on where a longer diagonal sits)")
    out, lse, _ = _function()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                              causal=causal, return_attn_probs=True)
    return out.transpose(1, 2), lse.float()


def alibi_attention(q, k, v, slopes: torch.Tensor, scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention with ALiBi biases ``-slopes[h] * (i - j)``, the queries being the last ``q_len`` keys; q
    (batch, heads, q_len, dim), k / v (batch, kv_heads, kv_len, dim). Returns (batch, q_len, heads, dim)."""
    return _function()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout,
                       softmax_scale=scale, causal=True, alibi_slopes=slopes.float())


__all__ = ["MIN_VERSION", "alibi_attention", "attention_with_lse", "enabled", "usable"]
