"""lm-evaluation-harness model type ``ctxext``: lm-eval's ``hf`` model, patched by ctxext.

    ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 --tasks TASKS

model_args: ``pretrained`` (hub id or directory), ``gguf_file``, ``adapter`` (a LoRA directory saved by a
ctxext fine-tune), ``method`` (``none`` for the unpatched model), ``factor``, the method's options by name
(e.g. ``beta_fast=32``), and any argument of lm-eval's ``hf`` model (``dtype``, ``batch_size``, ...).
A directory saved from a patched model is re-patched as saved unless ``method`` says otherwise.
``max_length`` (how much context lm-eval gives the model) is the patched length, not the original config.
A model object passed as ``pretrained`` is patched in place (lm-eval's hf model uses the object as it is), with a
warning. A per-sequence method (``dynamic-ntk``) runs with batch size 1 only.

Bad model_args are refused by :func:`check_model_args` before the model loads (``ctxext lm-eval`` runs the same
check before lm-eval loads any task): unknown keys (neither ctxext's, nor arguments of lm-eval's ``hf`` model, of
transformers' ``from_pretrained`` or attributes of the model's config, all read from the installed versions),
empty values, dtypes no loader knows, and the method, factor and options as ``ctxext.patch`` checks them.
:func:`check_model_args_items` refuses a key given twice or an item without ``=``. lm-eval passes model_args as
strings or as values parsed from them: a number-like ``factor`` string is converted to a number here, since
``ctxext.patch`` takes numbers only.

lm-eval 0.4.13 has no plugin discovery: importing this module registers the name. From Python:
``import ctxext.integrations.lm_eval`` before ``lm_eval.simple_evaluate(model="ctxext", ...)``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..api import describe, patch, unpatch
from ..compat import lm_eval as lm_eval_compat
from ..core.errors import PatchError
from ..loading import from_pretrained, load_adapter
from ..methods.registry import METHODS, accepted_options, resolve_method, validate_factor, validate_options
from ..data.sources import check_source

#: Every method option name ctxext knows (a model arg with one of these names is a method option, not an hf arg).
OPTION_NAMES = frozenset(k for m in METHODS.values() for k in accepted_options(m))


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
    _check_empty(args)
    for key, value in args.items():
        if key == "dtype" or key.endswith("_dtype"):
            check_dtype(key, value)
    local = isinstance(pretrained, (str, os.PathLike))  # not a model object (HFLM takes one, and ignores the kwargs)
    unknown = _unknown_keys(args) if local else []
    if unknown:  # before the patch checks: `Method=yarn,factor=4` is a misspelled key, not a factor without a method
        _check_pretrained(args)
        unknown = _not_for_the_model(unknown, args)  # the model's config may take them
        if unknown:
            raise ValueError(_unknown_message(unknown, args))
    _check_max_length(args.get("max_length"))
    checked = _check_patch(args.get("method"), args.get("factor"), {k: args[k] for k in args if k in OPTION_NAMES})
    if local:
        _check_pretrained(args)
        _check_tokenizer(args)
    adapter = args.get("adapter")
    if adapter is not None:
        from ..loading import adapter_files_missing

        folder = Path(str(adapter)).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"adapter: folder not found: {adapter} (a folder saved by `ctxext finetune`)")
        missing = adapter_files_missing(str(folder))  # the check ctxext eval and ctxext.from_pretrained make
        if missing:
            raise FileNotFoundError(f"adapter: {adapter}: {missing} (a folder saved by `ctxext finetune`)")
    return checked


def _check_pretrained(args: Mapping[str, Any]) -> None:
    revision = args.get("revision")
    check_source(args["pretrained"], gguf_file=args.get("gguf_file") or None,
                 revision=None if revision is None else str(revision), what="pretrained")


def _check_tokenizer(args: Mapping[str, Any]) -> None:
    """A local model folder without a tokenizer (``model.save_pretrained`` writes none) and no ``tokenizer=``: said
    before the model loads, not as a backend error after it."""
    from ..loading import TOKENIZER_FILES, lacks_tokenizer

    if not (args.get("tokenizer") or args.get("gguf_file")) and lacks_tokenizer(str(args["pretrained"])):
        raise FileNotFoundError(
            f"pretrained: {args['pretrained']} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...; "
            "model.save_pretrained writes none): pass tokenizer=FOLDER_OR_HUB_ID in model_args, or save the "
            "tokenizer beside the model")


def check_model_args_items(items: Iterable[str]) -> None:
    """Refuse a model_args item without ``=``, with no key, or a key given twice (lm-eval itself keeps the last
    value of a repeated key). ``items``: the ``key=value`` pieces of one command line or argument string."""
    seen: dict[str, str] = {}
    for item in items:
        if not item.strip():
            continue
        if "=" not in item:
            raise ValueError(f"model_args: {item.strip()!r} is not key=value (e.g. {item.strip()}=VALUE)")
        key, value = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(f"model_args: {item.strip()!r} has no key (model_args are key=value)")
        if key in seen:
            raise ValueError(f"model_args: {key} is given twice ({key}={seen[key]}, {key}={value}); give it once")
        seen[key] = value


def _ctxext_keys() -> list[str]:
    """ctxext's own model_args: the named parameters of :class:`CtxextLM` (method options are separate)."""
    return _named_parameters(CtxextLM.__init__)


