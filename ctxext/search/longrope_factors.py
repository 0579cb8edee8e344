"""LongRoPE's per-dimension rescale factors on a plain-RoPE model: where the search starts, how a candidate is put on
the model while it is scored, and the transformers-native ``longrope`` config that holds the result.

A candidate is one factor per rotary frequency, ``lambda_i >= 1`` (frequency i divided by it), non-decreasing in i
(LongRoPE's monotonicity constraint: a lower frequency is never interpolated less than a higher one). It runs as
transformers' ``longrope`` rope type computes its long set: ``inv_freq_i = 1 / (lambda_i * base ** (2i / d))``, with the
attention factor ``sqrt(1 + ln(s) / ln(L))`` for the extension factor s over the trained length L (Ding et al. 2024;
transformers' ``_compute_longrope_parameters``), so that the checkpoint written at the end loads in plain transformers
with exactly the frequencies that were scored. Sequences within L run with the short factors, all 1 here (the
original frequencies, with the same attention factor, as transformers applies it to both sets).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..adapters.rotary_units import RotaryUnit, _unit_saver, rotary_units, unit_inputs
from ..core.errors import PatchError
from ..methods import rope
from ..methods.rope import RopeInputs


def plain_rope_inputs(model: nn.Module, original_length: int) -> RopeInputs:
    """The one set of plain-RoPE frequencies every rotary module of ``model`` uses; ``PatchError`` otherwise (a shipped
    scaled rope type, frequencies per layer type, several different sets, no rotary module)."""
    units = rotary_units(model)
    if not units:
        raise PatchError(f"{type(model).__name__} has no rotary module whose frequencies ctxext knows; the LongRoPE "
                         "search rescales rotary frequencies")
    inputs = None
    for unit in units:
        if unit.layer_type is not None:
            raise PatchError(f"rotary module {unit.name} keeps one frequency set per layer type; the LongRoPE search "
                             "writes one set of factors (refused)")
        if unit.rope_type != "default":
            raise PatchError(f"rotary module {unit.name} already uses rope type {unit.rope_type!r}; the LongRoPE "
                             "search starts from plain RoPE (load the model with rope_type 'default')")
        found = unit_inputs(unit, original_length)
        if inputs is not None and (found.dim != inputs.dim or found.base != inputs.base):
            raise PatchError(f"{type(model).__name__} has rotary modules with different frequencies; the LongRoPE "
                             "search writes one set of factors (refused)")
        inputs = found
    return inputs


def attention_factor(factor: float, original_length: int) -> float:
    """LongRoPE's attention factor, as transformers derives it for ``longrope`` (1 where the factor is <= 1)."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_length))


def long_inv_freq(inputs: RopeInputs, factors: Sequence[float]) -> torch.Tensor:
    """The frequencies of a candidate, computed as transformers' ``longrope`` computes its long set (float32)."""
    ext = torch.tensor(list(factors), dtype=torch.float32)
    exponents = torch.arange(0, inputs.dim, 2, dtype=torch.int64).float() / inputs.dim
    return 1.0 / (ext * inputs.base**exponents)


def per_dimension(inputs: RopeInputs, inv_freq: torch.Tensor) -> list[float]:
    """The factors ``original / new`` per frequency of a method's frequencies, made monotone (>= 1, non-decreasing)."""
    ratio = (inputs.inv_freq.double() / inv_freq.double()).tolist()
    return monotone(ratio)


def monotone(factors: Sequence[float], upper: float | None = None) -> list[float]:
    """The nearest candidate above ``factors`` that meets the constraints: each at least 1 (and at most ``upper``),
    non-decreasing in the frequency index (a running maximum)."""
    out, best = [], 1.0
    for value in factors:
        value = max(1.0, float(value))
        if upper is not None:
            value = min(value, upper)
        best = max(best, value)
        out.append(best)
    return out


