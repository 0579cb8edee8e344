"""BLOOM family adapter: ALiBi.

Hook point: the module-level slope function of the model's modeling module (``_get_alibi_slopes`` in
``transformers.models.bloom.modeling_bloom``). BLOOM calls it on every path: directly when no attention mask is
given, and through ``build_alibi_tensor`` when one is (which is what ``generate`` does). ctxext replaces that
module attribute with a dispatcher while at least one model of the module is patched; the dispatcher transforms the
slopes only inside the forward pass of a patched model (a forward pre-hook sets which transform applies), so other
BLOOM models in the process are unaffected. The original function is put back when the last patched model is
unpatched or garbage-collected. The attention path (BLOOM is eager-only in transformers 5.23) is not
touched.

Two hook points, chosen by what the installed transformers has (principle 8: capability, not version):

- the module-level slope function ``_get_alibi_slopes`` where the modeling module defines one (transformers 5.x
  releases that have it: BLOOM calls it on every path), replaced by a dispatcher as above;
- otherwise (e.g. transformers 4.57, 5.0 and 5.12, where ``BloomModel.forward`` always builds a mask and calls
  ``self.build_alibi_tensor`` with it) the ``build_alibi_tensor`` method of the one patched ``BloomModel`` instance:
  the wrapper calls the original in float32, recovers each key's ALiBi position from it (BLOOM's own cumulative-mask
  positions) and multiplies them by the transformed slopes, which gives the same tensor, bit for bit, as the slope
  function path.

Where a model has neither, it is not detected as BLOOM (``find_adapter`` then refuses it with a PatchError).

- ``pi``: interpolated ALiBi, every relative distance divided by the factor (slopes / factor);
- ``nope``: slopes zero, the ALiBi bias removed;
- ``extrapolate``: slopes unchanged, only the advertised length grows;
- ``alibi``: refused, the model already is ALiBi.

Advertised length: BLOOM configs usually carry no length attribute (ALiBi has no table to size), and lm-eval falls
back to 2048 tokens for them. ctxext advertises the patched length in ``config.max_position_embeddings`` — the
attribute lm-eval reads after ``n_positions`` and the one ``generate`` warns against — and takes the original length
from the config where it says one (``max_position_embeddings``, else ``seq_length``: a whole number >= 1, written
256 or 256.0), else 2048 (the sequence length every BLOOM checkpoint of the family was trained with). An explicit
value always wins over that default: the shipped reference BLOOM, trained at 256 tokens, says so in
``max_position_embeddings``. ``unpatch`` deletes the attribute again when the config did not have it.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..compat import transformers as hf_compat
from ..core.spec import PatchSpec
from ..methods import alibi
from ..methods.declaration import Kind
from .base import WRAPPED_NAMES, Adapter, Restore, acquire_module_function, declaration, run_all, undone_on_failure

#: The sequence length all BLOOM checkpoints were trained with.
BLOOM_TRAINING_LENGTH = 2048
SLOPE_FUNCTION = hf_compat.BLOOM_SLOPE_FUNCTION

SlopeTransform = Callable[[torch.Tensor], torch.Tensor]

#: The slope transform of the patched model whose forward pass is running (None outside one).
_active_transform: contextvars.ContextVar[SlopeTransform | None] = contextvars.ContextVar(
    "ctxext_bloom_slopes", default=None
)


def slope_transform(spec: PatchSpec) -> SlopeTransform | None:
    method = declaration(spec)
    if method.interpolates:
        return functools.partial(alibi.interpolated_slopes, factor=spec.factor)
    if method.kind is Kind.NONE:
        return alibi.no_slopes
    return None  # a longer length alone: slopes unchanged


class _Dispatcher:
    """Replaces a modeling module's slope function while patched models of that module exist."""

    def __init__(self, modeling, original):
        self.modeling = modeling
        self.original = original
        self.users = 0

    def __call__(self, num_heads, device, *args, **kwargs):
        slopes = self.original(num_heads, device, *args, **kwargs)
        transform = _active_transform.get()
        return slopes if transform is None else transform(slopes)


_dispatchers: dict[str, _Dispatcher] = {}


def _acquire(modeling) -> Restore:
    return acquire_module_function(modeling, SLOPE_FUNCTION, lambda original: _Dispatcher(modeling, original), _dispatchers)


def alibi_owner(model: nn.Module) -> tuple[nn.Module, object | None] | None:
    """The module that builds the ALiBi tensor (BloomModel) and the modeling module holding its slope function
    (None where that module has no slope function: then the owner's ``build_alibi_tensor`` is the hook point)."""
    for module in model.modules():
        if hf_compat.alibi_tensor_builder(module) is not None:
            modeling = sys.modules.get(type(module).__module__)
            return module, (modeling if hf_compat.bloom_slope_function(modeling) is not None else None)
    return None


