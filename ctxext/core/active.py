"""The live patch on a model: where it is kept, and the transformers model a patch acts on. The layer that
``ctxext.api`` (which patches) and ``ctxext.export`` (which saves a patch natively) both read."""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

from torch import nn

from .errors import PatchError

#: Attribute on the model holding the live patch (spec + how to undo it). Not saved; the spec is, in config.
ACTIVE = "_ctxext_active"

#: Held while ctxext checks and changes a patch (``patch``, ``unpatch``, ``describe``): a check and the change it
#: allows are one step, so two threads patching one model (or two models that share a module) cannot both pass the
#: check, and the second never saves the first's patch as the model's original state. One lock for the process
#: (patches are rare and quick), reentrant: a replacing patch unpatches, and a failed one patches back.
PATCH_LOCK = threading.RLock()

#: Every model ctxext patched and has not unpatched, weakly (a model dropped is forgotten): the owners of modules.
_PATCHED: weakref.WeakSet = weakref.WeakSet()


def mark_patched(model: nn.Module) -> None:
    """Record ``model`` as patched: its modules are its patch's, and no other model's patch may touch them."""
    _PATCHED.add(model)


def unmark_patched(model: nn.Module) -> None:
    _PATCHED.discard(model)


def own_patch(model: nn.Module) -> Any:
    """The live patch ``model`` itself holds (not one of a sub-model inside it), or None."""
    return vars(model).get(ACTIVE)


def patched_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The sub-models inside ``model`` (not ``model`` itself) that hold a ctxext patch of their own, with their
    names in ``model``: ``ctxext.patch(model.model, ...)`` patches the ``LlamaModel`` inside a ``LlamaForCausalLM``,
    and so the outer model's logits."""
    return [(name, module) for name, module in model.named_modules()
            if module is not model and own_patch(module) is not None]


def active_patch(model: nn.Module) -> tuple[nn.Module, Any] | None:
    """(the model that holds the patch acting on ``model``, that live patch): ``model`` itself, or the first
    patched sub-model inside it; None where neither is patched."""
    own = own_patch(model)
    if own is not None:
        return model, own
    for _, part in patched_parts(model):
        return part, own_patch(part)
    return None


def model_name(model: nn.Module) -> str:
    """A model named for a message: its class and its id (two models of one class differ by it)."""
    return f"{type(model).__name__} at {id(model):#x}"


def patch_name(active: Any) -> str:
    spec = getattr(active, "spec", None)
    return f"{spec.method}, factor {spec.factor}" if spec is not None else "a ctxext patch"


def foreign_owner(model: nn.Module) -> str | None:
    """Why ``model`` cannot be patched because a module of it belongs to another model ctxext patched (None: none
    does). A module object can sit in two models (``b.model.rotary_emb = a.model.rotary_emb``, or ``model.model``
    inside ``model``): a patch of either changes both, and unpatching one would not restore the other. Patched
    sub-models inside ``model`` are not counted here (``patched_parts``: the outer model sees their patch)."""
    mine = {id(module): name for name, module in model.named_modules()}
    for other in list(_PATCHED):
        active = own_patch(other)
        if other is model or active is None or id(other) in mine:
            continue
        for theirs, module in other.named_modules():
            if id(module) not in mine:
                continue
            if module is model:
                return (f"it is module {theirs!r} of {model_name(other)}, which ctxext patched "
                        f"({patch_name(active)}): that patch already covers it; describe, patch (replace=True) or "
                        "unpatch that model instead")
            return (f"its module {mine[id(module)]!r} is also module {theirs!r} of {model_name(other)}, which "
                    f"ctxext patched ({patch_name(active)}): a patch here would change that model too, and unpatching "
                    "either would not restore the other. Unpatch that model first (ctxext.unpatch), or give this model "
                    "its own copy of the module (copy.deepcopy)")
    return None


def unwrapped(model: Any) -> Any:
    """The model inside a peft wrapper (``PeftModel.get_base_model()``: its adapter layers sit in that model's
    modules), or ``model`` itself; checks nothing."""
    if isinstance(model, nn.Module):
        get_base = getattr(model, "get_base_model", None)
        if callable(get_base):
            return get_base()
    return model


def base_model(model: Any, caller: str = "ctxext") -> nn.Module:
    """The transformers model inside a peft wrapper, or the model itself; PatchError for anything that is not a
    transformers model (an ``nn.Module`` whose ``.config`` is a transformers ``PretrainedConfig``)."""
    model = unwrapped(model)
    require_transformers_model(model, caller)
    return model


def _describe_object(obj: Any) -> str:
    text = repr(obj) if isinstance(obj, (str, bytes, int, float, type(None))) else type(obj).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def require_transformers_model(model: Any, caller: str) -> None:
    from .spec import transformers_config_class

    need = "a transformers model (an nn.Module with a transformers PretrainedConfig as .config, e.g. from " \
           "AutoModelForCausalLM.from_pretrained)"
    if not isinstance(model, nn.Module):
        raise PatchError(f"{caller} needs {need}; got {_describe_object(model)}")
    config = getattr(model, "config", None)
    base = transformers_config_class()
    if config is None or (base is not None and not isinstance(config, base)):
        what = "no .config" if config is None else f"a .config of type {type(config).__name__}"
        raise PatchError(f"{caller} needs {need}; got {type(model).__name__} with {what}")


def describe(model: nn.Module) -> dict[str, Any] | None:
    """The active patch spec as a dict, or None if the model is not patched. A patch of a sub-model inside it
    (``ctxext.patch(model.model, ...)``) acts on the model's logits too, and is described here as well."""
    model = base_model(model, "ctxext.describe")
    with PATCH_LOCK:
        found = active_patch(model)
        return copy.deepcopy(found[1].spec.to_dict()) if found is not None else None


def pickle_refusal(spec: Any = None) -> PatchError:
    """The error a pickle (``pickle.dumps``, ``torch.save``) of a patched model raises: what the live patch holds
    (undo functions, module-level dispatchers) does not survive a pickle; ``save_pretrained`` saves the patch."""
    what = f" ({spec.method}, factor {spec.factor})" if spec is not None and hasattr(spec, "method") else ""
    return PatchError(
        f"this model is patched by ctxext{what}, and a patched model cannot be pickled (pickle.dumps, torch.save, "
        "copying to another process): save it with model.save_pretrained(dir) and load it with "
        "ctxext.from_pretrained(dir), or call ctxext.unpatch(model) first (copy.deepcopy works on a patched model)"
    )
