"""MPT and Falcon-with-ALiBi adapters: ALiBi biases built by the model, transformed where they are built.

Both families add ``slope_h * position`` biases that the model computes itself, so the ALiBi methods act on the
function that builds them (principle 1: the model's own attention path is untouched). The ALiBi tensor is linear
in the slopes, so scaling the built tensor is the same as scaling the slopes:

- ``pi``: interpolated ALiBi, every relative distance divided by the factor (tensor / factor);
- ``nope``: the ALiBi bias removed (tensor x 0), only the causal mask orders tokens;
- ``extrapolate``: biases unchanged, only the advertised length grows;
- ``alibi``: refused, the model already is ALiBi; rotary methods and position remapping: refused, not rotary.

Hook points (by capability):

- MPT: the ``build_mpt_alibi_tensor`` method of the one patched ``MptModel`` instance (wrapped on the instance).
  MPT builds its bias for ``config.max_seq_len`` keys and slices it to the keys present, so it cannot run past that
  length: the advertised length *is* ``max_seq_len`` here, and a patch that advertises ``factor x`` the length lets
  the model read that many tokens (``extrapolate`` included).
- Falcon with ``alibi=True``: the module-level ``build_alibi_tensor`` of its modeling module, which the model calls
  by its global name. It is replaced by a dispatcher while a patched model of that module exists; the dispatcher
  transforms the tensor only inside the forward pass of a patched model (a forward pre-hook on the model sets which
  transform applies, as for BLOOM), so other Falcon models in the process are unaffected. Falcon builds its rotary
  module even with ALiBi on and never applies it: the rotary adapter leaves such models to this one.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..compat import transformers as hf_compat
from ..core.spec import PatchSpec
from ..methods.declaration import Kind
from .base import WRAPPED_NAMES, Adapter, Restore, acquire_module_function, declaration, run_all, undone_on_failure
from .bloom import _active_transform, _hooks

Transform = Callable[[torch.Tensor], torch.Tensor]

FALCON_FUNCTION = hf_compat.ALIBI_TENSOR_BUILDER
MPT_METHOD = hf_compat.MPT_ALIBI_TENSOR_BUILDER

NOT_ROTARY = "not rotary (ALiBi biases)"


def _divided(bias: torch.Tensor, factor: float) -> torch.Tensor:
    return bias / factor


def bias_transform(spec: PatchSpec) -> Transform | None:
    """How a patch changes a built ALiBi tensor (None: unchanged). Module-level functions (a partial), which a deep
    copy and a pickle of the patched model keep as they are."""
    method = declaration(spec)
    if method.interpolates:
        return functools.partial(_divided, factor=float(spec.factor))
    if method.kind is Kind.NONE:
        return torch.zeros_like
    return None  # a longer length alone


class _AlibiBiasAdapter(Adapter):
    interpolation = "ALiBi distances / f"
    kinds = {Kind.LENGTH: "advertise f x length", Kind.NONE: "ALiBi removed (bias x 0)"}
    refusals = {Kind.BIAS: "already ALiBi", Kind.FREQUENCY: NOT_ROTARY, Kind.REMAP: NOT_ROTARY}


# -- MPT -------------------------------------------------------------------------------------------------------------


def mpt_owner(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if hf_compat.mpt_alibi_tensor_builder(module) is not None:
            return module
    return None


class MptAdapter(_AlibiBiasAdapter):
    family = "mpt"
    title = "MPT (ALiBi)"
    length_attr = "max_seq_len"

    def detect(self, model: nn.Module) -> bool:
        return mpt_owner(model) is not None and isinstance(getattr(model.config, self.length_attr, None), int)

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        transform = bias_transform(spec)
        if transform is None:
            return lambda: None
        owner = mpt_owner(model)
        return hf_compat.wrap_instance_builder(owner, MPT_METHOD, lambda original: _Transformed(original, transform))


class _Transformed:
    """Stands in for a method that builds an ALiBi tensor: the original, then ``transform``. An object holding the
    original bound method, not a closure, so that a deep copy of the model calls its own (and it pickles)."""

    def __init__(self, original, transform: Transform):
        self.original = original
        self.transform = transform
        functools.update_wrapper(self, original, assigned=WRAPPED_NAMES, updated=())

    def __call__(self, *args, **kwargs):
        return self.transform(self.original(*args, **kwargs))


# -- Falcon with ALiBi -----------------------------------------------------------------------------------------------


class _Dispatcher:
    """Replaces a modeling module's ALiBi function while patched models of that module exist."""

    def __init__(self, original):
        self.original = original
        self.users = 0

    def __call__(self, *args, **kwargs):
        bias = self.original(*args, **kwargs)
        transform = _active_transform.get()
        return bias if transform is None else transform(bias)


_dispatchers: dict[str, _Dispatcher] = {}


def _acquire(modeling) -> Restore:
    return acquire_module_function(modeling, FALCON_FUNCTION, _Dispatcher, _dispatchers)


def falcon_alibi_owner(model: nn.Module) -> tuple[nn.Module, object] | None:
    """The module that builds Falcon's ALiBi tensor (``use_alibi`` True) and the modeling module whose
    ``build_alibi_tensor`` it calls."""
    for module in model.modules():
        if getattr(module, "use_alibi", None) is True:
            modeling = sys.modules.get(type(module).__module__)
            if hf_compat.alibi_tensor_builder(modeling) is not None:
                return module, modeling
    return None


class FalconAlibiAdapter(_AlibiBiasAdapter):
    family = "falcon-alibi"
    title = "Falcon (ALiBi)"
    length_attr = "max_position_embeddings"

    def detect(self, model: nn.Module) -> bool:
        return falcon_alibi_owner(model) is not None

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        transform = bias_transform(spec)
        if transform is None:
            return lambda: None
        owner, modeling = falcon_alibi_owner(model)
        with undone_on_failure() as undo:
            # released by unpatch, or when the model is garbage-collected without one
            undo.append(weakref.finalize(owner, _acquire(modeling)))
            undo.append(_hooks(owner, transform))
        return functools.partial(run_all, undo)
