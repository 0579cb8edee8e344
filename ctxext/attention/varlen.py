"""The kernel contract the CUDA plans call (``ctxext.attention.cuda_plans``), a dense reference emulator of it, and
the choice of the real kernel.

The contract is ``torch.nn.attention.varlen.varlen_attn`` (documented from torch 2.12; read from the torch 2.13
source, ``torch/nn/attention/varlen.py``), which calls ``aten._flash_attention_forward`` (FlashAttention 2):

- packed inputs: q (total_q, H, D), k / v (total_k, H_kv, D); sequence b is rows ``cu_seq_q[b] .. cu_seq_q[b+1]``
  of q against rows ``cu_seq_k[b] .. cu_seq_k[b+1]`` of k / v; ``enable_gqa``: query head h reads key head
  ``h // (H / H_kv)`` (as transformers' ``repeat_kv`` pairs them), no copies;
- ``window_size=(left, right)``: query r of a sequence of sq queries and sk keys sees key c iff
  ``r + sk - sq - left <= c <= r + sk - sq + right`` (a negative bound is no bound). So ``(-1, 0)`` is causal,
  ``(W, 0)`` a causal sliding window of W + 1 keys, ``(-1, -1)`` everything. The diagonal is aligned
  **bottom-right** (the last query sees the last key), as flash-attn's ``flash_attn_varlen_func`` does (its
  docstring, 2.1 on); torch's sdpa aligns it top-left. ``varlen_attn`` sets ``is_causal`` only for the tuple
  ``(-1, 0)``; flash's ``mha_varlen_fwd`` then forces right = 0 and turns a bound ``>= max_seqlen_k`` into -1
  (no bound), which the emulator copies: a right bound that large is NOT "up to r + right" when sq > sk;
- returns the output (total_q, H, D) in q's dtype and, with ``return_aux=AuxRequest(lse=True)``, the natural-log
  log-sum-exp of the scaled scores, float32. Its layout: the docstring says (total_q, H), the op's fake (meta)
  implementation (H, total_q), which is what flash's varlen kernel returns; ``normalise_lse`` accepts both;
- a query row that sees no key gets output 0 and log-sum-exp **+inf** (flash's ``softmax.h``: ``sum == 0`` ->
  INFINITY without split-KV). The plans never make such rows; the emulator returns +inf so a plan that did would
  fail its tests instead of silently merging wrong.

fp16 / bf16 on CUDA only; the emulator takes any float dtype on any device and computes in float32.

``CTXEXT_REMAP_PLAN``: ``emulate`` runs the plans on CPU (and CUDA) tensors through the emulator; ``0`` / ``off``
turns the plans off (today's paths); unset: the plans run on CUDA where a kernel is installed. ``emulated()`` and
``counting()`` do the same in a ``with`` block (tests).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import warnings
from collections import Counter

import torch

ENV = "CTXEXT_REMAP_PLAN"
#: rows of queries the emulator scores at once (bounds its memory: H x ROWS x sk float32)
ROWS = 1024
_OFF = ("0", "false", "off", "no")
#: the kernel a ``with emulated()`` / ``counting()`` block forces: (name, varlen function, biased function)
_FORCED: list = []
_WARNED: set = set()


def varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    """Dense reference of the contract above: (output (total_q, H, D) in q's dtype, lse (H, total_q) float32)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        raise ValueError(f"varlen: {heads} query heads against {kv_heads} key heads needs enable_gqa and a divisor")
    left, right = window_size
    if tuple(window_size) == (-1, 0):  # is_causal: right forced to 0
        right = 0
    left = -1 if left >= max_k else left  # flash's clamp of bounds past the longest key sequence
    right = -1 if right >= max_k else right
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(query.shape[0], heads, value.shape[-1], dtype=torch.float32, device=query.device)
    lse = torch.full((heads, query.shape[0]), float("inf"), dtype=torch.float32, device=query.device)
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    for b in range(len(cq) - 1):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if sq == 0 or sk == 0:
            continue
        k = key[ck[b]:ck[b + 1]].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, sk, D)
        v = value[ck[b]:ck[b + 1]].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        cols = torch.arange(sk, device=query.device)
        for r0 in range(0, sq, ROWS):
            r1 = min(sq, r0 + ROWS)
            q = query[cq[b] + r0:cq[b] + r1].float().transpose(0, 1)  # (H, n, D)
            diag = torch.arange(r0, r1, device=query.device)[:, None] + sk - sq
            seen = torch.ones(r1 - r0, sk, dtype=torch.bool, device=query.device)
            if left >= 0:
                seen &= cols >= diag - left
            if right >= 0:
                seen &= cols <= diag + right
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            s = s.masked_fill(~seen, float("-inf"))
            m = torch.logsumexp(s, dim=-1)  # (H, n); -inf for a row without keys
            p = torch.exp(s - m[..., None]).nan_to_num_(0.0)
            out[cq[b] + r0:cq[b] + r1] = torch.matmul(p, v).transpose(0, 1)
            lse[:, cq[b] + r0:cq[b] + r1] = torch.where(torch.isinf(m), float("inf"), m)
    return out.to(query.dtype), lse


def biased_reference(query, key, value, bias, causal: bool, scale: float):
    """Dense reference of CUDA's memory-efficient kernel as the ALiBi plan calls it (``_scaled_dot_product_efficient
    _attention(q, k, v, bias, compute_log_sumexp=True, is_causal=causal, scale=)``): q (N, H, L, D), k / v
    (N, H, S, D) (equal heads), an additive bias broadcasting to (N, H, L, S), a causal diagonal aligned top-left.
    Returns (output (N, H, L, D) in q's dtype, lse (N, H, L) float32)."""
    s = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale + bias.float()
    if causal:
        rows, cols = s.shape[-2:]
        s = s.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), value.float()).to(query.dtype), lse


