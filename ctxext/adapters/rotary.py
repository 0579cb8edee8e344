"""Rotary (LLaMA-family) adapter.

Acts on the rotary-embedding modules of transformers 5.x (Llama, Mistral, Qwen2, GPT-NeoX, ...): any module
with ``inv_freq`` / ``original_inv_freq`` buffers, an ``attention_scaling`` float and a string ``rope_type``.
Those modules compute cos/sin as ``position * inv_freq`` scaled by ``attention_scaling``, so a static method
only rewrites ``inv_freq`` in place and sets ``attention_scaling``: the attention path (sdpa, flash) is untouched.

Models that ship scaled RoPE (rope types ``linear``, ``yarn``, ``llama3``, ``longrope``: Llama 3.1-3.3, Qwen2.5 with
its YaRN config, Phi-3 ...): the frequency methods and a longer length alone compose on the frequencies the module
uses (``ctxext.adapters.rotary_compose``), with the advertised ``max_position_embeddings`` as the original length
(``unit_inputs``); the attention factor is the shipped one times the method's. ``longrope`` switches between a short
and a long set by sequence length in every forward; the method rewrites the long set (``long_inv_freq``) and the
switch stays. The methods that replace the rotation (NoPE, the ALiBi swap) or remap its positions (the
attention-remap methods) keep the model's own rotation on the static types (``linear``, ``yarn``, ``llama3``): its
frequencies and attention factor. ``dynamic`` rope types recompute ``inv_freq`` in every forward and are refused, as
are those methods on ``longrope``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import require_attention, use_attention
from ..attention.temperature import check_temperature, use_temperature
from ..core.errors import PatchError
from ..core.spec import PatchSpec
from ..core.undo import set_on_instance
from ..methods import nope, rope
from ..methods.declaration import Kind, Method
from ..methods.registry import METHODS
from ..methods.temperature import Temperature, split_options
from . import rotary_native
from .base import WRAPPED_NAMES, Adapter, Restore, declaration, run_all, undone_on_failure
from .rotary_units import RotaryUnit, _unit_saver, rotary_units, unit_inputs, unread_surface


def static_rule(method: Method) -> Callable | None:
    """How a rotary module carries ``method`` when its frequencies are fixed for every sequence:
    ``(RopeInputs, factor, **options) -> (inv_freq, attention_factor)``; None for per-sequence and remap methods.
    A frequency method brings its own function; a longer length alone keeps the frequencies; NoPE and the ALiBi swap
    disable rotary by an identity rotation (inv_freq = 0): the module and the attention kernel stay, and ALiBi adds
    its bias in the ``ctxext_alibi`` attention function."""
    if method.kind is Kind.FREQUENCY:
        return None if method.per_sequence else method.frequencies
    return {Kind.LENGTH: rope.identity, Kind.NONE: nope.identity_rotation,
            Kind.BIAS: nope.identity_rotation}.get(method.kind)


#: Static methods: spec.method -> function(RopeInputs, factor, **options) -> (inv_freq, attention_factor), for the
#: methods registered at import (``rule_of`` derives one for a method registered later).
STATIC_METHODS: dict[str, Callable] = {
    name: rule for name, rule in ((m.name, static_rule(m)) for m in METHODS.values()) if rule is not None
}


def rule_of(method: Method) -> Callable | None:
    """The static rule of ``method``: the table's entry (which a test may replace), else derived from its kind."""
    return STATIC_METHODS.get(method.name) or static_rule(method)


@dataclass
class SequenceScale:
    """The dynamic-NTK state one patched model's rotary modules share."""

    length_hint: int | None = None  # the planned total length (generate, ``ctxext.dynamic_length``)
    length: int | None = None  # the length the current sequence's scale was fixed from
    # None: no forward pass of the patched model in progress (every rotary call applies the rule); "start": one
    # has begun and its first rotary call decides; "locked": that call has decided
    pass_state: str | None = None


