"""Rotated copies of the cached keys, for decoding under a remap method without re-rotating the whole cache.

The remap attention (``ctxext.attention.remap``) receives *un-rotated* keys from the KV cache and rotates them per
rotation of the method's map. Every method here rotates a key by its own position only (``Rotation.key(j)``), so a
key's rotated copies never change once the key exists: a decode step needs to rotate only its new keys. This module
keeps, per attention module, one buffer per distinct key rotation (rotations sharing a key function share it; a key
rotated to position 0 with scale 1 is the un-rotated key itself and is not copied), extended in place as the cache
grows (capacity grows by a quarter, so copies are amortised).

When a copy is trusted. A forward pre-hook on the attention module (``note_cache``, installed by the remap patch)
looks at the cache layer before the module appends its new keys: the copies are reused only if that layer still
holds the very tensor object the last call received (``is`` plus its in-place version counter), the call appends
exactly ``q_len`` keys to it, the last old key is unchanged and the rows' positions are the same (a static cache's
buffer is that tensor, its filled part the keys: it keeps its copies). A new cache, a reset, a crop, a beam-search
reorder, a sliding-window layer (its window moves), a call without a cache: any of them rebuilds or bypasses the
copies. The copies are dropped when the cached tensor they belong to dies (the user dropped the cache),
on unpatch, and never kept for a full pass without a past (a plain forward holds nothing), with autograd, or with a
hook that did not run.

Which patch filled a cache. A remap patch's cache holds un-rotated keys, any other model's rotated ones, so a cache
continued across a patch boundary (generated inside ``ctxext.patched`` and continued after it, the reverse, an unpatch
from a logits processor in the middle of ``generate``, another remap method or factor) would decode wrong logits. The
pre-hook marks the cache object with the live patch (``CachePatch``) and refuses a cache that holds keys written under
another (or under none); it also wraps that cache's ``update`` (on the instance, so nothing stays on the model after
unpatch), which refuses an update no live patch announced while the cache holds keys of its patch. A cache emptied by
``reset`` (where the release empties it: transformers 4.x zeroes a dynamic cache's keys and keeps them) is free
again. Per step: a dict read and write in the hook and one wrapper call per layer.

Memory while decoding: per layer, B x kv_heads x (about 1.25 T) x head_dim elements of the key dtype per kept
rotation: self-extend, DCA and STRING keep two (about the size of the whole KV cache again), ReRoPE, LM-Infinite and
StreamingLLM one (half of it).
"""

from __future__ import annotations

import copy
import math
import weakref

import torch

from ..core.errors import PatchError
from ..methods.position_map import _zero
from .lse import _merge
from .lse import accepts as lse_accepts
from .lse import available as lse_available

ATTR = "_ctxext_rotated_keys"
#: most query rows of a cached call that ``decode_attention`` takes (generation: 1; assisted decoding: a few)
DECODE_ROWS = 64
#: False: neither kept copies nor ``decode_attention`` (every step re-rotates the cache: the "before" of a benchmark)
KEEP = True


class RotatedKeys:
    """One attention module's kept copies (not copied with the model: a deep copy or pickle gets an empty one)."""

    def __init__(self):
        self.mode = None  # set by the pre-hook for the next call: None (no cache), "fresh", "trusted"
        self.expecting = False
        self.clear()

    def clear(self):
        self.buffers, self.length, self.source, self.version, self.first, self.last = {}, 0, None, -1, None, None

    def __deepcopy__(self, memo):
        return RotatedKeys()

    def __reduce__(self):
        return RotatedKeys, ()

    def _died(self, _ref):
        if not self.expecting:  # the cache dropped the tensor: not an append on its way
            self.clear()


def entry(module) -> RotatedKeys:
    found = module.__dict__.get(ATTR)
    if found is None:
        found = module.__dict__[ATTR] = RotatedKeys()
    return found


def drop(module) -> None:
    module.__dict__.pop(ATTR, None)


class CachePatch:
    """The remap patch a cache's keys were written under: ``key`` (what decides the cached keys: method, factor,
    options, trained length, temperature) and ``label`` (for messages). Shared, not copied, with a deep copy."""

    __slots__ = ("key", "label")

    def __init__(self, key, label: str):
        self.key, self.label = key, label

    def __deepcopy__(self, memo):
        return self


