"""Loading models (and patched models) from the hub, a local directory or a GGUF file."""

from __future__ import annotations

from typing import Any

from torch import nn

from .api import patch
from .errors import PatchError
from .spec import CONFIG_KEY, PatchSpec


def pop_saved_spec(model: nn.Module) -> PatchSpec | None:
    """Remove a saved patch spec from a freshly loaded config, restoring the pre-patch advertised length."""
    saved = getattr(model.config, CONFIG_KEY, None)
    if not saved:
        return None
    spec = PatchSpec.from_dict(dict(saved))
    delattr(model.config, CONFIG_KEY)
    from .adapters import find_adapter

    adapter = find_adapter(model)
    if adapter.length_attr and spec.original_length is not None:
        setattr(model.config, adapter.length_attr, spec.original_length)
    return spec


def make_saveable(model: nn.Module) -> None:
    """GGUF weights are dequantized on load, but transformers keeps a quantizer marker that blocks
    ``save_pretrained``; drop it so a patched GGUF model can be saved as ordinary safetensors."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and "gguf" in type(quantizer).__name__.lower():
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")


def from_pretrained(pretrained: str, *, adapter: str | None = None, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` (same kwargs, ``gguf_file`` included) that re-applies a saved
    ctxext patch, and optionally loads a LoRA adapter directory saved by a ctxext fine-tune recipe."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(pretrained, **kwargs)
    except OSError as exc:
        raise OSError(
            f"cannot load model {pretrained!r}: {str(exc).splitlines()[0]} "
            "(a hub id needs network access or a local cache; offline, pass a local directory)"
        ) from exc
    if kwargs.get("gguf_file"):
        make_saveable(model)
    spec = pop_saved_spec(model)
    if spec is not None:
        patch(model, spec.method, spec.factor, **spec.options)
    if adapter is not None:
        model = load_adapter(model, adapter)
    return model


def load_adapter(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Load a peft (LoRA) adapter onto ``model``; apply the patch recorded beside it if the model has none."""
    import json
    from pathlib import Path

    from .api import describe

    spec_file = Path(adapter_dir) / "ctxext_patch.json"
    if spec_file.exists():
        spec = PatchSpec.from_dict(json.loads(spec_file.read_text()))
        active = describe(model)
        if active is None:
            patch(model, spec.method, spec.factor, **spec.options)
        elif (active["method"], active["factor"]) != (spec.method, spec.factor):
            raise PatchError(
                f"adapter {adapter_dir} was trained with {spec.method} x{spec.factor}, "
                f"but the model is patched with {active['method']} x{active['factor']}"
            )
    try:
        from peft import PeftModel
    except ImportError as exc:  # pragma: no cover - peft is a declared extra
        raise ImportError("loading an adapter needs peft: pip install 'ctxext[finetune]'") from exc
    return PeftModel.from_pretrained(model, adapter_dir)
