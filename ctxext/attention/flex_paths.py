"""Flex-attention paths for ctxext's swapped-in attention functions (``ctxext_alibi``, ``ctxext_remap``).

The chunked sdpa loops in ``ctxext.attention`` and ``ctxext.attention.remap`` keep memory bounded on any device, but
on a GPU they are many small kernel launches with materialised boolean / float masks. Here the same computations
run as ONE ``torch.nn.attention.flex_attention`` call (compiled on CUDA; eager on CPU, for tests) with a block mask,
so fully masked tiles are skipped and fully visible tiles run without evaluating any mask:

- ``flex_alibi``: ``score_mod`` adds the ALiBi bias ``-slope_h * (slot_i - j)`` (computed in float32 and rounded to
  the query dtype, as ``ctxext_alibi`` hands it to sdpa, so prefill here and sdpa decoding see the same biases);
  ``mask_mod`` = causal (in key-slot order) and the padding mask.
- ``flex_remap``: the concat trick in one call. With K rotations, the query is ``[q_0, q_1, ..]`` along head_dim
  (K x D; one copy when all rotations share their query positions, as STRING's do) and the key/value sequence is
  K copies of the keys, copy c holding ``k_c`` in the c-th D slot and zeros elsewhere (values duplicated), so the
  score of copy c is exactly ``q_c . k_c``. ``mask_mod`` keeps copy c of key j for query i iff
  ``select(qpos_i, kpos_j) == c`` and j is causally visible and not padding: every pair is scored once, under
  its rotation. Each copy is padded to a multiple of the block size so block boundaries never straddle copies.

Both return the attention interface's layout (batch, q_len, heads, v_head_dim), or raise. Query rows that see no
key at all (left padding) come out as zeros (the sdpa loops give them arbitrary finite values); no real row ever
attends to them.

Block masks are built once per forward pass, not per layer: a small cache keyed by the shapes, the position map,
the positions' contents (compared with ``torch.equal``) and the identity of the tensor transformers built the mask
in (held by weak reference, with its version counter), so the layers of one forward reuse one block mask.

``flex_available(device)``: opt-in (issue 48: no default path compiles): ``CTXEXT_FLEX=1`` turns the paths on for
CUDA with flex importable, ``CTXEXT_FLEX=force`` for any device (CPU runs flex eagerly: slow, O(T^2) memory; for tests
only); unset or ``0``: off. The compiled calls raise dynamo's recompile limit only around themselves and restore it.

``use_flex(query, dropout, key, value)``: the callers' test (several queries, no dropout, flex available; off CUDA
only without autograd, as flex has no CPU backward).

Drop-in attention functions that force these paths (for tests and benchmarks) live in ``ctxext.attention.flex_functions``.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..compat.torch import raised_recompile_limit

#: Block size of the block masks (flex's default). Key copies are padded to a multiple of it.
BLOCK = 128
#: ``torch.compile`` options for flex_attention and create_block_mask on CUDA. ``dynamic=None`` (automatic dynamic):
#: the first length compiles static, a second distinct length recompiles once with dynamic shapes, later lengths
#: reuse that. ``dynamic=False`` would recompile for every new length and, past dynamo's recompile limit, fall back
#: to eager flex (dense O(T^2) scores): do not use it for variable-length workloads.
COMPILE_KWARGS: dict = {"dynamic": None}
#: Each distinct mask/score function (ALiBi, each position map, dense or compact masks) and each switch to dynamic
#: shapes is one more compiled graph of the same function; past dynamo's ``recompile_limit`` (8 by default) dynamo
#: silently runs flex eagerly, which materialises (B x H x Q x KV) scores. Around each compiled call (only there:
#: ``compat.torch.raised_recompile_limit`` restores it after) the limit is at least this (None: dynamo's own setting).
RECOMPILE_LIMIT: int | None = 64
#: Pad q/k (and v) head dims to a power of two >= 16 before calling flex: "auto" = on CUDA only, True, False.
PAD_DIMS: bool | str = "auto"
#: Round the ALiBi bias to the query dtype before adding it (what ``ctxext_alibi`` does through sdpa's mask).
ROUND_ALIBI_BIAS = True
#: Cached block masks (a forward pass of a model needs one; a few for interleaved calls).
CACHE_SIZE = 4

_compiled: dict[str, object] = {}
#: On CUDA, calls with fewer queries keep the sdpa loops (``CTXEXT_FLEX=force`` ignores this).
MIN_QUERIES = 4096
_cache: OrderedDict = OrderedDict()


# ------------------------------------------------------------------------------------------------- availability


def _flex_module():
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError:  # torch < 2.5
        return None
    if not hasattr(fa, "flex_attention") or not hasattr(fa, "create_block_mask"):
        return None
    return fa


def flex_available(device: torch.device | str) -> bool:
    """Whether the flex paths should run on ``device``: only where asked (they compile on CUDA, about a minute per
    first call): ``CTXEXT_FLEX=1`` on CUDA with flex attention importable; ``CTXEXT_FLEX=force`` on every device (CPU:
    eager flex, for tests); unset or ``0``: never."""
    env = os.environ.get("CTXEXT_FLEX", "").strip().lower()
    if env in ("0", "false", "off", "no"):
        return False
    if _flex_module() is None:
        return False
    if env in ("force", "cpu", "all"):
        return True
    # opt-in (issue 48): a first compiled call takes about a minute, so no default path compiles
    return env in ("1", "true", "on", "yes") and torch.device(device).type == "cuda"


def use_flex(query: torch.Tensor, dropout: float = 0.0, *others: torch.Tensor) -> bool:
    """The callers' test: several queries (a prefill or full pass; decoding keeps sdpa), no dropout, flex available
    on the query's device; off CUDA (forced, for tests) only without autograd (flex has no CPU backward)."""
    if query.dim() != 4 or query.shape[2] <= 1 or dropout:
        return False
    if not flex_available(query.device):
        return False
    forced = os.environ.get("CTXEXT_FLEX", "").strip().lower() in ("force", "cpu", "all")
    if not forced:
        # Below this many queries the sdpa loops cost little and need no compilation (the first compiled call
        # takes about a minute, measured on an H100); training (autograd through compiled flex) is untested.
        if query.shape[2] < MIN_QUERIES or torch.is_grad_enabled() and any(
                t.requires_grad for t in (query, *others)):
            return False
    if query.device.type != "cuda" and torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, *others)):
        return False
    return True


