"""Rotary (LLaMA-family) adapter.

Acts on the rotary-embedding modules of transformers 5.x (Llama, Mistral, Qwen2, GPT-NeoX, ...): any module
with ``inv_freq`` / ``original_inv_freq`` buffers, an ``attention_scaling`` float and a string ``rope_type``.
Those modules compute cos/sin as ``position * inv_freq`` scaled by ``attention_scaling``, so a static method
only rewrites ``inv_freq`` in place and sets ``attention_scaling``: the attention path (sdpa, flash) is untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ..attention import require_attention, use_attention
from ..errors import PatchError
from ..methods import nope, rope
from ..methods.remap import REMAP_METHODS
from ..spec import PatchSpec
from .base import Adapter, Restore, run_all

#: Static methods: spec.method -> function(RopeInputs, factor, **options) -> (inv_freq, attention_factor).
STATIC_METHODS: dict[str, Callable] = {
    "pi": rope.position_interpolation,
    "ntk": rope.ntk_scale,
    "yarn": rope.yarn,
    "llama3": rope.llama3,
    "extrapolate": rope.identity,
    # NoPE and the ALiBi swap disable rotary by an identity rotation (inv_freq = 0): the module and the attention
    # kernel stay; ALiBi then adds its bias in the ``ctxext_alibi`` attention function.
    "nope": nope.identity_rotation,
    "alibi": nope.identity_rotation,
}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Rotary modules with one set of frequencies: ``inv_freq`` / ``original_inv_freq`` buffers, a float
    ``attention_scaling`` and a string ``rope_type`` (Llama, Mistral, Qwen2, GPT-NeoX, ...)."""
    found = []
    for name, module in model.named_modules():
        if (
            isinstance(getattr(module, "inv_freq", None), torch.Tensor)
            and isinstance(getattr(module, "original_inv_freq", None), torch.Tensor)
            and _is_number(getattr(module, "attention_scaling", None))
            and isinstance(getattr(module, "rope_type", None), str)
        ):
            found.append((name, module))
    return found


class RotaryUnit:
    """One set of rotary frequencies: a plain rotary module, or one layer type of a module that keeps
    ``<layer_type>_inv_freq`` / ``<layer_type>_original_inv_freq`` / ``<layer_type>_attention_scaling`` and a
    ``rope_type`` dict keyed by layer type (Gemma 3 in transformers 5.x)."""

    def __init__(self, name: str, module: nn.Module, layer_type: str | None = None):
        self.module = module
        self.layer_type = layer_type
        self.prefix = f"{layer_type}_" if layer_type else ""
        self.name = (name or "<root>") + (f"[{layer_type}]" if layer_type else "")

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.module, self.prefix + "inv_freq")

    @property
    def original_inv_freq(self) -> torch.Tensor:
        return getattr(self.module, self.prefix + "original_inv_freq")

    @original_inv_freq.setter
    def original_inv_freq(self, value) -> None:
        setattr(self.module, self.prefix + "original_inv_freq", value)

    @property
    def attention_scaling(self) -> float:
        return getattr(self.module, self.prefix + "attention_scaling")

    @attention_scaling.setter
    def attention_scaling(self, value: float) -> None:
        setattr(self.module, self.prefix + "attention_scaling", value)

    @property
    def rope_type(self) -> str:
        kind = self.module.rope_type
        return kind if self.layer_type is None else kind[self.layer_type]

    def thetas(self) -> list[float]:
        if self.layer_type is None:
            return _rope_thetas(self.module)
        params = getattr(getattr(self.module, "config", None), "rope_parameters", None) or {}
        theta = (params.get(self.layer_type) or {}).get("rope_theta") if isinstance(params, dict) else None
        return [float(theta)] if _is_number(theta) and theta > 0 else []


def _layered_types(module: nn.Module) -> list[str] | None:
    """The layer types of a rotary module with one set of frequencies per layer type, else None."""
    types = getattr(module, "layer_types", None)
    kinds = getattr(module, "rope_type", None)
    if not isinstance(types, (list, tuple, set)) or not types or not isinstance(kinds, dict):
        return None
    for t in types:
        if not (
            isinstance(t, str)
            and isinstance(getattr(module, f"{t}_inv_freq", None), torch.Tensor)
            and isinstance(getattr(module, f"{t}_original_inv_freq", None), torch.Tensor)
            and _is_number(getattr(module, f"{t}_attention_scaling", None))
            and isinstance(kinds.get(t), str)
        ):
            return None
    return sorted(types)