def start_points(inputs: RopeInputs, factor: float) -> dict[str, list[float]]:
    """The search's starting candidates, from the training-free methods at ``factor``: PI (every frequency / s), YaRN
    (NTK-by-parts: high frequencies kept, low ones / s, ramped between), and static NTK (a base change)."""
    return {
        "pi": [float(factor)] * (inputs.dim // 2),
        "yarn": per_dimension(inputs, rope.yarn(inputs, factor)[0]),
        "ntk": per_dimension(inputs, rope.ntk_scale(inputs, factor)[0]),
    }


@contextlib.contextmanager
def rescaled(model: nn.Module, inputs: RopeInputs, factors: Sequence[float], factor: float) -> Iterator[nn.Module]:
    """``model`` with the candidate's frequencies and LongRoPE's attention factor in every rotary module (as the
    native checkpoint runs past the trained length); everything restored bit-exactly on exit."""
    if len(factors) != inputs.dim // 2:
        raise ValueError(f"{len(factors)} factors for {inputs.dim // 2} rotary frequencies")
    units = rotary_units(model)
    savers = [_unit_saver(unit) for unit in units]
    try:
        for unit in units:
            _set(unit, long_inv_freq(inputs, factors), attention_factor(factor, inputs.original_length))
        yield model
    finally:
        for restore in reversed(savers):
            restore()


def _set(unit: RotaryUnit, inv_freq: torch.Tensor, scale: float) -> None:
    with torch.no_grad():
        unit.inv_freq.copy_(inv_freq.to(device=unit.inv_freq.device, dtype=unit.inv_freq.dtype))
    unit.attention_scaling = scale


def native_changes(config: Any, inputs: RopeInputs, factors: Sequence[float], factor: float) -> dict[str, Any]:
    """The config changes that make ``config`` a native ``longrope`` checkpoint of the candidate: 5.x
    ``rope_parameters`` (``rope_theta`` kept inside) or 4.x ``rope_scaling`` + ``original_max_position_embeddings``;
    the advertised length becomes ``round(s x L)``."""
    length = int(round(factor * inputs.original_length))
    fields = {"rope_type": "longrope", "short_factor": [1.0] * (inputs.dim // 2),
              "long_factor": [float(x) for x in factors], "factor": float(factor),
              "original_max_position_embeddings": int(inputs.original_length)}
    params = getattr(config, "rope_parameters", None)
    # the API this transformers reads (a 4.x config may carry a 5.x rope_parameters dict it ignores)
    reads_parameters = "rope_parameters" in inspect.signature(type(config).__init__).parameters
    if reads_parameters and isinstance(params, dict) and "rope_type" in params:
        return {"rope_parameters": {**params, **fields}, "max_position_embeddings": length}
    if hasattr(config, "rope_scaling"):
        return {"rope_scaling": {**fields, "type": "longrope"}, "max_position_embeddings": length,
                "original_max_position_embeddings": int(inputs.original_length)}
    raise PatchError(f"{type(config).__name__} has neither rope_parameters nor rope_scaling; no native longrope form")


def verify_native(model: nn.Module, inputs: RopeInputs, factors: Sequence[float], factor: float,
                  changes: dict[str, Any]) -> None:
    """Build transformers' own rotary module from the changed config and check it runs the candidate past the trained
    length (its long set and attention factor); ``PatchError`` with the difference otherwise."""
    from ..adapters.rotary_native import _config_with, _native_rotary
    from ..adapters.rotary_units import _shipped, rotary_modules

    config = _config_with(model.config, changes)
    expected = long_inv_freq(inputs, factors)
    scale = attention_factor(factor, inputs.original_length)
    for name, module in rotary_modules(model):
        native = _native_rotary(module, config)
        if native.rope_type != "longrope":
            raise PatchError(f"transformers reads rope type {native.rope_type!r} from the longrope config")
        long = _shipped(RotaryUnit(name, native), "longrope", seq_len=inputs.original_length + 1)
        if not torch.allclose(long, expected, rtol=1e-6, atol=0):
            raise PatchError("transformers' longrope frequencies differ from the searched ones "
                             f"(largest relative difference {float(((long - expected) / expected).abs().max()):.2e})")
        if not math.isclose(float(native.attention_scaling), scale, rel_tol=1e-6):
            raise PatchError(f"transformers' longrope attention factor {native.attention_scaling} differs from "
                             f"{scale}")


__all__ = ["attention_factor", "long_inv_freq", "monotone", "native_changes", "per_dimension", "plain_rope_inputs",
           "rescaled", "start_points", "verify_native"]
