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


def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for name, module in model.named_modules():
        if (
            isinstance(getattr(module, "inv_freq", None), torch.Tensor)
            and isinstance(getattr(module, "original_inv_freq", None), torch.Tensor)
            and isinstance(getattr(module, "attention_scaling", None), (int, float))
            and isinstance(getattr(module, "rope_type", None), str)
        ):
            found.append((name, module))
    return found


def _rope_thetas(module: nn.Module) -> list[float]:
    """The RoPE bases the module's config names, where each transformers API keeps it: ``rope_parameters
    ["rope_theta"]`` (5.x), ``rope_theta`` (4.x, most models) or ``rotary_emb_base`` (4.x GPT-NeoX). A 4.x config
    may also carry a ``rope_parameters`` attribute it ignores (passed as an unknown kwarg), so the caller keeps the
    base the module's ``inv_freq`` was actually built from."""
    config = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None) or {}
    found = [params.get("rope_theta") if isinstance(params, dict) else None]
    found += [getattr(config, "rope_theta", None), getattr(config, "rotary_emb_base", None)]
    return [float(t) for t in found if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0]


def rope_inputs(name: str, module: nn.Module, original_length: int) -> rope.RopeInputs:
    if module.rope_type != "default":
        raise PatchError(
            f"rotary module {name or '<root>'} already uses transformers rope_type {module.rope_type!r}; ctxext "
            "methods start from plain RoPE. Load the model with rope_parameters rope_type='default' to patch it."
        )
    stored = module.original_inv_freq.detach()
    inv_freq = stored.float()
    dim = 2 * inv_freq.numel()
    bases = _rope_thetas(module)
    if not bases or dim < 4:
        raise PatchError(f"rotary module {name or '<root>'} has no rope_theta or too few dimensions ({dim})")
    # Guard against a rotary module of the same shape but another frequency formula. A model cast with
    # ``.to(torch.bfloat16)`` (or .half()) rounds the buffer too, so the check allows that dtype's rounding.
    rtol = max(1e-4, torch.finfo(stored.dtype).eps)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    matching = [b for b in bases if torch.allclose(inv_freq.cpu().double(), 1.0 / (b**exponents), rtol=rtol, atol=0)]
    base = matching[0] if matching else bases[0]
    if not matching:
        raise PatchError(
            f"rotary module {name or '<root>'}: inv_freq does not follow base**(-2i/d) with rope_theta={base}; "
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

    def __init__(self, inputs: rope.RopeInputs, factor: float):
        self.inputs = inputs
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
            inv_freq, _ = rope.dynamic_ntk_scale(self.inputs, self.factor, target)
            module.inv_freq.copy_(inv_freq)
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
        return bool(rotary_modules(model))

    def check(self, model: nn.Module, spec: PatchSpec) -> None:
        if spec.original_length is None:
            raise PatchError(f"{type(model).__name__} config has no {self.length_attr}; cannot scale RoPE")
        for name, module in rotary_modules(model):
            rope_inputs(name, module, spec.original_length)
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
            for name, module in rotary_modules(model):
                undo.append(_saver(module))
                inputs = rope_inputs(name, module, spec.original_length)
                if spec.method == "dynamic-ntk":
                    hook = DynamicNTKHook(inputs, spec.factor)
                    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
                    module._ctxext_dynamic = hook
                    undo.append(functools.partial(_remove_hook, module, handle))
                else:
                    inv_freq, attention_factor = STATIC_METHODS[spec.method](inputs, spec.factor, **spec.options)
                    with torch.no_grad():
                        module.inv_freq.copy_(inv_freq)
                    module.attention_scaling = attention_factor
            if spec.method == "dynamic-ntk":
                undo.append(_wrap_generate(model))
            if spec.method == "alibi":
                undo.append(use_attention(model))
        except BaseException:
            run_all(undo)
            raise
        return functools.partial(run_all, undo)


def _saver(module: nn.Module) -> Restore:
    """Snapshot what a patch may change on a rotary module; the returned function puts it back bit-exactly.

    Where ``original_inv_freq`` is the ``inv_freq`` tensor itself (transformers 4.x rotary modules alias them; 5.x
    keeps a separate buffer), it becomes a copy while patched, so the in-place rewrite of ``inv_freq`` leaves the
    original frequencies intact (a replace, a second patch and transformers' own dynamic update read them); unpatch
    restores the alias."""
    inv_freq = module.inv_freq.detach().clone()
    attention_scaling = module.attention_scaling
    original = module.original_inv_freq
    aliased = original is module.inv_freq
    if aliased:
        module.original_inv_freq = original.detach().clone()

    def restore():
        with torch.no_grad():
            module.inv_freq.copy_(inv_freq.to(module.inv_freq.device))
        module.attention_scaling = attention_scaling
        if aliased:
            module.original_inv_freq = module.inv_freq

    return restore


def _remove_hook(module: nn.Module, handle) -> None:
    handle.remove()
    module.__dict__.pop("_ctxext_dynamic", None)