def _hf_keys() -> list[str]:
    """lm-eval's ``hf`` model_args: the named parameters of ``HFLM.__init__``, as installed (the rest of its
    keyword arguments go to transformers' ``from_pretrained``)."""
    return _named_parameters(HFLM.__init__)


def _named_parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]


@functools.lru_cache(maxsize=None)
def _from_pretrained_keys() -> frozenset[str] | None:
    """The keyword arguments transformers' ``AutoModelForCausalLM.from_pretrained`` takes for itself (its named
    parameters and the ``kwargs.pop(...)`` / ``kwargs.get(...)`` names in its source, as installed); whatever else
    it is given goes to the model's config and then to the model's ``__init__``. None where the source cannot be
    read (then unknown keys are left for transformers to report)."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    names: set[str] = set()
    popped: set[str] = set()
    for function in (AutoModelForCausalLM.from_pretrained, PreTrainedModel.from_pretrained):
        names.update(_named_parameters(function)[1:])  # not the checkpoint (pretrained_model_name_or_path)
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            return None
        popped.update(re.findall(r"""kwargs\.(?:pop|get)\(\s*["'](\w+)["']""", source))
    if len(popped) < 5:  # the source no longer reads its kwargs this way: no basis to refuse anything
        return None
    return frozenset(n for n in names | popped if not n.startswith("_"))


def _unknown_keys(args: Mapping[str, Any]) -> list[str]:
    """Keys that neither ctxext, lm-eval's hf model nor transformers' from_pretrained take (the model's config
    may still: see :func:`_not_for_the_model`)."""
    loading = _from_pretrained_keys()
    if loading is None:
        return []
    known = set(_ctxext_keys()) | OPTION_NAMES | set(_hf_keys()) | loading
    return sorted(k for k in args if k not in known)


def _not_for_the_model(keys: list[str], args: Mapping[str, Any]) -> list[str]:
    """Of ``keys``, those the model's config has no attribute for and its ``__init__`` does not take: what
    ``from_pretrained`` would hand the model's ``__init__`` and fail on (a TypeError after everything loaded).
    The config is read as lm-eval reads it (no weights); where it or the model class cannot be found, nothing is
    refused here."""
    if not keys:
        return []
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..loading import load_config

    kwargs = {k: args[k] for k in ("revision", "trust_remote_code", "subfolder", "gguf_file") if args.get(k)}
    try:
        config = load_config(str(args["pretrained"]), **kwargs)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # noqa: BLE001 - remote code, an unknown family, ...: transformers reports it when it loads
        return []
    parameters = inspect.signature(model_class.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return []
    taken = {p.name for p in parameters}
    return [k for k in keys if not hasattr(config, k) and k not in taken]


def _unknown_message(unknown: list[str], args: Mapping[str, Any]) -> str:
    keys = ", ".join(unknown)
    try:
        method = resolve_method(str(args["method"])).name if args.get("method") is not None else None
    except PatchError:  # reported on its own once the key is fixed
        method = None
    pool = _ctxext_keys() + sorted(OPTION_NAMES) + _hf_keys() + sorted(_from_pretrained_keys() or ())
    if method is not None:
        pool = list(accepted_options(METHODS[method])) + pool
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, [p for p in pool if p not in args], n=1, cutoff=0.75)
        if close:
            hints.append(f"did you mean {close[0]}" + ("" if len(unknown) == 1 else f" for {key}"))
    hint = f" ({'; '.join(hints)}?)" if hints else ""
    hf = ", ".join(k for k in _hf_keys() if k not in _ctxext_keys())
    head = f"model_args: unknown key(s) {keys}{hint}"
    ours = "a ctxext key (" + ", ".join(_ctxext_keys()) + ", or a method's option: `ctxext methods`)"
    if method is not None:
        ours = "a ctxext key (" + ", ".join(_ctxext_keys()) + ")"
        try:
            validate_options(METHODS[method], {k: None for k in unknown})
        except PatchError as exc:  # "unknown option(s) ... for method 'yarn'; accepted: ..."
            head = f"model_args: {exc}{hint}"
    return (f"{head}; {keys} is not {ours}, an argument of lm-eval's hf model ({hf}), a keyword of transformers' "
            "from_pretrained (e.g. attn_implementation, device_map) or an attribute of the model's config")


def _check_empty(args: Mapping[str, Any]) -> None:
    """``key=`` (an empty value) is refused unless the argument's own default is empty (lm-eval's ``subfolder``)."""
    defaults = {p.name: p.default for p in inspect.signature(HFLM.__init__).parameters.values()}
    for key, value in args.items():
        if isinstance(value, str) and not value.strip() and defaults.get(key) != "":
            raise ValueError(f"model_args: {key}= has no value (e.g. {_EXAMPLES.get(key, key + '=VALUE')})")


_EXAMPLES = {"factor": "factor=4", "method": "method=yarn", "dtype": "dtype=bfloat16", "batch_size": "batch_size=8"}


def _float_dtype_names() -> list[str]:
    """``ctxext eval``'s dtypes, then every other name of a floating-point torch dtype (what lm-eval's hf model
    hands transformers: ``getattr(torch, name)``)."""
    from ..evaluation.device import DTYPES

    names = [n for n in DTYPES if n != "auto"]
    extra = sorted(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)
                   and getattr(torch, n).is_floating_point and n not in names)
    return names + extra


def check_dtype(key: str, value: Any) -> None:
    """A dtype model_arg (``dtype``, ``softmax_dtype``, ``mixed_precision_dtype``, ...): None, a torch dtype, a
    floating-point torch dtype name, or (for ``dtype`` / ``torch_dtype``) ``auto``, as ``ctxext eval --dtype``
    checks with :func:`ctxext.evaluation.device.resolve_dtype` (which knows the common four)."""
    from ..evaluation.device import resolve_dtype

    if value is None or isinstance(value, torch.dtype):
        return
    with_auto = key in ("dtype", "torch_dtype")
    if isinstance(value, str):
        name = value.strip()
        if name == "auto":
            if with_auto:
                return
        else:
            try:
                resolve_dtype(name)  # ctxext eval's dtypes
                return
            except ValueError:
                if name in _float_dtype_names():
                    return
    accepted = (["auto"] if with_auto else []) + _float_dtype_names()
    raise ValueError(f"model_args: {key}={value} is not a dtype lm-eval's hf model can load; accepted: "
                     f"{', '.join(accepted)}")


def _check_max_length(value: Any) -> None:
    """``max_length`` (the context lm-eval gives the model): a whole number of tokens, at least 1."""
    if value is None:
        return
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"model_args: max_length={value} must be a whole number of tokens, at least 1 (the context "
                         "lm-eval gives the model; without it: the patched length)")