#: attributes on a cache object: the ``CachePatch`` its keys were written under, and whether the next ``update`` was
#: announced by a live patch's pre-hook
FILLED_UNDER = "_ctxext_filled_under"
ANNOUNCED = "_ctxext_update_announced"
START_OVER = ("start a new cache (past_key_values=None, or a new DynamicCache / StaticCache), or continue it under the "
              "patch it was filled under")


def check_cache(cache, index, patch: CachePatch) -> None:
    """Refuse ``cache`` if it holds keys written under another patch than ``patch`` (or under none); else mark it as
    ``patch``'s and announce the update the module is about to make. Free when the cache is already ``patch``'s."""
    state = getattr(cache, "__dict__", None)
    if state is None:  # not a transformers Cache object: nothing to mark
        return
    under = state.get(FILLED_UNDER)
    if under is not patch and (under is None or under.key != patch.key):
        if _holds_keys(cache, index):
            was = ("without a position-remapping patch (its cached keys are rotated: the plain model, or a frequency "
                   "patch such as yarn)" if under is None else f"under {under.label} (other cached keys)")
            raise PatchError(f"this KV cache was filled {was}; the model now runs {patch.label}, which caches "
                             f"un-rotated keys, so continuing it would give wrong logits: {START_OVER}")
        state[FILLED_UNDER] = patch
        _guard_updates(cache)
    state[ANNOUNCED] = True


def _holds_keys(cache, index) -> bool:
    try:
        return int(cache.get_seq_length(index if isinstance(index, int) else 0)) > 0
    except (TypeError, ValueError, IndexError, AttributeError):
        return False


def _guard_updates(cache) -> None:
    if not isinstance(cache.__dict__.get("update"), _GuardedUpdate):
        cache.update = _GuardedUpdate(cache, cache.__dict__.get("update"))


class _GuardedUpdate:
    """``Cache.update`` of a cache a remap patch filled: refused for a model without that live patch (no pre-hook
    announced the update) while the cache holds the patch's keys; an emptied cache is the new model's. Set on the
    cache instance; a deep copy or pickle of the cache carries it, bound to the copy."""

    __slots__ = ("cache", "inner")

    def __init__(self, cache, inner=None):
        self.cache, self.inner = cache, inner  # inner: an update already set on the instance, else the class's

    def __deepcopy__(self, memo):
        return _GuardedUpdate(copy.deepcopy(self.cache, memo), copy.deepcopy(self.inner, memo))

    def __reduce__(self):
        return _GuardedUpdate, (self.cache, self.inner)

    def __call__(self, key_states, value_states, layer_idx=0, *args, **kwargs):
        cache = self.cache
        state = cache.__dict__
        if not state.pop(ANNOUNCED, False):
            under = state.get(FILLED_UNDER)
            if under is not None:
                if _holds_keys(cache, layer_idx):
                    raise PatchError(f"this KV cache was filled under the position-remapping patch {under.label}, "
                                     "whose cached keys are un-rotated; the model updating it no longer runs that "
                                     "patch (it was unpatched, or patched with another method), so continuing it "
                                     f"would give wrong logits: {START_OVER}")
                del state[FILLED_UNDER]
        if self.inner is not None:
            return self.inner(key_states, value_states, layer_idx, *args, **kwargs)
        return type(cache).update(cache, key_states, value_states, layer_idx, *args, **kwargs)


def note_cache(module, args, kwargs, patch: CachePatch | None = None):
    """Forward pre-hook: refuse a cache filled under another patch (``check_cache``, where the patch passes its
    ``CachePatch``); whether the next call may extend the kept copies (see the module docstring)."""
    cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))  # the 4.x name too
    if cache is None:  # a plain forward keeps nothing, and leaves nothing on the module
        drop(module)
        return None
    if patch is not None:
        check_cache(cache, getattr(module, "layer_idx", None), patch)
    keep = entry(module)
    keep.expecting = False
    keep.mode = "fresh"
    layers, index = getattr(cache, "layers", None), getattr(module, "layer_idx", None)
    try:
        held = layers[index].keys
    except (TypeError, IndexError, AttributeError, KeyError):
        held = None
    source = keep.source() if keep.source is not None else None
    if held is not None and source is held and held._version == keep.version and keep.length:
        keep.mode, keep.expecting = "trusted", True
    return None


