"""Attention temperature by position: a per-query multiplier of the attention logits, composable with every rotary
method (frequency, length and remap kinds) as the patch option ``temperature``.

Each form maps a query's 0-based position ``p`` to a factor its query vector is multiplied by, so its logits against
every key are multiplied by it (the fused attention kernels stay; the cost is O(T x head_dim)):

- ``logn`` (Qwen 1's ``use_logn_attn``, its ``modeling_qwen.py``): ``max(1, log(p + 1) / log(L))``, ``L`` the trained
  (original) length: 1 within the trained length, growing with the log of the length past it. Qwen 1 applies it at
  inference only, with dynamic NTK.
- ``llama4`` (transformers' ``get_llama_4_attn_scale``, read by Ministral 3 / Mistral 4 as ``llama_4_scaling_beta``):
  ``1 + beta * log(1 + floor(p / floor))``; ``beta`` defaults to 0.1 (Llama 4's ``attn_scale`` and Ministral 3's
  shipped value) and ``floor`` to the original length (Ministral 3 divides by ``original_max_position_embeddings``).
  Llama 4's own NoPE-layer variant divides ``p + 1`` by its ``floor_scale`` (8192): pass ``floor`` for that scale; the
  one-position shift is not reproduced.
- ``ssmax`` (Scalable-Softmax, Nakanishi 2025, arXiv 2501.19399): logits multiplied by ``s * log(n)``, ``n`` the
  number of keys the query attends to, here ``p + 1`` (causal attention over the whole prefix). The paper learns
  ``s``; a model trained without SSMax gets ``s = 1 / log(L)`` by default, so the factor is exactly 1 at the trained
  length and the change grows (or shrinks) with the distance from it.

Query positions are the model's ``position_ids`` (true positions, so a cached decode scales each new query as a full
pass would, and left padding does not shift them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import PatchError
from .declaration import Kind, Method

#: The patch option that selects a form, and each form's own parameters (form -> option names).
OPTION = "temperature"
FORMS: dict[str, tuple[str, ...]] = {"logn": (), "llama4": ("beta", "floor"), "ssmax": ("s",)}
#: Every option the temperature adds to a method's own.
OPTIONS = (OPTION, "beta", "floor", "s")
#: The method kinds that carry a temperature: the rotary methods (the rotary family's attention path).
KINDS = (Kind.FREQUENCY, Kind.LENGTH, Kind.REMAP)
#: Defaults: ``beta`` as Llama 4 / Ministral 3 ship it; ``floor`` and ``s`` from the original length (None here).
BETA = 0.1
#: The largest ``beta`` and ``s`` accepted (bounded as the factor is, far past any real value: Llama 4 ships beta
#: 0.1, SSMax's default s is 1 / log(L), about 0.1, and its learned values stay below 1). Past them, the attention
#: is all but an argmax, and a large enough value makes every logit non-finite.
MAX_BETA = 10.0
MAX_S = 10.0
#: The largest ``floor``: 2**31 - 1 positions, as the methods' whole-number options.
MAX_FLOOR = 2**31 - 1
#: How far past the original length a temperature must stay finite: the largest factor
#: (``ctxext.methods.registry.MAX_FACTOR``, which imports this module; a test keeps the two equal).
HORIZON = 1024


def takes_temperature(method: Method) -> bool:
    return method.kind in KINDS


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the method's own options, the temperature's) from one options dict."""
    own = {k: v for k, v in options.items() if k not in OPTIONS}
    return own, {k: v for k, v in options.items() if k in OPTIONS}


