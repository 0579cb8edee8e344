"""Which patches to evaluate: `--methods none,pi,yarn:8 --factor 4 --option KEY=VALUE` as data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.errors import PatchError
from ..methods.registry import (MAX_FACTOR, METHODS, as_number, accepted_options, derived_options,
                                resolve_method, validate_options)
from ..methods.temperature import OPTION as TEMPERATURE
from ..methods.temperature import OPTIONS as TEMPERATURE_OPTIONS

NONE = "none"
#: how ``none`` with an attention temperature is applied: the model's own frequencies and length (``extrapolate``
#: x1 changes neither), with the temperature in front of its attention
NONE_WITH_TEMPERATURE = ("extrapolate", 1.0)
#: What the rows of a model evaluated with a LoRA adapter (``--adapter``) add to their method label.
ADAPTER_SUFFIX = " +LoRA"


@dataclass(frozen=True)
class Spelling:
    """How messages name the arguments of an evaluation: the command line's flags (``--output r.json``,
    ``--resume``) or ``ctxext.evaluate``'s keywords (``output='r.json'``, ``resume=True``). An argument is given by
    its keyword name (``output``, ``key_tokens``)."""

    flags: bool = True

    def name(self, arg: str) -> str:
        """``--output`` / ``output``."""
        return _FLAG_NAMES.get(arg, "--" + arg.replace("_", "-")) if self.flags else arg

    def given(self, arg: str, value: Any) -> str:
        """The argument with its value: ``--output r.json`` / ``output='r.json'``."""
        return f"{self.name(arg)} {value}" if self.flags else f"{arg}={value!r}"

    def on(self, arg: str) -> str:
        """A switch turned on: ``--resume`` / ``resume=True``."""
        return self.name(arg) if self.flags else f"{arg}=True"

    def again(self) -> str:
        """How to run the same evaluation again."""
        return "run the same command again" if self.flags else "call ctxext.evaluate again with the same arguments"


#: Keyword names whose flag is not ``--`` plus the name with dashes.
_FLAG_NAMES = {"options": "--option"}
FLAGS, KEYWORDS = Spelling(flags=True), Spelling(flags=False)


def is_unpatched_label(label: str) -> bool:
    """Whether a row label names the model without a patch (``none``; ``none +LoRA`` with an adapter)."""
    return label in (NONE, NONE + ADAPTER_SUFFIX)


@dataclass(frozen=True)
class MethodRequest:
    """One patch to evaluate; ``method`` is ``"none"`` for the unpatched model."""

    method: str
    factor: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        temperature = self.options.get(TEMPERATURE)
        suffix = f" +{str(temperature).strip().lower()}" if temperature else ""  # an attention temperature
        if self.method == NONE or self.factor is None:
            return self.method + suffix
        return f"{self.method} x{self.factor:g}{suffix}"

    def key(self) -> tuple[str, float | None]:
        return (self.method, self.factor)

    def matches(self, spec: dict[str, Any] | None) -> bool:
        """Whether this request is the patch ``spec`` (a ``ctxext.describe`` dict) describes: the same method, factor
        and options once the options' defaults are filled in. ``none`` matches no patch."""
        call = self.patch_call()
        if call is None or not isinstance(spec, dict) or self.method == NONE:
            return False
        method, factor, options = call
        length = spec.get("original_length")
        try:  # both sides with the settings the method derives from the factor filled in (a record holds them)
            info = resolve_method(method)
            asked = derived_options(info, validate_options(info, options), original_length=length, factor=factor)
            recorded = derived_options(info, validate_options(info, dict(spec.get("options") or {})),
                                       original_length=length, factor=spec.get("factor"))
        except (PatchError, ValueError, TypeError):
            return False
        same_factor = (factor is None) == (spec.get("factor") is None) and (
            factor is None or float(factor) == float(spec["factor"]))
        return info.name == spec.get("method") and same_factor and asked == recorded

    def patch_call(self) -> tuple[str, float | None, dict[str, Any]] | None:
        """The ``ctxext.patch`` arguments of this request; None for the unpatched model (``none`` with no options).
        ``none`` with a temperature (``--option none.temperature=logn``) is the model as loaded plus that temperature:
        :data:`NONE_WITH_TEMPERATURE`."""
        if self.method != NONE:
            return self.method, self.factor, dict(self.options)
        return (*NONE_WITH_TEMPERATURE, dict(self.options)) if self.options else None