def rotary_units(model: nn.Module) -> list[RotaryUnit]:
    """Every set of rotary frequencies in ``model``: plain rotary modules and per-layer-type ones."""
    units = [RotaryUnit(name, module) for name, module in rotary_modules(model)]
    for name, module in model.named_modules():
        types = _layered_types(module)
        if types:
            units += [RotaryUnit(name, module, t) for t in types]
    return units


def _rope_thetas(module: nn.Module) -> list[float]:
    """The RoPE bases the module's config names, where each transformers API keeps it: ``rope_parameters
    ["rope_theta"]`` (5.x), ``rope_theta`` (4.x, most models) or ``rotary_emb_base`` (4.x GPT-NeoX). A 4.x config
    may also carry a ``rope_parameters`` attribute it ignores (passed as an unknown kwarg), so the caller keeps the
    base the module's ``inv_freq`` was actually built from."""
    config = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None) or {}
    found = [params.get("rope_theta") if isinstance(params, dict) else None]
    found += [getattr(config, "rope_theta", None), getattr(config, "rotary_emb_base", None)]
    return [float(t) for t in found if _is_number(t) and t > 0]


def rope_inputs(name: str, module: nn.Module, original_length: int) -> rope.RopeInputs:
    """The frequencies a plain rotary module started from (``unit_inputs`` for any ``RotaryUnit``)."""
    return unit_inputs(RotaryUnit(name, module), original_length)


def _rotary_output(unit: RotaryUnit) -> torch.Tensor:
    inv_freq = unit.inv_freq
    x = torch.zeros(1, 2, 2 * inv_freq.numel(), dtype=torch.float32, device=inv_freq.device)
    position_ids = torch.tensor([[1, 2]], device=inv_freq.device)
    with torch.no_grad():  # .forward: without the module's hooks (a dynamic-NTK hook would rewrite inv_freq)
        if unit.layer_type is None:
            out = unit.module.forward(x, position_ids)
        else:
            out = unit.module.forward(x, position_ids, unit.layer_type)
    parts = list(out) if isinstance(out, (tuple, list)) else [out]  # (cos, sin), or one complex tensor
    return torch.cat([torch.view_as_real(p).flatten(-2) if p.is_complex() else p.float() for p in parts], dim=-1)


def unread_surface(unit: RotaryUnit) -> str | None:
    """Whether the module's forward reads the buffers a patch rewrites, probed on the module alone: its output with
    the original frequencies, with them halved, and with ``attention_scaling`` doubled (everything put back exactly;
    the original frequencies, not the current ones, so that a model patched with zero frequencies probes alike).
    Some modules recompute their frequencies from the config in every forward (Phimoe in transformers 5.x), so
    a patch of the buffers would change nothing. Returns why not, or None."""
    saved_freq = unit.inv_freq.detach().clone()
    saved_scaling = unit.attention_scaling
    original = unit.original_inv_freq.detach().clone()
    try:
        with torch.no_grad():
            unit.inv_freq.copy_(original)
        unit.attention_scaling = 1.0
        base = _rotary_output(unit)
        with torch.no_grad():
            unit.inv_freq.copy_(original * 0.5)
        halved = _rotary_output(unit)
        with torch.no_grad():
            unit.inv_freq.copy_(original)
        unit.attention_scaling = 2.0
        doubled = _rotary_output(unit)
    except Exception as exc:  # a forward this probe cannot call: say so rather than guess
        return f"ctxext could not probe its forward ({type(exc).__name__}: {exc}) to confirm a patch acts on it"
    finally:
        with torch.no_grad():
            unit.inv_freq.copy_(saved_freq)
        unit.attention_scaling = saved_scaling
    if torch.equal(halved, base):
        return ("its forward does not read its inv_freq buffer (it recomputes the frequencies), so a patch would "
                "change nothing")
    if not torch.allclose(doubled, 2 * base, rtol=1e-5, atol=1e-6):
        return "its forward does not apply its attention_scaling, so a patch's attention factor would be lost"
    return None


