"""Attention-side position remapping on rotary models: declarations, checks, apply/restore.

The integration surface for the registry and the rotary adapter:

- ``REMAP_METHODS``: method name -> ``registry.Method`` (summary, options, ``needs_factor=False``), to merge into
  ``registry.METHODS``. Options whose default depends on the factor are declared optional with default None and
  resolved by ``ctxext.methods.remap`` from the original length and the factor.
- ``check_remap(model, method, factor, options, original_length=None)``: raises ``PatchError`` before anything is
  touched (bad options, a model that is not rotary, a rotary variant this cannot rotate, attention features the
  function would drop: soft-capping, sliding windows, sinks, several rotary modules, multimodal rope). A model that
  ships a static scaled rope type (``linear``, ``yarn``, ``llama3``) keeps its rotation: the remapped positions are
  rotated with its shipped frequencies and attention factor.
- ``apply_remap(model, method, factor, options, original_length=None) -> restore``: identity-rotates the rotary
  modules, stashes a ``RemapState`` on every attention module, switches the attention to ``ctxext_remap``;
  ``restore()`` puts everything back bit-exactly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..attention import can_use_attention, use_attention
from ..errors import PatchError
from ..methods import nope
from ..methods.remap import REMAP_METHODS, PositionMap, build_map
from ..remap_attention import REMAP, STATE_ATTR, RemapState
from .base import Restore, run_all
from .rotary_units import RotaryUnit, _saver, rotary_modules, unit_inputs

def _original_length(model: nn.Module, original_length: int | None) -> int:
    if original_length is not None:
        return int(original_length)
    length = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(length, int):
        raise PatchError(f"{type(model).__name__} config has no max_position_embeddings; cannot remap positions")
    return length


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that call the registered attention function: causal self-attention layers (``is_causal`` and
    ``layer_idx`` attributes, as transformers' attention classes have)."""
    return [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "layer_idx")
            and not isinstance(m, nn.ModuleList)]


def _configs(model: nn.Module) -> list:
    from ..attention import _configs as configs

    return configs(model)


def _refuse_features(model: nn.Module, target: int) -> None:
    """Attention features the remap function would silently drop: refuse the model."""
    name = type(model).__name__
    for config in _configs(model):
        cap = getattr(config, "attn_logit_softcapping", None)
        if cap:
            raise PatchError(f"{name} soft-caps attention logits (attn_logit_softcapping={cap}); the position-"
                             "remapping attention does not, so it would change the model: refused")
        window = getattr(config, "sliding_window", None)
        use = getattr(config, "use_sliding_window", True)
        if window and use and window < target:
            raise PatchError(f"{name} uses sliding-window attention (sliding_window={window} < {target} tokens); "
                             "the position-remapping attention attends to all keys: refused")
        layer_types = getattr(config, "layer_types", None) or []
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise PatchError(f"{name} has attention layers of type(s) {', '.join(other)}; the position-remapping "
                             "attention implements full causal attention only: refused")
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and ("mrope_section" in params or "mrope_interleaved" in params):
            raise PatchError(f"{name} uses multimodal rotary positions (mrope); ctxext remaps 1-D positions only")
    for module in attention_modules(model):
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise PatchError(f"{name} has attention sinks ({type(module).__name__}.sinks); the position-remapping "
                             "attention has none: refused")