class _SlopesFromPositions:
    """Stands in for the owner's ``build_alibi_tensor`` (see ``_wrap_build_alibi_tensor``). An object holding the
    original bound method, not a closure, so that a deep copy of the model calls its own (and it pickles)."""

    def __init__(self, original, transform: SlopeTransform):
        self.original = original
        self.transform = transform
        functools.update_wrapper(self, original, assigned=WRAPPED_NAMES, updated=())

    def __call__(self, attention_mask, num_heads, dtype, *args, **kwargs):
        base = self.original(attention_mask, num_heads, torch.float32, *args, **kwargs)
        slopes = alibi.alibi_slopes(num_heads).to(base.device)
        batch = base.shape[0] // num_heads
        per_head = base.reshape(batch, num_heads, *base.shape[1:])
        positions = torch.round(per_head / slopes.view(1, num_heads, *([1] * (per_head.dim() - 2))))
        new_slopes = self.transform(slopes).view(1, num_heads, *([1] * (per_head.dim() - 2)))
        return (new_slopes * positions).reshape(base.shape).to(dtype)


def _wrap_build_alibi_tensor(owner: nn.Module, transform: SlopeTransform) -> Restore:
    """Hook point where the modeling module has no slope function: the owner's ``build_alibi_tensor`` method.

    BLOOM's tensor is ``slopes[h] * position`` (float32, then cast), shape (batch * heads, 1, keys). The wrapper
    takes the float32 tensor from the original, divides by the original slopes and rounds to get the (integer)
    positions back exactly, and multiplies them by the transformed slopes."""
    return hf_compat.wrap_instance_builder(owner, hf_compat.ALIBI_TENSOR_BUILDER,
                                           lambda original: _SlopesFromPositions(original, transform))


class _TransformScope:
    """Forward hooks on the owner that make ``transform`` the active one during its forward pass (the dispatchers
    read it). Bound methods of an object, not closures: a deep copy of the model gets hooks of its own (and they
    pickle)."""

    def __init__(self, transform):
        self.transform = transform
        self.tokens: list = []

    def enter(self, module, args, kwargs):
        self.tokens.append(_active_transform.set(self.transform))

    def leave(self, module, args, kwargs, output):
        if self.tokens:
            _active_transform.reset(self.tokens.pop())


def _hooks(owner: nn.Module, transform) -> Restore:
    scope = _TransformScope(transform)
    handles = [
        owner.register_forward_pre_hook(scope.enter, with_kwargs=True),
        owner.register_forward_hook(scope.leave, with_kwargs=True, always_call=True),
    ]

    def remove():
        for handle in handles:
            handle.remove()

    return remove


class BloomAdapter(Adapter):
    family = "bloom"
    title = "BLOOM (ALiBi)"
    length_attr = "max_position_embeddings"
    interpolation = "ALiBi distances / f"
    kinds = {Kind.LENGTH: "advertise f x length", Kind.NONE: "ALiBi removed (slopes 0)"}
    refusals = {Kind.BIAS: "already ALiBi", Kind.FREQUENCY: "not rotary", Kind.REMAP: "not rotary"}

    def detect(self, model: nn.Module) -> bool:
        return alibi_owner(model) is not None

    def original_length(self, model: nn.Module) -> int:
        config = model.config
        for attr in (self.length_attr, "seq_length"):  # an explicit length wins over the family's
            value = getattr(config, attr, None)
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # 256.0: a config edited by hand, or written by a tool that writes floats
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return BLOOM_TRAINING_LENGTH

    def native_form(self, model: nn.Module, spec: PatchSpec, *, check_only: bool = False):
        """A longer length alone is native: ALiBi has no table to size, only the advertised length changes."""
        from ..core.native_form import NativeForm

        if declaration(spec).kind is Kind.LENGTH:
            return NativeForm({}, summary="ALiBi unchanged, max_position_embeddings advertised")
        return super().native_form(model, spec, check_only=check_only)

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        transform = slope_transform(spec)
        if transform is None:
            return lambda: None
        owner, modeling = alibi_owner(model)
        with undone_on_failure() as undo:
            if modeling is None:
                undo.append(_wrap_build_alibi_tensor(owner, transform))
                return functools.partial(run_all, undo)
            # released by unpatch, or when the model is garbage-collected without one
            undo.append(weakref.finalize(owner, _acquire(modeling)))
            undo.append(_hooks(owner, transform))
        return functools.partial(run_all, undo)