def unit_inputs(unit: RotaryUnit, original_length: int) -> rope.RopeInputs:
    if unit.rope_type != "default":
        raise PatchError(
            f"rotary module {unit.name} already uses transformers rope_type {unit.rope_type!r}; ctxext "
            "methods start from plain RoPE. Load the model with rope_parameters rope_type='default' to patch it."
        )
    stored = unit.original_inv_freq.detach()
    inv_freq = stored.float()
    dim = 2 * inv_freq.numel()
    bases = unit.thetas()
    if not bases or dim < 4:
        raise PatchError(f"rotary module {unit.name} has no rope_theta or too few dimensions ({dim})")
    # Guard against a rotary module of the same shape but another frequency formula. A model cast with
    # ``.to(torch.bfloat16)`` (or .half()) rounds the buffer too, so the check allows that dtype's rounding.
    rtol = max(1e-4, torch.finfo(stored.dtype).eps)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    matching = [b for b in bases if torch.allclose(inv_freq.cpu().double(), 1.0 / (b**exponents), rtol=rtol, atol=0)]
    base = matching[0] if matching else bases[0]
    if not matching:
        raise PatchError(
            f"rotary module {unit.name}: inv_freq does not follow base**(-2i/d) with rope_theta={base}; "
            "ctxext does not know this rotary variant"
        )
    if stored.dtype != torch.float32:
        # Scale the float32 frequencies transformers builds (as its default rope init computes them), not the
        # rounded ones: the patched buffer is then what a model built with the native rope type and cast the same
        # way holds. Writing it back into the low-precision buffer rounds it again.
        inv_freq = 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return rope.RopeInputs(inv_freq=inv_freq.cpu(), base=float(base), dim=dim, original_length=int(original_length))


class DynamicNTKHook:
    """Forward pre-hook on a rotary module that sets dynamic-NTK frequencies for the current sequence.

    Cache semantics: the scale is fixed per sequence. A forward pass whose positions start at 0 (a full pass or
    the prefill of a cached decode) fixes it from the sequence length, or from ``length_hint`` when that is
    longer (``generate`` sets it to prompt + new tokens). Later passes that continue the sequence (positions not
    starting at 0) keep that scale, so cached keys and new queries are always rotated alike. A batch shares one
    scale, from its longest row.
    """

    def __init__(self, targets: list[tuple[RotaryUnit, rope.RopeInputs]], factor: float):
        self.targets = targets  # the module's frequency sets (one, or one per layer type) and their inputs
        self.inputs = targets[0][1]
        self.factor = factor
        self.length_hint: int | None = None
        self.length: int | None = None  # the length the current sequence's scale was fixed from
        self._applied: int | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if position_ids is None:
            return None
        start = int(position_ids.min())
        end = int(position_ids.max()) + 1
        if start == 0 or self.length is None:
            self.length = max(end, self.length_hint or 0)
        target = max(self.length, self.inputs.original_length)
        if target != self._applied:
            for unit, inputs in self.targets:
                inv_freq, _ = rope.dynamic_ntk_scale(inputs, self.factor, target)
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


