"""Architecture adapters, one per positional family. Detection is by structure, not class name."""

from __future__ import annotations

from torch import nn

from ..core.errors import PatchError
from .alibi_bias import FalconAlibiAdapter, MptAdapter
from .base import Adapter
from .bloom import BloomAdapter
from .gpt2 import GPT2Adapter
from .gpt_neo import GPTNeoAdapter
from .offset_table import OffsetTableAdapter
from .rotary import RotaryAdapter
from .sincos_table import SinCosTableAdapter

#: One adapter per positional family, in detection order (and column order of the method table).
ADAPTERS: list[Adapter] = [
    RotaryAdapter(), SinCosTableAdapter(), GPT2Adapter(), GPTNeoAdapter(), OffsetTableAdapter(), BloomAdapter(),
    MptAdapter(), FalconAlibiAdapter(),
]


def find_adapter(model: nn.Module) -> Adapter:
    for adapter in ADAPTERS:
        if adapter.detect(model):
            return adapter
    wrapped = sorted(name for name, module in model.named_modules() if type(module).__name__ == "ModulesToSaveWrapper")
    if wrapped:  # peft's trainable copy hides the module a family is detected by (GPT-2's wpe, say)
        raise PatchError(
            f"{type(model).__name__}: peft's modules_to_save wraps {', '.join(wrapped[:3])}, which hides the model's "
            "positional surface from ctxext; patch the model before get_peft_model, or leave position modules out "
            "of modules_to_save"
        )
    families = ", ".join(a.title for a in ADAPTERS)
    raise PatchError(
        f"{type(model).__name__} has no positional surface ctxext knows (supported families: {families}); "
        "see `ctxext methods`"
    )


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of ``model`` (unwrapped from peft), or a plain ``Adapter`` whose defaults ask nothing special of
    a model no family claims."""
    get_base = getattr(model, "get_base_model", None)
    plain = get_base() if callable(get_base) else model
    return next((a for a in ADAPTERS if a.detect(plain)), Adapter())


def config_length(config, attrs=("max_position_embeddings", "n_positions", "seq_length", "n_ctx")) -> int | None:
    """The context length a config advertises, from the first of ``attrs`` it sets: for a model no adapter claims."""
    return next((getattr(config, a) for a in attrs if getattr(config, a, None)), None)


def adapter_for_family(family: str) -> Adapter | None:
    """The adapter whose family key is ``family`` (as a saved patch spec records it), or None."""
    return next((a for a in ADAPTERS if a.family == family), None)
