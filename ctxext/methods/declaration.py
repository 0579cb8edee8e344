"""How a method is declared: its name, summary, kind, options (typed, with defaults), whether it needs a factor, and
what adapters and the native export read from it (its functions, its rule in words, its transformers-native form).

Kept apart from :mod:`ctxext.methods.registry` so that each method module declares its methods beside their
functions without importing the registry that collects the declarations. Adapters decide support by a method's
``kind`` and attributes, never by its name, so adding a method of a known kind is one declaration.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class Kind(enum.Enum):
    """What a method changes, which decides the families that can carry it."""

    #: rescales the rotary frequencies (``RopeInputs -> (inv_freq, attention_factor)``)
    FREQUENCY = "frequency"
    #: only the advertised length grows; positions are unchanged (a table family extends its table)
    LENGTH = "length"
    #: the positional signal removed; only the causal mask orders tokens
    NONE = "none"
    #: the positional signal replaced by an attention bias (the ALiBi swap)
    BIAS = "bias"
    #: the positions each query-key pair sees remapped inside attention (a ``PositionMap``)
    REMAP = "remap"


@dataclass(frozen=True)
class Option:
    default: Any
    kind: type  # float, int or bool
    help: str = ""
    optional: bool = False  # default None is allowed


@dataclass(frozen=True)
class NativeRope:
    """transformers' own form of a frequency method, written into a rotary config on export (``ctxext.export``)."""

    #: the rope type transformers computes it with (None: plain RoPE, only ``theta`` changes)
    rope_type: str | None = None
    #: the method's options the rope dict carries, in this order (None values left out; a flag only when it differs
    #: from its default, which transformers shares: releases without the key then read the config too)
    options: tuple[str, ...] = ()
    #: the rope dict names the original length (``original_max_position_embeddings``)
    names_original_length: bool = False
    #: transformers reads ``max_position_embeddings`` as the original length for this rope type, so the export
    #: keeps it there instead of advertising the patched length
    keeps_original_length: bool = False
    #: ``(base, factor, rotary dim) -> new rope_theta`` where the method is a change of base
    theta: Callable[[float, float, int], float] | None = None


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    kind: Kind
    needs_factor: bool = True
    #: The factor is optional but shapes the method (its derived defaults), so the evaluator hands a method without
    #: ``:F`` its run's ``--factor`` (or the one derived from ``--lengths``), as for methods that need one.
    scales_with_factor: bool = False
    aliases: tuple[str, ...] = ()
    options: dict[str, Option] = field(default_factory=dict)
    #: What it does, in a few words, on the surface its kind names (rotary frequencies, remapped positions): the
    #: rotary family's table cell.
    rule: str = ""
    #: The same rule where the frequencies are baked into a sin-cos table (default: ``rule``).
    table_rule: str | None = None
    #: Every position (relative distance) divided by the factor. Families whose positions are a learned table or
    #: ALiBi slopes carry such a method their own way (interpolated rows, slopes / factor).
    interpolates: bool = False
    #: FREQUENCY: ``(RopeInputs, factor, **options) -> (inv_freq, attention_factor)``; with ``per_sequence`` it also
    #: takes the sequence length after the factor.
    frequencies: Callable[..., Any] | None = None
    #: The frequencies depend on the sequence length (recomputed per sequence), so a fixed table cannot hold them.
    per_sequence: bool = False
    #: REMAP: ``(original_length, factor, **options) -> PositionMap``.
    position_map: Callable[..., Any] | None = None
    #: transformers' own form of the method on rotary models (None: none).
    native: NativeRope | None = None
    #: ``(resolved options) -> None``, raising PatchError: ranges and relations between options that a type alone
    #: does not say (checked with the options, before anything changes).
    check_options: Callable[[dict], None] | None = None

    @property
    def described_as_table(self) -> str:
        return self.table_rule if self.table_rule is not None else self.rule