def check_batch(method: str | None, batch_size: Any) -> None:
    """A method whose frequencies follow each sequence's length (dynamic-ntk) needs one sequence per batch: lm-eval's
    hf model right-pads a batch to its longest row and passes no attention mask for loglikelihoods, so the scale (and
    every score) would depend on which requests share the batch."""
    if method is None or not getattr(METHODS.get(method), "per_sequence", False):
        return
    if batch_size is not None and str(batch_size).strip() not in ("1", "1.0"):
        raise ValueError(f"{method} scales its frequencies by each sequence's length, and lm-eval pads a batch to "
                         f"its longest row: scores would depend on the batch; use batch size 1 (got {batch_size})")


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


lm_eval_compat.check_hflm_hooks(HFLM)  # the two private methods CtxextLM overrides


@register_model("ctxext")
class CtxextLM(HFLM):
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's, refusing an item without ``=`` or a key given twice (lm-eval keeps the last silently)."""
        if isinstance(arg_string, str):
            check_model_args_items(arg_string.split(","))  # as lm_eval.utils.simple_parse_args_string splits
        return super().create_from_arg_string(arg_string, additional_config)

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
        check_batch(checked["method"], kwargs.get("batch_size"))
        if checked["method"] is not None and isinstance(pretrained, torch.nn.Module):
            # HFLM evaluates a model object as it is, so the patch lands on the caller's object
            warnings.warn(f"CtxextLM patches the model object passed as pretrained= in place ({checked['method']}); "
                          "call ctxext.unpatch(model) afterwards, or pass a copy", UserWarning, stacklevel=2)
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm-eval passes its --device default (cuda:0) even on machines without CUDA
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=pretrained, device=device, **kwargs)
        model = lm_eval_compat.loaded_model(self)
        if adapter is not None:
            model = load_adapter(model, str(adapter))
            lm_eval_compat.replace_model(self, model)
        if method is not None:  # method=none: the unpatched model, even from a folder saved patched
            if describe(model) is not None:
                unpatch(model)
            if checked["method"] is not None:
                patch(model, checked["method"], checked["factor"], **options)
        self.ctxext_spec = describe(model)

    def _get_config(self, pretrained, *, revision="main", trust_remote_code=False, gguf_file=None, subfolder="", **kw):
        """lm-eval reads the config with AutoConfig, which refuses a checkpoint saved patched (on purpose: see
        ctxext.core.spec); ctxext's loader reads it as it was before the patch."""
        if not isinstance(pretrained, str):
            return super()._get_config(pretrained, revision=revision, trust_remote_code=trust_remote_code,
                                       gguf_file=gguf_file, subfolder=subfolder, **kw)
        from ..loading import load_config

        config = load_config(pretrained, revision=revision, trust_remote_code=trust_remote_code, gguf_file=gguf_file,
                             subfolder=subfolder)
        lm_eval_compat.set_config(self, config)

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
        if lm_eval_compat.max_length_argument(self):
            return lm_eval_compat.max_length_argument(self)
        spec = describe(lm_eval_compat.loaded_model(self))
        if spec and spec.get("patched_length"):
            return int(spec["patched_length"])
        return super().max_length

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["ctxext_patch"] = self.ctxext_spec
        return info
