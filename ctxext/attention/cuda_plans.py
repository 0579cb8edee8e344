"""The remap methods on CUDA in a few kernel calls per layer: a plan per position map, run on the varlen contract
(``ctxext.attention.varlen``: torch's ``varlen_attn`` or flash-attn's ``flash_attn_varlen_func``; on CPU through
the emulator where ``CTXEXT_REMAP_PLAN=emulate`` or ``varlen.emulated()`` asks).

A plan comes from the map's ``KeySplit`` alone (``ctxext.methods.position_map``): the query at position p sees keys
``near_start(p) .. p`` under rotation 0 and ``0 .. far_end(p) - 1`` under rotation 1 (``far_end = min(near_start,
far_keys)``). Each of the two is a key range ``[lo(p), hi(p))`` per query, cut into *pieces* of three shapes the
kernel knows without a mask:

- **window**: ``lo = max(0, p - W + 1)``, ``hi = p + 1`` for every query: one causal sliding-window call,
  ``window_size=(W - 1, 0)`` (a band: Self-Extend, ReRoPE, STRING, LM-Infinite, StreamingLLM);
- **causal**: a run of queries whose ``lo`` is fixed and whose ``hi`` rises by one per query: a causal square
  (equal numbers of queries and keys, so top-left and bottom-right alignments agree). Self-Extend's grouped part
  is one: the last T - W queries against the first T - W keys (LongLM's shifted rectangle);
- **full**: a run of queries whose ``lo`` and ``hi`` are both fixed: no mask (DCA's chunks, sink keys).

Pieces of one shape go to one varlen call, each piece (and batch row) a sequence, queries and keys gathered from
the rotation the piece uses; a call takes pieces while its packed keys stay within the keys of the layer (``B x
kv_len``), so overlapping key prefixes (DCA's inter-chunk keys) cost at most one extra copy of the keys per call.
The outputs merge by log-sum-exp. Calls per layer: 2 for Self-Extend / ReRoPE / STRING, 3 for LM-Infinite /
StreamingLLM, about 1 + T / chunk for DCA (one causal call for every chunk, then the full pieces), at any length.

Cached decoding (the queries are the last q_len of kv_len keys, q_len 1 included) is the same plan over those
queries; the window call's bottom-right diagonal puts them where they belong. Refused (None, today's path runs; the
reason from ``refusal``): padding or any attention mask, positions other than the slots, dropout, autograd (the
kernels' log-sum-exp has no gradient), sinks and soft-capping (``remap.py`` keeps those on its scores path), float32
on CUDA (FlashAttention 2 takes fp16 / bf16), value head dims unlike the query's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import varlen
from .flex_paths import flex_remap, use_flex

#: most runs of a key range before a plan gives up on runs
MAX_RUNS = 4096
#: the near range goes by runs when they average at least this many queries (DCA's chunks); else, as a band, by one
#: window call (a band's near range starts one key later for every query: one run per query)
MIN_RUN = 64


@dataclass(frozen=True)
class Piece:
    """Queries ``rows[0] .. rows[1] - 1`` (indices among the call's queries) against keys ``keys[0] .. keys[1] - 1``
    under ``rotation``; ``shape``: "window" (``window`` = W - 1), "causal" (a square) or "full"."""

    rotation: int
    rows: tuple[int, int]
    keys: tuple[int, int]
    shape: str
    window: int = -1


def _runs(lo: torch.Tensor, hi: torch.Tensor) -> list[tuple[int, int, int, int, int]] | None:
    """Runs (a, b, lo, hi[a], slope) of rows with a fixed ``lo`` and ``hi`` fixed (slope 0) or rising by one
    (slope 1); None past ``MAX_RUNS``."""
    n = lo.numel()
    if n == 0:
        return []
    empty = hi <= lo
    lo, hi = lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)  # one form for rows without keys: no new runs
    step = torch.zeros(n, dtype=torch.long, device=lo.device)
    step[1:] = hi[1:] - hi[:-1]
    moved = torch.zeros(n, dtype=torch.bool, device=lo.device)
    moved[1:] = lo[1:] != lo[:-1]
    hard = moved | (step < 0) | (step > 1)  # a new run, whatever the slope
    start = hard.clone()
    start[0] = True
    start[2:] |= (step[2:] != step[1:-1]) & ~hard[1:-1]  # the slope changes (not right after a hard start)
    cuts = start.nonzero().flatten().tolist()
    if len(cuts) > MAX_RUNS:
        return None
    cuts.append(n)
    lo_l, hi_l, step_l = lo.tolist(), hi.tolist(), step.tolist()
    return [(a, b, lo_l[a], hi_l[a], step_l[a + 1] if b - a > 1 else 0) for a, b in zip(cuts, cuts[1:])]


def _pieces_of_runs(runs, rotation: int) -> list[Piece]:
    pieces = []
    for a, b, lo, hi, slope in runs:
        if slope == 0:
            if hi > lo:
                pieces.append(Piece(rotation, (a, b), (lo, hi), "full"))
            continue
        skip = max(0, lo + 1 - hi)  # leading rows without a key
        a, hi = a + skip, hi + skip
        if a >= b:
            continue
        if hi - 1 > lo:  # keys every row of the run sees, before the causal square
            pieces.append(Piece(rotation, (a, b), (lo, hi - 1), "full"))
        pieces.append(Piece(rotation, (a, b), (hi - 1, hi - 1 + b - a), "causal"))
    return pieces


def plan(split, q_start: int, q_len: int) -> list[Piece] | None:
    """The pieces of a ``KeySplit`` for the queries at positions ``q_start .. q_start + q_len - 1`` against keys
    ``0 .. q_start + q_len - 1``; None where no plan within ``MAX_RUNS`` runs exists."""
    pos = torch.arange(q_start, q_start + q_len)
    near = split.near_start(pos).clamp(min=0).minimum(pos).long()
    far = near if split.far_keys is None else near.clamp(max=int(split.far_keys))
    runs = _runs(near, pos + 1)
    band = runs is None or (len(runs) > 2 and len(runs) * MIN_RUN > q_len)
    pieces = None if band else _pieces_of_runs(runs, 0)
    if band:  # a band: one window call of the narrowest near range, plus the near keys before it (StreamingLLM)
        width = pos - near
        inner = near > 0
        window = int(width[inner].min()) + 1 if bool(inner.any()) else q_start + q_len
        lower = (pos - window + 1).clamp(min=0)
        rest = None if bool((lower < near).any()) else _runs(near, lower)
        if rest is None:
            if runs is None:
                return None
            pieces = _pieces_of_runs(runs, 0)
        else:
            pieces = [Piece(0, (0, q_len), (0, q_start + q_len), "window", window - 1), *_pieces_of_runs(rest, 0)]
    far_runs = _runs(torch.zeros_like(far), far)
    if far_runs is None:
        return None
    return pieces + _pieces_of_runs(far_runs, 1)


def calls(pieces: list[Piece], batch: int, kv_len: int) -> list[list[Piece]]:
    """Pieces grouped into kernel calls: one shape (and window) per call, packed keys within ``batch x kv_len``."""
    out: list[list[Piece]] = []
    groups: dict[tuple[str, int], list[Piece]] = {}
    for p in pieces:
        groups.setdefault((p.shape, p.window), []).append(p)
    for group in groups.values():
        current, keys = [], 0
        for p in group:
            size = batch * (p.keys[1] - p.keys[0])
            if current and keys + size > batch * kv_len:
                out.append(current)
                current, keys = [], 0
            current.append(p)
            keys += size
        out.append(current)
    return out


def _merge(o, lse, o_other, lse_other) -> None:
    """Merge in place (float32) an output over other keys of the same softmax, by the two log-sum-exps."""
    weight = torch.sigmoid(lse_other - lse).nan_to_num_(0.0)[..., None]
    o.add_((o_other.float() - o).mul_(weight))
    lse.copy_(torch.logaddexp(lse, lse_other))


def run(pieces: list[Piece], queries, keys, value, scale: float, kernel) -> torch.Tensor:
    """Attention of ``pieces``: queries[c] (B, H, q_len, D) and keys[c] (B, H_kv, kv_len, D) as rotation c gives
    them, value (B, H_kv, kv_len, D); ``kernel`` a varlen function of the contract. Returns (B, q_len, H, D) in
    the queries' dtype."""
    batch, heads, q_len, dim = queries[0].shape
    kv_len = keys[0].shape[2]
    used = {p.rotation for p in pieces}
    qs = {c: queries[c].transpose(1, 2).contiguous() for c in used}  # (B, q_len, H, D): varlen's packed layout
    ks = {c: keys[c].transpose(1, 2).contiguous() for c in used}
    vs = value.transpose(1, 2).contiguous()
    out = torch.zeros(batch, q_len, heads, value.shape[-1], dtype=torch.float32, device=value.device)
    lse = torch.full((batch, q_len, heads), float("-inf"), dtype=torch.float32, device=value.device)
    enable_gqa = keys[0].shape[1] != heads
    for call in calls(pieces, batch, kv_len):
        segments = [(p, b) for p in call for b in range(batch)]
        q = [qs[p.rotation][b, p.rows[0]:p.rows[1]] for p, b in segments]
        k = [ks[p.rotation][b, p.keys[0]:p.keys[1]] for p, b in segments]
        v = [vs[b, p.keys[0]:p.keys[1]] for p, b in segments]
        q, k, v = (x[0] if len(x) == 1 else torch.cat(x) for x in (q, k, v))
        lens_q = [p.rows[1] - p.rows[0] for p, _ in segments]
        lens_k = [p.keys[1] - p.keys[0] for p, _ in segments]
        cu_q = torch.tensor([0, *lens_q], device=value.device).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0, *lens_k], device=value.device).cumsum(0).to(torch.int32)
        window = (call[0].window, 0) if call[0].shape == "window" else (-1, 0) if call[0].shape == "causal" \
            else (-1, -1)
        o, l_ = kernel(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), scale=scale, window_size=window,
                       enable_gqa=enable_gqa)
        l_ = varlen.normalise_lse(l_, heads, q.shape[0]).t()  # (total_q, H)
        lo = 0  # offsets from the Python lengths: reading cu_q back would wait for the GPU on every call
        for (p, b), n in zip(segments, lens_q):
            a, e = p.rows
            _merge(out[b, a:e], lse[b, a:e], o[lo:lo + n], l_[lo:lo + n])
            lo += n
    return out.to(queries[0].dtype)


