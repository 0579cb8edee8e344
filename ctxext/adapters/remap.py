"""Attention-side position remapping on rotary models: declarations, checks, apply/restore.

The integration surface for the registry and the rotary adapter:

- ``REMAP_METHODS``: method name -> declaration (``Kind.REMAP``; summary, options, ``needs_factor=False``), declared
  beside the maps in ``ctxext.methods.remap`` and re-exported here. Options whose default depends on the factor are
  declared optional with default None and resolved from the original length and the factor.
- ``check_remap(model, method, factor, options, original_length=None)``: raises ``PatchError`` before anything is
  touched (bad options, a model that is not rotary, a rotary variant this cannot rotate, attention features the
  function would drop: sinks other than one logit per head, sliding windows in every layer or past the trained
  length, several rotary frequency sets, multimodal rope; a model with no layer to remap). A model that ships a
  static scaled rope type (``linear``, ``yarn``, ``llama3``) keeps its rotation: the remapped positions are rotated
  with its shipped frequencies and attention factor, in its layout (halves or neighbour pairs).
- ``apply_remap(model, method, factor, options, original_length=None) -> restore``: identity-rotates the rotary
  modules, stashes a ``RemapState`` on every attention module (the map; the identity map on the sliding-window
  layers of a hybrid model; no rotation on layers the model runs without rotary positions, found by
  ``rotating_layers``), switches the attention to ``ctxext_remap``; ``restore()`` puts everything back bit-exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from ..core.active import pickle_refusal
from ..attention import can_use_attention, key_cache, use_attention
from ..core.errors import PatchError
from ..methods.temperature import compose
from ..methods.remap import REMAP_METHODS, PositionMap, build_map, identity_map, target_length
from ..attention.remap import PROBE, PROBE_ATTR, REMAP, STATE_ATTR, RemapState
from .base import Restore, run_all, undone_on_failure
from .rotary_units import _unit_saver, original_rotation, rotary_units, unit_inputs

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
    from ..attention.features import _configs as configs

    return configs(model)


def _binding_window(config, target: int) -> int | None:
    """The config's sliding window where it binds below ``target`` tokens (None: no window, or one never reached)."""
    window = getattr(config, "sliding_window", None)
    used = getattr(config, "use_sliding_window", True)
    return window if isinstance(window, int) and window and used and window < target else None


def kept_as_trained(model: nn.Module, module: nn.Module, target: int) -> bool:
    """Whether ``module`` is a sliding-window layer of a hybrid model (``layer_types``): its window is within the
    trained length, so it never meets an untrained distance, and the remap leaves it as it is (true positions,
    transformers' sliding mask). Full-attention layers take the position map."""
    config = getattr(module, "config", None) or model.config
    config = getattr(config, "get_text_config", lambda: config)()
    return _binding_window(config, target) is not None and _layer_type(model, module) == "sliding_attention"


def _refuse_features(model: nn.Module, target: int, length: int) -> None:
    """Attention features the remap function would silently drop: refuse the model. Hybrid models keep their
    sliding-window layers as trained (``kept_as_trained``); soft-capped logits (Gemma 2) and per-head sink logits
    (GPT-OSS) reach the function as its ``softcap`` / ``s_aux`` arguments and are applied there."""
    name = type(model).__name__
    for config in _configs(model):
        layer_types = getattr(config, "layer_types", None) or []
        window = _binding_window(config, target)
        if window and "full_attention" not in layer_types:
            raise PatchError(f"{name} uses sliding-window attention (sliding_window={window} < {target} tokens) in "
                             "every layer; the position-remapping attention acts on full-attention layers, so it "
                             "would change nothing: refused")
        if window and window > length:
            raise PatchError(f"{name}'s sliding-window layers see distances up to {window}, past its trained "
                             f"{length}, and the position-remapping attention keeps them as they are: refused")
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and ("mrope_section" in params or "mrope_interleaved" in params):
            raise PatchError(f"{name} uses multimodal rotary positions (mrope); ctxext remaps 1-D positions only")
    for module in attention_modules(model):
        # layers of other types that call the attention function (chunked, indexed / sparse attention) are refused;
        # layers that do not (the linear-attention or state-space layers of Qwen3-Next, Qwen3.5, MiniMax, OLMo
        # hybrid: no positions) never reach it and stay as trained
        kind = _layer_type(model, module)
        if kind not in (None, "full_attention", "sliding_attention"):
            raise PatchError(f"{name} has attention layers of type(s) {kind}; the position-remapping attention "
                             "implements full causal attention only: refused")
        sinks = getattr(module, "sinks", None)  # one logit per head (GPT-OSS's s_aux) is applied, other shapes not
        heads = getattr(module.config, "num_attention_heads", None) if hasattr(module, "config") else None
        if isinstance(sinks, torch.Tensor) and not (sinks.dim() == 1 and sinks.numel() == heads):
            raise PatchError(f"{name} has attention sinks of shape {tuple(sinks.shape)} ({type(module).__name__}."
                             "sinks); the position-remapping attention applies one sink logit per head only: refused")


