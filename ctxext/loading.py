"""Loading models (and patched models) from the hub, a local directory or a GGUF file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from .api import patch, take_saved_spec
from .compat import transformers as hf_compat
from .core.errors import PatchError
from .data.sources import check_source
from .core.shipped import check_name, reference_name, reference_path
from .export import ADAPTER_RECORD, read_adapter_record
from .core.spec import (CONFIG_KEY, LENGTH_ABSENT_KEY, TENSORS_KEY, PatchSpec, check_saved_config, is_native,
                        unmark_config_dict)


def auto_tokenizer(source: Any, **kwargs: Any):
    """``AutoTokenizer.from_pretrained``, which also reads a tokenizer saved by transformers 5.x
    (``tokenizer_class: TokenizersBackend``, a class 4.x does not have) on a transformers without that class: the
    same ``tokenizer.json`` through ``PreTrainedTokenizerFast.from_pretrained``."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    except ValueError as exc:
        if hasattr(transformers, "TokenizersBackend") or "TokenizersBackend" not in str(exc):
            raise
        return transformers.PreTrainedTokenizerFast.from_pretrained(source, **kwargs)


def make_saveable(model: nn.Module) -> None:
    """GGUF weights are dequantized on load, but transformers keeps a quantizer marker that blocks
    ``save_pretrained``; drop it so a patched GGUF model can be saved as ordinary safetensors."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and "gguf" in type(quantizer).__name__.lower():
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")


_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "local_files_only", "revision", "subfolder")
#: from_pretrained kwargs that AutoModelForCausalLM hands to the model itself, not to the config.
_MODEL_ONLY_KWARGS = ("dtype", "torch_dtype", "quantization_config", "trust_remote_code", "code_revision",
                      "adapter_kwargs")


def _check_source(pretrained: Any, kwargs: dict[str, Any]) -> None:
    """A missing folder, a missing GGUF file or a hub id offline fails at once (not after download retries)."""
    if "config" in kwargs or not isinstance(pretrained, (str, os.PathLike)):
        return
    subfolder = kwargs.get("subfolder")
    if subfolder:
        if not os.path.isdir(os.path.expanduser(os.fspath(pretrained))):
            return  # a hub id with a subfolder: transformers resolves it
        pretrained = os.path.join(os.fspath(pretrained), subfolder)
    revision = kwargs.get("revision")
    check_source(pretrained, gguf_file=kwargs.get("gguf_file") or None,
                 revision=None if revision is None else str(revision))


def _config_file(pretrained: Any, kwargs: dict[str, Any]) -> str:
    """Where a checkpoint's config.json is, for messages: the file of a local folder, else ``config.json of ID``."""
    folder = os.path.expanduser(os.fspath(pretrained))
    if os.path.isdir(folder):
        return os.path.join(folder, kwargs.get("subfolder") or "", "config.json")
    return f"config.json of {os.fspath(pretrained)}"