def _compile_target(device: torch.device) -> bool:
    return device.type == "cuda"


def _scoped(compiled):
    """A compiled function called with dynamo's recompile limit raised for that call only."""
    def call(*args, **kwargs):
        with raised_recompile_limit(RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    return call


def _flex_fn(device: torch.device):
    fa = _flex_module()
    if not _compile_target(device):
        return fa.flex_attention  # eager (CPU): the unfused reference implementation
    if "flex" not in _compiled:
        import logging

        logging.getLogger("ctxext").warning(
            "ctxext: compiling flex attention for the swapped-in attention (first long input; about a minute, and "
            "again once for a new length). CTXEXT_FLEX=0 keeps the uncompiled, slower sdpa path.")
        _compiled["flex"] = torch.compile(fa.flex_attention, **COMPILE_KWARGS)
    return _scoped(_compiled["flex"])


def _block_mask(mask_mod, batch: int, q_len: int, kv_len: int, device: torch.device):
    fa = _flex_module()
    if not _compile_target(device):
        return fa.create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device, BLOCK_SIZE=BLOCK)
    if "block_mask" not in _compiled:  # compiled: never materialises the (B, Q, KV) mask
        _compiled["block_mask"] = torch.compile(fa.create_block_mask, **COMPILE_KWARGS)
    return _scoped(_compiled["block_mask"])(mask_mod, batch, None, q_len, kv_len, device, BLOCK)


def clear_cache() -> None:
    """Drop the cached block masks."""
    _cache.clear()


# ------------------------------------------------------------------------------------------------------ helpers


def _flex_dim(width: int, device: torch.device) -> int:
    pad = PAD_DIMS if isinstance(PAD_DIMS, bool) else device.type == "cuda"
    if not pad:
        return width
    return max(16, 1 << (width - 1).bit_length())


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _mask_key(mask: torch.Tensor | None):
    """(weak reference to the tensor the mask is a view of, its version, the view's geometry), or None."""
    if mask is None:
        return None
    root = mask
    while root._base is not None:
        root = root._base
    return (weakref.ref(root), root._version, tuple(mask.shape), tuple(mask.stride()), mask.storage_offset(),
            root.untyped_storage().data_ptr())