def _refuse_shipped_dual_chunk(model: nn.Module, method: str, options: dict[str, Any]) -> None:
    """Qwen2.5-1M ships its Dual Chunk Attention settings as ``dual_chunk_attention_config`` (``chunk_size``,
    ``local_size``, read by vLLM; transformers ignores them). They follow the reference implementation's
    parametrisation (ChunkLlama / vLLM: chunks of ``chunk_size - local_size`` tokens, positions bounded by
    ``chunk_size``), which ctxext's ``dca`` (the paper's equations, ``ctxext.methods.remap.dca``) does not reproduce
    exactly, and its defaults would not read them: ``dca`` without its own options is refused on such a model, with
    the shipped values, so it never silently differs from what the model ships."""
    if method != "dca" or options.get("chunk_size") is not None or options.get("local_window") is not None:
        return
    shipped = next((getattr(c, "dual_chunk_attention_config", None) for c in _configs(model)
                    if getattr(c, "dual_chunk_attention_config", None)), None)
    if not shipped:
        return
    values = ", ".join(f"{k}={v}" for k, v in dict(shipped).items()) if isinstance(shipped, dict) else repr(shipped)
    raise PatchError(
        f"{type(model).__name__} ships Dual Chunk Attention settings (dual_chunk_attention_config: {values}) in the "
        "parametrisation of the reference code that vLLM serves it with, which ctxext's dca (the paper's Eqs. 2-8: "
        "chunk_size s, local_window w, inter-chunk query at the trained length - 1) does not reproduce exactly; "
        "refused rather than silently differ. Pass chunk_size (and local_window) to run ctxext's dca anyway")


def check_remap(model: nn.Module, method: str, factor: float | None, options: dict[str, Any],
                original_length: int | None = None) -> PositionMap:
    """Validate a remap patch without touching the model; returns the position map it would apply."""
    return _checked(model, method, factor, options, original_length)[0]


def _checked(model: nn.Module, method: str, factor: float | None, options: dict[str, Any],
             original_length: int | None) -> tuple[PositionMap, set[int]]:
    """``check_remap``'s checks; also returns ``rotating_layers`` (the probe runs once per patch)."""
    if method not in REMAP_METHODS:
        raise PatchError(f"unknown position-remapping method {method!r}; choose one of {', '.join(REMAP_METHODS)}")
    length = _original_length(model, original_length)
    options = {k: v for k, v in options.items() if v is not None}
    _refuse_shipped_dual_chunk(model, method, options)
    pmap = build_map(method, length, factor, **options)
    attention = attention_modules(model)
    rotation_of = _rotations(model, length, method)
    for module in attention:
        rotation_of(module)  # every attention layer has its frequency set
    reason = can_use_attention(model)
    if reason:
        raise PatchError(f"cannot use the position-remapping attention: {reason}")
    if not attention:
        raise PatchError(f"{type(model).__name__} has no attention module with is_causal / layer_idx to carry the "
                         "position map")
    target = target_length(length, factor)
    _refuse_features(model, target, length)
    _layout(model)
    _rotary_start(model, 2 * rotation_of(attention[0]).inv_freq.numel())
    rotating = rotating_layers(model, attention)
    if not any(id(m) in rotating and not kept_as_trained(model, m, target) for m in attention):
        raise PatchError(f"{type(model).__name__}: no attention layer both rotates its keys and attends beyond a "
                         "sliding window within the trained length (its rotary layers are all windowed, or carry "
                         "no rotary positions), so the position-remapping attention has nothing to remap: refused")
    return pmap, rotating


def _layer_type(model: nn.Module, module: nn.Module) -> str | None:
    """The ``config.layer_types`` entry of an attention module (None where the config has none)."""
    config = getattr(module, "config", None) or model.config
    config = getattr(config, "get_text_config", lambda: config)()
    layer_types = getattr(config, "layer_types", None) or []
    index = getattr(module, "layer_idx", None)
    return layer_types[index] if isinstance(index, int) and index < len(layer_types) else None


