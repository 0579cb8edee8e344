"""Recipes: YAML files read into dataclasses, validated before anything is loaded or trained.

A recipe has seven sections (``model``, ``patch``, ``lora``, ``data``, ``train``, ``eval``, ``output``);
every key is typed and checked, unknown keys are errors, and ``--set a.b=value`` overrides any key
(the value is read as YAML: ``4``, ``2e-4``, ``[q_proj, v_proj]``, ``null``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml


class RecipeError(ValueError):
    """A recipe that cannot run: unknown key, wrong type, missing data, a patch that does not fit."""


@dataclass
class ModelConfig:
    #: hub id, local directory, directory holding ``gguf_file``, or ``reference:llama`` / ``reference:gpt2`` / ...
    name: str = ""
    gguf_file: Optional[str] = None
    #: tokenizer source; default: the model's
    tokenizer: Optional[str] = None
    #: weights dtype: float32, bfloat16, float16 or auto
    dtype: str = "float32"
    attn_implementation: Optional[str] = None
    revision: Optional[str] = None
    trust_remote_code: bool = False


@dataclass
class PatchConfig:
    #: a ``ctxext methods`` name, or null / "none" for no patch (plain LoRA at a longer length)
    method: Optional[str] = None
    factor: Optional[float] = None
    options: dict = field(default_factory=dict)


@dataclass
class LoraConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    #: module-name suffixes to adapt; null = peft's default for the architecture; "all-linear" = every linear layer
    target_modules: Optional[Union[list[str], str]] = None
    #: modules trained in full and saved with the adapter (peft ``modules_to_save``), matched by name suffix:
    #: LongLoRA trains ``[embed_tokens, norm]``; GPT-2 + PI trains ``[wpe]``, the interpolated position table
    trainable: list[str] = field(default_factory=list)
    bias: str = "none"
    use_rslora: bool = False


@dataclass
class DataConfig:
    #: text files (.txt, any other suffix read as text), JSONL files (.jsonl, one document per line under
    #: ``text_field``) and folders of them (searched recursively, sorted)
    files: list[str] = field(default_factory=list)
    #: file names to skip inside folders (glob patterns), e.g. the held-out book
    exclude: list[str] = field(default_factory=list)
    #: a ``datasets`` name or path, read with ``datasets.load_dataset(dataset, dataset_config, split=split)``
    dataset: Optional[str] = None
    dataset_config: Optional[str] = None
    split: str = "train"
    #: stream the dataset (read only the documents used, no full download)
    streaming: bool = False
    text_field: str = "text"
    #: read at most this many documents (files, JSONL lines and dataset rows, in order); null = all
    max_documents: Optional[int] = None
    #: training sequence length; default: the patched length (factor x the model's original length)
    seq_length: Optional[int] = None
    #: append the tokenizer's EOS after each document before packing
    add_eos: bool = True
    #: cap on the number of packed training sequences (after shuffling); null = all
    max_sequences: Optional[int] = None


@dataclass
class TrainConfig:
    steps: int = 1000
    #: global batch: sequences per optimizer step, over all processes
    batch_size: int = 8
    #: sequences per forward pass on one process; gradient accumulation = batch_size / (micro_batch_size x processes)
    micro_batch_size: int = 1
    lr: float = 2e-4
    warmup_steps: int = 20
    #: a ``transformers.get_scheduler`` name: linear, cosine, constant_with_warmup, ...
    scheduler: str = "cosine"
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: Optional[float] = 1.0
    gradient_checkpointing: bool = True
    #: accelerate mixed precision: "no", "bf16" or "fp16"
    mixed_precision: str = "no"
    seed: int = 0
    log_every: int = 1
    #: write a resumable checkpoint every N optimizer steps (0: only at the end)
    save_every: int = 100
    #: checkpoints kept on disk (oldest deleted first)
    keep_checkpoints: int = 2
    #: force CPU even where an accelerator is present
    cpu: bool = False


@dataclass
class EvalConfig:
    #: before/after perplexity at the end of the run
    enabled: bool = True
    #: "reference" (the held-out book shipped with ctxext) or text files / folders
    data: Union[list[str], str] = "reference"
    #: evaluation lengths; default: [data.seq_length]
    lengths: list[int] = field(default_factory=list)
    protocol: str = "chunks"
    stride: Optional[int] = None
    max_windows: Optional[int] = 8
    batch_size: int = 1
    #: also evaluate the patched model before training (training-free)
    before: bool = True
    #: also evaluate the model as loaded, before the patch
    unpatched: bool = False


@dataclass
class OutputConfig:
    dir: str = ""
    #: also save the merged model (base + LoRA folded in) under ``DIR/merged``
    merged: bool = False
    #: start over in a folder that holds checkpoints of an earlier run (otherwise: pass --resume)
    overwrite: bool = False


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    patch: PatchConfig = field(default_factory=PatchConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    #: the YAML file it came from (None when built in code); relative paths are tried against cwd, then its folder
    source: Optional[str] = field(default=None, metadata={"internal": True})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source", None)
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def resolve_path(self, path: str) -> Path:
        """A path from the recipe: as given (absolute or relative to the working directory), else relative to the
        recipe's folder or one of its parents (so ``../shared/data`` in ``recipes/tiny/x.yaml`` finds the folder
        beside the checkout from anywhere)."""
        p = Path(path).expanduser()
        if p.is_absolute() or p.exists() or self.source is None:
            return p
        folder = Path(self.source).resolve().parent
        for base in [folder, *folder.parents]:
            if (base / p).exists():
                return base / p
        return p


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe) if not f.metadata.get("internal")}


# ---------------------------------------------------------------------------------------------- parsing


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        name = " or ".join(_type_name(a) for a in args)
        return name + (" or null" if len(args) < len(typing.get_args(tp)) else "")
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(inner)}"
    if tp is dict:
        return "mapping"
    return {int: "integer", float: "number", str: "string", bool: "true/false"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise RecipeError(f"{where}: must be {_type_name(tp)}, got null")
        errors = []
        # try list before str so "[a, b]" stays a list, str before float so names stay names
        for arg in sorted((a for a in args if a is not type(None)), key=lambda a: 0 if typing.get_origin(a) is list else 1):
            try:
                return _coerce(value, arg, where)
            except RecipeError as exc:
                errors.append(exc)
        raise RecipeError(f"{where}: must be {_type_name(tp)}, got {value!r}")
    if value is None:
        raise RecipeError(f"{where}: must be {_type_name(tp)}, got null")
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}: must be {_type_name(tp)}, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
        raise RecipeError(f"{where}: must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise RecipeError(f"{where}: must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise RecipeError(f"{where}: must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise RecipeError(f"{where}: must be a number, got {value!r}")
        try:
            number = float(value)  # YAML 1.1 reads 2e-4 as a string
        except (TypeError, ValueError):
            raise RecipeError(f"{where}: must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise RecipeError(f"{where}: must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise RecipeError(f"{where}: must be a string, got {value!r}")
    raise RecipeError(f"{where}: unsupported type {tp}")  # pragma: no cover


def _section(cls, data: Any, where: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: must be a mapping of keys, got {data!r}")
    hints = _hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in known]
    if unknown:
        raise RecipeError(
            f"unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; {where} accepts: {', '.join(known)}"
        )
    values = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**values)


def recipe_from_dict(data: Any, source: str | None = None) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"a recipe is a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}")
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        raise RecipeError(f"unknown section(s) {', '.join(map(str, unknown))}; a recipe has: {', '.join(SECTIONS)}")
    hints = _hints(Recipe)
    sections = {name: _section(hints[name], data.get(name), name) for name in SECTIONS}
    recipe = Recipe(**sections, source=source)
    validate(recipe)
    return recipe


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value read as YAML)."""
    if "=" not in text:
        raise RecipeError(f"--set expects KEY=VALUE (e.g. train.steps=100), got {text!r}")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in path):
        raise RecipeError(f"--set: bad key {key!r} (e.g. train.steps=100)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = dict(data or {})
    for text in overrides:
        path, value = parse_override(text)
        if path[0] not in SECTIONS:
            raise RecipeError(f"--set {text}: unknown section {path[0]!r}; a recipe has: {', '.join(SECTIONS)}")
        node = data
        for i, key in enumerate(path[:-1]):
            child = node.get(key)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise RecipeError(f"--set {text}: {'.'.join(path[: i + 1])} is not a section")
            child = dict(child)
            node[key] = child
            node = child
        node[path[-1]] = value
    return data


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply ``--set`` overrides, and validate it (no model or data is loaded)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {str(path)!r} not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path}: not valid YAML: {exc}") from None
    data = apply_overrides(data or {}, list(overrides))
    try:
        return recipe_from_dict(data, source=str(path))
    except RecipeError as exc:
        raise RecipeError(f"recipe {path}: {exc}") from None


