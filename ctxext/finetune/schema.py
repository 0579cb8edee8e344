"""The recipe's schema: seven pydantic sections (``model``, ``patch``, ``lora``, ``data``, ``train``, ``eval``,
``output``), every key typed (``extra="forbid"``: unknown keys are errors), and the rules between keys as validators.

A rule that spans keys is a validator on the last key (or section) it reads, so pydantic reports it beside every
other problem; the rules' bodies are in ``rules`` (what must exist on disk, what one section asks of another) and
``args`` (train.args). Each raises :func:`refused`'s error, which the formatter (``config``) lists line by line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from . import rules
from .errors import RecipeError
from .rules import is_shipped


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

#: The most micro-batches (gradient accumulation x processes) one optimizer step may run: far past any recipe (the
#: refusal says why), where 10**12 would sit at step 0 for ever.
MAX_MICRO_BATCHES = 4096


def refused(problems: list[str]) -> PydanticCustomError:
    """The validation error for problems found by a rule: one error of type ``recipe`` listing them (each its own
    line in the report)."""
    return PydanticCustomError("recipe", "; ".join(problems), {"problems": problems})


def _raise(problems: list[str]) -> None:
    if problems:
        raise refused(problems)


def _source(info: ValidationInfo) -> tuple[bool, str | None]:
    """(whether the recipe is being read, so the rules that read the disk apply; the recipe file, if any)."""
    context = info.context if isinstance(info.context, dict) else None
    return context is not None, (context or {}).get("source")


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

    @model_validator(mode="after")
    def _loadable(self, info: ValidationInfo):
        if _source(info)[0]:
            _raise(rules.model_problems(self))
        return self


class PatchConfig(Section):
    #: a ``ctxext methods`` name, or null / "none" for no patch (plain LoRA at a longer length)
    method: Optional[str] = None
    factor: Optional[Float] = None
    options: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known(self):
        """The method is one ``ctxext methods`` lists, with a factor and options it takes."""
        from ..methods.registry import resolve_method, validate_factor, validate_options

        if self.method is not None and self.method.strip().lower() in ("none", ""):
            self.method = None
        if self.method is None:
            _raise(["patch.factor/options given without patch.method"] if self.factor is not None or self.options
                   else [])
            return self
        try:
            info = resolve_method(self.method)
        except ValueError as exc:
            raise refused([f"patch.method: {exc}"]) from None
        problems = []
        for check, key in ((lambda: validate_factor(info, self.factor), "patch.factor"),
                           (lambda: validate_options(info, self.options), "patch.options")):
            try:
                check()
            except ValueError as exc:
                problems.append(f"{key}: {exc}")
        _raise(problems)
        return self


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

    @field_validator("target_modules", "trainable")
    @classmethod
    def _names(cls, value, info: ValidationInfo):
        key = f"lora.{info.field_name}"
        if value == [] and info.field_name == "target_modules":
            raise refused(["lora.target_modules is an empty list; name modules, use all-linear, or null for peft's "
                           "default"])
        if any(not n.strip() for n in rules.listed(value)):
            raise refused([f"{key}: an empty module name (a name matches modules by suffix, so an empty one would "
                           "match every module); remove it"])
        return value


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

    @field_validator("files")
    @classmethod
    def _readable(cls, files: list[str], info: ValidationInfo) -> list[str]:
        reading, source = _source(info)
        if any(not f.strip() for f in files):
            raise refused([rules.empty_path("data.files", source)])
        if reading:
            _raise([why for f in files if (why := rules.missing_data(f, "data.files", source))])
        return files

    @field_validator("text_field")
    @classmethod
    def _named(cls, value: str) -> str:
        _raise([] if value else ["data.text_field must not be empty"])
        return value

    @model_validator(mode="after")
    def _something_to_read(self, info: ValidationInfo):
        reading, source = _source(info)
        if reading:
            _raise(rules.data_problems(self, source, reading))
        return self


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

    @field_validator("micro_batch_size")
    @classmethod
    def _divides_the_batch(cls, micro: int, info: ValidationInfo) -> int:
        batch = info.data.get("batch_size")
        if batch is not None and batch % micro:
            raise refused([f"train.batch_size ({batch}) must be a multiple of train.micro_batch_size ({micro})"])
        if batch is not None and batch // micro > MAX_MICRO_BATCHES:
            raise refused([
                f"train.batch_size / train.micro_batch_size = {batch // micro} micro-batches per optimizer step "
                f"(gradient accumulation x processes), more than the {MAX_MICRO_BATCHES} ctxext allows: a step runs "
                "them all before its first update, so this many would stall at step 0; lower train.batch_size (LoRA "
                "recipes use 8 to a few hundred sequences) or raise train.micro_batch_size"])
        return micro

    @field_validator("betas")
    @classmethod
    def _a_pair(cls, betas: list[float]) -> list[float]:
        if len(betas) != 2:
            raise refused([f"train.betas must be two numbers, got {betas}"])
        _raise([] if all(0 <= b < 1 for b in betas) else [f"train.betas must be in [0, 1), got {betas}"])
        return betas

    @field_validator("scheduler")
    @classmethod
    def _a_schedule(cls, name: str) -> str:
        from transformers.trainer_utils import SchedulerType  # the schedules Trainer has, checked when read

        names = [s.value for s in SchedulerType]
        _raise([] if name in names else [f"train.scheduler must be one of {', '.join(names)}, got {name!r}"])
        return name

    @field_validator("args")
    @classmethod
    def _training_arguments(cls, value: dict) -> dict:
        from .args import args_problems

        _raise(args_problems(value) if value else [])
        return value


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

    @field_validator("data")
    @classmethod
    def _readable(cls, data, info: ValidationInfo):
        reading, source = _source(info)
        if reading and info.data.get("enabled"):
            _raise(rules.eval_problems(data, source))
        return data


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

    @model_validator(mode="after")
    def _a_folder(self, info: ValidationInfo):
        if _source(info)[0]:
            _raise(rules.output_problems(self))
        return self


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

    @field_validator("train")
    @classmethod
    def _train_fits_data_and_patch(cls, train: TrainConfig, info: ValidationInfo) -> TrainConfig:
        _raise(rules.train_problems(train, info.data.get("data"), info.data.get("patch")))
        return train

    @field_validator("output")
    @classmethod
    def _apart_from_what_it_reads(cls, output: OutputConfig, info: ValidationInfo) -> OutputConfig:
        reading, source = _source(info)
        if reading:
            _raise(rules.apart_problems(output, *(info.data.get(k) for k in ("model", "data", "eval")), source))
        return output

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
            return str(rules.resolve(item, self.source))

        return [fix(v) for v in value] if isinstance(value, list) else fix(value)

    def to_yaml(self, absolute_paths: bool = False) -> str:
        """The recipe as YAML (``absolute_paths`` as in :meth:`to_dict`)."""
        return yaml.safe_dump(self.to_dict(absolute_paths), sort_keys=False)

    @property
    def base_dir(self) -> Path:
        """The folder relative data paths are read from: the recipe file's folder, else the working directory."""
        return rules.base_dir(self.source)

    def data_paths(self, items: list[str], key: str) -> list[Path]:
        """Paths of data entries: ``reference:NAME`` -> the shipped files, anything else -> :meth:`resolve_path`."""
        return rules.data_paths(items, key, self.source)


SECTIONS = dict(Recipe.model_fields)