def parse_options(pairs: list[str] | None, spelling: Spelling = FLAGS) -> dict[str | None, dict[str, str]]:
    """``KEY=VALUE`` (every method that accepts KEY) or ``METHOD.KEY=VALUE`` -> {method or None: {key: value}}."""
    out: dict[str | None, dict[str, str]] = {}
    option = spelling.name("options")
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"{option} expects KEY=VALUE or METHOD.KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        method = None
        if "." in key:
            method, key = key.split(".", 1)
            method = NONE if method.strip().lower() == NONE else resolve_method(method).name
        if not key.strip():
            raise ValueError(f"{option} {pair}: no option name before '='; give KEY=VALUE or METHOD.KEY=VALUE "
                             "(e.g. beta_fast=32)")
        out.setdefault(method, {})[key.strip()] = value.strip()
    return out


def parse_factor(text, what: str) -> float:
    """A factor (a number or a number-like string, as the command line gives it), between 1 and ``MAX_FACTOR``.
    What is a number is ``ctxext.patch``'s rule: a bool is not (``True`` would run the model unpatched as x1)."""
    value = _number_in(text) if isinstance(text, str) else as_number(text)
    if value is None:
        kind = f" ({type(text).__name__})" if not isinstance(text, str) else ""
        raise ValueError(f"{what}: factor must be a number, got {text!r}{kind}")
    if not math.isfinite(value) or not 1 <= value <= MAX_FACTOR:
        raise ValueError(f"{what}: factor must be a number between 1 and {MAX_FACTOR:g}, got {text!r}")
    return value