# ------------------------------------------------------------------------------------------- validation

DTYPES = ("float32", "bfloat16", "float16", "auto")
MIXED = ("no", "bf16", "fp16")
PROTOCOLS = ("chunks", "sliding")


def validate(recipe: Recipe) -> None:
    """Checks that need no model: required keys, ranges, known names, data present."""
    m, p, lo, d, t, e, o = (recipe.model, recipe.patch, recipe.lora, recipe.data, recipe.train, recipe.eval,
                            recipe.output)
    if not m.name:
        raise RecipeError("model.name is required (a hub id, a local directory, or reference:llama)")
    if m.dtype not in DTYPES:
        raise RecipeError(f"model.dtype must be one of {', '.join(DTYPES)}, got {m.dtype!r}")
    if not o.dir:
        raise RecipeError("output.dir is required (the folder for the adapter, checkpoints and log)")

    if p.method is not None and p.method.strip().lower() in ("none", ""):
        p.method = None
    if p.method is not None:
        from ..registry import resolve_method, validate_factor, validate_options

        try:
            info = resolve_method(p.method)
            validate_factor(info, p.factor)
            validate_options(info, p.options)
        except ValueError as exc:
            raise RecipeError(f"patch: {exc}") from None
    elif p.factor is not None or p.options:
        raise RecipeError("patch.factor/options given without patch.method")

    if lo.r < 1:
        raise RecipeError(f"lora.r must be >= 1, got {lo.r}")
    if not 0 <= lo.dropout < 1:
        raise RecipeError(f"lora.dropout must be in [0, 1), got {lo.dropout}")
    if lo.bias not in ("none", "all", "lora_only"):
        raise RecipeError(f"lora.bias must be none, all or lora_only, got {lo.bias!r}")

    if not d.files and not d.dataset:
        raise RecipeError("data: give data.files (text/JSONL files or folders) or data.dataset (a datasets name)")
    for f in d.files:
        if not recipe.resolve_path(f).exists():
            raise RecipeError(f"data.files: {f!r} not found (relative paths are read from the working directory"
                              + (f", else from {Path(recipe.source).parent} or its parents" if recipe.source else "")
                              + ")")
    if d.seq_length is not None and d.seq_length < 2:
        raise RecipeError(f"data.seq_length must be >= 2, got {d.seq_length}")
    if d.max_documents is not None and d.max_documents < 1:
        raise RecipeError(f"data.max_documents must be >= 1, got {d.max_documents}")
    if d.max_sequences is not None and d.max_sequences < 1:
        raise RecipeError(f"data.max_sequences must be >= 1, got {d.max_sequences}")

    for key in ("steps", "batch_size", "micro_batch_size", "log_every"):
        if getattr(t, key) < 1:
            raise RecipeError(f"train.{key} must be >= 1, got {getattr(t, key)}")
    for key in ("warmup_steps", "save_every", "keep_checkpoints"):
        if getattr(t, key) < 0:
            raise RecipeError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if t.batch_size % t.micro_batch_size:
        raise RecipeError(f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size "
                          f"({t.micro_batch_size})")
    if t.lr <= 0:
        raise RecipeError(f"train.lr must be > 0, got {t.lr}")
    if len(t.betas) != 2:
        raise RecipeError(f"train.betas must be two numbers, got {t.betas}")
    if t.mixed_precision not in MIXED:
        raise RecipeError(f"train.mixed_precision must be one of {', '.join(MIXED)}, got {t.mixed_precision!r}")
    from transformers.trainer_utils import SchedulerType

    names = [s.value for s in SchedulerType]
    if t.scheduler not in names:
        raise RecipeError(f"train.scheduler must be one of {', '.join(names)}, got {t.scheduler!r}")

    if e.protocol not in PROTOCOLS:
        raise RecipeError(f"eval.protocol must be one of {', '.join(PROTOCOLS)}, got {e.protocol!r}")
    if any(n < 2 for n in e.lengths):
        raise RecipeError(f"eval.lengths must be >= 2, got {e.lengths}")
    if e.enabled:
        data = [e.data] if isinstance(e.data, str) else e.data
        for f in data:
            if f != "reference" and not recipe.resolve_path(f).exists():
                raise RecipeError(f"eval.data: {f!r} not found (use 'reference' for the held-out book)")
