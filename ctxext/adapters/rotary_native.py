"""The rotary family's native form: a patch written as the rope settings transformers reads (5.x
``rope_parameters``, 4.x ``rope_scaling`` + ``rope_theta``), so a plain ``from_pretrained`` builds the same model.

What a method's native form is comes from its declaration (``Method.native``: a rope type with the options it
carries, or a new rope_theta); a longer length alone writes only the new ``max_position_embeddings``. On a model that
ships scaled RoPE the method composes on it (``_composed_updates``). Every candidate is *verified* before it is
written: transformers' own rotary class is built from the native config (the exact path a plain ``from_pretrained``
takes) and its frequencies and attention scale must equal the patched model's to float32 rounding (``RTOL``);
per-sequence methods are compared at several sequence lengths. So the config form this transformers reads is found
by what works, not by version, and a form that would differ is never written.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from ..core.errors import PatchError
from ..core.native_form import NativeForm, NoNativeForm, no_form_reason
from ..core.spec import CONFIG_KEY, PatchSpec
from ..methods.declaration import Kind, Method
from ..methods.registry import METHODS
from ..methods.temperature import OPTION as TEMPERATURE
from .rotary_compose import LONGROPE
from .rotary_units import RotaryUnit, long_frequencies, rotary_modules, unit_inputs

#: Relative tolerance between the patched model's rotary frequencies / attention scale and those transformers
#: computes from the native config: float32 rounding (a few units in the last place), nothing more.
RTOL = 1e-6


def _rope_fields(method: Method, spec: PatchSpec) -> dict[str, Any]:
    """The native rope-type fields for the spec (without rope_theta and the other plain-RoPE fields), as the
    method's ``NativeRope`` lists them."""
    native = method.native
    out: dict[str, Any] = {"rope_type": native.rope_type, "factor": float(spec.factor)}
    if native.names_original_length:
        out["original_max_position_embeddings"] = spec.original_length
    for key in native.options:
        default = method.options[key].default
        value = spec.options.get(key, default)
        if value is None:
            continue
        if isinstance(value, bool):
            if value != default:  # a flag at its default is left out: releases without the key read it alike
                out[key] = value
        else:
            out[key] = float(value)
    return out


def _composed_updates(method: Method, spec: PatchSpec, preset: str, rope: dict[str, Any], base: float, dim: int,
                      attention_scaling: float) -> dict[str, Any]:
    """The changes to a shipped scaled rope type's settings (``rope``) that compute ``spec`` composed on it, where
    transformers has such a form (each is still verified): interpolation (``pi``) on its own native type (``linear``)
    x a is that type x (a * f); a change of base (``ntk``) is the same rope type with rope_theta = base *
    f^(d/(d-2)) (exact for ``linear``; for the others verification decides); interpolation on ``longrope``
    multiplies the long factors by f; a longer length alone (``extrapolate``) keeps the settings. A ``longrope``
    form writes its attention factor explicitly (transformers would otherwise derive it from the new advertised
    length)."""
    f = float(spec.factor)
    native = method.native
    updates: dict[str, Any] = {}
    if (method.interpolates and native is not None and preset == native.rope_type
            and isinstance(rope.get("factor"), (int, float))):
        updates["factor"] = float(rope["factor"]) * f
    elif method.interpolates and preset == LONGROPE and isinstance(rope.get("long_factor"), (list, tuple)):
        updates["long_factor"] = [float(x) * f for x in rope["long_factor"]]
    elif native is not None and native.theta is not None:
        updates["rope_theta"] = native.theta(base, f, dim)
    elif method.kind is not Kind.LENGTH:
        raise NoNativeForm(f"{method.name} x{f:g} composed on the shipped rope type {preset!r} has no "
                           "transformers-native form (no transformers rope type computes it)")
    if preset == LONGROPE:
        updates["attention_factor"] = float(attention_scaling)
    return updates


