"""The method index: every method's declaration, collected from the module that holds its functions, and the
checks of a patch request against a declaration (name, factor, options).

Each method is declared once, beside its functions (``ctxext.methods.rope``, ``alibi``, ``nope``, ``remap``), with a
kind that adapters read to decide support (the method x family table that ``ctxext methods`` prints is asked of the
adapters: ``ctxext.adapters.table``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ..core.errors import PatchError
from .alibi import ALIBI
from . import temperature
from .declaration import Method
from .nope import NOPE
from .remap import REMAP_METHODS
from .rope import EXTRAPOLATE, FREQUENCY_METHODS

#: Every method by name, in the order of the method table.
METHODS: dict[str, Method] = {
    m.name: m for m in (*FREQUENCY_METHODS, ALIBI, NOPE, EXTRAPOLATE, *REMAP_METHODS.values())
}

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


def as_number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (int, float, a numpy or 0-d torch scalar), else None.
    Booleans and strings are not numbers here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real) and not _is_bool_like(value):
        try:
            return float(value)
        except OverflowError:  # an int past float's range (10**400): as large as a float gets, refused as not finite
            return math.inf if value > 0 else -math.inf
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
    number = as_number(factor)
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


def accepted_options(method: Method) -> tuple[str, ...]:
    """The option names ``method`` takes: its own, and an attention temperature's where it carries one."""
    return tuple(method.options) + (temperature.OPTIONS if temperature.takes_temperature(method) else ())


def validate_options(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """Return the method's options with defaults filled in; unknown or ill-typed options raise. An attention
    temperature (``ctxext.methods.temperature``) is added only where one is given, so a patch without it records the
    method's options alone."""
    options, temperature_options = temperature.split_options(options)
    unknown = sorted(map(str, set(options) - set(method.options)))  # a YAML key may be a number
    if unknown:
        accepted = ", ".join(method.options) or "none"
        if temperature.takes_temperature(method):
            accepted += f"; with an attention temperature: {', '.join(temperature.OPTIONS)}"
        raise PatchError(f"unknown option(s) {', '.join(unknown)} for method {method.name!r}; accepted: {accepted}")
    extra = temperature.validate(method, temperature_options)
    resolved = {}
    for key, opt in method.options.items():
        value = options.get(key, opt.default)
        if value is None:
            if not opt.optional:
                raise PatchError(f"option {key!r} of method {method.name!r} cannot be None")
        else:
            value = _coerce(method.name, key, value, opt.kind)
        resolved[key] = value
    if method.check_options is not None:
        method.check_options(resolved)
    return {**resolved, **extra}


def derived_options(method: Method, options: dict[str, Any], *, original_length: int | None,
                    factor: float | None) -> dict[str, Any]:
    """``options`` (as :func:`validate_options` returns them) with the defaults the method derives from the original
    length and the factor filled in: the values the patch runs with. A remap method's position map states them
    (Self-Extend's group and window, DCA's chunk size and local window, ReRoPE's window, STRING's shift and local,
    ...); a method that derives none, or an unknown original length, gives ``options`` unchanged. The result gives
    the same patch as ``options``, and itself again, so a record that holds it reloads to the same patch. PatchError
    for options the method refuses."""
    if method.position_map is None or original_length is None:
        return dict(options)
    own, temperature_options = temperature.split_options(options)
    ran = method.position_map(original_length, factor, **{k: v for k, v in own.items() if v is not None}).options
    return {**own, **ran, **temperature_options}


#: The largest whole-number option (window, group, sink tokens, ...): 2**31 - 1 positions.
INT_OPTION_LIMIT = 2**31 - 1


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
    except OverflowError:  # an int past float's range
        raise PatchError(f"option {key!r} of method {method!r} is out of range, got {value!r:.40}...") from None
    if kind is int:
        if not math.isfinite(number) or not number.is_integer():
            raise PatchError(f"option {key!r} of method {method!r} must be a whole number, got {value!r}")
        if abs(number) > INT_OPTION_LIMIT:  # sizes and counts of positions: beyond any context, and past int64 maths
            raise PatchError(f"option {key!r} of method {method!r} must be between {-INT_OPTION_LIMIT} and "
                             f"{INT_OPTION_LIMIT}, got {value!r}")
        number = int(number)
    if isinstance(number, float) and not math.isfinite(number):
        raise PatchError(f"option {key!r} of method {method!r} must be finite, got {value!r}")
    return number
