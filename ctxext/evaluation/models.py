"""Loading the model and tokenizer to evaluate (hub id, local directory, GGUF file, LoRA adapter)."""

from __future__ import annotations

from typing import Any

from .device import move_model, placement_kwargs, resolve_dtype


def load_tokenizer(model_id: str, *, gguf_file: str | None = None):
    from ..loading import auto_tokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = auto_tokenizer(model_id, **kwargs)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OSError(
            f"cannot load the tokenizer of {model_id!r}: {first} "
            "(a hub id needs network access or a local cache; offline, pass a local directory)"
        ) from exc
    return tokenizer


def load_model(
    model_id: str, *, gguf_file: str | None = None, adapter: str | None = None, dtype: str | None = None,
    device: str = "cpu", state=None,
):
    """The model, in eval mode, with a saved ctxext patch re-applied and ``adapter`` (a LoRA dir) loaded."""
    from pathlib import Path

    from ..loading import from_pretrained

    if adapter is not None and not Path(adapter).is_dir():
        raise FileNotFoundError(f"adapter directory not found: {adapter}")
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype)}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    kwargs.update(placement_kwargs(device, state))
    model = from_pretrained(model_id, adapter=adapter, **kwargs)
    model = move_model(model, device, state)
    return model.eval()


def model_info(model, model_id: str, **extra: Any) -> dict[str, Any]:
    """What the results JSON says about a model."""
    from ..adapters import config_length, find_adapter
    from ..api import base_model, describe
    from ..core.errors import PatchError

    base = base_model(model)
    spec = describe(model)
    try:
        adapter = find_adapter(base)
        family, original = adapter.family, adapter.original_length(base)
    except PatchError:  # no adapter: only the unpatched model can be evaluated
        family, original = None, config_length(base.config)
    if spec:
        original = spec["original_length"]
    params = sum(p.numel() for p in base.parameters())
    info = {
        "label": extra.pop("label", None) or model_id,
        "model": model_id,
        "architecture": type(base).__name__,
        "family": family,
        "original_length": original,
        "parameters": params,
        "dtype": str(next(base.parameters()).dtype).replace("torch.", ""),
        "loaded_patch": spec,
    }
    info.update({k: v for k, v in extra.items() if v is not None})
    return info
