"""The live patch on a model: where it is kept, and the transformers model a patch acts on. The layer that
``ctxext.api`` (which patches) and ``ctxext.export`` (which saves a patch natively) both read."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from .errors import PatchError

#: Attribute on the model holding the live patch (spec + how to undo it). Not saved; the spec is, in config.
ACTIVE = "_ctxext_active"


def base_model(model: Any, caller: str = "ctxext") -> nn.Module:
    """The transformers model inside a peft wrapper, or the model itself; PatchError for anything that is not a
    transformers model (an ``nn.Module`` whose ``.config`` is a transformers ``PretrainedConfig``)."""
    if isinstance(model, nn.Module):
        get_base = getattr(model, "get_base_model", None)
        if callable(get_base):
            model = get_base()
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
    """The active patch spec as a dict, or None if the model is not patched."""
    active = getattr(base_model(model, "ctxext.describe"), ACTIVE, None)
    return copy.deepcopy(active.spec.to_dict()) if active is not None else None


def pickle_refusal(spec: Any = None) -> PatchError:
    """The error a pickle (``pickle.dumps``, ``torch.save``) of a patched model raises: what the live patch holds
    (undo functions, module-level dispatchers) does not survive a pickle; ``save_pretrained`` saves the patch."""
    what = f" ({spec.method}, factor {spec.factor})" if spec is not None and hasattr(spec, "method") else ""
    return PatchError(
        f"this model is patched by ctxext{what}, and a patched model cannot be pickled (pickle.dumps, torch.save, "
        "copying to another process): save it with model.save_pretrained(dir) and load it with "
        "ctxext.from_pretrained(dir), or call ctxext.unpatch(model) first (copy.deepcopy works on a patched model)"
    )
