"""Recipes: YAML files read into pydantic models, validated before anything is loaded or trained.

A recipe has seven sections (``model``, ``patch``, ``lora``, ``data``, ``train``, ``eval``, ``output``);
every key is typed and checked by pydantic (``extra="forbid"``: unknown keys are errors), every problem is reported
at once with its key path, and ``--set a.b=value`` overrides any key (the value is read as YAML: ``4``, ``2e-4``,
``[q_proj, v_proj]``, ``null``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from .. import reference
from .errors import RecipeError  # re-exported: ctxext.finetune.config.RecipeError


def _not_bool(value: Any) -> Any:
    """pydantic's lax mode reads true as 1: a true / false given for a number is a mistake."""
    if isinstance(value, bool):
        raise ValueError("input should be a number, not true / false")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
AtLeast1 = Annotated[Int, Ge(1)]
AtLeast2 = Annotated[Int, Ge(2)]
NotNegative = Annotated[Int, Ge(0)]
#: a seed every random generator a run seeds takes (numpy's is the narrowest: 0 <= seed < 2**32)
Seed = Annotated[Int, Ge(0), Lt(2 ** 32)]

#: The most micro-batches one optimizer step may run: train.batch_size / train.micro_batch_size, over all processes
#: (gradient accumulation x processes). A step runs them all before its first update, so a larger count is a mistake
#: in the recipe, not a batch anyone trains with (LoRA recipes use global batches of 8 to a few hundred sequences):
#: 10**12 would sit at step 0 for ever. 4096 is a global batch of 4096 sequences one at a time, far past any recipe.
MAX_MICRO_BATCHES = 4096


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class Problems:
    """Collects recipe problems so that all of them are reported at once."""

    def __init__(self):
        self.items: list[str] = []
        #: key paths whose value could not be read (their later checks are skipped: no second message)
        self.bad: set[str] = set()

    def add(self, message: str, key: str | None = None) -> None:
        if key is not None and any(key == b or key.startswith(b + ".") or key.startswith(b + "[") for b in self.bad):
            return
        message = _one_line(message)
        if message not in self.items:
            self.items.append(message)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self, prefix: str = "") -> None:
        if not self.items:
            return
        n = len(self.items)
        head = f"{prefix}{n} problems: " if n > 1 else prefix
        raise RecipeError(head + "; ".join(self.items), self.items)


class Section(BaseModel):
    """How every section reads: unknown keys refused, numbers finite, numbers accepted where a name is expected."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, coerce_numbers_to_str=True)


class ModelConfig(Section):
    #: hub id, local directory, directory holding ``gguf_file``, or ``reference:llama`` / ``reference:gpt2`` / ...
    name: str = ""
    gguf_file: Optional[str] = None
    #: tokenizer source; default: the model's
    tokenizer: Optional[str] = None
    #: weights dtype: float32, bfloat16, float16 or auto
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    attn_implementation: Optional[str] = None
    revision: Optional[str] = None
    trust_remote_code: bool = False


class PatchConfig(Section):
    #: a ``ctxext methods`` name, or null / "none" for no patch (plain LoRA at a longer length)
    method: Optional[str] = None
    factor: Optional[Float] = None
    options: dict = Field(default_factory=dict)


class LoraConfig(Section):
    r: AtLeast1 = 8
    alpha: Annotated[Float, Gt(0)] = 16.0
    dropout: Annotated[Float, Ge(0), Lt(1)] = 0.0
    #: module-name suffixes to adapt; null = peft's default for the architecture; "all-linear" = every linear layer
    target_modules: Optional[Union[list[str], str]] = None
    #: modules trained in full and saved with the adapter (peft ``modules_to_save``), matched by name suffix:
    #: LongLoRA trains ``[embed_tokens, norm]``; GPT-2 + PI trains ``[wpe]``, the interpolated position table
    trainable: list[str] = Field(default_factory=list)
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False


class DataConfig(Section):
    #: text files (.txt, any other suffix read as text), JSONL files (.jsonl, one document per line under
    #: ``text_field``), either xz-compressed (``.txt.xz``, ``.jsonl.xz``), folders of them (searched recursively,
    #: sorted), and text shipped with ctxext: ``reference:train`` (the five Austen novels the reference models were
    #: trained on) or ``reference:emma`` (the held-out novel). Relative paths are read from the recipe file's folder
    #: (from the working directory when given with ``--set`` or when the recipe is built in code).
    files: list[str] = Field(default_factory=list)
    #: file names to skip (glob patterns, matched with and without a ``.xz`` suffix), e.g. the held-out book
    exclude: list[str] = Field(default_factory=list)
    #: a ``datasets`` name or path, read with ``datasets.load_dataset(dataset, dataset_config, split=split)``
    dataset: Optional[str] = None
    dataset_config: Optional[str] = None
    split: str = "train"
    #: stream the dataset (read only the documents used, no full download)
    streaming: bool = False
    text_field: str = "text"
    #: read at most this many documents (files, JSONL lines and dataset rows, in order); null = all
    max_documents: Optional[AtLeast1] = None
    #: training sequence length; default: the patched length (factor x the model's original length); with
    #: train.pose: the model's original length
    seq_length: Optional[AtLeast2] = None
    #: append the tokenizer's EOS after each document before packing
    add_eos: bool = True
    #: cap on the number of packed training sequences (after shuffling); null = all
    max_sequences: Optional[AtLeast1] = None


class PoseConfig(Section):
    """PoSE (positional skip-wise training, Zhu et al. 2023): train on short windows whose position ids span the
    target length. Each window is cut into ``chunks`` pieces; every piece keeps consecutive positions and the
    pieces after the first are shifted by random, non-decreasing skips, so positions stay below ``target_length``.
    The skips and cuts are fixed by ``train.seed`` and the sample's index in the run (as the batch order is)."""

    #: the length the position ids span; default: the patched length (patch.factor x the model's original length)
    target_length: Optional[AtLeast2] = None
    #: pieces per window (the paper's default, 2: the first chunk keeps positions 0.., the second is shifted)
    chunks: AtLeast2 = 2