_CACHE: dict = {}


def _cached_plan(pmap, q_start: int, q_len: int):
    """Plans per (map, q_start, q_len): the layers of a forward pass (and decode steps at one length) share one."""
    key = (id(pmap.split), q_start, q_len)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not pmap.split:
        if len(_CACHE) > 16:
            _CACHE.clear()
        hit = _CACHE[key] = (pmap.split, plan(pmap.split, q_start, q_len))
    return hit[1]


def refusal(pmap, queries, keys, value, qpos, kpos, slots, attention_mask, dropout, kernel_name: str) -> str | None:
    """Why this call cannot take a plan (None: it can). Cheap checks first; positions are read last."""
    q = queries[0]
    if pmap.split is None or len(pmap.rotations) != 2:
        return "the position map declares no two-rotation key split"
    if attention_mask is not None:
        return "an attention mask (padding, or a static cache) is given: the plans take unpadded rows only"
    if dropout:
        return "dropout"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*queries, *keys, value)):
        return "autograd: the kernels' log-sum-exp carries no gradient"
    if value.shape[-1] != q.shape[-1]:
        return "value head dim differs from the query's"
    if kernel_name != "emulate" and kernel_name != "counting" and q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype} on CUDA: FlashAttention 2 takes float16 / bfloat16"
    q_len, kv_len = q.shape[2], keys[0].shape[2]
    if int(slots[0]) != kv_len - q_len:
        return "the queries are not the last keys (a preallocated cache)"
    expected = torch.arange(kv_len, device=q.device)
    if not (bool((kpos == expected).all()) and bool((qpos == expected[kv_len - q_len:]).all())):
        return "positions other than the key slots (padding or shifted position_ids)"
    return None


def remap_plan(pmap, queries, keys, value, qpos, kpos, slots, attention_mask, dropout, scale):
    """``ctxext_remap``'s dispatch for a call that mixes rotations: the plan where a kernel is available and the
    call qualifies (output (B, q_len, H, D)); else the compiled flex path where ``CTXEXT_FLEX`` opts in; else None
    (the caller's own paths)."""
    chosen = varlen.kernels(queries[0].device)
    if chosen is not None and refusal(pmap, queries, keys, value, qpos, kpos, slots, attention_mask, dropout,
                                      chosen[0]) is None:
        pieces = _cached_plan(pmap, int(slots[0]), queries[0].shape[2])
        if pieces is not None:
            return run(pieces, queries, keys, value, scale, chosen[1])
    if use_flex(queries[0], dropout, keys[0], value):  # opt-in (ctxext.attention.flex_paths)
        raw = None if attention_mask is None else attention_mask[:, 0]  # its identity lets layers share a block mask
        return flex_remap(pmap, queries, keys, value, qpos, kpos, slots, raw, scale)
    return None


__all__ = ["MAX_RUNS", "Piece", "calls", "plan", "refusal", "remap_plan", "run"]