def _rotary_candidates(config: Any, spec: PatchSpec, base: float, dim: int, preset: str = "default",
                       attention_scaling: float = 1.0, title: str = "") -> list[dict[str, Any]]:
    """Native config changes for ``spec``, one per RoPE config API the config may have (5.x ``rope_parameters``,
    4.x ``rope_scaling`` + ``rope_theta`` / ``rotary_emb_base``); each is verified before use. ``preset``: the rope
    type the model ships (a method composed on a scaled one, see ``_composed_updates``)."""
    method = METHODS[spec.method]
    native = method.native
    if native is None and method.kind is not Kind.LENGTH:  # NoPE, the ALiBi swap, the remap methods
        raise NoNativeForm(no_form_reason(spec.method, title))
    if preset != "default":
        candidates = []
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and params.get("rope_type") == preset:
            rope = {**params, **_composed_updates(method, spec, preset, params, base, dim, attention_scaling)}
            candidates.append({"rope_parameters": rope, "max_position_embeddings": spec.patched_length})
        scaling = getattr(config, "rope_scaling", None)
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == preset:
            updates = _composed_updates(method, spec, preset, scaling, base, dim, attention_scaling)
            theta = updates.pop("rope_theta", None)
            changes = {"rope_scaling": {**scaling, **updates}, "max_position_embeddings": spec.patched_length}
            if theta is not None:
                for key in ("rope_theta", "rotary_emb_base"):
                    if isinstance(getattr(config, key, None), (int, float)):
                        changes[key] = theta
            candidates.append(changes)
        return candidates
    length = spec.original_length if native is not None and native.keeps_original_length else spec.patched_length
    new_base = native.theta(base, spec.factor, dim) if native is not None and native.theta is not None else None
    rope_type = native.rope_type if native is not None else None
    candidates = []
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" in params:  # 5.x: one dict, rope_theta inside
        rope = dict(params)
        if rope_type:
            rope.update(_rope_fields(method, spec))
        elif new_base is not None:
            rope["rope_theta"] = new_base
        candidates.append({"rope_parameters": rope, "max_position_embeddings": length})
    if hasattr(config, "rope_scaling"):  # 4.x: rope_scaling (None for plain RoPE) + rope_theta / rotary_emb_base
        changes: dict[str, Any] = {"max_position_embeddings": length}
        scaling = getattr(config, "rope_scaling", None)
        if rope_type:
            changes["rope_scaling"] = {**(scaling or {}), **_rope_fields(method, spec)}
        if new_base is not None:
            for key in ("rope_theta", "rotary_emb_base"):
                if isinstance(getattr(config, key, None), (int, float)):
                    changes[key] = new_base
        candidates.append(changes)
    return candidates


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return a.shape == b.shape and bool(torch.all((a - b).abs() <= RTOL * b.abs()))


def _native_rotary(module: nn.Module, config: Any):
    """transformers' rotary class of ``module`` built from ``config``, as a plain load builds it."""
    import warnings

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(module)(config=config)
    finally:
        hf_logging.set_verbosity(verbosity)


def _config_with(config: Any, changes: dict[str, Any]):
    """A config of the same class, from the live one's dict with ``changes`` (what a plain load of the native
    ``config.json`` reads), through transformers' own ``from_dict`` (its validation and standardisation)."""
    import warnings

    from transformers.utils import logging as hf_logging

    data = config.to_dict()
    data.pop(CONFIG_KEY, None)
    data.update(copy.deepcopy(changes))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(config).from_dict(data)
    finally:
        hf_logging.set_verbosity(verbosity)