class TrainConfig(Section):
    #: at most 2**31 - 1: Trainer counts steps in index-sized integers (a longer run is a typo, not a schedule)
    steps: Annotated[Int, Ge(1), Lt(2 ** 31)] = 1000
    #: global batch: sequences per optimizer step, over all processes
    batch_size: AtLeast1 = 8
    #: sequences per forward pass on one process; gradient accumulation = batch_size / (micro_batch_size x processes)
    micro_batch_size: AtLeast1 = 1
    #: 0 < lr <= 1: AdamW moves every trained weight by about lr per step (LoRA uses 1e-5 to 1e-2); past 1 the
    #: weights are noise after one step, and a float32 optimizer overflows
    lr: Annotated[Float, Gt(0), Le(1)] = 2e-4
    warmup_steps: NotNegative = 20
    #: a ``transformers.get_scheduler`` name: linear, cosine, constant_with_warmup, ...
    scheduler: str = "cosine"
    weight_decay: Annotated[Float, Ge(0)] = 0.0
    betas: list[Float] = Field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: Optional[Annotated[Float, Gt(0)]] = 1.0
    gradient_checkpointing: bool = True
    #: "no", "bf16" or "fp16" (TrainingArguments' bf16 / fp16)
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    seed: Seed = 0
    log_every: AtLeast1 = 1
    #: write a resumable checkpoint every N optimizer steps (0: only on --stop-after)
    save_every: NotNegative = 100
    #: checkpoints kept on disk (oldest deleted first; 0 keeps all)
    keep_checkpoints: NotNegative = 2
    #: force CPU even where an accelerator is present
    cpu: bool = False
    #: PoSE: train at the short data.seq_length (default then: the model's original length) with position ids
    #: spanning pose.target_length; ``true`` for the defaults, a mapping (target_length, chunks), or null (off)
    pose: Optional[PoseConfig] = None
    #: LongLoRA's shifted sparse attention (S²-Attn) while training: attention within groups of
    #: ``shift_group_ratio`` x the sequence, half the heads shifted by half a group; evaluation, generate and the saved
    #: model keep full attention (``ctxext.attention.shifted_sparse``)
    shift_attention: bool = False
    #: the group's share of the sequence, 1/n (LongLoRA's default 1/4)
    shift_group_ratio: Annotated[Float, Gt(0), Le(1)] = 0.25
    #: any other ``transformers.TrainingArguments`` field, passed through as given: ``report_to: wandb``,
    #: ``deepspeed: ds.json``, ``fsdp: full_shard``, ``optim: adamw_torch_fused``, ``torch_compile: true``, ...
    #: (fields the keys above set are refused here, with the key that sets them)
    args: dict = Field(default_factory=dict)

    @field_validator("pose", mode="before")
    @classmethod
    def _pose_shorthand(cls, value: Any) -> Any:
        return {} if value is True else (None if value is False else value)  # "pose: true" = defaults, false = off


class EvalConfig(Section):
    #: before/after perplexity at the end of the run
    enabled: bool = True
    #: "reference" (the held-out book shipped with ctxext, also ``reference:emma``) or text files / folders
    #: (relative paths as in data.files)
    data: Union[list[str], str] = "reference"
    #: evaluation lengths; default: [data.seq_length] (with train.pose: [train.pose.target_length])
    lengths: list[AtLeast2] = Field(default_factory=list)
    protocol: Literal["chunks", "sliding"] = "chunks"
    stride: Optional[AtLeast1] = None
    max_windows: Optional[AtLeast1] = 8
    batch_size: AtLeast1 = 1
    #: also evaluate the patched model before training (training-free)
    before: bool = True
    #: also evaluate the model as loaded, before the patch
    unpatched: bool = False


