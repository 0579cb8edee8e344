"""train.args: any other ``transformers.TrainingArguments`` field, checked before anything loads.

TrainingArguments takes a value of any type and Trainer fails on it only mid-run (``label_smoothing_factor: abc``),
so each value is checked against its field's annotation here (pydantic, strict); the fields a recipe key already sets
are refused with that key, and a few fields are taken only at their default or within a range.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

from pydantic import ConfigDict, ValidationError

from .errors import short as _short

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


def args_problems(args: dict) -> list[str]:
    """train.args: every key a TrainingArguments field that no recipe key already sets, with a value of the field's
    type and, for a few fields, range."""
    import dataclasses
    import typing

    from transformers import TrainingArguments, __version__

    fields = training_argument_fields()
    try:
        hints = typing.get_type_hints(TrainingArguments)
    except Exception:  # noqa: BLE001 - a release whose annotations do not resolve: types left to transformers
        hints = {}
    defaults = {f.name: getattr(f.default, "value", f.default) for f in dataclasses.fields(TrainingArguments)}
    problems = []
    for key, value in args.items():
        if key in OWNED:
            why = f"set by {OWNED[key]}"
        elif key in DEFAULT_ONLY and str(value).lower() != str(defaults.get(key)).lower():
            why = f"only its default, {defaults.get(key)!r}, is taken: {DEFAULT_ONLY[key]}"
        elif key not in fields:  # a field of another transformers release is named as such
            why = f"not a transformers.TrainingArguments field (transformers {__version__})"
        elif key in hints and not _fits(value, hints[key]):
            why = f"expected {_type_name(hints[key])}, got {_short(value)}"
        elif key in ARG_RANGES and _is_number(value) and not ARG_RANGES[key][0](value):
            why = f"must be {ARG_RANGES[key][1]}, got {_short(value)}"
        else:
            continue
        problems.append(f"train.args.{key}: {why}")
    return problems


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

    args, origin = typing.get_args(hint), typing.get_origin(hint)
    if args and origin not in (list, dict):
        return " or ".join(dict.fromkeys(_type_name(a) for a in args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # YAML gives an enum field one of its values' names
        return "a string"
    names = {type(None): "null", bool: "true/false", int: "a whole number", float: "a number", str: "a string",
             list: "a list", dict: "a mapping"}
    return names.get(origin or hint, getattr(hint, "__name__", str(hint)))