def _rotations(model: nn.Module, length: int, method: str):
    """The function giving each attention module the rotation it applies (``unit_inputs``: plain RoPE, or a static
    scaled rope type's frequencies and attention factor): the one set of the model's rotary modules, or, where one
    module keeps a set per layer type (Gemma 3, OLMo 3 in transformers 5.x), the set of the module's layer type.
    PatchError for dynamic / longrope types, unknown variants, plain modules that disagree, a layer without a set."""
    name = type(model).__name__
    units = rotary_units(model)
    if not units:
        raise PatchError(f"method {method!r} remaps rotary positions; {name} has no rotary module")
    typed = {u.layer_type: unit_inputs(u, length, method) for u in units if u.layer_type}
    plain = [unit_inputs(u, length, method) for u in units if not u.layer_type]
    if plain and typed or len({id(u.module) for u in units if u.layer_type}) > 1:
        raise PatchError(f"{name} has rotary modules of several kinds; the position-remapping attention follows one "
                         "module (one set, or one set per layer type): refused")
    if plain:
        if any(not torch.equal(plain[0].inv_freq, i.inv_freq) or i.attention_scaling != plain[0].attention_scaling
               for i in plain[1:]):
            raise PatchError(f"{name} has rotary modules with different frequencies (per layer type); the position-"
                             "remapping attention cannot tell which layer uses which: refused")
        return lambda module: plain[0]

    def of_layer(module: nn.Module):
        kind = _layer_type(model, module)
        if kind not in typed:
            raise PatchError(f"{name}: attention layer {getattr(module, 'layer_idx', '?')} (layer type {kind!r}) has "
                             f"no rotary frequency set of its own (sets: {', '.join(sorted(typed))}): refused")
        return typed[kind]

    return of_layer


def _layout(model: nn.Module) -> str:
    """How the model pairs its rotated dims ("half" or "interleaved"), which the remap attention follows; a model
    that rotates in a way the probe does not recognise is refused."""
    from .rotary_units import rotation_layout

    name = type(model).__name__
    layout = rotation_layout(model)
    if layout not in ("half", "interleaved"):
        raise PatchError(f"{name} applies rotary positions in a way ctxext does not recognise; the position-"
                         "remapping attention rotates halves (rotate_half) or neighbour pairs: refused")
    return layout


def _rotary_start(model: nn.Module, rotary_dims: int) -> int:
    """The first rotated dim of each query / key head: 0 (a rotary part first, if partial), or, with multi-head
    latent attention (DeepSeek V3 and relatives: ``qk_rope_head_dim``), after its ``qk_nope_head_dim`` dims without
    positions, as its attention concatenates [no-position part, rotary part]."""
    for config in _configs(model):
        rope = getattr(config, "qk_rope_head_dim", None)
        if rope:
            if rope != rotary_dims:
                raise PatchError(f"{type(model).__name__}: qk_rope_head_dim={rope} but its rotary module turns "
                                 f"{rotary_dims} dims; ctxext does not know this layout: refused")
            return int(getattr(config, "qk_nope_head_dim", 0) or 0)
    return 0


def apply_remap(model: nn.Module, method: str, factor: float | None, options: dict[str, Any],
                original_length: int | None = None, temperature=None) -> Restore:
    """Apply a remap patch (after ``check_remap`` passed); returns the function restoring the model exactly.
    ``temperature``: per-position query factors (``ctxext.methods.temperature.Temperature``) multiplied into every
    layer's map, the layers kept as trained and those without rotary positions included."""
    pmap, rotating = _checked(model, method, factor, options, original_length)  # probed before the rotation is off
    length = _original_length(model, original_length)
    attention = attention_modules(model)
    target = target_length(length, factor)
    with undone_on_failure() as undo:
        layout = _layout(model)
        rotation_of = _rotations(model, length, method)
        # copied before the rotation is switched off below (4.x modules alias original_inv_freq to inv_freq)
        states = {id(m): (r.inv_freq.float().clone(), float(r.attention_scaling))
                  for m, r in ((m, rotation_of(m)) for m in attention)}
        for unit in rotary_units(model):
            undo.append(_unit_saver(unit))
            with torch.no_grad():
                unit.inv_freq.zero_()  # identity rotation: the remap attention rotates q and k itself
            unit.attention_scaling = 1.0
        start = _rotary_start(model, 2 * states[id(attention[0])][0].numel())
        # the caches this patch fills are marked with it: continued under another patch (or none) they are refused
        note_cache = functools.partial(key_cache.note_cache, patch=_cache_patch(method, factor, pmap, length,
                                                                                 temperature))
        for module in attention:
            kept = identity_map(method, pmap.options) if kept_as_trained(model, module, target) else pmap
            inv_freq, scaling = states[id(module)]
            if id(module) in rotating:
                state = _LiveRemapState(kept, inv_freq, scaling, layout, start)
            else:  # a layer without rotary positions: the map's mask only (no rotation, no query scaling)
                state = _LiveRemapState(dataclasses.replace(kept, query_scale=None), torch.zeros_like(inv_freq), 1.0,
                                        layout, start)
            if temperature is not None:
                state.map = dataclasses.replace(state.map, query_scale=compose(state.map.query_scale, temperature))
            setattr(module, STATE_ATTR, state)
            undo.append(functools.partial(_drop_state, module))
            # sees the KV cache before the module appends to it: whether kept rotated keys may be extended
            undo.append(module.register_forward_pre_hook(note_cache, with_kwargs=True).remove)
        undo.append(use_attention(model, REMAP))
    return functools.partial(run_all, undo)


