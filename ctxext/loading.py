"""Loading models (and patched models) from the hub, a local directory or a GGUF file."""

from __future__ import annotations

from typing import Any

from torch import nn

from .api import patch, take_saved_spec
from .errors import PatchError
from .spec import CONFIG_KEY, PatchSpec


def make_saveable(model: nn.Module) -> None:
    """GGUF weights are dequantized on load, but transformers keeps a quantizer marker that blocks
    ``save_pretrained``; drop it so a patched GGUF model can be saved as ordinary safetensors."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and "gguf" in type(quantizer).__name__.lower():
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")


_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "local_files_only", "revision", "subfolder")


def _original_length_kwargs(pretrained: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Build a saved patched model at its original length: config.json advertises the patched length, but GPT-2
    sizes its position table from it while the checkpoint holds the original table (the patch is applied again
    after loading)."""
    if kwargs.get("gguf_file") or "config" in kwargs:
        return {}
    from transformers import PretrainedConfig

    from .adapters import ADAPTERS

    try:
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        config_dict, _ = PretrainedConfig.get_config_dict(pretrained, **hub)
    except Exception:  # noqa: BLE001 - from_pretrained reports the real problem
        return {}
    saved = config_dict.get(CONFIG_KEY)
    if not isinstance(saved, dict):
        return {}
    spec = PatchSpec.from_dict(saved)
    adapter = next((a for a in ADAPTERS if a.family == spec.family), None)
    if adapter is None or not adapter.length_attr or spec.original_length is None or adapter.length_attr in kwargs:
        return {}
    return {adapter.length_attr: spec.original_length}


def from_pretrained(pretrained: str, *, adapter: str | None = None, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` (same kwargs, ``gguf_file`` included) that re-applies a saved
    ctxext patch, and optionally loads a LoRA adapter directory saved by a ctxext fine-tune recipe."""
    from transformers import AutoModelForCausalLM

    try:
        length = _original_length_kwargs(pretrained, kwargs)
        model = AutoModelForCausalLM.from_pretrained(pretrained, **length, **kwargs)
    except OSError as exc:
        raise OSError(
            f"cannot load model {pretrained!r}: {str(exc).splitlines()[0]} "
            "(a hub id needs network access or a local cache; offline, pass a local directory)"
        ) from exc
    if kwargs.get("gguf_file"):
        make_saveable(model)
    spec = take_saved_spec(model)
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
    from .finetune.model import prepare_for_adapter

    # a trained position table (GPT-2 + pi) is saved in modules_to_save: make it a parameter so it loads
    return PeftModel.from_pretrained(prepare_for_adapter(model, adapter_dir), adapter_dir)