class OutputConfig(Section):
    #: the run's folder; a relative path is relative to the working directory (as any command's output); ``~`` is
    #: the home folder
    dir: str = ""

    @field_validator("dir")
    @classmethod
    def _home(cls, value: str) -> str:  # expanded once: Trainer and ctxext must write into one folder
        try:
            return str(Path(value).expanduser()) if value.startswith("~") else value
        except RuntimeError:  # ~name of no user on this machine
            raise ValueError(f"{value.split('/')[0]!r} names no user's home folder here") from None
    #: also save the merged model (base + LoRA folded in) under ``DIR/merged``
    merged: bool = False
    #: start over in a folder that holds checkpoints of an earlier run (otherwise: pass --resume)
    overwrite: bool = False


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    patch: PatchConfig = Field(default_factory=PatchConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    #: the YAML file it came from (None when built in code): relative data paths are read from its folder
    _source: Optional[str] = PrivateAttr(default=None)

    @property
    def source(self) -> Optional[str]:
        return self._source

    def error(self, message: str, problems: list[str] | None = None) -> RecipeError:
        """A RecipeError that starts with the recipe file, as every recipe error does."""
        return RecipeError((f"recipe {self.source}: " if self.source else "") + message, problems)

    def to_dict(self, absolute_paths: bool = False) -> dict[str, Any]:
        """The recipe as a mapping; ``absolute_paths``: relative data paths made absolute (for a copy saved
        elsewhere, e.g. ``output.dir/recipe.yaml``, which would otherwise read them from its own folder)."""
        d = self.model_dump()
        if absolute_paths:
            d["data"]["files"] = self.absolute_data(d["data"]["files"])
            d["eval"]["data"] = self.absolute_data(d["eval"]["data"])
        return d

    def absolute_data(self, value: Any) -> Any:
        """A ``data.files`` / ``eval.data`` value with relative paths made absolute (shipped names kept)."""
        def fix(item):
            if not isinstance(item, str) or item == "reference" or is_shipped(item):
                return item
            return str(self.resolve_path(item))

        return [fix(v) for v in value] if isinstance(value, list) else fix(value)

    def to_yaml(self, absolute_paths: bool = False) -> str:
        """The recipe as YAML (``absolute_paths`` as in :meth:`to_dict`)."""
        return yaml.safe_dump(self.to_dict(absolute_paths), sort_keys=False)

    @property
    def base_dir(self) -> Path:
        """The folder relative data paths are read from: the recipe file's folder, else the working directory."""
        return Path(self.source).resolve().parent if self.source else Path.cwd()

    def resolve_path(self, path: str) -> Path:
        """A path the recipe reads (data.files, eval.data): absolute, or relative to :attr:`base_dir`."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.base_dir / p

    def data_paths(self, items: list[str], key: str) -> list[Path]:
        """Paths of data entries: ``reference:NAME`` -> the shipped files, anything else -> :meth:`resolve_path`."""
        paths: list[Path] = []
        for item in items:
            if is_shipped(item):
                paths.extend(shipped_files(item, key))
            else:
                paths.append(self.resolve_path(item))
        return paths


REFERENCE_PREFIX = "reference:"


def is_shipped(item: str) -> bool:
    return isinstance(item, str) and item.startswith(REFERENCE_PREFIX)


def shipped_files(item: str, key: str) -> list[Path]:
    """``reference:train`` / ``reference:emma`` -> the xz-compressed text files shipped with ctxext."""
    name = item[len(REFERENCE_PREFIX):]
    try:
        return reference.data_files(name)
    except ValueError:
        raise RecipeError(f"{key}: unknown shipped text {item!r}; choose one of "
                          + ", ".join(f"{REFERENCE_PREFIX}{n} = {what}" for n, what in reference.DATA_NAMES.items())
                          ) from None
    except FileNotFoundError as exc:
        raise RecipeError(f"{key}: {exc}") from None


SECTIONS = dict(Recipe.model_fields)


# ---------------------------------------------------------------------------------------------- parsing


def _model_class(annotation) -> type[BaseModel] | None:
    """The section model of a field (``PoseConfig`` for ``Optional[PoseConfig]``), else None."""
    return next((a for a in (annotation, *getattr(annotation, "__args__", ())) if isinstance(a, type)
                 and issubclass(a, BaseModel)), None)


def _key_path(loc: tuple, unknown: bool) -> tuple[list[str], type[BaseModel]]:
    """The key path of a pydantic error location: field names (and list indices) from the recipe down; the union
    branches pydantic names on the way are left out. For an unknown key, the key itself ends the path. Also returns
    the model holding the last key."""
    path, cls, parent = [], Recipe, Recipe
    for i, part in enumerate(loc):
        fields = cls.model_fields if cls is not None else {}
        if isinstance(part, str) and part in fields:
            path.append(part)
            parent, cls = cls, _model_class(fields[part].annotation)
        elif isinstance(part, int) and path:
            path[-1] += f"[{part}]"
        elif unknown and i == len(loc) - 1:
            path.append(str(part))
            parent = cls
    return path, parent


def _drop(data: dict, path: list[str]) -> None:
    """Remove the key at ``path`` (list indices stripped: the whole list goes) so that it keeps its default."""
    if not path:
        return
    *parents, last = [p.split("[")[0] for p in path]
    for part in parents:
        data = data.get(part) if isinstance(data, dict) else None
    if isinstance(data, dict):
        data.pop(last, None)


def _copy(data: Any) -> Any:
    return {k: _copy(v) for k, v in data.items()} if isinstance(data, dict) else data


def _drop_non_string_keys(data: dict, where: str, problems: Problems) -> None:
    """Keys that are not names (YAML reads on / off / yes / no and numbers as values): reported and dropped."""
    for key in list(data):
        name = f"{where}.{key}" if where else str(key)
        if not isinstance(key, str):
            problems.add(f"{'key' if where else 'section'} {name!r} is not a name (YAML reads on, off, yes, no, true, "
                         "false and numbers as values): quote it or correct it")
            del data[key]
        elif isinstance(data[key], dict) and key != "options" and key != "args":
            _drop_non_string_keys(data[key], name, problems)


def _parse(data: dict, problems: Problems) -> Recipe | None:
    """pydantic reads the recipe; each error becomes one line with its key path, and the keys it could not read are
    dropped (they keep their defaults) so that the checks of the rest still run. None if even that fails."""
    data = _copy(data)
    _drop_non_string_keys(data, "", problems)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
    unknown: dict[str, tuple[list[str], type[BaseModel]]] = {}
    for err in errors:
        is_unknown = err["type"] == "extra_forbidden"
        path, parent = _key_path(err["loc"], is_unknown)
        key = ".".join(path)
        if is_unknown:
            unknown.setdefault(".".join(path[:-1]), ([], parent))[0].append(path[-1])
        elif key not in problems.bad:
            msg = err["msg"].removeprefix("Value error, ")
            problems.add(f"{key}: {msg[:1].lower() + msg[1:]}, got {_short(err.get('input'))}")
            problems.bad.add(key.split("[")[0])
        _drop(data, path)
    for parent, (keys, cls) in unknown.items():
        what = "key" if parent else "section"
        problems.add(f"unknown {what}(s) {', '.join(f'{parent}.{k}' if parent else k for k in keys)}; "
                     f"{parent or 'a recipe'} accepts: {', '.join(cls.model_fields)}")
    try:
        return Recipe.model_validate(data)
    except ValidationError:
        return None


def recipe_from_dict(data: Any, source: str | None = None, problems: Problems | None = None) -> Recipe:
    """Build and validate a recipe; every problem (with any already in ``problems``) is reported at once in one
    :class:`RecipeError`."""
    if not isinstance(data, dict):
        kind = "nothing" if data is None else f"a {_yaml_kind(data)} ({_short(data)})"
        raise RecipeError(f"a recipe must be a mapping with sections {', '.join(SECTIONS)} "
                          f"(e.g. 'model:' then '  name: reference:llama'), got {kind}")
    problems = Problems() if problems is None else problems
    recipe = _parse({k: ({} if v is None and k in SECTIONS else v) for k, v in data.items()}, problems)
    if recipe is not None:
        recipe._source = source
        validate(recipe, problems)
    problems.raise_if_any()
    return recipe


def _yaml_kind(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _short(value: Any, limit: int = 40) -> str:
    text = _one_line(repr(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: keys whose values are paths the recipe reads; given with --set they are relative to the working directory
_PATH_KEYS = {("data", "files"), ("eval", "data")}


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value read as YAML)."""
    if "=" not in text:
        raise RecipeError(f"--set expects KEY=VALUE (e.g. train.steps=100), got {text!r}")
    key, raw = text.split("=", 1)
    path = [p.strip() for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in path):
        raise RecipeError(f"--set {text}: bad key {key.strip()!r}; a key is SECTION.NAME (e.g. train.steps=100)")
    if len(path) == 1:
        raise RecipeError(f"--set {text}: {key.strip()!r} is a whole section; set one key, SECTION.NAME=VALUE "
                          f"(e.g. {key.strip()}.{_first_key(key.strip())}=...)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return path, value


def _first_key(section: str) -> str:
    fields = getattr(SECTIONS[section].annotation, "model_fields", {}) if section in SECTIONS else {}
    return next(iter(fields), "key")


def _absolute_from_cwd(value: Any) -> Any:
    """A --set path value (or list of them) made absolute against the working directory."""
    def fix(v):
        if (isinstance(v, str) and v and v != "reference" and not is_shipped(v)
                and not Path(v).expanduser().is_absolute()):
            return str(Path.cwd() / Path(v).expanduser())
        return v

    if isinstance(value, list):
        return [fix(v) for v in value]
    return fix(value)


def apply_overrides(data: dict, overrides: list[str], problems: Problems | None = None) -> dict:
    """Apply ``--set KEY=VALUE`` overrides. Bad ones go to ``problems`` when given (the others still apply);
    without it, every bad one is reported at once in a RecipeError."""
    data = dict(data or {})
    own = problems is None
    problems = Problems() if own else problems
    for text in overrides:
        try:
            path, value = parse_override(text)
        except RecipeError as exc:
            problems.add(str(exc))
            continue
        if path[0] not in SECTIONS:
            problems.add(f"--set {text}: unknown section {path[0]!r}; a recipe has: {', '.join(SECTIONS)}")
            continue
        if tuple(path) in _PATH_KEYS:
            value = _absolute_from_cwd(value)
        node = data
        for i, key in enumerate(path[:-1]):
            child = node.get(key)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                problems.add(f"--set {text}: {'.'.join(path[: i + 1])} is not a section")
                break
            child = dict(child)
            node[key] = child
            node = child
        else:
            node[path[-1]] = value
    if own:
        problems.raise_if_any()
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        try:
            key = loader.construct_object(key_node, deep=True)
            hash(key)
        except Exception:  # noqa: BLE001 - let the normal constructor report odd keys
            continue
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """``FILE:LINE: problem`` from a YAML error (line numbers from 1)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
    text = f"{where}: {problem}"
    if context and context != problem:
        text += f" ({context}" + (f" at line {exc.context_mark.line + 1}" if getattr(exc, "context_mark", None)
                                  and exc.context_mark.line != getattr(mark, "line", None) else "") + ")"
    hints = ("block end", "block mapping", "mapping values are not allowed", "could not find expected ':'")
    if any(w in text for w in hints):
        text += "; check the indentation and that each key is followed by ': '"
    return _one_line(text + "; not valid YAML")


def read_recipe_file(path: str | Path) -> dict:
    """The recipe file as a mapping; a missing, unreadable, empty, non-YAML or non-mapping file is a RecipeError."""
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"recipe {str(path)!r} not found")
    if path.is_dir():
        raise RecipeError(f"recipe {str(path)!r} is a folder; give a recipe YAML file "
                          "(e.g. recipes/tiny/llama_pi_lora.yaml)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"recipe {path}: not UTF-8 text (byte {exc.start}); a recipe is a YAML file") from None
    except OSError as exc:
        raise RecipeError(f"recipe {path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise RecipeError(_yaml_error(path, exc)) from None
    if data is None:
        raise RecipeError(f"recipe {path} is empty; a recipe is a mapping with sections {', '.join(SECTIONS)}")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: a recipe must be a mapping with sections {', '.join(SECTIONS)}, got a "
                          f"{_yaml_kind(data)} ({_short(data)})")
    return data


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply ``--set`` overrides, and validate it (no model or data is loaded). Every problem
    found (unknown keys, wrong types, bad values, missing files, bad overrides) is reported in one RecipeError."""
    path = Path(path)
    data = read_recipe_file(path)
    problems = Problems()
    try:
        data = apply_overrides(data, list(overrides), problems)
        return recipe_from_dict(data, source=str(path), problems=problems)
    except RecipeError as exc:
        raise RecipeError(f"recipe {path}: {exc}", exc.problems) from None


# ------------------------------------------------------------------------------------------- validation

def validate(recipe: Recipe, problems: Problems | None = None) -> None:
    """Checks that need no model: required keys, ranges, known names, data present. With ``problems``, adds to it;
    without, raises one RecipeError listing every problem."""
    own = problems is None
    problems = Problems() if own else problems
    err = problems.add
    m, p, lo, d, t, e, o = (recipe.model, recipe.patch, recipe.lora, recipe.data, recipe.train, recipe.eval,
                            recipe.output)
    if not m.name:
        err("model.name is required (a hub id, a local directory, or reference:llama)", "model.name")
    elif reference.reference_name(m.name) is not None:
        try:
            reference.model_source(m.name)
        except (ValueError, FileNotFoundError) as exc:
            err(f"model.name {m.name!r}: {exc}", "model.name")
    else:
        check_model_sources(m, err)
    if not o.dir:
        err("output.dir is required (the folder for the adapter, checkpoints and log)", "output.dir")
    else:
        out = Path(o.dir).expanduser()
        if out.exists() and not out.is_dir():
            err(f"output.dir: {o.dir!r} is a file, not a folder", "output.dir")
        elif not out.exists():
            parent = next((q for q in out.absolute().parents if q.exists()), None)
            if parent is not None and not parent.is_dir():
                err(f"output.dir: {o.dir!r} cannot be made: {str(parent)!r} is a file", "output.dir")
        _check_output_apart(recipe, out.resolve(), err)

    if p.method is not None and p.method.strip().lower() in ("none", ""):
        p.method = None
    if p.method is not None:
        from ..methods.registry import resolve_method, validate_factor, validate_options

        info = None
        try:
            info = resolve_method(p.method)
        except ValueError as exc:
            err(f"patch.method: {exc}", "patch.method")
        if info is not None:
            for check, key in ((lambda: validate_factor(info, p.factor), "patch.factor"),
                               (lambda: validate_options(info, p.options), "patch.options")):
                try:
                    check()
                except ValueError as exc:
                    err(f"{key}: {exc}", key)
    elif p.factor is not None or p.options:
        err("patch.factor/options given without patch.method", "patch.method")

    if isinstance(lo.target_modules, list) and not lo.target_modules:
        err("lora.target_modules is an empty list; name modules, use all-linear, or null for peft's default",
            "lora.target_modules")
    for key, names in (("lora.target_modules", _listed(lo.target_modules)), ("lora.trainable", lo.trainable)):
        if any(not n.strip() for n in names):
            err(f"{key}: an empty module name (a name matches modules by suffix, so an empty one would match every "
                f"module); remove it", key)
            problems.bad.add(key)

    for key, paths in (("data.files", d.files), ("eval.data", _listed(e.data) if e.enabled else [])):
        if any(not f.strip() for f in paths):
            folder = "the recipe folder" if recipe.source else "the working directory"
            err(f"{key}: an empty path (it would name {folder}, read as a whole); remove it or give a file or folder",
                key)
            problems.bad.add(key)
    if not d.files and not d.dataset:
        err("data: give data.files (text/JSONL files or folders, or reference:train) or data.dataset "
            "(a datasets name)", "data.files")
    _check_data_files(recipe, problems)
    if not d.text_field:
        err("data.text_field must not be empty", "data.text_field")

    if t.batch_size % t.micro_batch_size:
        err(f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size})", "train.batch_size")
    elif t.batch_size // t.micro_batch_size > MAX_MICRO_BATCHES and "train.micro_batch_size" not in problems.bad:
        err(f"train.batch_size / train.micro_batch_size = {t.batch_size // t.micro_batch_size} micro-batches per "
            f"optimizer step (gradient accumulation x processes), more than the {MAX_MICRO_BATCHES} ctxext allows: a "
            "step runs them all before its first update, so this many would stall at step 0; lower "
            "train.batch_size (LoRA recipes use 8 to a few hundred sequences) or raise train.micro_batch_size",
            "train.batch_size")
    if d.max_sequences is not None and t.batch_size > d.max_sequences and "data.max_sequences" not in problems.bad:
        err(f"train.batch_size ({t.batch_size}) is larger than data.max_sequences ({d.max_sequences}), the most "
            "packed sequences the run keeps: one optimizer step would repeat sequences; lower train.batch_size or "
            "raise data.max_sequences", "train.batch_size")
    if len(t.betas) != 2:
        err(f"train.betas must be two numbers, got {t.betas}", "train.betas")
    elif not all(0 <= b < 1 for b in t.betas):
        err(f"train.betas must be in [0, 1), got {t.betas}", "train.betas")
    if t.pose is not None:
        _check_pose(recipe, err)
    if t.args:
        check_args(t.args, err)
    if t.shift_attention and "train.shift_group_ratio" not in problems.bad:
        _check_shift(recipe, err)
    from transformers.trainer_utils import SchedulerType

    names = [s.value for s in SchedulerType]
    if t.scheduler not in names:
        err(f"train.scheduler must be one of {', '.join(names)}, got {t.scheduler!r}", "train.scheduler")

    if e.enabled:
        data = [e.data] if isinstance(e.data, str) else e.data
        if not data:
            err("eval.data is empty; use reference (the held-out book) or files, or set eval.enabled: false",
                "eval.data")
        for f in data:
            if f == "reference":
                continue
            try:
                path = recipe.data_paths([f], "eval.data")[0]
            except RecipeError as exc:
                err(str(exc), "eval.data")
                continue
            if not path.exists():
                err(f"eval.data: {f!r} not found{_where(recipe, f)} (use 'reference' for the held-out book)",
                    "eval.data")
    if own:
        problems.raise_if_any()


def _check_output_apart(recipe: Recipe, out: Path, err) -> None:
    """output.dir holds none of what the run reads (--overwrite clears the folder: a base model kept in it, say an
    earlier run's merged/, would go), and lies in no data.files folder (the run's log and checkpoints would be read as
    training data by the next run)."""
    m, d, e = recipe.model, recipe.data, recipe.eval
    reads = [("model.name", m.name), ("model.tokenizer", m.tokenizer)]
    reads += [("data.files", f) for f in d.files if not is_shipped(f)]
    if e.enabled:
        reads += [("eval.data", f) for f in _listed(e.data) if f != "reference" and not is_shipped(f)]
    for key, item in reads:
        if not item or reference.reference_name(item) is not None:
            continue
        path = (Path(item).expanduser() if key.startswith("model") else recipe.resolve_path(item)).resolve()
        if not path.exists():
            continue
        if path == out or out in path.parents:
            err(f"output.dir {recipe.output.dir!r} holds {key} {item!r}: a run writes there and --overwrite clears "
                "it; choose an output.dir apart from what the run reads", "output.dir")
        elif key == "data.files" and path.is_dir() and path in out.parents:
            err(f"output.dir {recipe.output.dir!r} is inside the data.files folder {item!r}: the run's log and "
                "checkpoints would be read as training data by the next run; choose an output.dir outside it",
                "output.dir")


def _listed(value) -> list[str]:
    """A key that takes one name or a list of them, as a list of strings (null: none)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


#: TrainingArguments fields a recipe sets through its own keys (train.args may not set them again)
OWNED = {
    "output_dir": "output.dir", "max_steps": "train.steps", "num_train_epochs": "train.steps",
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.batch_size (the global batch; accumulation follows from it)",
    "learning_rate": "train.lr", "warmup_steps": "train.warmup_steps", "lr_scheduler_type": "train.scheduler",
    "weight_decay": "train.weight_decay", "adam_beta1": "train.betas", "adam_beta2": "train.betas",
    "max_grad_norm": "train.max_grad_norm", "gradient_checkpointing": "train.gradient_checkpointing",
    "activation_checkpointing": "train.gradient_checkpointing",
    "gradient_checkpointing_kwargs": "ctxext (use_reentrant: false)", "activation_checkpointing_kwargs": "ctxext",
    "bf16": "train.mixed_precision", "fp16": "train.mixed_precision", "seed": "train.seed",
    "logging_steps": "ctxext (every step; train.log_every sets log.jsonl's)", "logging_strategy": "ctxext",
    "save_steps": "train.save_every", "save_strategy": "train.save_every",
    "save_total_limit": "train.keep_checkpoints", "use_cpu": "train.cpu", "resume_from_checkpoint": "--resume",
    "disable_tqdm": "--no-progress", "logging_nan_inf_filter": "ctxext (a non-finite loss stops the run)",
    "remove_unused_columns": "ctxext (its examples hold only model inputs)",
}
#: TrainingArguments fields train.args may give only at their default: another value would make --resume differ from
#: an uninterrupted run, or needs an evaluation set Trainer does not get (ctxext evaluates with ``eval:``)
DEFAULT_ONLY = {
    "save_only_model": "a checkpoint must keep the optimizer and the schedule, so that --resume continues the run "
                       "exactly",
    "ignore_data_skip": "--resume skips the batches already trained, so that the run equals an uninterrupted one",
    "eval_strategy": "ctxext evaluates before and after training (eval:); Trainer gets no evaluation set",
    "eval_on_start": "ctxext evaluates before and after training (eval:); Trainer gets no evaluation set",
    "load_best_model_at_end": "Trainer gets no evaluation set to pick a best checkpoint by",
}
#: TrainingArguments fields whose type takes values Trainer fails on (or trains wrongly with) only once the model has
#: loaded: field -> (the values taken, as a test of a number, and as words). null keeps a field's default (off).
ARG_RANGES = {
    # NEFTune adds uniform noise in [-a, a] x alpha / sqrt(L x d) to the embeddings: a negative alpha makes torch's
    # uniform_ fail at the first step ("from > to"), an infinite one makes the embeddings noise
    "neftune_noise_alpha": (lambda v: math.isfinite(v) and v >= 0,
                            "a finite number >= 0 (NEFTune's noise scale; its paper uses 5 to 15), or null for none"),
    # the share of the target's probability spread over the vocabulary: outside [0, 1) the loss rewards wrong tokens
    "label_smoothing_factor": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
}


def training_argument_fields() -> set[str]:
    import dataclasses

    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments) if f.init}


def check_args(args: dict, err) -> None:
    """train.args: every key a TrainingArguments field that no recipe key already sets, with a value of the field's
    type (TrainingArguments takes any value and fails on it mid-run: ``label_smoothing_factor: abc``)."""
    import dataclasses
    import typing

    from transformers import TrainingArguments

    fields = training_argument_fields()
    try:
        hints = typing.get_type_hints(TrainingArguments)
    except Exception:  # noqa: BLE001 - a release whose annotations do not resolve: types left to transformers
        hints = {}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    for key, value in args.items():
        if key in OWNED:
            err(f"train.args.{key}: set by {OWNED[key]}", f"train.args.{key}")
        elif key in DEFAULT_ONLY and str(value).lower() != str(getattr(defaults.get(key), "value",
                                                                          defaults.get(key))).lower():
            err(f"train.args.{key}: only its default, {getattr(defaults.get(key), 'value', defaults.get(key))!r}, "
                f"is taken: {DEFAULT_ONLY[key]}", f"train.args.{key}")
        elif key not in fields:  # a field of another transformers release is named as such
            err(f"train.args.{key}: not a transformers.TrainingArguments field (transformers "
                f"{_transformers_version()})", f"train.args.{key}")
        elif key in hints and not _fits(value, hints[key]):
            err(f"train.args.{key}: expected {_type_name(hints[key])}, got {_short(value)}", f"train.args.{key}")
        elif key in ARG_RANGES and _is_number(value) and not ARG_RANGES[key][0](value):
            err(f"train.args.{key}: must be {ARG_RANGES[key][1]}, got {_short(value)}", f"train.args.{key}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a TrainingArguments annotation: pydantic's strict validation (no true for 1, no 1.5
    for a whole number, no list for a name; an enum field takes its values' strings)."""
    from pydantic import TypeAdapter

    try:
        adapter = TypeAdapter(_yaml_form(hint), config=ConfigDict(strict=True, arbitrary_types_allowed=True))
    except Exception:  # noqa: BLE001 - an annotation pydantic cannot read: its value is left to transformers
        return True
    try:
        adapter.validate_python(value)
    except ValidationError:
        return False
    return True


def _yaml_form(hint: Any) -> Any:
    """``hint`` with every Enum also taking its values (YAML gives ``debug: [underflow_overflow]``, not the member;
    strict validation takes only members)."""
    import enum
    import typing

    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return Union[hint, Literal[tuple(m.value for m in hint)]]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if not args or origin is Literal:
        return hint
    forms = tuple(_yaml_form(a) for a in args)
    if origin in (list, dict):
        return origin[forms]
    if origin is Union or type(hint).__name__ == "UnionType":
        return Union[forms]
    return hint


def _type_name(hint: Any) -> str:
    import enum
    import typing

    args = typing.get_args(hint)
    if args and typing.get_origin(hint) not in (list, dict):
        return " or ".join(dict.fromkeys(_type_name(a) for a in args))
    if hint is type(None):
        return "null"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # YAML gives an enum field one of its values' names
        return "a string"
    names = {bool: "true/false", int: "a whole number", float: "a number", str: "a string", dict: "a mapping"}
    if hint in names:
        return names[hint]
    if typing.get_origin(hint) is list or hint is list:
        return "a list"
    if typing.get_origin(hint) is dict:
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _transformers_version() -> str:
    from transformers import __version__

    return __version__


#: patch methods that take positions out of the model's input: PoSE, which trains through the position ids, has
#: nothing to act on (NoPE has no positions; the ALiBi swap biases attention by the tokens' distance in the sequence)
NO_POSITION_INPUT = {"alibi": "the ALiBi swap biases attention by distance in the sequence, not by position ids",
                     "nope": "NoPE removes the positional encoding"}


def _check_shift(recipe: Recipe, err) -> None:
    """train.shift_attention checks that need no model: the group ratio, data.seq_length splitting into groups (when
    given; otherwise checked once the patch gives the length), a patch method that computes attention itself."""
    from ..attention.shifted_sparse import check_shift_attention
    from ..core.errors import PatchError

    t, d, p = recipe.train, recipe.data, recipe.patch
    method = p.method if p.method not in (None, "none") else None
    try:
        check_shift_attention(d.seq_length, t.shift_group_ratio, method)
    except PatchError as exc:
        err(f"train.shift_attention: {exc}", "train.shift_attention")


def _check_pose(recipe: Recipe, err) -> None:
    """train.pose checks that need no model: the options, the window against the target, a patch that leaves
    positions in the input. The target against the patched model's length is checked with the architecture
    (``finetune.train.check``)."""
    pose, d, p = recipe.train.pose, recipe.data, recipe.patch
    if pose.target_length is not None:
        if d.seq_length is not None and d.seq_length >= pose.target_length:
            err(f"train.pose.target_length ({pose.target_length}) must be longer than data.seq_length "
                f"({d.seq_length}), the window PoSE trains on", "train.pose.target_length")
    elif p.method is None:
        err("train.pose.target_length is required without a patch (by default it is the patched length)",
            "train.pose.target_length")
    if d.seq_length is not None and d.seq_length < pose.chunks:
        err(f"data.seq_length ({d.seq_length}) must be at least train.pose.chunks ({pose.chunks})", "data.seq_length")
    method = (p.method or "").strip().lower()
    if method in NO_POSITION_INPUT:
        err(f"train.pose: PoSE trains through the position ids, and patch.method {p.method!r} takes them out of the "
            f"model's input ({NO_POSITION_INPUT[method]}); drop train.pose or use a rotary patch (pi, yarn, ...)",
            "train.pose")


def check_model_sources(m: ModelConfig, err, hub: bool = False) -> None:
    """model.name / model.tokenizer must be loadable: local folders (or what looks like a path) always, hub ids only
    with ``hub`` (when the run starts), so --check works offline."""
    from ..data.sources import _looks_like_path, check_source

    for key, name, gguf in (("model.name", m.name, m.gguf_file), ("model.tokenizer", m.tokenizer, None)):
        if not name or reference.reference_name(name) is not None:
            continue
        if not (hub or _looks_like_path(name) or Path(name).expanduser().exists()):
            continue
        try:
            check_source(name, gguf_file=gguf, revision=m.revision, what=key)
        except (ValueError, OSError) as exc:
            err(str(exc), key)


def expand_files(paths: list[Path], exclude: list[str]) -> list[Path]:
    """A recipe's data files, found as evaluation finds them (``textfiles.select_files``)."""
    from ..data.textfiles import select_files

    try:
        return select_files(paths, exclude, exclude_key="data.exclude")
    except ValueError as exc:
        raise RecipeError(f"data.files: {exc}") from None


def _where(recipe: Recipe, item: str) -> str:
    if Path(item).expanduser().is_absolute():
        return ""
    return f" (relative paths are read from {'the recipe folder ' if recipe.source else ''}{recipe.base_dir})"


def _check_data_files(recipe: Recipe, problems: Problems) -> None:
    """data.files: every entry exists; folders hold text; data.exclude does not drop everything."""
    d = recipe.data
    paths, complete = [], True
    for f in d.files:
        try:
            found = recipe.data_paths([f], "data.files")
        except RecipeError as exc:
            problems.add(str(exc), "data.files")
            complete = False
            continue
        if not all(q.exists() for q in found):
            problems.add(f"data.files: {f!r} not found{_where(recipe, f)}", "data.files")
            complete = False
            continue
        paths.extend(found)
    if paths and complete and not any(b in ("data.files", "data.exclude") for b in problems.bad):
        try:
            expand_files(paths, d.exclude)
        except RecipeError as exc:
            problems.add(str(exc), "data.files")