def normalise_lse(lse: torch.Tensor, heads: int, total_q: int) -> torch.Tensor:
    """The log-sum-exp as (H, total_q) float32, from either documented layout ((H, total_q) preferred)."""
    if lse.shape == (heads, total_q):
        return lse.float()
    if lse.shape == (total_q, heads):
        return lse.float().t()
    raise ValueError(f"varlen kernel returned a log-sum-exp of shape {tuple(lse.shape)} for {heads} heads and "
                     f"{total_q} queries")


@functools.lru_cache(maxsize=None)
def _torch_varlen():
    """(varlen_attn, AuxRequest, takes enable_gqa, takes scale), or None where this torch lacks it or its
    ``window_size`` (torch 2.10 had only ``is_causal``)."""
    try:
        mod = importlib.import_module("torch.nn.attention.varlen")
        params = inspect.signature(mod.varlen_attn).parameters
        if "window_size" not in params or "return_aux" not in params:
            return None
        return mod.varlen_attn, mod.AuxRequest, "enable_gqa" in params, "scale" in params
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def _flash_varlen():
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception:  # missing, or built for another torch / CUDA
        return None


def _call_torch(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    fn, aux, takes_gqa, takes_scale = _torch_varlen()
    extra = {}
    if enable_gqa and k.shape[1] != q.shape[1]:
        if takes_gqa:
            extra["enable_gqa"] = True
        else:  # an older varlen_attn: the key heads repeated as transformers' repeat_kv pairs them
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if takes_scale:
        extra["scale"] = scale
    elif scale is not None:  # its default scale is dim ** -0.5: fold the rest into the queries
        q = q * (scale * q.shape[-1] ** 0.5)
    out, lse = fn(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=aux(lse=True), window_size=tuple(window_size),
                  **extra)
    return out, normalise_lse(lse, q.shape[1], q.shape[0])


def _call_flash(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    causal = tuple(window_size) == (-1, 0)
    out, lse, _ = _flash_varlen()(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                  window_size=(-1, -1) if causal else tuple(window_size), return_attn_probs=True)
    return out, normalise_lse(lse, q.shape[1], q.shape[0])


def _efficient(q, k, v, bias, causal: bool, scale: float):
    from ..compat.torch import efficient_attention

    return efficient_attention(q, k, v, bias, causal, scale)


def mode() -> str:
    """``emulate``, ``off`` or ``auto`` (``CTXEXT_REMAP_PLAN``)."""
    env = os.environ.get(ENV, "").strip().lower()
    return "emulate" if env == "emulate" else "off" if env in _OFF else "auto"


def kernels(device: torch.device) -> tuple[str, object, object] | None:
    """(name, varlen function, biased function) the plans use on ``device``, or None (today's paths). On CUDA:
    torch's ``varlen_attn`` where this torch has it, else flash-attn's ``flash_attn_varlen_func``, else None with a
    one-time warning that names both."""
    if _FORCED:
        return _FORCED[-1]
    chosen = mode()
    if chosen == "off":
        return None
    if chosen == "emulate":
        return ("emulate", varlen_reference, biased_reference)
    if torch.device(device).type != "cuda":
        return None
    if _torch_varlen() is not None:
        return ("varlen_attn", _call_torch, _efficient)
    if _flash_varlen() is not None:
        return ("flash_attn_varlen_func", _call_flash, _efficient)
    warn_once("kernel", "ctxext: the few-call CUDA plans need torch.nn.attention.varlen.varlen_attn (torch >= 2.12) "
              f"or flash-attn's flash_attn_varlen_func; this torch {torch.__version__} has neither: the remap "
              "methods keep today's slower paths")
    return None


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def emulated(varlen=varlen_reference, biased=biased_reference, name: str = "emulate"):
    """Within the block the plans run on any device through these functions (default: the emulator)."""
    _FORCED.append((name, varlen, biased))
    try:
        yield
    finally:
        _FORCED.pop()


def zeros_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
    """A stand-in that computes nothing (zeros of the right shapes, lse 0): for counting calls at lengths the dense
    emulator cannot afford."""
    return (query.new_zeros(query.shape[0], query.shape[1], value.shape[-1]),
            torch.zeros(query.shape[1], query.shape[0], device=query.device))


def zeros_biased(query, key, value, bias, causal, scale):
    return query.new_zeros(*query.shape[:-1], value.shape[-1]), torch.zeros(query.shape[:-1], device=query.device)


@contextlib.contextmanager
def counting(varlen=varlen_reference, biased=biased_reference):
    """``emulated`` with every call counted: yields a ``collections.Counter`` keyed by ``"varlen"`` / ``"biased"``
    and, for varlen calls, ``"window=(l, r)"``."""
    calls: Counter = Counter()

    def count_varlen(*args, **kwargs):
        calls["varlen"] += 1
        calls[f"window={tuple(kwargs.get('window_size', (-1, -1)))}"] += 1
        return varlen(*args, **kwargs)

    def count_biased(*args, **kwargs):
        calls["biased"] += 1
        return biased(*args, **kwargs)

    with emulated(count_varlen, count_biased, name="counting"):
        yield calls


__all__ = ["ENV", "biased_reference", "counting", "emulated", "kernels", "mode", "normalise_lse",
           "varlen_reference", "zeros_biased", "zeros_varlen"]