def check_remap(model: nn.Module, method: str, factor: float | None, options: dict[str, Any],
                original_length: int | None = None) -> PositionMap:
    """Validate a remap patch without touching the model; returns the position map it would apply."""
    if method not in REMAP_METHODS:
        raise PatchError(f"unknown position-remapping method {method!r}; choose one of {', '.join(REMAP_METHODS)}")
    modules = rotary_modules(model)
    if not modules:
        from .rotary_units import rotary_units

        if rotary_units(model):
            raise PatchError(f"{type(model).__name__} has rotary frequencies per layer type; the position-remapping "
                             "attention uses one set: refused")
        raise PatchError(f"method {method!r} remaps rotary positions; {type(model).__name__} has no rotary module")
    length = _original_length(model, original_length)
    options = {k: v for k, v in options.items() if v is not None}
    pmap = build_map(method, length, factor, **options)
    # the rotation the model applies: plain RoPE, or the frequencies and attention factor of a static scaled rope
    # type it ships (PatchError for dynamic / longrope types and unknown variants)
    inputs = [_rotation(name, module, length, method) for name, module in modules]
    frequencies = [i.inv_freq for i in inputs]
    if any(not torch.equal(frequencies[0], f) for f in frequencies[1:]) or \
            len({i.attention_scaling for i in inputs}) > 1:
        raise PatchError(f"{type(model).__name__} has rotary modules with different frequencies (per layer type); "
                         "the position-remapping attention uses one set: refused")
    reason = can_use_attention(model)
    if reason:
        raise PatchError(f"cannot use the position-remapping attention: {reason}")
    if not attention_modules(model):
        raise PatchError(f"{type(model).__name__} has no attention module with is_causal / layer_idx to carry the "
                         "position map")
    target = length if factor is None else int(round(length * factor))
    _refuse_features(model, target)
    _layout(model)
    return pmap


def _layout(model: nn.Module) -> str:
    """How the model pairs its rotated dims ("half" or "interleaved"), which the remap attention follows; a model
    that rotates in a way the probe does not recognise, or only part of a latent head (MLA), is refused."""
    from .rotary_units import rotation_layout

    name = type(model).__name__
    layout = rotation_layout(model)
    if layout not in ("half", "interleaved"):
        raise PatchError(f"{name} applies rotary positions in a way ctxext does not recognise; the position-"
                         "remapping attention rotates halves (rotate_half) or neighbour pairs: refused")
    for config in _configs(model):
        if getattr(config, "qk_rope_head_dim", None):
            raise PatchError(f"{name} uses multi-head latent attention (rotary on qk_rope_head_dim="
                             f"{config.qk_rope_head_dim} of each head); the position-remapping attention does not "
                             "follow it: refused")
    return layout


def apply_remap(model: nn.Module, method: str, factor: float | None, options: dict[str, Any],
                original_length: int | None = None) -> Restore:
    """Apply a remap patch (after ``check_remap`` passed); returns the function restoring the model exactly."""
    pmap = check_remap(model, method, factor, options, original_length)
    length = _original_length(model, original_length)
    undo: list[Restore] = []
    try:
        modules = rotary_modules(model)
        layout = _layout(model)
        shipped = _rotation(*modules[0], length, method)
        inv_freq, scaling = shipped.inv_freq.float().clone(), float(shipped.attention_scaling)
        for name, module in modules:
            undo.append(_saver(module))
            zeros, factor_one = nope.identity_rotation(_rotation(name, module, length, method))
            with torch.no_grad():
                module.inv_freq.copy_(zeros)
            module.attention_scaling = factor_one
        for module in attention_modules(model):
            setattr(module, STATE_ATTR, RemapState(pmap, inv_freq, scaling, layout))
            undo.append(functools.partial(_drop_state, module))
        undo.append(use_attention(model, REMAP))
    except BaseException:
        run_all(undo)
        raise
    return functools.partial(run_all, undo)


def _rotation(name: str, module: nn.Module, length: int, method: str):
    """The frequencies and attention factor the module applies (``unit_inputs``), which the remap keeps."""
    return unit_inputs(RotaryUnit(name, module), length, method)


def _drop_state(module: nn.Module) -> None:
    module.__dict__.pop(STATE_ATTR, None)


def resolved_options(model: nn.Module, method: str, factor: float | None, options: dict[str, Any],
                     original_length: int | None = None) -> dict[str, Any]:
    """The options with the derived defaults filled in (for the patch spec and ``describe``)."""
    length = _original_length(model, original_length)
    return dict(build_map(method, length, factor, **{k: v for k, v in options.items() if v is not None}).options)


__all__ = ["REMAP_METHODS", "apply_remap", "attention_modules", "check_remap", "resolved_options"]
