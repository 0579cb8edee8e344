"""lm-evaluation-harness model type ``ctxext``: lm-eval's ``hf`` model, patched by ctxext.

    ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 --tasks TASKS

model_args: ``pretrained`` (hub id or directory), ``gguf_file``, ``adapter`` (a LoRA directory saved by a
ctxext fine-tune), ``method`` (``none`` for the unpatched model), ``factor``, the method's options by name
(e.g. ``beta_fast=32``), and any argument of lm-eval's ``hf`` model (``dtype``, ``batch_size``, ...).
A directory saved from a patched model is re-patched as saved unless ``method`` says otherwise.
``max_length`` (how much context lm-eval gives the model) is the patched length, not the original config.

Bad model_args are refused by :func:`check_model_args` before the model loads (``ctxext lm-eval`` runs the same
check before lm-eval loads any task). lm-eval passes model_args as strings or as values parsed from them: a
number-like ``factor`` string is converted to a number here, since ``ctxext.patch`` takes numbers only.

lm-eval 0.4.13 has no plugin discovery: importing this module registers the name. From Python:
``import ctxext.lm_eval_model`` before ``lm_eval.simple_evaluate(model="ctxext", ...)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .api import describe, patch, unpatch
from .loading import from_pretrained, load_adapter
from .registry import METHODS, resolve_method, validate_factor, validate_options
from .sources import check_source

#: Every method option name ctxext knows (a model arg with one of these names is a method option, not an hf arg).
OPTION_NAMES = frozenset(k for m in METHODS.values() for k in m.options)


def _number(value: Any) -> Any:
    """A number-like string from lm-eval's model_args (``"4"``, ``"2.5"``) as a float; anything else unchanged,
    so the registry reports it with its own message. ``ctxext.patch`` itself takes numbers only."""
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


def check_model_args(model_args: Mapping[str, Any]) -> dict[str, Any]:
    """Validate the ``ctxext`` model type's model_args before anything loads; raise ``ValueError`` (``PatchError``)
    or ``OSError`` (``FileNotFoundError``) with a one-line message on bad input.

    Used by ``ctxext lm-eval`` before lm-eval loads any task, and by :class:`CtxextLM` itself, so
    ``lm_eval.simple_evaluate(model="ctxext", model_args=...)`` refuses with the same messages. Returns
    ``{"method": canonical name or None, "factor": float or None, "options": {...}}``; ``options`` holds only the
    options given (the rest keep their defaults in ``patch``).
    """
    args = dict(model_args)
    pretrained = args.get("pretrained")
    if pretrained is None or (isinstance(pretrained, str) and not pretrained.strip()):
        raise ValueError("model_args: pretrained= is required (a local folder, a hub id, or a folder with gguf_file=), "
                         "e.g. --model_args pretrained=DIR,method=yarn,factor=4")
    checked = _check_patch(args.get("method"), args.get("factor"), {k: args[k] for k in args if k in OPTION_NAMES})
    if isinstance(pretrained, (str, os.PathLike)):  # not a model object (HFLM accepts one)
        revision = args.get("revision")
        check_source(pretrained, gguf_file=args.get("gguf_file") or None,
                     revision=None if revision is None else str(revision), what="pretrained")
    adapter = args.get("adapter")
    if adapter is not None:
        folder = Path(str(adapter)).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"adapter: folder not found: {adapter} (a folder saved by `ctxext finetune`)")
        if not (folder / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"adapter: {adapter} has no adapter_config.json (a folder saved by `ctxext finetune`)"
            )
    return checked


def _check_patch(method: Any, factor: Any, options: dict[str, Any]) -> dict[str, Any]:
    if method is None or (isinstance(method, str) and method.strip().lower() == "none"):
        if factor is not None:
            raise ValueError(f"factor={factor} given without method= (e.g. method=yarn,factor={factor}); "
                             "method=none evaluates the unpatched model")
        if options:
            raise ValueError(f"method option(s) {', '.join(sorted(options))} given without method=")
        return {"method": None, "factor": None, "options": {}}
    info = resolve_method(str(method))
    factor = validate_factor(info, _number(factor))
    resolved = validate_options(info, options)  # another method's option, or a value of the wrong type, raises
    return {"method": info.name, "factor": factor, "options": {k: resolved[k] for k in options}}


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
        pretrained: Any = None,  # required; checked by check_model_args, so a missing one gets its message
        method: str | None = None,
        factor: float | None = None,
        adapter: str | None = None,
        device: str | None = None,
        **kwargs: Any,
    ) -> None:
        checked = check_model_args({"pretrained": pretrained, "method": method, "factor": factor,
                                     "adapter": adapter, **kwargs})
        options = checked["options"]
        for key in options:
            kwargs.pop(key)
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm-eval passes its --device default (cuda:0) even on machines without CUDA
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=pretrained, device=device, **kwargs)
        model = self._model
        if adapter is not None:
            self._model = model = load_adapter(model, str(adapter))
        if method is not None:  # method=none: the unpatched model, even from a folder saved patched
            if describe(model) is not None:
                unpatch(model)
            if checked["method"] is not None:
                patch(model, checked["method"], checked["factor"], **options)
        self.ctxext_spec = describe(model)

    def _get_config(self, pretrained, *, revision="main", trust_remote_code=False, gguf_file=None, subfolder="", **kw):
        """lm-eval reads the config with AutoConfig, which refuses a checkpoint saved patched (on purpose: see
        ctxext.spec); ctxext's loader reads it as it was before the patch."""
        if not isinstance(pretrained, str):
            return super()._get_config(pretrained, revision=revision, trust_remote_code=trust_remote_code,
                                       gguf_file=gguf_file, subfolder=subfolder, **kw)
        from .loading import load_config

        self._config = load_config(pretrained, revision=revision, trust_remote_code=trust_remote_code,
                                   gguf_file=gguf_file, subfolder=subfolder)

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