def _verify_rotary(model: nn.Module, spec: PatchSpec, changes: dict[str, Any], preset: str = "default") -> str | None:
    """None where transformers' rotary modules built from the native config equal the patched ones; else why not.
    A ``longrope`` module is compared on both its sets (short: ``original_inv_freq``; long: ``long_inv_freq``)."""
    try:
        config = _config_with(model.config, changes)
    except Exception as exc:  # noqa: BLE001 - transformers refuses the candidate config
        return f"transformers refuses the native config ({type(exc).__name__}: {exc})"
    method = METHODS[spec.method]
    native_type = method.native.rope_type if method.native is not None else None
    expected_type = (native_type or "default") if preset == "default" else preset
    for name, module in rotary_modules(model):
        try:
            native = _native_rotary(module, config)
        except Exception as exc:  # noqa: BLE001
            return f"transformers cannot build {type(module).__name__} from the native config ({exc})"
        if native.rope_type != expected_type:
            return f"transformers reads rope type {native.rope_type!r} from it, not {expected_type!r}"
        if preset == LONGROPE:
            try:
                native_long = long_frequencies(RotaryUnit(name, native))
            except PatchError as exc:
                return str(exc)
            patched_long = getattr(module, "long_inv_freq", None)
            if patched_long is None:
                patched_long = long_frequencies(RotaryUnit(name, module))
            if not _close(native.original_inv_freq, module.original_inv_freq) or not _close(native_long, patched_long):
                return f"its short or long frequencies differ from the patched ones in {name or 'the rotary module'}"
            if not math.isclose(native.attention_scaling, module.attention_scaling, rel_tol=RTOL, abs_tol=0):
                return (f"its attention scale {native.attention_scaling} differs from the patched "
                        f"{module.attention_scaling}")
            continue
        if not method.per_sequence:
            if not _close(native.inv_freq, module.inv_freq):
                return f"its rotary frequencies differ from the patched ones in {name or 'the rotary module'}"
            if not math.isclose(native.attention_scaling, module.attention_scaling, rel_tol=RTOL, abs_tol=0):
                return (f"its attention scale {native.attention_scaling} differs from the patched "
                        f"{module.attention_scaling}")
            continue
        inputs = unit_inputs(RotaryUnit(name, module), spec.original_length, spec.method)
        x = torch.zeros(1, 1, 1, dtype=torch.float32, device=module.inv_freq.device)
        lengths = sorted({spec.original_length, spec.original_length + 1, 2 * spec.original_length,
                          spec.patched_length, 2 * spec.patched_length + 3})
        for length in lengths:  # increasing: transformers' dynamic type only grows between resets
            native(x, torch.tensor([[length - 1]], device=x.device))
            ours, _ = method.frequencies(inputs, spec.factor, length, **spec.options)
            if not _close(native.inv_freq, ours) or native.attention_scaling != 1.0:
                return f"transformers' dynamic frequencies differ from ctxext's at length {length}"
    return None


#: The key transformers' Ministral 3 (and Mistral 4) attention reads its llama4 temperature from, in rope_parameters,
#: with ``original_max_position_embeddings`` as the floor: the one native form an attention temperature has.
LLAMA4_BETA = "llama_4_scaling_beta"


def _llama4_scale_function(model: nn.Module):
    """transformers' llama4 temperature function where this model's attention reads ``llama_4_scaling_beta``: the
    modeling module of the model's class defines it (``get_llama_4_attn_scale``; ``_get_llama_4_attn_scale`` in
    transformers 5.0) and the config carries the key. Else None."""
    import sys

    module = sys.modules.get(type(model).__module__)
    params = getattr(model.config, "rope_parameters", None)
    if not isinstance(params, dict) or LLAMA4_BETA not in params:
        return None
    return getattr(module, "get_llama_4_attn_scale", None) or getattr(module, "_get_llama_4_attn_scale", None)


def _llama4_temperature_function(model: nn.Module, spec: PatchSpec):
    """transformers' function for the patch's temperature on this model, or NoNativeForm saying why it has none."""
    form = spec.options[TEMPERATURE]
    scale = _llama4_scale_function(model)
    if form != "llama4" or scale is None:
        raise NoNativeForm(f"{TEMPERATURE}={form} (an attention temperature) has no transformers-native form here: "
                           f"transformers writes one only as {LLAMA4_BETA} (temperature=llama4) on models whose "
                           "attention reads it (Ministral 3)")
    shipped = model.config.rope_parameters.get(LLAMA4_BETA) or 0.0
    if shipped:
        raise NoNativeForm(f"the model ships {LLAMA4_BETA}={shipped:g}; the temperature given multiplies it, which "
                           "no single beta writes")
    return scale


