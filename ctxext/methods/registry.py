"""The method registry: names, aliases, options, and which architecture family supports which method.

The method x family table is data: adapters declare the methods they implement, and ``method_table()``
derives the table that ``ctxext methods`` prints and the README shows.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ..core.errors import PatchError
from .declaration import Method, Option
from .remap import REMAP_METHODS


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("pi", "position interpolation: positions divided by the factor", aliases=("linear",)),
        Method("ntk", "static NTK-aware scaling: rope base * factor^(d/(d-2))"),
        Method(
            "dynamic-ntk",
            "NTK scaling that grows with the sequence length past the original length",
            aliases=("dynamic",),
        ),
        Method(
            "yarn",
            "YaRN: NTK-by-parts interpolation with attention temperature",
            options={
                "beta_fast": Option(32.0, float, "rotations above which a dimension is kept"),
                "beta_slow": Option(1.0, float, "rotations below which a dimension is interpolated"),
                "attention_factor": Option(None, float, "mscale; default 0.1*ln(factor)+1", optional=True),
                "mscale": Option(None, float, "DeepSeek-style mscale numerator", optional=True),
                "mscale_all_dim": Option(None, float, "DeepSeek-style mscale denominator", optional=True),
                "truncate": Option(True, bool, "round the ramp bounds to whole dimensions"),
            },
        ),
        Method(
            "llama3",
            "Llama 3.1 frequency-dependent interpolation",
            options={
                "low_freq_factor": Option(1.0, float, "wavelengths above L0/low are interpolated"),
                "high_freq_factor": Option(4.0, float, "wavelengths below L0/high are kept"),
            },
        ),
        Method(
            "alibi",
            "ALiBi swap: the positional encoding replaced by ALiBi linear attention biases (factor optional: "
            "advertise factor x the length)",
            needs_factor=False,
        ),
        Method(
            "nope",
            "NoPE ablation: the positional encoding removed, only the causal mask orders tokens (factor optional: "
            "advertise factor x the length)",
            needs_factor=False,
        ),
        Method("extrapolate", "advertise factor x the length, positions unchanged (GPT-2: table extended)"),
    ]
}
METHODS.update(REMAP_METHODS)  # attention-side position remapping, declared beside its position maps

ALIASES: dict[str, str] = {alias: m.name for m in METHODS.values() for alias in m.aliases}


def resolve_method(name: str) -> Method:
    if not isinstance(name, str):
        raise PatchError(f"method must be a string, got {type(name).__name__}; choose one of {method_names()}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in METHODS:
        raise PatchError(f"unknown method {name!r}; choose one of {method_names()}")
    return METHODS[key]


def method_names() -> str:
    names = []
    for m in METHODS.values():
        names.append(m.name + (f" (alias {', '.join(m.aliases)})" if m.aliases else ""))
    return ", ".join(names)


#: The largest factor accepted: 1024 x a 128k model is 128M positions, far past anything these methods reach.
MAX_FACTOR = 1024


def _as_number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (int, float, a numpy or 0-d torch scalar), else None.
    Booleans and strings are not numbers here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real) and not _is_bool_like(value):
        return float(value)
    if type(value).__module__.startswith("torch") and getattr(value, "ndim", None) == 0:
        dtype = getattr(value, "dtype", None)
        if dtype is not None and (getattr(dtype, "is_complex", False) or str(dtype) == "torch.bool"):
            return None
        try:
            return float(value.item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _is_bool_like(value: Any) -> bool:
    """numpy.bool_ and friends (not numbers.Real in current numpy, but guard anyway)."""
    return "bool" in type(value).__name__.lower()


def validate_factor(method: Method, factor: Any) -> float | None:
    """The factor as a float in [1, MAX_FACTOR], or None where the method takes none and none is given.

    Numbers only: int, float, numpy scalars, 0-d torch tensors. A string (even ``"4"``) or a bool raises
    ``PatchError``; the CLI converts its strings to numbers before calling this.
    """
    if not method.needs_factor:
        if factor is None:
            return None
    elif factor is None:
        raise PatchError(f"method {method.name!r} needs a factor (a number >= 1, e.g. factor=4)")
    number = _as_number(factor)
    if number is None:
        if isinstance(factor, str):
            try:
                hint = f"factor={float(factor.strip()):g}"
            except ValueError:
                hint = "e.g. factor=4"
            raise PatchError(f"factor must be a number, not the string {factor!r}: pass {hint}")
        raise PatchError(f"factor must be a number >= 1 (int or float), got {factor!r} ({type(factor).__name__})")
    if not math.isfinite(number):
        raise PatchError(f"factor must be a finite number >= 1, got {number}")
    if number < 1:
        raise PatchError(
            f"factor must be >= 1 for method {method.name!r} (it multiplies the context length), got {number:g}"
        )
    if number > MAX_FACTOR:
        raise PatchError(
            f"factor {number:g} is above the maximum {MAX_FACTOR} for method {method.name!r} "
            f"(it multiplies the context length); pass a factor between 1 and {MAX_FACTOR}"
        )
    return number


def validate_options(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """Return the method's options with defaults filled in; unknown or ill-typed options raise."""
    unknown = sorted(set(options) - set(method.options))
    if unknown:
        accepted = ", ".join(method.options) if method.options else "none"
        raise PatchError(f"unknown option(s) {', '.join(unknown)} for method {method.name!r}; accepted: {accepted}")
    resolved = {}
    for key, opt in method.options.items():
        value = options.get(key, opt.default)
        if value is None:
            if not opt.optional:
                raise PatchError(f"option {key!r} of method {method.name!r} cannot be None")
        else:
            value = _coerce(method.name, key, value, opt.kind)
        resolved[key] = value
    return resolved


def _coerce(method: str, key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise PatchError(f"option {key!r} of method {method!r} must be true or false, got {value!r}")
    if isinstance(value, bool) or _is_bool_like(value):
        raise PatchError(f"option {key!r} of method {method!r} must be a number, got {value!r}")
    try:
        number = float(value) if kind is int else kind(value)  # via float: "2.0" is an int, 2.5 is not
    except (TypeError, ValueError):
        raise PatchError(f"option {key!r} of method {method!r} must be a number, got {value!r}") from None
    if kind is int:
        if not math.isfinite(number) or not number.is_integer():
            raise PatchError(f"option {key!r} of method {method!r} must be a whole number, got {value!r}")
        number = int(number)
    if isinstance(number, float) and not math.isfinite(number):
        raise PatchError(f"option {key!r} of method {method!r} must be finite, got {value!r}")
    return number


def method_table(adapters=None) -> list[dict[str, str]]:
    """One row per method: for each family, 'yes' or why not."""
    from ..adapters import ADAPTERS

    adapters = ADAPTERS if adapters is None else adapters
    rows = []
    for m in METHODS.values():
        row = {"method": m.name, "summary": m.summary}
        for adapter in adapters:
            row[adapter.family] = adapter.support(m.name)
        rows.append(row)
    return rows


def format_method_table(markdown: bool = False) -> str:
    from ..adapters import ADAPTERS

    header = ["method"] + [a.title for a in ADAPTERS]
    body = [[r["method"]] + [r[a.family] for a in ADAPTERS] for r in method_table()]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(f"`{c}`" if i == 0 else c for i, c in enumerate(row)) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in body])