def _wrap_generate(model: nn.Module) -> Restore:
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        hooks = dynamic_hooks(model)
        total = planned_generate_length(model, args, kwargs)
        for hook in hooks:
            hook.length_hint = total
        try:
            return original(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.length_hint = None

    model.generate = generate
    return lambda: model.__dict__.pop("generate", None)


class RotaryAdapter(Adapter):
    family = "rotary"
    title = "LLaMA-family (rotary)"
    length_attr = "max_position_embeddings"
    methods = {
        "pi": "yes: frequencies / factor",
        "ntk": "yes: base * factor^(d/(d-2))",
        "dynamic-ntk": "yes: scale from sequence length",
        "yarn": "yes: NTK-by-parts + mscale",
        "llama3": "yes: Llama 3.1 by wavelength",
        "extrapolate": "yes: frequencies unchanged",
        "alibi": "yes: rotary off + ALiBi bias",
        "nope": "yes: rotary off (identity rotation)",
        # attention-side position remapping (ctxext.adapters.remap): rotary off, q and k rotated per pair
        "self-extend": "yes: grouped positions beyond a window",
        "dca": "yes: chunked positions (intra / successive / inter-chunk)",
        "rerope": "yes: distance clipped at a window",
        "lm-infinite": "yes: Lambda mask + distance cap",
        "string": "yes: large distances shifted down",
    }

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
            unit_inputs(unit, spec.original_length)
            reason = unread_surface(unit)
            if reason:
                raise PatchError(f"rotary module {unit.name} of {type(model).__name__}: {reason}; refused")
        if spec.method == "alibi":
            require_attention(model)
        if spec.method in REMAP_METHODS:
            from .remap import check_remap  # imports this module

            check_remap(model, spec.method, spec.factor, spec.options, spec.original_length)

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        if spec.method in REMAP_METHODS:
            from .remap import apply_remap

            return apply_remap(model, spec.method, spec.factor, spec.options, spec.original_length)
        undo: list[Restore] = []
        try:
            dynamic: dict[int, tuple[nn.Module, list]] = {}
            for unit in rotary_units(model):
                undo.append(_unit_saver(unit))
                inputs = unit_inputs(unit, spec.original_length)
                if spec.method == "dynamic-ntk":
                    dynamic.setdefault(id(unit.module), (unit.module, []))[1].append((unit, inputs))
                else:
                    inv_freq, attention_factor = STATIC_METHODS[spec.method](inputs, spec.factor, **spec.options)
                    with torch.no_grad():
                        unit.inv_freq.copy_(inv_freq)
                    unit.attention_scaling = attention_factor
            for module, targets in dynamic.values():
                hook = DynamicNTKHook(targets, spec.factor)
                handle = module.register_forward_pre_hook(hook, with_kwargs=True)
                module._ctxext_dynamic = hook
                undo.append(functools.partial(_remove_hook, module, handle))
            if spec.method == "dynamic-ntk":
                undo.append(_wrap_generate(model))
            if spec.method == "alibi":
                undo.append(use_attention(model))
        except BaseException:
            run_all(undo)
            raise
        return functools.partial(run_all, undo)


def positions_not_rotary(model: nn.Module) -> str | None:
    """Why a model that builds a rotary module takes its positions elsewhere (None: it uses the rotary module).

    A structure can mislead: Falcon builds a rotary module even when its config selects ALiBi (``alibi=True``) and
    then never applies it."""
    for config in _configs(model):
        if getattr(config, "alibi", None) is True:
            return "takes its positions from ALiBi (config alibi=True), not from its rotary module"
    return None


def _configs(model: nn.Module) -> list:
    from ..attention import _configs as configs

    return configs(model)


def _saver(module: nn.Module) -> Restore:
    """Snapshot what a patch may change on a plain rotary module (see ``_unit_saver``)."""
    return _unit_saver(RotaryUnit("", module))


def _unit_saver(unit: RotaryUnit) -> Restore:
    """Snapshot what a patch may change on a set of rotary frequencies; the returned function puts it back
    bit-exactly.

    Where ``original_inv_freq`` is the ``inv_freq`` tensor itself (transformers 4.x rotary modules alias them; 5.x
    keeps a separate buffer), it becomes a copy while patched, so the in-place rewrite of ``inv_freq`` leaves the
    original frequencies intact (a replace, a second patch and transformers' own dynamic update read them); unpatch
    restores the alias."""
    inv_freq = unit.inv_freq.detach().clone()
    attention_scaling = unit.attention_scaling
    original = unit.original_inv_freq
    aliased = original is unit.inv_freq
    if aliased:
        unit.original_inv_freq = original.detach().clone()

    def restore():
        with torch.no_grad():
            unit.inv_freq.copy_(inv_freq.to(unit.inv_freq.device))
        unit.attention_scaling = attention_scaling
        if aliased:
            unit.original_inv_freq = unit.inv_freq

    return restore


def _remove_hook(module: nn.Module, handle) -> None:
    handle.remove()
    module.__dict__.pop("_ctxext_dynamic", None)



def _half_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _interleaved_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    return x * cos + torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2) * sin


def rotation_layout(model: nn.Module) -> str | None:
    """How the model's attention applies its rotary cos/sin, read from what its modeling code computes (the
    ``apply_rotary_pos_emb`` its attention modules call, probed on a random vector), not from a class name:
    ``"half"`` (rotate_half over two halves: Llama, Mistral, GPT-NeoX, ...), ``"interleaved"`` (rotate every two:
    Cohere, GLM, Helium, ERNIE 4.5, ...), or None where neither fits or the function is not found.

    Methods that only rewrite ``inv_freq`` work with any layout; a function that rotates q and k itself (the
    position-remapping attention) must use the model's layout or refuse the model."""
    import sys

    functions = set()
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "is_causal"):
            fn = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
            if callable(fn):
                functions.add(fn)
    if len(functions) != 1:
        return None
    (fn,) = functions
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 3, 8, generator=generator)
    k = torch.randn(1, 1, 3, 8, generator=generator)
    freqs = torch.outer(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([1.0, 0.3, 0.1, 0.01]))
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, seq, dim): the half layout every rotary module returns
    cos, sin = emb.cos(), emb.sin()
    try:
        rq, rk = fn(q, k, cos, sin)[:2]
    except Exception:
        return None
    c, s_ = cos[:, None], sin[:, None]
    for name, rotate in (("half", _half_rotation), ("interleaved", _interleaved_rotation)):
        if torch.allclose(rq, rotate(q, c, s_), atol=1e-6) and torch.allclose(rk, rotate(k, c, s_), atol=1e-6):
            return name
    return None