class DynamicNTKHook:
    """Forward pre-hook on a rotary module that sets dynamic-NTK frequencies for the current sequence.

    Cache semantics: the scale is fixed per sequence. A forward pass whose positions start at 0 (a full pass or
    the prefill of a cached decode) fixes it from the sequence length, or from ``length_hint`` when that is
    longer (``generate`` sets it to prompt + new tokens). Later passes that continue the sequence (positions not
    starting at 0) keep that scale, so cached keys and new queries are always rotated alike. A batch shares one
    scale, from its longest row.

    Within one forward pass of the patched model only its first rotary call decides, for every rotary module of
    the model (they share one ``SequenceScale``): some models also rotate compressed entries at positions of their
    own (DeepSeek-V4's compressors: 0, r, 2r, ..., with rotary modules of their own), which must not set another
    scale mid-pass (``_mark_model_passes`` tells the hooks where a pass of the model starts and ends).
    """

    def __init__(self, targets: list[tuple[RotaryUnit, rope.RopeInputs]], factor: float,
                 sequence: SequenceScale | None = None, frequencies: Callable = rope.dynamic_ntk_scale,
                 options: dict | None = None):
        self.targets = targets  # the module's frequency sets (one, or one per layer type) and their inputs
        self.inputs = targets[0][1]
        self.factor = factor
        self.frequencies = frequencies  # (RopeInputs, factor, seq_len, **options) -> (inv_freq, attention_factor)
        self.options = dict(options or {})
        self.sequence = sequence or SequenceScale()
        self._applied: int | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if position_ids is None:
            return None
        start = int(position_ids.min())
        end = int(position_ids.max()) + 1
        seq = self.sequence
        decides = seq.pass_state != "locked"
        if seq.pass_state == "start":
            seq.pass_state = "locked"
        if decides and (start == 0 or seq.length is None):
            seq.length = max(end, seq.length_hint or 0)
        target = max(seq.length, self.inputs.original_length)
        if target != self._applied:
            for unit, inputs in self.targets:
                inv_freq, _ = self.frequencies(inputs, self.factor, target, **self.options)
                unit.inv_freq.copy_(inv_freq)
            self._applied = target
        return None


def dynamic_hooks(model: nn.Module) -> list[DynamicNTKHook]:
    return [m._ctxext_dynamic for m in model.modules() if isinstance(getattr(m, "_ctxext_dynamic", None), DynamicNTKHook)]


def planned_generate_length(model: nn.Module, args: tuple, kwargs: dict) -> int | None:
    """Prompt length plus the tokens ``generate`` may add, as transformers' generate decides it."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
        prompt = inputs.shape[1] if inputs is not None else 0
    else:
        prompt = inputs.shape[-1]
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    max_new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if max_new is not None:
        return prompt + int(max_new)
    max_length = kwargs.get("max_length", getattr(config, "max_length", None))
    return max(prompt, int(max_length)) if max_length is not None else prompt


class _PassMarks:
    """Forward hooks on the model marking where each of its forward passes starts and ends (see ``DynamicNTKHook``).
    Bound methods of an object, not closures: a deep copy of the model gets hooks that mark its own sequence."""

    def __init__(self, sequence: SequenceScale):
        self.sequence = sequence

    def started(self, module, args):
        self.sequence.pass_state = "start"

    def ended(self, module, args, output):
        self.sequence.pass_state = None


def _mark_model_passes(model: nn.Module, sequence: SequenceScale) -> Restore:
    """Tell the dynamic hooks where each forward pass of ``model`` starts and ends (see ``DynamicNTKHook``)."""
    marks = _PassMarks(sequence)
    handles = [model.register_forward_pre_hook(marks.started),
               model.register_forward_hook(marks.ended, always_call=True)]
    return lambda: [handle.remove() for handle in handles]


def _plan_length(model: nn.Module, length: int | None) -> Restore | None:
    """Set the planned total length of the model's dynamic-NTK sequence (shared by its hooks); None if it has none."""
    hooks = dynamic_hooks(model)
    if not hooks:
        return None
    sequence = hooks[0].sequence
    previous, sequence.length_hint = sequence.length_hint, length

    def forget():  # back to the enclosing plan (a generate or dynamic_length around this one), not to none
        sequence.length_hint = previous

    return forget


class _PlannedGenerate:
    """Stands in for ``model.generate`` while dynamic-NTK patched: plans the sequence's total length (prompt + new
    tokens) for the model's dynamic hooks, then runs the original. An object holding the model and the original
    bound method, not a closure, so that a deep copy of the model plans and generates with itself (and it pickles)."""

    def __init__(self, model: nn.Module, original):
        self.model = model
        self.original = original
        functools.update_wrapper(self, original, assigned=WRAPPED_NAMES, updated=())

    def __call__(self, *args, **kwargs):
        forget = _plan_length(self.model, planned_generate_length(self.model, args, kwargs))
        try:
            return self.original(*args, **kwargs)
        finally:
            if forget is not None:
                forget()


def _wrap_generate(model: nn.Module) -> Restore:
    generate = getattr(model, "generate", None)
    if generate is None:  # a base model (LlamaModel) generates nothing; dynamic_length plans its cached decodes
        return _nothing
    return set_on_instance(model, "generate", _PlannedGenerate(model, generate))


def _nothing() -> None:
    """The undo of a step that changed nothing."""