def _temperature_changes(model: nn.Module, spec: PatchSpec, changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` with the patch's attention temperature written natively, where transformers has the form:
    ``temperature=llama4`` on a model that reads ``llama_4_scaling_beta``, shipped with beta 0 (a shipped temperature
    multiplies ctxext's, which no single beta writes), floored at the native ``original_max_position_embeddings``.
    The beta written is verified: transformers' own function of it equals the patch's factors at every position up to
    8x the floor. NoNativeForm says why not."""
    from ..methods.temperature import Temperature

    scale = _llama4_temperature_function(model, spec)
    if not isinstance(changes.get("rope_parameters"), dict):
        raise NoNativeForm(f"{LLAMA4_BETA} is read from rope_parameters, which this config form has not")
    rope = dict(changes["rope_parameters"])
    floor = rope.get("original_max_position_embeddings")
    temperature = Temperature.from_options(spec.options, spec.original_length)
    if floor != (temperature.floor or temperature.original_length):
        raise NoNativeForm(f"{TEMPERATURE}=llama4 with floor {temperature.floor or temperature.original_length}: "
                           f"transformers floors {LLAMA4_BETA} at original_max_position_embeddings ({floor})")
    positions = torch.arange(8 * int(floor)).unsqueeze(0)
    theirs = scale(positions, temperature.beta, floor).reshape(-1)
    if not _close(theirs, temperature(positions).reshape(-1)):
        raise NoNativeForm(f"transformers' {LLAMA4_BETA} temperature differs from the patch's")
    rope[LLAMA4_BETA] = temperature.beta
    return {**changes, "rope_parameters": rope}


def native_form(model: nn.Module, spec: PatchSpec, title: str) -> NativeForm:
    """The verified native form of ``spec`` on the patched rotary ``model`` (``title``: its family, for the
    reason where the method has none); NoNativeForm says why there is none."""
    if spec.options.get(TEMPERATURE):
        _llama4_temperature_function(model, spec)  # refused before any candidate is built
    modules = rotary_modules(model)
    if not modules or any(getattr(m, "config", None) is not model.config for _, m in modules):
        raise NoNativeForm("the rotary modules do not read the model's own config (a nested text config); "
                           "ctxext writes native forms for top-level configs only")
    try:
        inputs = unit_inputs(RotaryUnit(*modules[0]), spec.original_length, spec.method)
    except PatchError as exc:
        raise NoNativeForm(str(exc)) from exc
    reasons = []
    # a longrope form writes the patched attention factor (pi / ntk / extrapolate keep the shipped one)
    theta_changes = METHODS[spec.method].native is not None and METHODS[spec.method].native.theta is not None
    for changes in _rotary_candidates(model.config, spec, inputs.base, inputs.dim, inputs.preset,
                                      modules[0][1].attention_scaling, title):
        problem = _verify_rotary(model, spec, changes, inputs.preset)
        if problem is None and spec.options.get(TEMPERATURE):
            try:
                changes = _temperature_changes(model, spec, changes)
            except NoNativeForm as exc:
                problem = str(exc)
        if problem is None:
            rope = changes.get("rope_parameters") or changes.get("rope_scaling") or {}
            what = f"rope type {rope.get('rope_type', 'default')!r}"
            if theta_changes:
                theta = changes.get("rope_parameters", changes)
                what += f", rope_theta {theta.get('rope_theta', changes.get('rotary_emb_base'))}"
            if spec.options.get(TEMPERATURE):
                what += f", {LLAMA4_BETA} {changes['rope_parameters'][LLAMA4_BETA]:g}"
            return NativeForm(changes, summary=f"{what}, max_position_embeddings {changes['max_position_embeddings']}")
        reasons.append(problem)
    raise NoNativeForm(f"{spec.method} x{spec.factor:g} has no exact native form on this model: "
                       + ("; ".join(reasons) or "its config has no RoPE settings transformers reads"))