def validate(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """The temperature options given with ``method``, checked and typed: ``{}`` when none is given, else
    ``{"temperature": form, <the form's parameters, as given>}`` (defaults stay open: they follow the original length).
    Raises ``PatchError`` for a method that cannot carry one, an unknown form, or a parameter of another form."""
    given = {k: v for k, v in options.items() if k in OPTIONS}
    if not given:
        return {}
    form = given.get(OPTION)
    if form is None:
        params = ", ".join(sorted(given))
        raise PatchError(f"unknown option(s) {params} for method {method.name!r} without a {OPTION}: they are "
                         f"parameters of an attention temperature; give {OPTION}={'|'.join(FORMS)} with them")
    if not takes_temperature(method):
        raise PatchError(f"method {method.name!r} ({method.kind.value}) takes no {OPTION}: an attention temperature "
                         f"composes with the rotary methods (frequency, length and remap kinds)")
    if not isinstance(form, str) or form.strip().lower() not in FORMS:
        raise PatchError(f"option {OPTION}={form!r} of method {method.name!r}: choose one of {', '.join(FORMS)}")
    form = form.strip().lower()
    out: dict[str, Any] = {OPTION: form}
    for key in sorted(set(given) - {OPTION}):
        if key not in FORMS[form]:
            takes = ", ".join(FORMS[form]) or "no parameters"
            raise PatchError(f"option {key!r} does not apply to {OPTION}={form} (it takes {takes})")
        out[key] = _number(key, given[key], form)
    return out


def _number(key: str, value: Any, form: str) -> float | int:
    if isinstance(value, bool):
        raise PatchError(f"option {key!r} of {OPTION}={form} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PatchError(f"option {key!r} of {OPTION}={form} must be a number, got {value!r}") from None
    except OverflowError:  # an int past float's range
        number = math.inf
    if not math.isfinite(number):
        raise PatchError(f"option {key!r} of {OPTION}={form} must be finite, got {_shown(value)}")
    if key == "floor":
        if not number.is_integer() or number < 1:
            raise PatchError(f"option 'floor' of {OPTION}={form} must be a whole number of positions >= 1, "
                             f"got {value!r}")
        if number > MAX_FLOOR:
            raise PatchError(f"option 'floor' of {OPTION}={form} is {_shown(value)}, above the maximum {MAX_FLOOR} "
                             f"positions; pass a floor between 1 and {MAX_FLOOR}")
        return int(number)
    if key == "beta" and number < 0:
        raise PatchError(f"option 'beta' of {OPTION}={form} must be >= 0 (0: no temperature), got {value!r}")
    if key == "beta" and number > MAX_BETA:
        raise PatchError(f"option 'beta' of {OPTION}={form} is {_shown(value)}, above the maximum {MAX_BETA:g} "
                         f"(Llama 4 and Ministral 3 ship {BETA}); pass a beta between 0 and {MAX_BETA:g}")
    if key == "s" and number <= 0:
        raise PatchError(f"option 's' of {OPTION}={form} must be > 0, got {value!r}")
    if key == "s" and number > MAX_S:
        raise PatchError(f"option 's' of {OPTION}={form} is {_shown(value)}, above the maximum {MAX_S:g} (the default "
                         f"is 1 / log of the original length, about 0.1); pass an s above 0 and at most {MAX_S:g}")
    return number


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Temperature:
    """One form with its parameters resolved against the original length: ``__call__(positions)`` gives the query
    factors (float32, the shape of ``positions``)."""

    form: str
    original_length: int
    beta: float = BETA
    floor: int | None = None
    s: float | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any], original_length: int) -> Temperature | None:
        """The temperature a patch's options ask for (None: none)."""
        form = options.get(OPTION)
        if form is None:
            return None
        if not isinstance(original_length, int) or original_length < 2:
            raise PatchError(f"{OPTION}={form} needs the model's original length (at least 2), got {original_length!r}")
        made = cls(form, original_length, float(options.get("beta", BETA)), options.get("floor"), options.get("s"))
        made.check_finite()
        return made

    def check_finite(self) -> None:
        """``PatchError`` where a query's factor is not a finite float32 number at some position up to the longest
        context any patch reaches (the original length times the largest factor): the logits would be non-finite.
        Every form is monotone in the position, so the two ends are enough."""
        last = self.original_length * HORIZON
        factors = self(torch.tensor([0, 1, self.original_length, last], dtype=torch.float64))
        if not bool(torch.isfinite(factors).all()):
            params = {"beta": self.beta, "floor": self.floor} if self.form == "llama4" else \
                {"s": self.s} if self.form == "ssmax" else {}
            given = ", ".join(f"{k}={v!r}" for k, v in params.items() if v is not None)
            raise PatchError(f"{OPTION}={self.form}{' with ' + given if given else ''} gives a non-finite attention "
                             f"factor by position {last} (original length {self.original_length} x {HORIZON}): "
                             "every logit there would be non-finite; use smaller parameters")

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        p = positions.to(torch.float64)
        if self.form == "logn":
            factor = (torch.log1p(p) / math.log(self.original_length)).clamp(min=1.0)
        elif self.form == "llama4":
            floor = self.floor or self.original_length
            factor = 1.0 + self.beta * torch.log1p(torch.floor(p / floor))
        else:  # ssmax: s * log(n), n = p + 1 keys
            s = self.s if self.s is not None else 1.0 / math.log(self.original_length)
            factor = s * torch.log1p(p)
        return factor.to(torch.float32)


def compose(first, second):
    """The product of two per-position query factors (either may be None)."""
    if first is None:
        return second
    if second is None:
        return first
    return _Product(first, second)


@dataclass(frozen=True)
class _Product:
    first: Any
    second: Any

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        return self.first(positions).to(torch.float32) * self.second(positions).to(torch.float32)


__all__ = ["FORMS", "KINDS", "OPTION", "OPTIONS", "Temperature", "compose", "split_options", "takes_temperature",
           "validate"]