def _same_mask(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    root = a[0]()
    return root is not None and root is b[0]() and a[1:] == b[1:]


def _cached(key: tuple, owner, tensors: tuple, mask_key, build):
    """A block mask for ``key``; reused while ``owner`` (the position map; compared by identity and held, so its
    id cannot be reused by another map), ``tensors`` (compared by content) and the mask (by identity) are the
    same, otherwise built by ``build()``."""
    entry = _cache.get(key)
    if entry is not None:
        old_owner, old_tensors, old_mask_key, value = entry
        if old_owner is owner and _same_mask(old_mask_key, mask_key) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(old_tensors, tensors)
        ):
            _cache.move_to_end(key)
            return value
    value = build()
    _cache[key] = (owner, tuple(t.clone() for t in tensors), mask_key, value)
    _cache.move_to_end(key)
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return value


def _key_validity(mask: torch.Tensor, qslot: torch.Tensor, batch: int):
    """For a boolean (B or 1, q_len, kv_len) mask: (key validity (batch, kv_len), None) when the mask is exactly
    ``causal (key slot <= query slot) & key validity`` (transformers' causal + padding mask); otherwise
    (None, the mask expanded to batch) to be looked up densely (sliding windows, static-cache slots, ...)."""
    kv_len = mask.shape[-1]
    valid = mask.any(1)  # (B', kv_len): keys some query sees
    keys = torch.arange(kv_len, device=mask.device)
    rows = max(1, (64 * 2**20) // max(1, mask.shape[0] * kv_len))
    for start in range(0, mask.shape[1], rows):
        end = min(start + rows, mask.shape[1])
        expect = (keys[None, None, :] <= qslot[None, start:end, None]) & valid[:, None, :]
        if not torch.equal(expect, mask[:, start:end]):
            return None, mask.expand(batch, *mask.shape[1:])
    return valid.expand(batch, kv_len).contiguous(), None


def _finish(out: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, Q, Dv') -> the attention interface's (B, Q, H, Dv), contiguous."""
    return out[..., :width].transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------------------- ALiBi


def flex_alibi(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slopes: torch.Tensor,
    q_start: int,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Causal ALiBi attention in one flex call; what ``ctxext_alibi`` computes.

    query (B, H, q_len, D); key/value (B, Hkv, kv_len, D / Dv), Hkv dividing H (GQA without repeating keys).
    slopes: float32 (H,). Query r sits at key slot ``q_start + r``; its bias on key j is
    ``-slopes[h] * (q_start + r - j)`` and it sees keys ``j <= q_start + r`` that ``mask`` allows.
    mask: None or a boolean / additive (B or 1, q_len, kv_len) mask (True = attend), already cut to the last
    kv_len keys. Returns (B, q_len, H, Dv), or None for an additive mask holding values other than 0 and the
    dtype's minimum (a bias flex's mask_mod cannot express: the caller keeps its sdpa path).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    device = query.device
    dtype = query.dtype
    scaling = head_dim**-0.5 if scaling is None else scaling
    mask_key = _mask_key(mask)  # the given mask's identity (a float mask's too: converted once per forward)
    qslot = torch.arange(q_start, q_start + q_len, device=device)

    def build():
        if mask is None:
            valid, dense = torch.ones(batch, kv_len, dtype=torch.bool, device=device), None
        else:
            allowed = _as_bool(mask)
            if mask.dtype != torch.bool and not bool(((mask == 0) | ~allowed).all()):
                return None  # an additive mask with values other than 0 / -inf: not a mask_mod
            valid, dense = _key_validity(allowed, qslot, batch)
        if dense is None:
            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= qslot[q_idx]) & valid[b, kv_idx]
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= qslot[q_idx]) & dense[b, q_idx, kv_idx]
        return _block_mask(mask_mod, batch, q_len, kv_len, device)

    block_mask = _cached(("alibi", batch, q_len, kv_len, str(device)), None, (qslot,), mask_key, build)
    if block_mask is None:
        return None
    slopes = slopes.to(device=device, dtype=torch.float32)
    round_to = dtype if ROUND_ALIBI_BIAS and dtype != torch.float32 else None

    def score_mod(score, b, h, q_idx, kv_idx):
        bias = -slopes[h] * (qslot[q_idx] - kv_idx).to(torch.float32)
        if round_to is not None:
            bias = bias.to(round_to)
        return score + bias.to(score.dtype)

    dq = _flex_dim(head_dim, device)
    dv = value.shape[-1]
    out = _flex_fn(device)(
        _pad_last(query, dq), _pad_last(key, dq), _pad_last(value, _flex_dim(dv, device)),
        score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=kv_heads != heads,
    )
    return _finish(out, dv)


def alibi_q_start(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> int:
    """Where ``ctxext_alibi`` puts the queries among the keys (see ``alibi_attention_forward``)."""
    if attention_mask is None:
        return kv_len - 1 if q_len == 1 else 0
    return kv_len - q_len


# ----------------------------------------------------------------------------------------------------- remap


def flex_remap(
    pmap,
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    value: torch.Tensor,
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention under a position map in one flex call; what ``ctxext_remap``'s chunk loop computes.

    pmap: the ``PositionMap``; queries[c] (B, H, q_len, D) and keys[c] (B, Hkv, kv_len, D) rotated (and queries
    scaled) for rotation c, as ``remap_attention_forward`` builds them; value (B, Hkv, kv_len, Dv). qpos (B, q_len)
    and kpos (B, kv_len): the positions ``pmap.select`` takes; slots (q_len,): each query's key slot (causality).
    mask: None or a boolean / additive (B or 1, q_len, kv_len) mask (True = attend). scaling: the softmax scale of
    the original head dim. Returns (B, q_len, H, Dv).
    """
    count = len(keys)
    batch, heads, q_len, head_dim = queries[0].shape
    kv_heads, kv_len = keys[0].shape[1], keys[0].shape[2]
    device = queries[0].device
    shared = all(r.query is pmap.rotations[0].query for r in pmap.rotations[:count])
    stride = -(-kv_len // BLOCK) * BLOCK  # each copy padded to whole blocks
    width = head_dim if shared else count * head_dim
    dq = _flex_dim(width, device)
    mask_key = _mask_key(mask)  # the given mask's identity (a float mask's too: converted once per forward)
    qpos = qpos.expand(batch, q_len).contiguous()
    kpos = kpos.expand(batch, kv_len).contiguous()
    slots = slots.contiguous()

    def build():
        if mask is None:
            valid, dense = torch.ones(batch, kv_len, dtype=torch.bool, device=device), None
        else:
            valid, dense = _key_validity(_as_bool(mask), slots, batch)  # as the chunk loop, True = finite
        # per flex key index (copy c, slot j): the copy, the slot, the key position, whether it is a real key
        kslot_one = torch.arange(stride, device=device)
        kcopy = torch.arange(count, device=device, dtype=torch.int8).repeat_interleave(stride)
        kslot = kslot_one.clamp(max=kv_len - 1).repeat(count)
        kpos_x = F.pad(kpos, (0, stride - kv_len)).repeat(1, count)
        if dense is not None:  # validity comes from the dense mask
            valid = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
        real = F.pad(valid, (0, stride - kv_len)).repeat(1, count)
        select = pmap.select
        if dense is None:
            def mask_mod(b, h, q_idx, kv_idx):
                ok = real[b, kv_idx] & (kslot[kv_idx] <= slots[q_idx])
                return ok & (select(qpos[b, q_idx], kpos_x[b, kv_idx]) == kcopy[kv_idx])
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                ok = real[b, kv_idx] & (kslot[kv_idx] <= slots[q_idx]) & dense[b, q_idx, kslot[kv_idx]]
                return ok & (select(qpos[b, q_idx], kpos_x[b, kv_idx]) == kcopy[kv_idx])
        return _block_mask(mask_mod, batch, q_len, count * stride, device)

    key_ = ("remap", batch, q_len, kv_len, count, str(device))
    block_mask = _cached(key_, pmap, (qpos, kpos, slots), mask_key, build)

    q = queries[0] if shared else torch.cat(queries[:count], dim=-1)
    q = _pad_last(q, dq)
    k = keys[0].new_zeros(batch, kv_heads, count, stride, dq)
    for c in range(count):
        lo = 0 if shared else c * head_dim
        k[:, :, c, :kv_len, lo : lo + head_dim] = keys[c]
    k = k.view(batch, kv_heads, count * stride, dq)
    dv = value.shape[-1]
    v = F.pad(value, (0, _flex_dim(dv, device) - dv, 0, stride - kv_len))
    v = v.unsqueeze(2).expand(-1, -1, count, -1, -1).reshape(batch, kv_heads, count * stride, -1)
    out = _flex_fn(device)(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=kv_heads != heads)
    return _finish(out, dv)


__all__ = [
    "alibi_q_start",
    "clear_cache",
    "flex_alibi",
    "flex_available",
    "flex_remap",
    "use_flex",
]
