"""lm-evaluation-harness model type ``ctxext``: lm-eval's ``hf`` model, patched by ctxext.

    ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 --tasks TASKS

model_args: ``pretrained`` (hub id or directory), ``gguf_file``, ``adapter`` (a LoRA directory saved by a
ctxext fine-tune), ``method`` (``none`` for the unpatched model), ``factor``, the method's options by name
(e.g. ``beta_fast=32``), and any argument of lm-eval's ``hf`` model (``dtype``, ``batch_size``, ...).
A directory saved from a patched model is re-patched as saved unless ``method`` says otherwise.
``max_length`` (how much context lm-eval gives the model) is the patched length, not the original config.

lm-eval 0.4.13 has no plugin discovery: importing this module registers the name. From Python:
``import ctxext.lm_eval_model`` before ``lm_eval.simple_evaluate(model="ctxext", ...)``.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .api import describe, patch, unpatch
from .loading import from_pretrained, load_adapter
from .registry import METHODS, resolve_method


class _CtxextAutoModel:
    """Stands in for AutoModelForCausalLM inside HFLM: loads through ``ctxext.from_pretrained``, so a model
    saved patched comes back patched (and GPT-2 tables and GGUF markers are handled as ctxext does)."""

    @staticmethod
    def from_pretrained(pretrained, **kwargs):
        return from_pretrained(pretrained, **kwargs)


@register_model("ctxext")
class CtxextLM(HFLM):
    def __init__(
        self,
        pretrained: Any,
        method: str | None = None,
        factor: float | None = None,
        adapter: str | None = None,
        device: str | None = None,
        **kwargs: Any,
    ) -> None:
        options = {}
        if method is not None and str(method).lower() != "none":
            info = resolve_method(str(method))
            options = {k: kwargs.pop(k) for k in list(kwargs) if k in info.options}
        else:
            known = {k for m in METHODS.values() for k in m.options}
            stray = sorted(set(kwargs) & known)
            if stray:
                raise ValueError(f"method option(s) {', '.join(stray)} given without method=")
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm-eval passes its --device default (cuda:0) even on machines without CUDA
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=pretrained, device=device, **kwargs)
        model = self._model
        if adapter is not None:
            self._model = model = load_adapter(model, str(adapter))
        if method is not None:
            if describe(model) is not None:
                unpatch(model)
            if str(method).lower() != "none":
                patch(model, str(method), factor, **options)
        self.ctxext_spec = describe(model)

    def _create_model(self, pretrained, *args, **kwargs):
        if not isinstance(pretrained, str) or self.AUTO_MODEL_CLASS is not transformers.AutoModelForCausalLM:
            return super()._create_model(pretrained, *args, **kwargs)
        self.AUTO_MODEL_CLASS = _CtxextAutoModel
        try:
            return super()._create_model(pretrained, *args, **kwargs)
        finally:
            self.AUTO_MODEL_CLASS = transformers.AutoModelForCausalLM

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        spec = describe(self._model)
        if spec and spec.get("patched_length"):
            return int(spec["patched_length"])
        return super().max_length

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["ctxext_patch"] = self.ctxext_spec
        return info