def rotated_keys(module, state, key, kpos, q_len: int, count: int, rotate, source=None) -> list:
    """``key`` rotated by the key positions of each of the map's first ``count`` rotations, as ``rotate`` would,
    rotating only the new keys where the kept copies are trusted. ``source``: the tensor the cache holds, where
    ``key`` is its filled part (a static cache's buffer; default ``key``)."""
    source = key if source is None else source
    rotations = state.map.rotations[:count]
    inv_freq = state.frequencies(key.device)
    args = (inv_freq, state.attention_scaling, state.layout, state.start)
    keep = module.__dict__.get(ATTR)
    mode = None if keep is None else keep.mode
    if keep is not None:
        keep.mode = None  # one call per hook run
    kv_len = key.shape[2]
    if not KEEP or mode is None or q_len >= kv_len or (torch.is_grad_enabled() and key.requires_grad):
        if keep is not None and mode is not None:  # nothing kept (a prefill, a plain pass): nothing left on the module
            keep.expecting = False
            keep.clear()
            drop(module)
        return _fresh(rotations, key, kpos, args, rotate)
    old = keep.length
    trusted = (mode == "trusted" and old + q_len == kv_len and keep.buffers.keys() >= _fns(rotations, args)
               and torch.equal(kpos[:, 0], keep.first) and keep.last.shape == key[:, :, old - 1].shape
               and torch.equal(key[:, :, old - 1], keep.last))
    keep.expecting = False
    if not trusted:
        keep.clear()
        out = _fresh(rotations, key, kpos, args, rotate)
        for r, k in zip(rotations, out):
            if k is not key:
                keep.buffers[r.key] = k
    else:
        out = []
        for r in rotations:
            if _plain(r, args):
                out.append(key)
                continue
            buf = keep.buffers[r.key]
            if buf.shape[2] < kv_len:  # grow by a quarter (at least 64 slots): amortised copies
                grown = buf.new_empty(*buf.shape[:2], kv_len + max(64, kv_len // 4), buf.shape[-1])
                grown[:, :, :old] = buf[:, :, :old]
                buf = keep.buffers[r.key] = grown
            buf[:, :, old:kv_len] = rotate(key[:, :, old:], r.key(kpos[:, old:]), *args)
            out.append(buf[:, :, :kv_len])
        for fn in set(keep.buffers) - _fns(rotations, args):  # not extended by this call: stale from now on
            del keep.buffers[fn]
    keep.length, keep.first, keep.last = kv_len, kpos[:, 0].clone(), key[:, :, kv_len - 1].clone()
    keep.source, keep.version = weakref.ref(source, keep._died), source._version
    return out


def _plain(rotation, args) -> bool:
    """Rotation to position 0 with scale 1: the un-rotated key itself."""
    return rotation.key is _zero and args[1] == 1.0


def _fns(rotations, args) -> set:
    return {r.key for r in rotations if not _plain(r, args)}


def _fresh(rotations, key, kpos, args, rotate) -> list:
    done = {}
    for r in rotations:
        if r.key not in done:
            done[r.key] = key if _plain(r, args) else rotate(key, r.key(kpos), *args)
    return [done[r.key] for r in rotations]


def use_decode(q_len: int, kv_len: int, dropout: float, query) -> bool:
    """A cached call with few queries (generation) and no autograd: ``decode_attention``."""
    return KEEP and 0 < q_len <= DECODE_ROWS and q_len < kv_len and not dropout and not (
        torch.is_grad_enabled() and query.requires_grad)


def decode_attention(pmap, queries, keys, value, qpos, kpos, slots, mask, scaling, softcap=None, sinks=None):
    """Attention of a few queries against the cache: per rotation, only the key columns some pair uses (one key
    range), so a step reads each cached key about once, as plain attention does. On CPU without soft-capping or
    sinks, one fused flash call per rotation, merged by log-sum-exp; otherwise float32 scores. Returns (batch,
    q_len, heads, head_dim)."""
    batch, heads, q_len, dim = queries[0].shape
    kv_len, kv_heads = value.shape[2], value.shape[1]
    fused = (softcap is None and sinks is None and value.device.type == "cpu" and lse_available(value.device)
             and lse_accepts(value.device, value.dtype) and value.shape[-1] == dim)
    split = pmap.split
    if fused and split is not None and len(queries) == 2 and q_len == 1 and batch == 1 and mask is None:
        # one row, no padding: the two key ranges straight from the map's KeySplit (as ``select`` derives them)
        slot, i = int(slots[0]), qpos[:, 0]
        offset, start = slot - int(i[0]), int(split.near_start(i)[0])
        far_end = start if split.far_keys is None else min(start, int(split.far_keys))
        near_lo = min(max(start + offset, 0), slot)
        far_hi = min(max(far_end + offset, 0), near_lo)
        return _fused(queries, keys, value, [(0, near_lo, slot + 1, None)] + ([(1, 0, far_hi, None)] * (far_hi > 0)),
                      scaling)
    key_range = torch.arange(kv_len, device=value.device)
    which = pmap.select(qpos[:, :, None], kpos[:, None, :])  # (B, q_len, kv_len)
    allowed = (which >= 0) & (key_range[None, None] <= slots[None, :, None])
    if mask is not None:
        allowed = allowed & mask
    empty = ~allowed.any(-1, keepdim=True)  # padded query rows: attend to anything (their output is unused)
    allowed, which = allowed | empty, torch.where(empty, 0, which)
    picks = []
    for c in range(len(queries)):
        pick = (which == c) & allowed
        cols = pick.any(1).any(0).nonzero()
        if cols.numel():
            picks.append((c, int(cols[0]), int(cols[-1]) + 1, pick))
    if fused:
        return _fused(queries, keys, value, picks, scaling)
    n_rep = heads // kv_heads
    scores = value.new_full((batch, kv_heads, n_rep, q_len, kv_len), -math.inf, dtype=torch.float32)
    for c, lo, hi, pick in picks:
        q = queries[c].reshape(batch, kv_heads, n_rep * q_len, dim).float()
        s = torch.matmul(q, keys[c][:, :, lo:hi].float().transpose(-1, -2)).view(batch, kv_heads, n_rep, q_len, -1)
        s = s * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        part = scores[..., lo:hi]
        part.copy_(torch.where(pick[:, None, None, :, lo:hi], s, part))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # query head h = kv_head * n_rep + r, as repeat_kv pairs them
        sink = sinks.float().reshape(1, kv_heads, n_rep, 1, 1).expand(batch, -1, -1, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.to(value.dtype).view(batch, kv_heads, n_rep * q_len, kv_len), value)
    return out.view(batch, heads, q_len, -1).transpose(1, 2).contiguous(), None


def _fused(queries, keys, value, picks, scaling):
    from ..compat.torch import cpu_flash_attention

    o = lse = None
    for c, lo, hi, pick in picks:
        part = None if pick is None else pick[..., lo:hi]  # None: every row sees every key of the range
        bias = None
        if part is not None and not bool(part.all()):
            bias = torch.zeros(part.shape, dtype=value.dtype, device=value.device).masked_fill_(~part, -math.inf)
            bias = bias[:, None]
        got = cpu_flash_attention()(queries[c], keys[c][:, :, lo:hi], value[:, :, lo:hi], 0.0, False,
                                    attn_mask=bias, scale=scaling)
        o_c, lse_c = got[0].float(), got[1].float()
        missed = None if part is None else ~part.any(-1)[:, None]  # rows without a key here: weight 0, not exp(0)
        if missed is not None and bool(missed.any()):
            o_c, lse_c = o_c.masked_fill(missed[..., None], 0), lse_c.masked_fill(missed, -math.inf)
        if o is None:
            o, lse = o_c.clone(), lse_c.clone()
        else:
            _merge(o, lse, o_c, lse_c)
    return o.to(value.dtype).transpose(1, 2).contiguous(), None


__all__ = ["ATTR", "DECODE_ROWS", "KEEP", "CachePatch", "RotatedKeys", "check_cache", "decode_attention", "drop",
           "note_cache", "rotated_keys", "use_decode"]


def kept_bytes(model) -> int:
    """Bytes of the rotated keys kept now over ``model``'s attention modules (what decoding holds beside the cache)."""
    total = 0
    for m in model.modules():
        keep = m.__dict__.get(ATTR)
        if keep is not None:
            total += sum(b.numel() * b.element_size() for b in keep.buffers.values())
    return total