def _cache_patch(method: str, factor, pmap: PositionMap, length: int, temperature) -> key_cache.CachePatch:
    """What decides the keys this patch caches (the map's method and options, the factor, the trained length, a
    temperature), and its name for messages, e.g. "self-extend x4 (group=4, window=16)"."""
    options = tuple(sorted(pmap.options.items()))
    shown = ", ".join(f"{k}={v}" for k, v in options)
    label = f"{method} x{factor:g} ({shown})" if isinstance(factor, (int, float)) else f"{method} ({shown})"
    if temperature is not None:
        label += f" with temperature {temperature.form}"
    return key_cache.CachePatch((method, factor, options, length, temperature), label)


def rotating_layers(model: nn.Module, modules: list[nn.Module]) -> set[int]:
    """``id`` of every attention module whose keys carry rotary positions. Some models skip the rotation in some
    layers (SmolLM3's ``no_rope_layers``, EXAONE 4's full-attention layers when it has sliding ones), so the remap
    attention must not rotate there: it would add positions the model never had.

    Probed, not read from names: two short passes whose position ids differ by a constant. Rotary attention is
    unchanged by the shift (it sees relative positions), so the hidden states entering every layer are the same
    up to rounding; the keys a layer hands to attention then differ only where the layer rotated them. A model
    whose weights are not loaded (meta) cannot be probed: every layer counts as rotating there."""
    from ..core.active import PATCH_LOCK

    if not modules or any(p.is_meta for p in model.parameters()):
        return {id(m) for m in modules}
    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 0) or 0) or 2
    ids = (torch.arange(6, device=device) * 7 + 3).remainder(vocab)[None]
    positions = torch.arange(6, device=device)[None]
    # the probe switches the model's attention for a moment: a patch in another thread must not start or end inside it
    with PATCH_LOCK:
        restore, was_training = use_attention(model, PROBE), model.training
        model.eval()
        try:
            # as the model rotates unpatched (a replace probes a patched one)
            with torch.no_grad(), original_rotation(model):
                for shift in (0, 37):
                    model(input_ids=ids, position_ids=positions + shift, use_cache=False)
            keys = {id(m): vars(m).pop(PROBE_ATTR, []) for m in modules}
        except Exception:  # noqa: BLE001 - a forward this probe cannot make: every layer rotates, as before the probe
            return {id(m) for m in modules}
        finally:
            for m in modules:
                vars(m).pop(PROBE_ATTR, None)
            model.train(was_training)
            restore()
    rotating = set()
    for ident, calls in keys.items():
        half = len(calls) // 2  # the calls of the first pass, then those of the second
        first, second = calls[:half], calls[half:]
        same_shapes = len(first) == len(second) and all(a.shape == b.shape for a, b in zip(first, second))
        if not same_shapes or not first or any(  # not comparable: counted as rotating, as before the probe
                torch.linalg.vector_norm(a - b) > 0.1 * torch.linalg.vector_norm(a) for a, b in zip(first, second)):
            rotating.add(ident)
    return rotating


class _LiveRemapState(RemapState):
    """The ``RemapState`` a patch stashes on an attention module. A deep copy of the model copies it (the map's
    functions shared: they hold only numbers); a pickle of the model raises the ``PatchError`` that says how to save
    a patched model (the map's functions are local ones, which a pickle cannot carry)."""

    def __deepcopy__(self, memo: dict) -> _LiveRemapState:
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __reduce_ex__(self, protocol):
        raise pickle_refusal()


def _drop_state(module: nn.Module) -> None:
    module.__dict__.pop(STATE_ATTR, None)
    key_cache.drop(module)  # the kept rotated keys go with the patch


def resolved_options(model: nn.Module, method: str, factor: float | None, options: dict[str, Any],
                     original_length: int | None = None) -> dict[str, Any]:
    """The options with the derived defaults filled in (for the patch spec and ``describe``)."""
    length = _original_length(model, original_length)
    return dict(build_map(method, length, factor, **{k: v for k, v in options.items() if v is not None}).options)


__all__ = ["REMAP_METHODS", "apply_remap", "attention_modules", "check_remap", "resolved_options"]