def _saved_config_dict(pretrained: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The raw config.json of a checkpoint saved from a ctxext-patched model (marked or not), else None. A ctxext
    record that this ctxext cannot read as written (damaged, or from a newer ctxext) is a PatchError naming the file
    and the key (``ctxext.core.spec.check_saved_config``), not a model loaded without it."""
    if kwargs.get("gguf_file") or "config" in kwargs or not isinstance(pretrained, (str, os.PathLike)):
        return None
    from .core.spec import transformers_config_class

    try:
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        config_dict, _ = transformers_config_class().get_config_dict(pretrained, **hub)
    except Exception:  # noqa: BLE001 - from_pretrained reports the real problem
        return None
    if not isinstance(config_dict, dict) or CONFIG_KEY not in config_dict:
        return None
    check_saved_config(config_dict, f" in {_config_file(pretrained, kwargs)}")
    return config_dict


def _holds_replaced_tensors(config_dict: dict[str, Any]) -> bool:
    """A native export whose weights are the patched ones (GPT-2's resized table), the originals beside them."""
    return is_native(config_dict) and bool(config_dict[CONFIG_KEY].get(TENSORS_KEY))


class UnknownModelType(OSError):
    """A checkpoint saved patched from a model type this transformers does not know (the message says so whole)."""


def _config_from_saved(pretrained: Any, config_dict: dict[str, Any], kwargs: dict[str, Any], *,
                       as_saved: bool = False):
    """The config of a checkpoint saved patched, as the model had it *before* the patch (save mark or native form
    undone, the advertised length back to the original: GPT-2 sizes its position table from it, and the checkpoint
    holds the original table), with the spec still recorded under ``config.ctxext``. ``as_saved``: the config as
    written (a native export whose weights were replaced loads as saved; ``ctxext.export`` then puts the originals
    back). Returns ``(config, unused_kwargs)``, as ``AutoConfig.from_pretrained(..., return_unused_kwargs=True)``
    does."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .adapters import adapter_for_family

    if as_saved:
        data = dict(config_dict)
        data[CONFIG_KEY] = PatchSpec.from_dict(data[CONFIG_KEY]).to_dict()
    else:
        data = unmark_config_dict(dict(config_dict))
        spec = PatchSpec.from_dict(data[CONFIG_KEY])
        adapter = adapter_for_family(spec.family)
        if adapter is not None and adapter.length_attr and data[CONFIG_KEY].get(LENGTH_ABSENT_KEY) is True:
            data.pop(adapter.length_attr, None)  # the config had none before the patch (BLOOM)
        elif adapter is not None and adapter.length_attr and spec.original_length is not None:
            data[adapter.length_attr] = spec.original_length
    model_type = data.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UnknownModelType(
            f"cannot load model {str(pretrained)!r}: it was saved patched by ctxext from a model of type "
            f"{model_type!r}, which this transformers does not know"
        )
    config_kwargs = {k: v for k, v in kwargs.items() if k not in _HUB_KWARGS and k not in _MODEL_ONLY_KWARGS}
    return CONFIG_MAPPING[model_type].from_dict(
        data, return_unused_kwargs=True, name_or_path=str(pretrained), **config_kwargs
    )


def load_config(pretrained: str, **kwargs: Any):
    """``AutoConfig.from_pretrained`` that also reads checkpoints saved from a ctxext-patched model (whose
    ``config.json`` plain transformers refuses): their config comes back as it was before the patch, with the
    spec in ``config.ctxext`` (``take_saved_spec`` / ``from_pretrained`` use it)."""
    from transformers import AutoConfig

    _check_source(pretrained, kwargs)
    saved = _saved_config_dict(pretrained, kwargs)
    if saved is None:
        return AutoConfig.from_pretrained(pretrained, **kwargs)
    config, _ = _config_from_saved(pretrained, saved, kwargs)
    return config


def model_skeleton(pretrained: str, *, attn_implementation: str | None = None, **kwargs: Any) -> nn.Module:
    """The model without weights: parameters on the meta device, buffers real
    (``accelerate.init_empty_weights(include_buffers=False)``), so it costs no memory for the weights yet has the
    rotary ``inv_freq`` buffers, the position tables' shapes and the config that the adapters inspect. A saved ctxext
    patch is taken off (as loading does before it re-applies it). For checks before anything loads: whether a patch
    fits, the original length. Raises OSError where the config cannot be read."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    _check_source(pretrained, kwargs)  # its message as it is
    try:
        config = load_config(pretrained, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OSError(f"cannot read the config of {pretrained!r}: {first}") from exc
    if attn_implementation:
        hf_compat.set_attn_implementation(config, attn_implementation)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=bool(kwargs.get("trust_remote_code")))
    take_saved_spec(model)
    return model


def from_pretrained(pretrained: str, *, adapter: str | None = None, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` (same kwargs, ``gguf_file`` included) that re-applies a saved
    ctxext patch, and optionally loads a LoRA adapter directory saved by a ctxext fine-tune recipe (or by peft's
    ``save_pretrained`` of a patched model: both write the patch record ``ctxext_patch.json`` beside it).

    ``pretrained`` may name a reference checkpoint shipped in the package as the commands do, ``reference:NAME``
    (``ctxext.reference``): loaded in float32 unless a ``dtype`` is given (it is stored in 16 bits), and recorded
    under that portable name (``model.name_or_path``), which an adapter saved from it then names as its base.

    The source is checked first (``ctxext.data.sources.check_source``): a missing folder or GGUF file, or a hub id with
    no network, fails at once with a message saying what to pass instead."""
    from transformers import AutoModelForCausalLM

    shipped = reference_name(pretrained) if isinstance(pretrained, str) else None
    if shipped is not None:
        name, pretrained = f"reference:{check_name(shipped)}", str(reference_path(shipped))  # else ValueError /
        # FileNotFoundError saying why not
        kwargs = dict(kwargs)
        kwargs.setdefault("local_files_only", True)
        if "dtype" not in kwargs and "torch_dtype" not in kwargs:
            import torch

            kwargs["dtype"] = (_trained_dtype(adapter) if adapter is not None else None) or torch.float32
        model = from_pretrained(pretrained, **kwargs)
        name_model(model, name)
        return model if adapter is None else load_adapter(model, adapter)
    _check_source(pretrained, kwargs)
    if adapter is not None and "dtype" not in kwargs and "torch_dtype" not in kwargs:
        trained = _trained_dtype(adapter)
        if trained is not None:  # as the adapter was trained, not as the base's config says (often 16-bit)
            kwargs = dict(kwargs, dtype=trained)
    as_loaded = None  # a native export's tensors as saved, checked against the ones the patch rebuilds
    saved = _saved_config_dict(pretrained, kwargs)  # a damaged or newer ctxext record: its own PatchError
    try:
        if saved is not None:
            as_saved = _holds_replaced_tensors(saved)
            config, unused = _config_from_saved(pretrained, saved, kwargs, as_saved=as_saved)
            load_kwargs = {k: v for k, v in kwargs.items() if k in _HUB_KWARGS or k in _MODEL_ONLY_KWARGS}
            model = AutoModelForCausalLM.from_pretrained(pretrained, config=config, **load_kwargs, **unused)
            if as_saved:
                from .export import restore_original_tensors

                hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
                as_loaded = restore_original_tensors(model, pretrained, saved[CONFIG_KEY], hub)
        else:
            model = AutoModelForCausalLM.from_pretrained(pretrained, **kwargs)
    except UnknownModelType:
        raise
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
        if as_loaded:
            from .export import check_rebuilt_tensors

            check_rebuilt_tensors(model, as_loaded, pretrained)
        if saved is not None and is_native(saved):
            from .export import check_rebuilt_config

            check_rebuilt_config(model, saved, pretrained)
    if adapter is not None:
        model = load_adapter(model, adapter)
    return model


def _trained_dtype(adapter_dir: str):
    """The weights dtype a ctxext fine-tune trained the adapter's base in (``model.dtype`` of the ``recipe.yaml`` it
    saves beside the adapter), or None where there is no such record or it says ``auto``."""
    import torch
    import yaml
    from pathlib import Path

    try:
        recipe = yaml.safe_load((Path(adapter_dir) / "recipe.yaml").read_text(encoding="utf-8"))
        name = recipe["model"]["dtype"]
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None
    return getattr(torch, name) if name in ("float32", "bfloat16", "float16") else None


def name_model(model: nn.Module, name: str) -> None:
    """Record ``name`` as where ``model`` was loaded from (``model.name_or_path`` and its config's): peft writes it
    as the base of an adapter saved from the model (``adapter_config.json``'s ``base_model_name_or_path``, the model
    card's ``base_model``), so a portable name (``reference:llama``) is recorded there, not this machine's folder."""
    from .export import install_adapter_record

    model.name_or_path = name
    config = getattr(model, "config", None)
    if config is not None and hasattr(type(config), "name_or_path"):
        config.name_or_path = name
    install_adapter_record()  # peft's save then says nothing about that name (it finds no config.json under it)


#: Files a ctxext fine-tune writes beside its adapter that say which patch it trained with (first found first).
RUN_RECORDS = ("results.json", "log.jsonl", "recipe.yaml")


def _recorded_patch(adapter_dir: str) -> tuple[str, str, Any] | None:
    """Where an adapter folder whose ``ctxext_patch.json`` is missing still says it was trained patched: the file
    a ctxext fine-tune wrote beside it (``results.json``'s ``patch``, ``log.jsonl``'s start record, ``recipe.yaml``'s
    ``patch.method``), the method and the factor; None where none of them records a patch."""
    import json
    from pathlib import Path

    folder = Path(adapter_dir)

    def read(name: str) -> Any:
        path = folder / name
        if not path.is_file():
            return None
        try:
            text = path.read_text(encoding="utf-8-sig")
            if name == "recipe.yaml":
                import yaml

                recipe = yaml.safe_load(text)
                return recipe.get("patch") if isinstance(recipe, dict) else None
            if name == "log.jsonl":
                for line in text.splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and row.get("event") == "start":
                        return row.get("patch")
                return None
            result = json.loads(text)
            return result.get("patch") if isinstance(result, dict) else None
        except Exception:  # noqa: BLE001 - an unreadable run record is no evidence either way
            return None

    for name in RUN_RECORDS:
        patch_record = read(name)
        if isinstance(patch_record, dict) and isinstance(patch_record.get("method"), str) \
                and patch_record["method"] not in ("", "none"):
            return name, patch_record["method"], patch_record.get("factor")
    return None


def _same_patch(active: dict[str, Any] | None, method: str, factor: Any) -> bool:
    """Whether the model's active patch is ``method`` (a name or alias) at ``factor`` (None: any)."""
    if active is None:
        return False
    try:
        from .methods.registry import resolve_method

        method = resolve_method(method).name
    except Exception:  # noqa: BLE001 - a name this ctxext does not know is not the active one
        return False
    return active["method"] == method and (factor is None or active["factor"] == factor)


def _factor_text(factor: Any) -> str:
    return f" x{factor:g}" if isinstance(factor, (int, float)) and not isinstance(factor, bool) else ""


def lost_adapter_record(adapter_dir: str, active: dict[str, Any] | None = None) -> str | None:
    """Why an adapter folder cannot be loaded onto a model with the patch ``active`` (``ctxext.describe``'s dict, None:
    unpatched): its ``ctxext_patch.json`` is missing while the files of the ctxext fine-tune that trained it
    (``RUN_RECORDS``) say it was trained with another patch. None where it can (the record is there, or nothing says
    the adapter was trained patched, or the model has that patch). Reads no weights: a command can ask before it
    loads the model."""
    from pathlib import Path

    spec_file = Path(adapter_dir) / ADAPTER_RECORD
    if spec_file.exists():
        return None
    evidence = _recorded_patch(adapter_dir)
    if evidence is None or _same_patch(active, *evidence[1:]):
        return None
    source, method, factor = evidence
    now = "unpatched" if active is None else f"patched with {active['method']}{_factor_text(active['factor'])}"
    return (f"adapter {adapter_dir}: its {source} says it was trained with {method}{_factor_text(factor)}, but "
            f"{spec_file.name}, the record from which ctxext applies that patch again, is missing: loaded on the "
            f"{now} model, the adapter would run on another model than the one it was trained on. Restore "
            f"{spec_file.name} from the training run's output")


def load_adapter(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Load a peft (LoRA) adapter onto ``model``; apply the patch recorded beside it (``ctxext_patch.json``) if the
    model has none. An adapter folder without that record whose fine-tune's own files (``RUN_RECORDS``) say it was
    trained patched is refused, naming the file and the patch, unless the model already has that patch: loaded
    unpatched it would run another model than the one it was trained on."""
    from .api import describe

    if not (Path(adapter_dir) / ADAPTER_RECORD).exists() and _recorded_patch(adapter_dir) is not None:
        refusal = lost_adapter_record(adapter_dir, describe(model))  # (describe: a transformers model)
        if refusal is not None:
            raise PatchError(refusal)
    try:
        spec = read_adapter_record(adapter_dir)
    except PatchError as exc:
        raise PatchError(f"adapter {adapter_dir}: {exc}") from None
    if spec is not None:
        active = describe(model)
        if active is None:
            patch(model, spec.method, spec.factor, **spec.options)
        elif (active["method"], active["factor"]) != (spec.method, spec.factor):
            raise PatchError(
                f"adapter {adapter_dir} was trained with {spec.method} x{spec.factor}, "
                f"but the model is patched with {active['method']} x{active['factor']}"
            )
        elif active["options"] != (recorded := spec.to_dict()["options"]):  # both with derived settings filled in
            differ = sorted(k for k in set(active["options"]) | set(recorded)
                            if active["options"].get(k) != recorded.get(k))
            raise PatchError(
                f"adapter {adapter_dir} was trained with {spec.method} x{spec.factor} and other options: "
                + ", ".join(f"{k}={recorded.get(k)!r} (the model: {active['options'].get(k)!r})" for k in differ)
            )
    try:
        from peft import PeftModel
    except ImportError as exc:  # pragma: no cover - peft is a declared extra
        raise ImportError("loading an adapter needs peft: pip install 'ctxext[finetune]'") from exc
    from .core.outputs import file_damage

    missing = adapter_files_missing(adapter_dir) if Path(adapter_dir).is_dir() else None  # else a hub id: peft's
    if missing:  # peft would look for them on the hub under the folder's name
        raise FileNotFoundError(f"adapter {adapter_dir}: {missing}")
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        path = Path(adapter_dir) / name
        why = file_damage(path) if path.exists() else None
        if why is not None:
            raise ValueError(f"adapter {adapter_dir}: {path} is damaged ({why}); train it again or use an intact copy")
    unsafe = _pickled_weights_refusal(adapter_dir) if Path(adapter_dir).is_dir() else None
    if unsafe:  # before peft wraps the model: it would raise this as a traceback advising an unsafe load
        raise ValueError(f"adapter {adapter_dir}: {unsafe}")
    from .compat.transformers import peft_wrap_quietly

    with peft_wrap_quietly():  # peft reads a property transformers deprecated
        return PeftModel.from_pretrained(prepare_for_adapter(model, adapter_dir), adapter_dir)


def _pickled_weights_refusal(adapter_dir: str) -> str | None:
    """Why peft cannot load the adapter's ``adapter_model.bin`` (read only without adapter_model.safetensors) with
    torch's safe loader, or None. Unpickles it as peft does (weights_only=True: no code runs); a torch.save archive
    memory-mapped, so that its tensor data is not read."""
    import pickle
    import zipfile

    import torch

    from .core.torch_files import UNREADABLE, unreadable_reason

    folder = Path(adapter_dir)
    path = folder / "adapter_model.bin"
    if (folder / "adapter_model.safetensors").exists() or not path.is_file():
        return None
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except UNREADABLE as exc:
        reason = unreadable_reason(path, exc)
        if isinstance(exc, pickle.UnpicklingError) and "GLOBAL" in reason:
            return (f"{path.name} is a pickle that torch's safe loader refuses ({reason}); re-save the adapter as "
                    "adapter_model.safetensors")
        return f"{path.name} is {reason}" if reason.startswith("a ") else f"{path.name} cannot be read ({reason})"
    return None


#: Files from which transformers builds a tokenizer (one is enough)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def lacks_tokenizer(folder: str | os.PathLike) -> bool:
    """A local model folder with no tokenizer file (``model.save_pretrained`` writes none)."""
    from pathlib import Path

    folder = Path(folder).expanduser()
    return folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES)


def adapter_files_missing(adapter_dir: str) -> str | None:
    """What a local peft adapter folder lacks (its config, or weights), else None."""
    from pathlib import Path

    folder = Path(adapter_dir)
    if not (folder / "adapter_config.json").is_file():
        return "not a LoRA adapter folder (no adapter_config.json)"
    if not any((folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        return "no adapter weights (adapter_model.safetensors or adapter_model.bin)"
    return None


def prepare_for_adapter(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Before ``PeftModel.from_pretrained(model, adapter_dir)`` on a patched model: let the family turn the patched
    modules the adapter trained (its ``modules_to_save``, e.g. GPT-2's interpolated table) into parameters, so
    their trained values load. A no-op otherwise."""
    import json
    from pathlib import Path

    from .adapters import adapter_for

    config = Path(adapter_dir) / "adapter_config.json"
    if not config.exists():
        return model
    names = json.loads(config.read_text()).get("modules_to_save") or []
    if names:
        get_base = getattr(model, "get_base_model", None)
        plain = get_base() if callable(get_base) else model
        adapter_for(plain).make_trainable(plain, list(names))
    return model