def _number_in(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_methods(
    spec: str | None, *, factor: float | None, options: list[str] | None = None, default: list[str] | None = None,
    spelling: Spelling = FLAGS,
) -> list[MethodRequest]:
    """Parse ``--methods`` (comma-separated ``NAME`` or ``NAME:FACTOR``; ``none`` = unpatched).

    ``factor`` applies to every method that takes one and has no ``:FACTOR``. ``default`` (method
    names) is used when ``spec`` is empty. Unknown methods, and options no listed method accepts, raise.
    """
    names = method_names(spec) if spec else list(default or [])
    if not names:
        raise ValueError(no_methods(spelling))
    by_method = parse_options(options, spelling)
    requests: list[MethodRequest] = []
    used_global: set[str] = set()
    for item in names:
        name, colon, own = item.partition(":")
        name = name.strip().lower()
        if colon and not own.strip():
            raise ValueError(f"{item!r}: nothing after ':'; give a factor (e.g. {name}:4) or drop the ':'")
        if name == NONE:
            if own:
                raise ValueError("'none' (the unpatched model) takes no factor")
            own_options = by_method.get(NONE, {})  # only by name: a global --option leaves the baseline as it is
            stray = sorted(set(own_options) - set(TEMPERATURE_OPTIONS))
            if stray:
                raise ValueError(f"'none' (the unpatched model) takes only an attention temperature "
                                 f"({', '.join(TEMPERATURE_OPTIONS)}), not {', '.join(stray)}")
            if own_options and TEMPERATURE not in own_options:
                raise ValueError(f"none.{', none.'.join(own_options)}: parameters of an attention temperature; give "
                                 f"none.{TEMPERATURE}=logn|llama4|ssmax with them")
            req = MethodRequest(NONE, None, dict(own_options))
        else:
            info = resolve_method(name)
            f = parse_factor(own, item) if own else None
            if f is None and takes_factor(info.name):
                f = factor
            opts = {k: v for k, v in by_method.get(None, {}).items() if k in accepted_options(info)}
            used_global.update(opts)
            own_options = by_method.get(info.name, {})
            clash = sorted(k for k in own_options if k in ("factor", "method", "model"))
            if clash:  # names of the patch call itself, not options
                methods_, factor_ = spelling.name("methods"), spelling.name("factor")
                raise ValueError(f"{info.name}.{clash[0]}: not an option of {info.name!r}; give a factor as "
                                 f"{info.name}:F in {methods_} or with {factor_}, the method in {methods_}")
            opts.update(own_options)
            req = MethodRequest(info.name, f, opts)
        if req in requests:
            continue
        requests.append(req)
    unused = sorted(set(by_method.get(None, {})) - used_global)
    if unused:
        raise ValueError(f"option(s) {', '.join(unused)} apply to none of the methods {', '.join(names)}")
    for method in by_method:
        if method is not None and method not in {r.method for r in requests}:
            raise ValueError(f"{spelling.name('options')} for {method!r}, which is not among "
                             f"{spelling.name('methods')}")
    return requests


def method_names(spec: str) -> list[str]:
    """The names of a ``--methods`` string, each once as written: ``"none, yarn:8,"`` -> ["none", "yarn:8"]."""
    return [s.strip() for s in spec.split(",") if s.strip()]


def no_methods(spelling: Spelling = FLAGS) -> str:
    """What to say where the methods asked for are none (``methods=[]``, ``--methods ""``)."""
    methods = spelling.name("methods")
    return (f"{methods}: no methods to evaluate; name some (e.g. none,pi,yarn), or leave {methods} out for the "
            "default set (none and every method that fits the model)")


def takes_factor(method: str) -> bool:
    """Whether a method gets ``--factor`` (or the factor the evaluator derives) when its request names none."""
    info = METHODS[method]
    return info.needs_factor or info.scales_with_factor


def with_factor(requests: list[MethodRequest], factor: float | None) -> list[MethodRequest]:
    """``requests`` with ``factor`` given to each one that takes a factor and names none; a request that then
    equals an earlier one is dropped (``pi,pi:4 --factor 4`` is one patch)."""
    out: list[MethodRequest] = []
    for req in requests:
        if req.factor is None and req.method != NONE and takes_factor(req.method):
            req = replace(req, factor=factor)
        if req not in out:
            out.append(req)
    return out


@dataclass(frozen=True)
class MethodChoice:
    """``--methods``, ``--factor`` and ``--option`` parsed once: the requests as given (the factor left open where
    each model's own lengths decide it), or ``given=None`` for the default set, every method that fits a model."""

    given: tuple[MethodRequest, ...] | None = None
    options: tuple[str, ...] = ()
    #: How messages name --methods and --option (the keywords where ``ctxext.evaluate`` asked).
    spelling: Spelling = field(default=FLAGS, compare=False)

    @classmethod
    def parse(cls, spec: str | None, *, options: list[str] | None = None, spelling: Spelling = FLAGS) -> MethodChoice:
        """Raises ValueError (PatchError for a bad option value) on unknown names, bad factors and stray options;
        without ``spec`` only the form of each option is checked: which methods take it depends on the model."""
        if not spec:
            parse_options(options, spelling)
            return cls(None, tuple(options or ()), spelling)
        return cls(tuple(parse_methods(spec, factor=None, options=options, spelling=spelling)), tuple(options or ()),
                   spelling)

    @property
    def patches(self) -> bool:
        """Whether a patch was asked for by name (a method other than ``none``, or ``none`` with a temperature)."""
        return self.given is not None and any(r.patch_call() is not None for r in self.given)

    def for_model(self, model, factor: float | None) -> list[MethodRequest]:
        """The requests for ``model``, ``factor`` filled in where a request takes one and names none."""
        if self.given is not None:
            return with_factor(list(self.given), factor)
        from ..api import available_methods

        try:
            fits = list(available_methods(model))
        except PatchError:
            fits = []
        return parse_methods(None, factor=factor, options=list(self.options), default=[NONE] + fits,
                             spelling=self.spelling)


def check_request(model, request: MethodRequest, spelling: Spelling = FLAGS) -> None:
    """Raise PatchError if ``request`` cannot be applied to (the unpatched) ``model``; touches nothing. ``spelling``:
    how the message names ``factor``."""
    call = request.patch_call()
    if call is None:
        return
    from ..api import build_spec

    method, factor, options = call
    if factor is None and METHODS[method].needs_factor:
        factor_n = f"{spelling.name('factor')} N" if spelling.flags else "factor=N"
        raise PatchError(f"method {method!r} needs a factor: give {factor_n} or {method}:N")
    build_spec(model, method, factor, **options)
