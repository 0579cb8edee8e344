"""Attention with remapped rotary positions (Self-Extend, DCA, ReRoPE, LM-Infinite, STRING) through transformers'
attention interfaces.

``ctxext_remap`` is an attention function registered with ``AttentionInterface`` and a mask function of the same
name registered with ``AttentionMaskInterface`` (transformers' sdpa mask: without it, models would give the
function no padding mask), as ``ctxext_alibi`` is in ``ctxext.attention``.

The model's rotary modules are turned into identity rotations (``ctxext.adapters.remap.apply_remap``), so the
function receives *un-rotated* queries and keys and the KV cache holds un-rotated keys. At patch time each
attention module gets a ``RemapState`` (attribute ``_ctxext_remap``): the method's ``PositionMap`` and the
rotary frequencies and ``attention_scaling`` the model had. The function rotates q and k itself, per rotation of
the map, in the model's layout (LLaMA / NeoX ``rotate_half``, or GLM / ERNIE 4.5 pairs of neighbours; with partial
rotary only the first ``2 * len(inv_freq)`` dims of each head are rotated, as GPT-NeoX and GLM do), and takes the
exact softmax over the merged scores.

Positions. Queries take ``position_ids`` from the attention kwargs (transformers passes them). Keys are the cache
slots: the queries are the last ``q_len`` of the ``kv_len`` keys (a full pass, or a dynamic cache). A preallocated
cache (``StaticCache``; a static sliding layer before it fills) puts the new tokens at its fill length and leaves
the slots after them unfilled: those are dropped first (``_keys_in_use``, read from the mask; without a mask and
with several queries the queries are the first slots: transformers drops the mask only for the prefill of an empty
static cache), so the queries are again the last ones. A key's position is its slot minus the row's offset (slot -
position) of its latest real query, one that attends to itself; so left padding (masked keys at negative positions)
and cached decoding see the positions of a full pass over the unpadded row, as long as positions are consecutive
within a row (as ``generate`` and ``cumsum(mask) - 1`` make them). Without ``position_ids`` the slots are the
positions.

Memory. The function never builds a (heads x T x T) tensor for large T. When every pair of the call is within the
map's ``near`` range (e.g. all within the window), or every query is before the map's ``plain_below`` (DCA's first
chunk and local window), it rotates q and k once and calls transformers' own sdpa function, so short inputs cost what
the unpatched model costs. Otherwise the queries go in chunks of at most ``CHUNK_BYTES`` of scores, each chunk only
over the keys up to its last query; a chunk whose pairs all use one rotation runs sdpa with a boolean mask; a chunk
that mixes rotations runs the ``STRATEGY`` below. A long full pass on CPU without autograd under a map that declares
its key ranges (``KeySplit``: every method here) skips the chunks: a few fused CPU flash calls per block of queries,
one per key range, merged by log-sum-exp (``ctxext.attention.lse``; ``LSE_PATH`` says exactly when; on CUDA by default
on torch 2.11, where it was tested, ``CTXEXT_CUDA_LSE=1`` / ``0`` elsewhere). A cached step of a few queries rotates
only the new keys and reads each cached key about once (``ctxext.attention.key_cache``).

Soft-capping and sinks. A model whose attention soft-caps its logits (Gemma 2: ``softcap`` in the call's kwargs,
``cap * tanh(score / cap)`` before the mask, as its eager attention does) or adds a learned sink logit per head to
the softmax (GPT-OSS, Granite SWA: ``s_aux``, one more softmax column dropped after it) gets it: sdpa and the flex
path have neither, so such a call takes the chunked "scores" path for every chunk, the fast path and decoding
included.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import transformers as hf_compat
from ..methods.remap import PositionMap
from . import key_cache
from .features import dropped_features
from .cuda_plans import remap_plan
from .lse import accepts as lse_accepts
from .lse import available as lse_available
from .lse import split_attention

REMAP = "ctxext_remap"
STATE_ATTR = "_ctxext_remap"

#: Upper bound on one chunk's score tensors (all rotations together).
CHUNK_BYTES = 32 * 2**20
#: Without a tighter byte bound, queries go in this many chunks (of at least MIN_ROWS rows), each skipping the keys
#: after its last query, so the work stays close to that of causal attention.
CAUSAL_CHUNKS = 8
MIN_ROWS = 128
#: How a chunk that mixes rotations is computed: "scores" (one score matmul per rotation, select, softmax, @V) or
#: "concat" (one sdpa call over [q_0, q_1, ...] along head_dim against block-diagonal key copies and a boolean mask
#: that picks each pair's copy). Measured on CPU (benchmarks/bench_remap.py): see ``STRATEGY_NOTE``.
STRATEGY = "concat"
STRATEGY_NOTE = ""
#: The log-sum-exp path (``ctxext.attention.lse``): a full pass (positions 0 .. T-1, causal, no padding, q_len ==
#: kv_len) on CPU without autograd, dropout, soft-capping or sinks, under a map that declares a ``KeySplit``, runs
#: as a few fused CPU flash calls per block of queries (near keys, far keys), merged exactly by log-sum-exp, instead
#: of the chunks below. On CUDA the same calls run on torch's flash / memory-efficient kernels where
#: ``lse.available("cuda")`` (torch 2.11, where the ``gpu`` tests passed; ``CTXEXT_CUDA_LSE=1`` / ``0`` to opt in /
#: out). False turns it off (tests, benchmarks: the "before" of a measurement); every other call takes the paths
#: below unchanged.
LSE_PATH = True
#: ... only from this many tokens. The path already wins below it (the small benchmark LLaMA, factor 4, 1 thread, whole
#: forward, path off -> on: 512 tokens 0.72 -> 0.62 s, 1024 1.87 -> 1.43 s, 2048 5.4 -> 3.5 s); the bound keeps
#: short inputs on the chunked path that test_remap.py checks against the papers' definitions.
LSE_MIN_LEN = 1024


@dataclass
class RemapState:
    """What the remap attention needs of one attention module, stashed on it at patch time."""

    map: PositionMap
    inv_freq: torch.Tensor  # the original rotary frequencies, float32, (rotary_dim / 2,)
    attention_scaling: float = 1.0
    #: how the model's attention pairs the rotated dims: "half" (rotate_half: Llama, NeoX) or "interleaved"
    #: (every two: GLM, ERNIE 4.5, Cohere), as ``ctxext.adapters.rotary_units.rotation_layout`` reads it
    layout: str = "half"
    #: the first rotated dim of each head: 0, or where multi-head latent attention (DeepSeek V3) puts its rotary
    #: part, after the ``qk_nope_head_dim`` dims without positions
    start: int = 0
    _on_device: dict = field(default_factory=dict, repr=False)

    def frequencies(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = self.inv_freq.detach().to(device=device, dtype=torch.float32)
        return self._on_device[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0,
           layout: str = "half", start: int = 0) -> torch.Tensor:
    """RoPE of ``x`` (batch, heads, n, head_dim) at ``positions`` (batch or 1, n), computed as transformers' rotary
    modules and ``apply_rotary_pos_emb`` do (float32 angles, cos/sin times ``scale`` cast to x's dtype); only the
    ``2 * len(inv_freq)`` dims from ``start`` are rotated (partial rotary: the first ones; MLA: the last ones).
    ``layout``: frequency i turns dims (i, i + d/2) ("half") or (2i, 2i + 1) ("interleaved") of that part."""
    rotary = 2 * inv_freq.numel()
    freqs = positions[..., None].float() * inv_freq
    if layout == "interleaved":
        emb, turn = freqs.repeat_interleave(2, dim=-1), _rotate_every_two
    else:
        emb, turn = torch.cat((freqs, freqs), dim=-1), _rotate_half
    cos = (emb.cos() * scale).to(x.dtype)[:, None]
    sin = (emb.sin() * scale).to(x.dtype)[:, None]
    if rotary == x.shape[-1]:
        return x * cos + turn(x) * sin
    part = x[..., start:start + rotary]
    return torch.cat((x[..., :start], part * cos + turn(part) * sin, x[..., start + rotary:]), dim=-1)


def _positions(query, attention_mask, q_len, kv_len, kwargs):
    """(query slot per row (q_len,), query positions (B, q_len), key positions (B, kv_len), last real row per b)."""
    batch = query.shape[0]
    device = query.device
    q_start = (kv_len - 1 if q_len == 1 else 0) if attention_mask is None else kv_len - q_len
    slots = torch.arange(q_start, q_start + q_len, device=device)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != q_len:
        qpos = slots[None].expand(batch, q_len)
    else:
        qpos = position_ids.to(device=device, dtype=torch.long).expand(batch, q_len)
    rows = torch.arange(q_len, device=device)
    if attention_mask is None:
        last = torch.full((batch,), q_len - 1, device=device)
    else:
        attends_self = _as_bool(attention_mask)[:, 0, rows, slots].expand(batch, q_len)
        last = torch.where(attends_self, rows, -1).amax(-1)
        last = torch.where(last < 0, q_len - 1, last)
    offset = slots[last] - qpos.gather(1, last[:, None])[:, 0]
    kpos = torch.arange(kv_len, device=device)[None] - offset[:, None]
    return slots, qpos, kpos, last


def _keys_in_use(attention_mask, q_len: int, kv_len: int) -> int:
    """How many key slots reach up to the last query's slot: ``kv_len``, except in a preallocated cache (transformers'
    ``StaticCache``, its static sliding layers before they fill), where the new tokens sit at the cache's fill length
    and the slots after them are unfilled. Read from the mask, which transformers builds from the cache's own offsets:
    a query attends to its own slot and to none after it, so the queries start at max over rows of (last attended
    slot - row). Without a mask, several queries in a longer cache are an empty static cache's prefill (transformers
    drops the mask only there): the first slots; one query is a dynamic cache's step: the last slot."""
    if q_len >= kv_len:
        return kv_len
    if attention_mask is None:
        return q_len if q_len > 1 else kv_len
    mask = _as_bool(attention_mask)[:, 0]
    if bool(mask[:, -1, -1].any()):  # the last query sees the last slot: a dynamic cache (one read per row)
        return kv_len
    columns = torch.arange(kv_len, device=mask.device)
    last_seen = torch.where(mask, columns, -1).amax(-1)  # (B or 1, q_len); -1 for a row that sees nothing
    start = int((last_seen - torch.arange(q_len, device=mask.device)).amax())
    return min(max(start, 0) + q_len, kv_len)


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def remap_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal self-attention under a position map; same signature and output layout as transformers' sdpa function.

    query: (batch, heads, q_len, head_dim), un-rotated; key/value: (batch, kv_heads, kv_len, head_dim), un-rotated
    keys, kv_heads dividing heads. attention_mask: None, a boolean (batch or 1, 1, q_len, kv_len) mask (True =
    attend) or an additive float mask. Returns (batch, q_len, heads, head_dim) and no attention weights.
    """
    state: RemapState | None = getattr(module, STATE_ATTR, None)
    if state is None:
        raise RuntimeError(
            f"{REMAP}: {type(module).__name__} carries no position map; select this attention only through "
            "ctxext.patch (ctxext.adapters.remap.apply_remap)"
        )
    softcap = kwargs.pop("softcap", None)  # honoured below (the "scores" path), not dropped
    sinks = kwargs.pop("s_aux", None)  # likewise: one sink logit per query head
    dropped = dropped_features(kwargs)
    if dropped:
        raise ValueError(f"{REMAP} would drop what this attention call asks for ({dropped}); the model should have "
                         "been refused at patch time")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise ValueError(f"{REMAP} applies to causal self-attention only")

    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{REMAP}: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    scaling = head_dim**-0.5 if scaling is None else scaling
    if sinks is not None and sinks.numel() != heads:
        raise ValueError(f"{REMAP}: attention sinks of shape {tuple(sinks.shape)}, expected one per head ({heads})")
    eager_only = softcap is not None or sinks is not None  # features sdpa and flex do not have
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(f"{REMAP} expects a 4D attention mask, got shape {tuple(attention_mask.shape)}")
        attention_mask = attention_mask[..., :kv_len]  # as transformers' sdpa: a mask may carry extra columns
    cached = key  # the cache's own tensor (a static cache's whole buffer): what the kept rotated keys follow
    filled = _keys_in_use(attention_mask, q_len, kv_len)
    if filled < kv_len:  # a preallocated cache: the slots after the last query are causally unseen (unfilled)
        key, value, kv_len = key[:, :, :filled], value[:, :, :filled], filled
        attention_mask = None if attention_mask is None else attention_mask[..., :filled]
    pmap = state.map
    inv_freq = state.frequencies(query.device)
    att = state.attention_scaling
    slots, qpos, kpos, last = _positions(query, attention_mask, q_len, kv_len, kwargs)
    if pmap.query_scale is not None:
        query = query * pmap.query_scale(qpos).to(query.dtype)[:, None, :, None]

    # the fast path: every pair of the call within ``near`` -> plain RoPE attention, transformers' sdpa function
    if attention_mask is None:
        first_key = kpos[:, 0]
    else:
        seen = _as_bool(attention_mask[:, 0]).expand(batch, q_len, kv_len)
        seen = seen[torch.arange(batch, device=query.device), last]  # the latest real query's row: its keys
        first = torch.where(seen, torch.arange(kv_len, device=query.device), kv_len - 1).amin(-1)
        first_key = kpos.gather(1, first[:, None])[:, 0]
    farthest = int((qpos.amax(-1) - first_key).amax()) if q_len else 0
    if not eager_only and (farthest < pmap.near or (q_len and int(qpos.amax()) < pmap.plain_below)):
        return hf_compat.sdpa_attention()(
            module,
            rotate(query, qpos, inv_freq, att, state.layout, state.start),
            key_cache.rotated_keys(module, state, key, kpos, q_len, 1, rotate, cached)[0],
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )

    rotations = pmap.rotations
    keys = key_cache.rotated_keys(module, state, key, kpos, q_len, len(rotations), rotate, cached)  # new keys only
    queries = [rotate(query, r.query(qpos), inv_freq, att, state.layout, state.start) for r in rotations]
    mask = None if attention_mask is None else _as_bool(attention_mask)[:, 0]  # (B or 1, q_len, kv_len)
    planned = None if eager_only else remap_plan(pmap, queries, keys, value, qpos, kpos, slots, attention_mask,
                                                 dropout, scaling)
    if planned is not None:  # CUDA: a few varlen calls (CTXEXT_REMAP_PLAN=emulate: on CPU too) or opt-in flex
        return planned, None
    if key_cache.use_decode(q_len, kv_len, dropout, query):  # a cached step: each cached key read about once
        return key_cache.decode_attention(pmap, queries, keys, value, qpos, kpos, slots, mask, scaling, softcap, sinks)
    # a full pass on CPU without autograd under a map with declared key ranges: fused flash calls, merged by log-sum-exp
    if not eager_only and _use_lse(pmap, query, key, value, dropout, qpos, kpos, mask):
        split = pmap.split
        near_start = split.near_start(torch.arange(q_len, device=query.device))
        return split_attention(queries, keys, value, near_start, split.far_keys, scaling), None

    count = len(rotations)
    strategy = "scores" if eager_only else STRATEGY
    if strategy == "concat":  # per row: the selector, masks and picks (bytes), no float scores
        per_row = batch * kv_len * (8 + 2 * count)
    else:  # per row: one float32 score tensor per rotation and the merged one
        per_row = batch * heads * kv_len * 4 * (count + 1)
    rows = max(1, min(max(MIN_ROWS, -(-q_len // CAUSAL_CHUNKS)), CHUNK_BYTES // max(per_row, 1)))
    n_rep = heads // kv_heads
    gqa_cpu = query.device.type == "cpu"
    out = query.new_empty(batch, q_len, heads, value.shape[-1])
    key_range = torch.arange(kv_len, device=query.device)
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        k_end = min(kv_len, int(slots[end - 1]) + 1)
        i = qpos[:, start:end, None]
        j = kpos[:, None, :k_end]
        which = pmap.select(i, j)  # (B, rows, k_end)
        allowed = (which >= 0) & (key_range[None, None, :k_end] <= slots[start:end, None])
        if mask is not None:
            allowed = allowed & mask[:, start:end, :k_end]
        empty = ~allowed.any(-1, keepdim=True)  # padded query rows: attend to anything (their output is unused)
        if bool(empty.any()):
            allowed = allowed | empty
            which = torch.where(empty, 0, which).to(torch.int8)
        used = [c for c in range(count) if bool(((which == c) & allowed).any())]
        if not used:
            used = [0]
        qs = [queries[c][:, :, start:end] for c in used]
        ks = [keys[c][:, :, :k_end] for c in used]
        v = value[:, :, :k_end]
        if strategy == "scores" and (eager_only or len(used) > 1):
            o = _scores_chunk(qs, ks, v, which, allowed, used, dropout, scaling, n_rep, softcap, sinks)
        elif len(used) == 1:
            kk, vv = ks[0], v
            extra = {}
            if n_rep > 1:
                if gqa_cpu:
                    extra = {"enable_gqa": True}
                else:
                    kk, vv = kk.repeat_interleave(n_rep, dim=1), vv.repeat_interleave(n_rep, dim=1)
            o = F.scaled_dot_product_attention(
                qs[0], kk, vv, attn_mask=allowed[:, None], dropout_p=dropout, scale=scaling, **extra
            )
        else:
            shared = all(rotations[c].query is rotations[used[0]].query for c in used)
            o = _concat_chunk(qs[:1] if shared else qs, ks, v, [(which == c) & allowed for c in used], dropout,
                              scaling, n_rep, gqa_cpu)
        out[:, start:end] = o.transpose(1, 2)
    return out, None


def _use_lse(pmap, query, key, value, dropout, qpos, kpos, mask) -> bool:
    """Whether this call may take the log-sum-exp path (see ``LSE_PATH``); every check is cheap except the mask's
    (one pass over it, only when a mask is given)."""
    if not (LSE_PATH and pmap.split is not None and len(pmap.rotations) == 2 and lse_available(query.device)):
        return False
    if dropout or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)):
        return False
    batch, heads, q_len, head_dim = query.shape
    if q_len != key.shape[2] or q_len < LSE_MIN_LEN:
        return False
    if not lse_accepts(query.device, query.dtype) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if value.shape[-1] != head_dim or (query.device.type == "cuda" and head_dim % 8):
        return False  # CUDA's fused kernels want head dims in multiples of 8 (sdpa pads them; the ops do not)
    # positions 0 .. T-1 for every row, queries and keys
    expected = torch.arange(q_len, device=query.device)
    if not (bool((qpos == expected).all()) and bool((kpos == expected).all())):
        return False
    return mask is None or _is_causal(mask)


#: The last mask ``_is_causal`` read (a weak reference: the same live object, not a reused address), its version and
#: the answer: every layer of a forward pass gets the same mask object, read once, not once per layer (O(T^2) each)
_LAST_MASK: list = [None, -1, False]


def _is_causal(mask: torch.Tensor) -> bool:
    """Whether a boolean (B or 1, T, T) mask is exactly the causal one (row i: keys 0 .. i, no padding)."""
    ref, version, answer = _LAST_MASK
    if ref is not None and ref() is mask and version == mask._version:
        return answer
    answer = _read_causal(mask)
    _LAST_MASK[:] = [weakref.ref(mask), mask._version, answer]
    return answer


def _read_causal(mask: torch.Tensor) -> bool:
    t = mask.shape[-1]
    if mask.shape[-2] != t:
        return False
    m = mask.view(torch.uint8)
    rows = torch.arange(1, t + 1, device=mask.device)
    if not bool((m.sum(-1) == rows).all()):  # row i: i + 1 keys ...
        return False
    # ... the first i + 1: its first False (argmin; the last row has none) at column i + 1
    first_false = torch.argmin(m[..., :-1, :], dim=-1)
    return bool((first_false == rows[:-1]).all())


def _scores_chunk(qs, ks, v, which, allowed, used, dropout, scaling, n_rep, softcap=None, sinks=None):
    """One score matmul per rotation (keys grouped for GQA, not repeated), select, soft-cap (``softcap``: as the
    model's eager attention, ``cap * tanh(score / cap)``), masked softmax in float32 (``sinks``: a per-head logit as
    one more column, dropped after the softmax), @V."""
    batch, heads, rows, dim = qs[0].shape
    kv_heads = ks[0].shape[1]
    scores = None
    for q, k, c in zip(qs, ks, used):
        s = torch.matmul(q.reshape(batch, kv_heads, n_rep * rows, dim), k.transpose(-1, -2))
        s = s.view(batch, kv_heads, n_rep, rows, -1)
        scores = s if scores is None else torch.where((which == c)[:, None, None], s, scores)
    scores = scores.float().mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # out of place: tanh's backward reads its output
    scores.masked_fill_(~allowed[:, None, None], -math.inf)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
    else:  # query head h = kv_head * n_rep + r, as repeat_kv pairs them
        sink = sinks.float().reshape(1, kv_heads, n_rep, 1, 1).expand(batch, -1, -1, rows, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout, training=True)
    o = torch.matmul(probs.view(batch, kv_heads, n_rep * rows, -1), v)
    return o.view(batch, heads, rows, -1)


def _concat_chunk(qs, ks, v, picks, dropout, scaling, n_rep, gqa_cpu):
    """One sdpa call: [q_0, q_1, ...] along head_dim against key copies [k_0, 0, ...], [0, k_1, ...], ...; a
    boolean mask picks each pair's copy, so the score of copy c is exactly q_c . k_c. Copy c only holds the key
    range some pair of the chunk uses it for (near keys for the near rotation, far keys for the far one), so the
    keys seen are about k_end + the band where rotations mix, not count x k_end."""
    count = len(qs)  # 1 when the rotations share their query positions: the key copies then differ only in keys
    dim = qs[0].shape[-1]
    q = torch.cat(qs, dim=-1) if count > 1 else qs[0]
    blocks, values, masks = [], [], []
    for c, (k, pick) in enumerate(zip(ks, picks)):
        cols = pick.any(1).any(0).nonzero()
        lo, hi = int(cols[0]), int(cols[-1]) + 1  # picks are never empty: the caller keeps used rotations only
        if count == 1:
            block = k[:, :, lo:hi]
        else:
            block = k.new_zeros(*k.shape[:-2], hi - lo, count * dim)
            block[..., c * dim : (c + 1) * dim] = k[:, :, lo:hi]
        blocks.append(block)
        values.append(v[:, :, lo:hi])
        masks.append(pick[..., lo:hi])
    k = torch.cat(blocks, dim=2)
    vv = torch.cat(values, dim=2)
    width = vv.shape[-1]
    if width != count * dim:  # CPU's flash kernel needs value dim == query dim (else sdpa falls back to math)
        vv = F.pad(vv, (0, count * dim - width))
    mask = torch.cat(masks, dim=-1)[:, None]
    extra = {}
    if n_rep > 1:
        if gqa_cpu:
            extra = {"enable_gqa": True}
        else:
            k, vv = k.repeat_interleave(n_rep, dim=1), vv.repeat_interleave(n_rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, vv, attn_mask=mask, dropout_p=dropout, scale=scaling, **extra)
    return out[..., :width]


#: A recording attention (sdpa, keeping the keys it got as ``PROBE_ATTR``), for ``adapters.remap.rotating_layers``.
PROBE = "ctxext_rotation_probe"
PROBE_ATTR = "_ctxext_probe_keys"


def probe_attention_forward(module: nn.Module, query, key, value, attention_mask, **kwargs):
    vars(module).setdefault(PROBE_ATTR, []).append(key.detach().float().clone())
    # sdpa has no soft-capping or sinks (refuses softcap); they do not change keys: left out of both passes alike
    kwargs = {k: v for k, v in kwargs.items() if k not in ("softcap", "s_aux")}
    return _SDPA(module, query, key, value, attention_mask, **kwargs)


#: transformers' sdpa function, bound when ctxext registers its functions (the probe's own reference to it)
_SDPA = None


def _register() -> None:
    global _SDPA
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _SDPA = hf_compat.sdpa_attention()
    AttentionInterface.register(REMAP, remap_attention_forward)
    AttentionMaskInterface.register(REMAP, sdpa_mask)
    AttentionInterface.register(PROBE, probe_attention_forward)
    AttentionMaskInterface.register(PROBE, sdpa_mask)


_register()
__all__ = ["CHUNK_BYTES", "PROBE", "REMAP", "STATE_ATTR", "RemapState", "remap_attention_forward", "rotate"]
