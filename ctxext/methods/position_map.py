"""The form every attention-side position remapping takes (``ctxext.methods.remap``): a ``PositionMap``.

A rotary model scores a query at position i against a key at position j with ``R(i) q . R(j) k``, which only
depends on the relative position ``i - j``. The training-free methods here change which relative position each
query-key pair sees, piecewise: true distances near the diagonal, remapped (grouped, clipped, shifted, capped)
distances further away. A ``PositionMap`` says that in a form attention can run without a (T x T) position tensor:

- ``rotations``: K pairs of position functions ``(query_position(i), key_position(j))``. Rotation c rotates every
  query by ``query_position(i)`` and every key by ``key_position(j)``, so one matmul scores all pairs under it.
- ``select(i, j)``: which rotation a pair uses (an int8 index), or -1 where the method masks the pair; derived
  from ``split`` (the key ranges each query sees under each rotation) for every two-rotation map.

so that ``score(i, j) = (R(qpos_c(i)) q_i) . (R(kpos_c(j)) k_j)`` with ``c = select(i, j)``. Positions are absolute
token positions (0 = the first real token of a row); rotary positions may be floats. ``near`` says that every pair
with ``0 <= i - j < near`` uses rotation 0, whose positions are the true ones: attention over such pairs only is
plain RoPE attention (the fast path); ``plain_below`` says the same of every pair whose query position is below it
(DCA: the first chunk and the local window after it). ``query_scale`` optionally multiplies each query (ReRoPE's
log-length scaling).

Why this form: with K small (2 for every method here) a chunk of queries costs K score matmuls and a select,
never a per-pair rotation; and a rotation's query and key positions only depend on i and j respectively, so keys
are rotated once per forward pass. A table of relative positions per pair would not fit in memory at 16k tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import PatchError

Positions = Callable[[torch.Tensor], torch.Tensor]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)


@dataclass(frozen=True)
class Rotation:
    """Rotary positions of one rotation: ``query(i)`` for queries at absolute positions i, ``key(j)`` for keys."""

    query: Positions = _same
    key: Positions = _same

    @property
    def is_identity(self) -> bool:
        return self.query is _same and self.key is _same


IDENTITY = Rotation()


@dataclass(frozen=True)
class KeySplit:
    """A two-rotation map as key ranges per query (``select`` restated for a full pass over positions 0 .. T-1):
    the query at i sees keys ``near_start(i) .. i`` under rotation 0 and keys ``0 .. min(near_start(i),
    far_keys) - 1`` under rotation 1; every other key is masked. ``near_start(i) <= i`` (a query always sees
    itself), and ``far_keys`` None means no far key is masked. Each range is a contiguous run of keys, which is
    what a fused attention kernel takes (``ctxext.attention.lse.split_attention``)."""

    #: (T,) int64 query positions -> (T,) int64, the first key each query sees under rotation 0
    near_start: Callable[[torch.Tensor], torch.Tensor]
    #: how many leading keys rotation 1 may reach (sinks, global tokens); None: all keys before ``near_start``
    far_keys: int | None = None


def _band_start(window: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``near_start`` of a band: keys closer than ``window`` at rotation 0."""

    def near_start(i: torch.Tensor) -> torch.Tensor:
        return (i - window + 1).clamp(min=0)

    return near_start


@dataclass(frozen=True)
class PositionMap:
    """Which rotation each (query, key) pair uses; see the module docstring."""

    method: str
    rotations: tuple[Rotation, ...]
    #: (i, j) -> int8 rotation index per pair, -1 = masked by the method; i and j broadcast (e.g. (B, q, 1), (B, 1, k)).
    #: None: derived from ``split`` (every two-rotation map declares one, so the two cannot disagree)
    select: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    #: every pair with 0 <= i - j < near uses rotations[0], which is the identity (math.inf: the whole map is)
    near: float = 0
    #: optional per-query multiplier from the query's absolute position (ReRoPE's log-length scaling)
    query_scale: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: the resolved options (defaults filled in), for the patch spec
    options: dict[str, Any] = field(default_factory=dict)
    #: every pair (0 <= j <= i) whose query position i is below this uses rotations[0] (0: no such promise)
    plain_below: float = 0
    #: the map's key ranges for fused attention kernels (``KeySplit``; None: not declared). A full pass under it
    #: runs as a few fused calls merged by log-sum-exp (``ctxext.attention.lse``) instead of per-pair selection
    split: KeySplit | None = None

    def __post_init__(self):
        if self.select is None:
            if self.split is None:
                raise ValueError(f"position map of {self.method!r}: give select or split")
            object.__setattr__(self, "select", _select_from_split(self.split))

    def __post_init__(self):
        if self.select is None:
            if self.split is None:
                raise ValueError(f"position map of {self.method!r}: give select or split")
            object.__setattr__(self, "select", _select_from_split(self.split))

    @property
    def is_identity(self) -> bool:
        return self.near == math.inf and self.query_scale is None

    def relative(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """The relative rotary position each pair sees (float64, NaN where masked). For inspection and tests."""
        i, j = torch.broadcast_tensors(i, j)
        which = self.select(i, j)
        out = torch.full(i.shape, math.nan, dtype=torch.float64)
        for c, rot in enumerate(self.rotations):
            rel = rot.query(i).double() - rot.key(j).double()
            out = torch.where(which == c, rel, out)
        return out


def identity_map(method: str, options: dict[str, Any] | None = None) -> PositionMap:
    """Every pair at its true position: the unpatched model."""
    return PositionMap(method, (IDENTITY,), _all_near, math.inf, None, dict(options or {}))


def _all_near(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return torch.zeros(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.int8, device=i.device)


def _select_from_split(split: KeySplit) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``select`` restated from key ranges: rotation 0 from ``near_start(i)`` on, rotation 1 before it (within
    ``far_keys``), masked elsewhere."""

    def select(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        start = split.near_start(i)
        far = j < start if split.far_keys is None else (j < start) & (j < split.far_keys)
        return torch.where(j >= start, 0, torch.where(far, 1, -1)).to(torch.int8)

    return select


# ----------------------------------------------------------------------------------------------------- options


def target_length(original_length: int, factor: float | None) -> int:
    """The length a patch advertises: ``round(factor x original_length)``, or the original length."""
    return int(round(original_length * factor)) if factor is not None else int(original_length)


def _int(method: str, key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise PatchError(f"option {key!r} of method {method!r} must be a whole number >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise PatchError(f"option {key!r} of method {method!r} must be >= {minimum}, got {int(value)}")
    return int(value)


def _larger_than_needed(method: str, key: str, value: int, needed: int, what: str) -> None:
    if value > needed:
        raise PatchError(
            f"option {key}={value} of method {method!r} is larger than needed: the patch advertises {needed} "
            f"tokens, so {what}. Pass {key} <= {needed} (or a larger factor)"
        )