class RotaryAdapter(Adapter):
    family = "rotary"
    title = "LLaMA-family (rotary)"
    length_attr = "max_position_embeddings"
    kinds = {
        Kind.LENGTH: "frequencies unchanged",
        Kind.BIAS: "rotary off + ALiBi bias",
        Kind.NONE: "rotary off (identity rotation)",
    }
    native_form_needs_patch = True  # verified against transformers' rotary class built from the native config
    takes_temperature = True  # a per-query factor in front of the model's attention, or in the remap's map

    def does(self, method: Method) -> str | None:
        # the kinds that act on rotary positions are this family's own: each method says what it does
        # (attention-side remapping: ctxext.adapters.remap, rotary off and q / k rotated per pair)
        if method.kind in (Kind.FREQUENCY, Kind.REMAP):
            return method.rule
        return super().does(method)

    def plan_length(self, model: nn.Module, length: int) -> Restore | None:
        return _plan_length(model, length)

    def detect(self, model: nn.Module) -> bool:
        # a model whose rotary module is never applied (positions from ALiBi) is left to the ALiBi adapters
        return bool(rotary_units(model)) and positions_not_rotary(model) is None

    def check(self, model: nn.Module, spec: PatchSpec) -> None:
        reason = positions_not_rotary(model)
        if reason:
            raise PatchError(f"{type(model).__name__} {reason}: patching its rotary module would change nothing")
        if spec.original_length is None:
            raise PatchError(f"{type(model).__name__} config has no {self.length_attr}; cannot scale RoPE")
        for unit in rotary_units(model):
            unit_inputs(unit, spec.original_length, spec.method)
            reason = unread_surface(unit)
            if reason:
                raise PatchError(f"rotary module {unit.name} of {type(model).__name__}: {reason}; refused")
        kind = declaration(spec).kind
        options, temperature_options = split_options(spec.options)
        if kind is Kind.BIAS:
            require_attention(model)
        if kind is Kind.REMAP:
            from .remap import check_remap  # imports this module

            check_remap(model, spec.method, spec.factor, options, spec.original_length)
        elif temperature_options:
            check_temperature(model)
        Temperature.from_options(temperature_options, spec.original_length)

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        method = declaration(spec)
        options, temperature_options = split_options(spec.options)
        temperature = Temperature.from_options(temperature_options, spec.original_length)
        if method.kind is Kind.REMAP:
            from .remap import apply_remap

            return apply_remap(model, spec.method, spec.factor, options, spec.original_length, temperature)
        with undone_on_failure() as undo:
            dynamic: dict[int, tuple[nn.Module, list]] = {}
            for unit in rotary_units(model):
                inputs = unit_inputs(unit, spec.original_length, spec.method)
                undo.append(_unit_saver(unit))
                if method.per_sequence:
                    dynamic.setdefault(id(unit.module), (unit.module, []))[1].append((unit, inputs))
                    continue
                inv_freq, attention_factor = rule_of(method)(inputs, spec.factor, **options)
                if inputs.preset == "longrope":
                    # transformers copies the short (original_inv_freq) or the long set into inv_freq in every
                    # forward, by sequence length: the method acts on the long set, the switch stays
                    setattr(unit.module, unit.prefix + "long_inv_freq",
                            inv_freq.to(device=unit.inv_freq.device, dtype=torch.float32))
                else:
                    with torch.no_grad():
                        unit.inv_freq.copy_(inv_freq)
                # composes: the shipped attention factor (1.0 on plain RoPE) times the method's
                unit.attention_scaling = attention_factor if inputs.preset == "default" else \
                    inputs.attention_scaling * attention_factor
            hooks, sequence = [], SequenceScale()
            for module, targets in dynamic.values():
                hook = DynamicNTKHook(targets, spec.factor, sequence, method.frequencies, options)
                handle = module.register_forward_pre_hook(hook, with_kwargs=True)
                module._ctxext_dynamic = hook
                hooks.append(hook)
                undo.append(functools.partial(_remove_hook, module, handle))
            if hooks:
                undo.append(_mark_model_passes(model, sequence))
            if method.per_sequence:
                undo.append(_wrap_generate(model))
            if method.kind is Kind.BIAS:
                undo.append(use_attention(model))
            if temperature is not None:
                undo.append(use_temperature(model, temperature))
        return functools.partial(run_all, undo)

    def native_form(self, model: nn.Module, spec: PatchSpec, *, check_only: bool = False):
        """A rope type, a new rope_theta or the longer length alone, verified against transformers' own rotary
        class built from the native config (``ctxext.adapters.rotary_native``); ``check_only`` is not enough here."""
        return rotary_native.native_form(model, spec, self.title)


def positions_not_rotary(model: nn.Module) -> str | None:
    """Why a model that builds a rotary module takes its positions elsewhere (None: it uses the rotary module).

    A structure can mislead: Falcon builds a rotary module even when its config selects ALiBi (``alibi=True``) and
    then never applies it."""
    for config in _configs(model):
        if getattr(config, "alibi", None) is True:
            return "takes its positions from ALiBi (config alibi=True), not from its rotary module"
    return None


def _configs(model: nn.Module) -> list:
    from ..attention.features import _configs as configs

    return configs(model)


def _remove_hook(module: nn.Module, handle) -> None:
    handle.remove()
    module.__dict__.pop("_ctxext_dynamic", None)
