"""Attention-side position remapping as pure position maps: Self-Extend, DCA, ReRoPE, LM-Infinite, StreamingLLM,
STRING.

A rotary model scores a query at position i against a key at position j with ``R(i) q . R(j) k``, which only
depends on the relative position ``i - j``. The training-free methods here change which relative position each
query-key pair sees, piecewise: true distances near the diagonal, remapped (grouped, clipped, shifted, capped)
distances further away. Each says so as a ``PositionMap`` (``ctxext.methods.position_map``: a few rotations and
which one each pair uses), a form attention runs without a (T x T) position tensor.

Each function takes the model's original (trained) length ``original_length`` and an optional ``factor`` (the
length to advertise is ``factor x original_length``), fills the paper's defaults for that target length, checks
the options and raises ``PatchError`` with the accepted values. ``factor`` 1 (or none) keeps every default at the
identity within the original length, except STRING, whose purpose is to act inside it (see ``string``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import PatchError
from .declaration import Kind, Method, Option
from .position_map import (IDENTITY, KeySplit, PositionMap, Rotation, _all_near, _band_start, _int, _larger_than_needed,
                           _same, _zero, identity_map, target_length)


# ------------------------------------------------------------------------------------------------- self-extend


def suggest_self_extend(
    original_length: int, target: int, window: int | None = None, budget: float = 2 / 3
) -> tuple[int, int]:
    """(group, window) for ``target`` tokens from Self-Extend's rule ``budget * L > W + (N - W) / G``.

    The paper asks the largest grouped position, about ``W + (N - W) / G``, to stay below ``(1/2 .. 2/3) x L``
    (L the trained length, N the target). The window defaults to L/4 (1024 for a 4k model, the LongLM examples'
    neighbour window); the group is the smallest that satisfies the rule. Up to the trained length no grouping is
    needed: group 1, the unpatched model.
    """
    if not 0 < budget <= 1:
        raise PatchError(f"self-extend budget must be in (0, 1], got {budget}")
    window = max(1, original_length // 4) if window is None else window
    if target <= original_length:
        return 1, window
    limit = budget * original_length
    if window >= limit:
        raise PatchError(
            f"self-extend window {window} leaves no room for grouped positions below {budget:.2g} x {original_length}"
        )
    group = max(1, math.floor((target - window) / (limit - window)) + 1)
    return group, window


def self_extend(original_length: int, factor: float | None = None, group: int | None = None,
                window: int | None = None) -> PositionMap:
    """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM"; datamllab/LongLM).

    Within the neighbour window (``i - j < window``) pairs see their true positions. Beyond it, the query at i and
    the key at j are rotated to ``i // G + (W - W // G)`` and ``j // G``: the grouped distance, shifted so that it
    continues from the window. ``group == 1`` is the unpatched model. Defaults: ``suggest_self_extend``.
    (LongLM's eager code shifts by ``W - W / G``, a float; the flash path and the paper use ``W - W // G``; both
    agree when G divides W, as in every published setting.)
    """
    method = "self-extend"
    target = target_length(original_length, factor)
    window = max(1, original_length // 4) if window is None else _int(method, "window", window)
    _larger_than_needed(method, "window", window, target, "no pair is ever outside the neighbour window")
    if group is None:
        group, _ = suggest_self_extend(original_length, target, window=window)
    group = _int(method, "group", group)
    options = {"group": group, "window": window}
    if group == 1:
        return identity_map(method, options)
    shift = window - window // group

    far = Rotation(query=lambda i: torch.div(i, group, rounding_mode="floor") + shift,
                   key=lambda j: torch.div(j, group, rounding_mode="floor"))
    return PositionMap(method, (IDENTITY, far), None, window, None, options,
                       split=KeySplit(_band_start(window)))


# --------------------------------------------------------------------------------------- Dual Chunk Attention


def dca(original_length: int, factor: float | None = None, chunk_size: int | None = None,
        local_window: int | None = None) -> PositionMap:
    """Dual Chunk Attention (An et al. 2024, "Training-Free Long-Context Scaling of Large Language Models", ICML;
    HKUNLP/ChunkLlama), as the paper defines it (Section 3, Eqs. 2-8).

    With c the pretraining length (``original_length``), s the chunk size and w the local window, keys sit at
    ``P_k[j] = j mod s`` and the query at i takes one of three positions by how many chunks lie between it and
    the key (chunk = position // s):

    - same chunk (intra-chunk): ``P_q^Intra[i] = i mod s``;
    - the chunk before (successive-chunk): ``P_q^Succ[i] = s + (i mod s)`` if ``i mod s < w``, else ``c - 1``;
    - further back (inter-chunk): ``P_q^Inter[i] = c - 1``.

    All pairs share one softmax (Eq. 9). As a map this is two rotations, exactly: an intra-chunk pair sees
    ``(i mod s) - (j mod s) = i - j`` and a successive-chunk pair with ``i mod s < w`` sees
    ``s + (i mod s) - (j mod s) = i - j``, both their true distance (rotation 0, the identity); every other pair
    sees ``c - 1 - (j mod s)`` (rotation 1: query at ``c - 1``, key at ``j mod s``). Relative positions stay
    below c as long as ``s < c`` and ``w <= c - s`` (successive positions up to ``s + w - 1 <= c - 1``).

    Defaults: the paper's ``s = 3/4 c`` (3072 for Llama 2's 4096) and ``w = c - s`` (Section 3.3: "can be
    directly set to the difference between pretraining length and chunk size"); given only s, ``w =
    min(s, c - s)``. With ``s >= c / 2`` and ``w = c - s`` the map is the unpatched model up to c tokens (no
    query before c is two chunks from a key or past the local window), so the defaults cost nothing there; the
    factor only sets the advertised length, as DCA reaches any length. ``w = 0`` leaves out successive-chunk
    attention (the paper's intra + inter ablation). (The reference code, ``replace_with_chunkllama(c)``,
    parametrises differently: its ``chunk_size = 3c/4`` bounds the positions and its chunks are
    ``3c/4 - c/8`` long; that is this map with ``s = 5c/8``, ``w = c/8 + 1`` and the inter-chunk query at ``3c/4``
    instead of ``c - 1``.)
    """
    method = "dca"
    c = int(original_length)
    if chunk_size is None:
        chunk_size = max(1, (3 * c) // 4)
    s = _int(method, "chunk_size", chunk_size)
    if s >= c:
        raise PatchError(
            f"option chunk_size={s} of method {method!r} must be < the trained length {c} (the paper's "
            f"inter-chunk query position c - 1 must lie past every key position j mod chunk_size); default 3/4 "
            f"of it, {max(1, (3 * c) // 4)}"
        )
    w = min(s, c - s) if local_window is None else _int(method, "local_window", local_window, minimum=0)
    if w > s and s < c - s:
        raise PatchError(
            f"option local_window={w} of method {method!r} is larger than needed: it counts query offsets within a "
            f"chunk of chunk_size={s}, so local_window <= {s}"
        )
    if w > c - s:
        raise PatchError(
            f"option local_window={w} of method {method!r} puts successive-chunk queries at chunk_size + "
            f"local_window - 1 = {s + w - 1}, past the trained positions (< {c}): pass local_window <= "
            f"{c - s} (= trained length - chunk_size, the paper's setting)"
        )
    options = {"chunk_size": s, "local_window": w}
    inter = c - 1

    far = Rotation(query=lambda i: torch.full_like(i, inter), key=lambda j: torch.remainder(j, s))

    # pairs at distance <= w never cross two chunk boundaries (w <= s) and, crossing one, have i mod s < w;
    # queries before s + w are in the first chunk or within the window of the second
    def near_start(i: torch.Tensor) -> torch.Tensor:  # the query's chunk, and the one before within the window
        chunk = torch.div(i, s, rounding_mode="floor")
        return (chunk - ((torch.remainder(i, s) < w) & (chunk > 0)).long()) * s

    return PositionMap(method, (IDENTITY, far), None, w + 1, None, options, plain_below=s + w,
                       split=KeySplit(near_start))


# ------------------------------------------------------------------------------------------------------ ReRoPE


def rerope(original_length: int, factor: float | None = None, window: int | None = None,
           leaky: float | None = None, log_scale: bool = True) -> PositionMap:
    """ReRoPE / Leaky ReRoPE (Su 2023, bojone/rerope).

    Distances below ``window`` are kept; beyond it ReRoPE clips them to ``window`` (query rotated to ``window``,
    key unrotated), Leaky ReRoPE with ``leaky=k`` makes them ``window + (d - window) / k`` (query at
    ``(i + window (k - 1)) / k``, key at ``j / k``). ``log_scale`` multiplies each query by
    ``max(1, log(i + 1) / log(original_length))`` as the reference patches do (1 within the trained length).
    Defaults: ``window`` = original length / 8 (512 for a 4k model, the reference setting) when the patch
    advertises more than the original length, else the original length (the identity there).
    """
    method = "rerope"
    target = target_length(original_length, factor)
    if window is None:
        window = max(1, original_length // 8) if target > original_length else original_length
    window = _int(method, "window", window)
    _larger_than_needed(method, "window", window, target, "no distance is ever clipped")
    if leaky is not None:
        if isinstance(leaky, bool) or not isinstance(leaky, (int, float)) or not math.isfinite(leaky) or leaky < 1:
            raise PatchError(f"option 'leaky' of method {method!r} must be a number >= 1 (or None), got {leaky!r}")
        leaky = float(leaky)
    if not isinstance(log_scale, bool):
        raise PatchError(f"option 'log_scale' of method {method!r} must be true or false, got {log_scale!r}")
    options = {"window": window, "leaky": leaky, "log_scale": log_scale}
    scale = None
    if log_scale:
        log_length = math.log(original_length)

        def scale(i: torch.Tensor) -> torch.Tensor:
            return (torch.log1p(i.double().clamp(min=0)) / log_length).clamp(min=1.0)

    if leaky is None:
        far = Rotation(query=lambda i: torch.full_like(i, window), key=_zero)
    elif leaky == 1.0:
        far = IDENTITY
    else:
        k = leaky
        offset = window * (k - 1)
        far = Rotation(query=lambda i: (i.double() + offset) / k, key=lambda j: j.double() / k)
    if far is IDENTITY:
        return PositionMap(method, (IDENTITY,), _all_near, math.inf, scale, options)
    return PositionMap(method, (IDENTITY, far), None, window, scale, options,
                       split=KeySplit(_band_start(window)))


# ------------------------------------------------------------------------------------------------- LM-Infinite


def lm_infinite(original_length: int, factor: float | None = None, global_tokens: int = 10,
                window: int | None = None) -> PositionMap:
    """LM-Infinite (Han et al. 2023, Glaciohound/LM-Infinite): the Lambda-shaped mask with a distance limit.

    A query attends to the keys within ``window`` (true distances) and to the first ``global_tokens`` tokens of
    the sequence; those global keys, when outside the window, are seen at the distance limit, the original length
    (query rotated to ``original_length``, key unrotated). Everything else is masked. Defaults: the reference's
    ``convert_llama_model(model, L, 10)``: window = the original length, 10 global tokens.
    """
    method = "lm-infinite"
    target = target_length(original_length, factor)
    window = original_length if window is None else _int(method, "window", window)
    global_tokens = _int(method, "global_tokens", global_tokens, minimum=0)
    _larger_than_needed(method, "window", window, target, "no key is ever outside the window")
    options = {"global_tokens": global_tokens, "window": window}
    cap = int(original_length)
    far = Rotation(query=lambda i: torch.full_like(i, cap), key=_zero)

    return PositionMap(method, (IDENTITY, far), None, window, None, options,
                       split=KeySplit(_band_start(window), global_tokens))


def streaming_llm(original_length: int, factor: float | None = None, sinks: int = 4,
                  window: int | None = None) -> PositionMap:
    """StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks";
    mit-han-lab/streaming-llm): a KV cache of ``sinks`` first tokens plus the ``window`` most recent ones (the query's
    own token included), with positions given by place in the cache, not in the text.

    While the sequence fits the cache (query position i < sinks + window) it is the unpatched model. Past it a query
    sees the keys within ``window`` at their true distance (the recent keys are consecutive in the cache, ending at
    the query) and the sink tokens at their distance in the cache, ``sinks + window - 1 - j`` (query rotated to the
    last cache position, keys at their own); everything else has been evicted (masked). Default window: the original
    length minus ``sinks``, so the whole cache sits within the trained positions (the paper's cache sizes are the
    pre-trained window or less).
    """
    method = "streaming-llm"
    target = target_length(original_length, factor)
    sinks = _int(method, "sinks", sinks, minimum=0)
    window = max(1, original_length - sinks) if window is None else _int(method, "window", window)
    cache = sinks + window
    _larger_than_needed(method, "window", window, target, "no key is ever evicted")
    _larger_than_needed(method, "sinks", sinks, target, "every token is a sink and no key is ever evicted")
    options = {"sinks": sinks, "window": window}
    last = cache - 1
    far = Rotation(query=lambda i: torch.clamp(i, max=last), key=_same)

    def near_start(i: torch.Tensor) -> torch.Tensor:  # the whole causal prefix while the cache holds it
        return torch.where(i < cache, 0, (i - window + 1).clamp(min=0))

    return PositionMap(method, (IDENTITY, far), None, window, None, options, plain_below=cache,
                       split=KeySplit(near_start, sinks))


# ------------------------------------------------------------------------------------------------------ STRING


def string(original_length: int, factor: float | None = None, shift: int | None = None,
           local: int | None = None) -> PositionMap:
    """STRING (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?"; HKUNLP/STRING).

    Relative positions ``d >= shift`` become ``d - shift + local``: the rarely trained large positions are
    overwritten by well-trained ones, with a small ``local`` window so the shifted keys are not all seen as
    neighbours. Pairs with ``d < shift`` are unchanged. (The reference's flash code runs the two branches with
    windows that both include ``d == shift`` and merges them, counting that one key twice; this follows the
    paper's definition, where it is shifted.) The reference also scales cos/sin by ``0.1 ln 2 + 1``; that
    temperature is not part of the method and is left out.

    Default local: the paper's 128, at most original length / 16 for small models. Default shift: the paper's ``0.33 x N`` for N = the advertised length, raised to ``N - L + local`` when N > L
    (so shifted positions stay below the trained length L); ``shift = 0`` turns STRING off (the identity).
    Past ``N = 2 L - local`` no shift keeps every position below L + local; that is refused.
    """
    method = "string"
    target = target_length(original_length, factor)
    local = min(128, max(1, original_length // 16)) if local is None else _int(method, "local", local, minimum=0)
    if shift is None:
        shift = max(int(round(0.33 * target)), target - original_length + local)
    shift = _int(method, "shift", shift, minimum=0)
    options = {"shift": shift, "local": local}
    if shift == 0:
        return identity_map(method, options)
    if local > shift:
        raise PatchError(
            f"option local={local} of method {method!r} must be <= shift={shift} (shifted distances d - shift + "
            "local would grow, not shrink); use shift=0 to turn STRING off"
        )
    _larger_than_needed(method, "shift", shift, target, "no distance is ever shifted")
    largest = max(shift - 1, target - 1 - shift + local)
    if largest >= original_length + local:
        raise PatchError(
            f"STRING with shift={shift}, local={local} at {target} tokens still sees relative positions up to "
            f"{largest}, past the trained {original_length} (+ local); STRING reaches at most "
            f"{2 * original_length - local} tokens with these settings: use a smaller factor or another method"
        )
    # the query at i - (shift - local) against the key at j is the query at i against the key at j + shift - local:
    # the same relative position, and the rotation shares the identity's query positions (one query rotation)
    far = Rotation(query=_same, key=lambda j: j + (shift - local))
    if shift == local:
        return identity_map(method, options)
    return PositionMap(method, (IDENTITY, far), None, shift, None, options,
                       split=KeySplit(_band_start(shift)))


def build_map(method: str, original_length: int, factor: float | None = None, **options: Any) -> PositionMap:
    """The position map of ``method`` for a model trained to ``original_length``; PatchError for bad options."""
    if method not in MAPS:
        raise PatchError(f"unknown position-remapping method {method!r}; choose one of {', '.join(MAPS)}")
    if not isinstance(original_length, int) or original_length < 2:
        raise PatchError(f"{method} needs the model's trained length (>= 2), got {original_length!r}")
    try:
        return MAPS[method](original_length, factor, **options)
    except TypeError as e:  # an unknown keyword
        raise PatchError(f"bad option for method {method!r}: {e}") from None


__all__ = ["IDENTITY", "MAPS", "REMAP_METHODS", "PositionMap", "Rotation", "build_map", "dca", "identity_map",
           "lm_infinite", "rerope", "self_extend", "streaming_llm", "string", "suggest_self_extend", "target_length"]


# -- declarations: one per method (collected by ctxext.methods.registry) ---------------------------------------------

_DERIVED = "default: derived from the factor (see ctxext.methods.remap)"

#: One declaration per method: summary, options (types and defaults), no factor needed (it only sets the
#: advertised length and the derived defaults).
REMAP_METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method(
            "self-extend",
            "Self-Extend: true positions within a neighbour window, grouped (floor-divided) positions beyond it "
            "(factor optional: the length to advertise and to pick group/window for)",
            Kind.REMAP,
            rule="grouped positions beyond a window",
            position_map=self_extend,
            needs_factor=False,
            scales_with_factor=True,
            options={
                "group": Option(None, int, "group size G (1 = unpatched); " + _DERIVED, optional=True),
                "window": Option(None, int, "neighbour window W; default original length / 4", optional=True),
            },
        ),
        Method(
            "dca",
            "Dual Chunk Attention (ChunkLlama): keys at position mod chunk size; intra-chunk, successive-chunk "
            "(local window) and inter-chunk query positions, one softmax (factor optional: the length to advertise)",
            Kind.REMAP,
            rule="chunked positions (intra / successive / inter-chunk)",
            position_map=dca,
            needs_factor=False,
            scales_with_factor=True,
            options={
                "chunk_size": Option(None, int, "chunk size s < original length; default 3/4 of the original "
                                     "length", optional=True),
                "local_window": Option(None, int, "local window w <= min(s, original - s) (0 = no successive-chunk "
                                       "attention); default min(s, original length - s)", optional=True),
            },
        ),
        Method(
            "rerope",
            "ReRoPE: relative distance clipped at a window (leaky: slope 1/k beyond it), queries log-length "
            "scaled (factor optional: the length to advertise)",
            Kind.REMAP,
            rule="distance clipped at a window",
            position_map=rerope,
            needs_factor=False,
            scales_with_factor=True,
            options={
                "window": Option(None, int, "distances >= window are clipped; default original length / 8",
                                 optional=True),
                "leaky": Option(None, float, "Leaky ReRoPE: beyond the window, distance w + (d - w) / leaky",
                                optional=True),
                "log_scale": Option(True, bool, "scale queries by max(1, log(i + 1) / log(original length))"),
            },
        ),
        Method(
            "lm-infinite",
            "LM-Infinite: Lambda-shaped attention (window + first tokens), distance capped at the original length "
            "(factor optional: the length to advertise)",
            Kind.REMAP,
            rule="Lambda mask + distance cap",
            position_map=lm_infinite,
            needs_factor=False,
            scales_with_factor=True,
            options={
                "global_tokens": Option(10, int, "first tokens every query attends to"),
                "window": Option(None, int, "local window; default the original length", optional=True),
            },
        ),
        Method(
            "streaming-llm",
            "StreamingLLM: a cache of attention-sink first tokens + a recent window, positions by place in the cache "
            "(factor optional: the length to advertise)",
            Kind.REMAP,
            rule="sink tokens + recent window, positions in the cache",
            position_map=streaming_llm,
            needs_factor=False,
            scales_with_factor=True,
            options={
                "sinks": Option(4, int, "first tokens kept (attention sinks)"),
                "window": Option(None, int, "recent tokens kept, the query's own included; default the original "
                                 "length minus sinks", optional=True),
            },
        ),
        Method(
            "string",
            "STRING: relative positions >= shift moved down by shift - local, overwriting rarely trained "
            "positions (factor optional: the length to advertise and to pick the shift for)",
            Kind.REMAP,
            rule="large distances shifted down",
            position_map=string,
            needs_factor=False,
            scales_with_factor=True,
            options={
                "shift": Option(None, int, "shift S (0 = off); default 0.33 x the advertised length, at least "
                                "advertised - original + local", optional=True),
                "local": Option(None, int, "local window W; default min(128, original length / 16)", optional=True),
            },
        ),
    ]
}

#: method name -> position-map builder(original_length, factor, **options)
MAPS: dict[str, Callable[..., PositionMap]] = {m.name: m.position_map for m in REMAP_METHODS.values()}
