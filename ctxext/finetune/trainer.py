"""What ``ctxext finetune`` hands to ``transformers.Trainer``: the TrainingArguments a recipe's ``train:`` section
means, the run's samples read in order, and one callback for what Trainer does not do (the JSON-lines log, a stop
on a non-finite loss, ``--stop-after``, ctxext's record in each checkpoint)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ProgressCallback

from . import checkpoint as ckpt
from .args import training_argument_fields
from .config import Recipe, RecipeError
from .errors import one_line


def training_arguments(recipe: Recipe, accumulation: int, progress: bool, use_cpu: bool) -> TrainingArguments:
    t = recipe.train
    mapped = dict(
        output_dir=str(recipe.output.dir), max_steps=t.steps, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=accumulation, learning_rate=t.lr, warmup_steps=t.warmup_steps,
        lr_scheduler_type=t.scheduler, weight_decay=t.weight_decay, adam_beta1=t.betas[0], adam_beta2=t.betas[1],
        max_grad_norm=t.max_grad_norm or 0.0, bf16=t.mixed_precision == "bf16",
        # the loss is logged every step (the callback keeps it per step, stops on a non-finite one before any save,
        # and writes log.jsonl every train.log_every steps)
        fp16=t.mixed_precision == "fp16", seed=t.seed, logging_steps=1, logging_nan_inf_filter=False,
        save_strategy="steps" if t.save_every else "no", save_steps=t.save_every or 500,
        # train.keep_checkpoints is applied by RunCallback.on_save once ctxext's record completes a checkpoint:
        # Trainer rotates before that record exists, so a kill between the two could leave no complete one
        save_total_limit=None, use_cpu=use_cpu, disable_tqdm=not progress,
        remove_unused_columns=False, report_to="none", optim="adamw_torch",
    )
    # transformers 5.x renamed gradient checkpointing to activation checkpointing (the old names warn)
    fields = training_argument_fields()
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    mapped.update({name: t.gradient_checkpointing, f"{name}_kwargs": {"use_reentrant": False}})
    mapped.update(t.args)
    _check_packages(recipe, t.args)
    try:
        args = TrainingArguments(**mapped)
    except (ValueError, TypeError, ImportError) as exc:
        raise recipe.error("train: transformers.TrainingArguments refused the training settings (train keys and "
                           f"train.args): {_exception_text(exc)}") from None
    _check_reporting(recipe, args.report_to)
    _check_optimizer(recipe, args)
    return args


def _exception_text(exc: BaseException) -> str:
    """An exception's message on one line. importlib's PackageNotFoundError prints "No package metadata was found for
    NAME", and transformers raises it with a sentence as the NAME: that sentence is the message."""
    import importlib.metadata

    text = exc.args[0] if isinstance(exc, importlib.metadata.PackageNotFoundError) and exc.args else exc
    return one_line(text)


#: train.args fields that need a package ctxext does not install: field -> (the package as pip names it, the
#: transformers function that tells whether it is there: module, name). Trainer would meet a missing one only after
#: the model has loaded (liger-kernel at its first step; deepspeed in TrainingArguments, with a garbled message).
NEEDS_PACKAGE = {
    "use_liger_kernel": ("liger-kernel>=0.3.0", "transformers.utils.import_utils", "is_liger_kernel_available"),
    "deepspeed": ("deepspeed", "transformers.integrations.deepspeed", "is_deepspeed_available"),
}


def _check_packages(recipe: Recipe, given: dict) -> None:
    """The packages that the train.args fields given need (:data:`NEEDS_PACKAGE`) are installed, as
    train.args.report_to's integrations and train.args.optim's optimizer are (a field given as false / null / empty
    is off and needs nothing)."""
    import importlib.util

    for key, (package, module, probe) in NEEDS_PACKAGE.items():
        if not given.get(key):
            continue
        try:
            installed = bool(getattr(importlib.import_module(module), probe)())
        except (ImportError, AttributeError):  # a release without the probe: the import name decides
            installed = importlib.util.find_spec(package.split(">")[0].replace("-", "_")) is not None
        if not installed:
            raise recipe.error(f"train.args.{key}: needs {package}, which is not installed in this environment "
                               f"(pip install '{package}', or drop train.args.{key})")


def _check_optimizer(recipe: Recipe, args: TrainingArguments) -> None:
    """train.args.optim names an optimizer whose package is installed, and train.args.lr_scheduler_kwargs are
    arguments the schedule takes: Trainer would meet either only at its first step, after the model has loaded."""
    try:
        Trainer.get_optimizer_cls_and_kwargs(args)
    except ImportError as exc:
        raise recipe.error(f"train.args.optim: {getattr(args.optim, 'value', args.optim)}: {one_line(exc)}") from None
    except Exception:  # noqa: BLE001 - an optimizer that needs the model to be built (GaLore): left to Trainer
        pass
    if args.lr_scheduler_kwargs:
        from transformers import get_scheduler

        probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        try:
            get_scheduler(args.lr_scheduler_type, probe, num_warmup_steps=args.get_warmup_steps(args.max_steps),
                          num_training_steps=args.max_steps, scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs))
        except (TypeError, ValueError) as exc:
            raise recipe.error(f"train.args.lr_scheduler_kwargs: the {recipe.train.scheduler} schedule refused "
                               f"{args.lr_scheduler_kwargs}: {one_line(exc)}") from None


def _check_reporting(recipe: Recipe, report_to) -> None:
    """train.args.report_to names integrations that are installed: Trainer would refuse the others only once the
    model has loaded (``--check`` would pass a run that cannot start)."""
    from transformers.integrations import get_available_reporting_integrations

    wanted = [report_to] if isinstance(report_to, str) else list(report_to or [])
    missing = [name for name in wanted if name not in ("none", "all") + tuple(get_available_reporting_integrations())]
    if missing:
        raise recipe.error(f"train.args.report_to: {', '.join(map(str, missing))} is not installed in this environment "
                           "(pip install it, or drop it from train.args.report_to)")


class RunTrainer(Trainer):
    """Trainer reading the run's samples in order: their order is already the seeded shuffle (``RunSamples``)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def _save_checkpoint(self, *args, **kwargs):
        # a write that fails (a full disk: torch.save's "unexpected pos N vs M") is one line naming the folder
        with ckpt.writing(Path(self.args.output_dir) / f"{ckpt.PREFIX}{self.state.global_step}",
                          Path(self.args.output_dir)):
            return super()._save_checkpoint(*args, **kwargs)


class LossBar(ProgressCallback):
    """Trainer's progress bar with the loss on the bar instead of a printed dict per step (the step records go to
    ``log.jsonl``; stdout keeps the run's summary)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)


class RunCallback(TrainerCallback):
    """The run's record: ``log.jsonl`` step records (main process), the losses, a stop on a non-finite loss,
    ``--stop-after N`` (stop with a checkpoint after N steps in this invocation), ctxext's checkpoint record."""

    def __init__(self, recipe: Recipe, record: dict[str, Any], log, tokens_per_step: int, stop_after: int | None,
                 beside_adapter: dict[str, str] | None = None, begin=None):
        self.recipe, self.record, self.log = recipe, record, log
        #: called once, when this invocation's first step begins (Trainer has built its optimizer and run whatever it
        #: runs before training): the run's first write into output.dir
        self.begin = begin
        #: files written into each checkpoint beside its adapter (name -> text): the patch file and the recipe, so
        #: that ``ctxext.from_pretrained(base, adapter=OUT/checkpoint-N)`` loads it patched and in its trained dtype
        self.beside_adapter = dict(beside_adapter or {})
        self.tokens_per_step, self.stop_after = tokens_per_step, stop_after
        self.ran, self.tic, self.seconds = 0, 0.0, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        # a resumed state carries the interrupted run's cadence: train.save_every may change on resume
        state.save_steps, state.logging_steps = args.save_steps, args.logging_steps

    def on_step_begin(self, args, state, control, **kwargs):
        if self.begin is not None:
            begin, self.begin = self.begin, None
            begin()
        self.tic = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.tic
        self.record["elapsed"] += self.seconds
        self.ran += 1
        if state.global_step >= state.max_steps:
            control.should_save = False  # the adapter is saved at the end; a last checkpoint would only take room
        elif self.stop_after is not None and self.ran >= self.stop_after:
            control.should_save = control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        loss = float(logs["loss"])
        self.record["losses"].append(loss)
        if state.global_step % self.recipe.train.log_every == 0 or state.global_step >= state.max_steps \
                or not math.isfinite(loss):
            tok_s = self.tokens_per_step / self.seconds if self.seconds > 0 else float("nan")
            grad = logs.get("grad_norm")
            self.log.write(event="step", step=state.global_step, loss=loss, lr=logs.get("learning_rate"),
                           grad_norm=None if grad is None else float(grad),
                           tokens=state.global_step * self.tokens_per_step, tokens_per_s=tok_s, seconds=self.seconds)
        if not math.isfinite(loss):  # raised before the step's checkpoint (Trainer logs, then saves)
            raise RecipeError(f"loss is {loss} at step {state.global_step}: lower train.lr (or lora.alpha / lora.r, "
                              "the scale of the LoRA update), or check the data")
        grad = logs.get("grad_norm")
        # a non-finite gradient has already made the weights NaN (or, clipped, left them unchanged for good): stop
        # before this step's checkpoint exists. fp16's loss scaler skips such steps itself, so there it is routine.
        if grad is not None and not math.isfinite(float(grad)) and self.recipe.train.mixed_precision != "fp16":
            raise RecipeError(f"gradient norm is {float(grad)} at step {state.global_step} (loss {loss:.4g}): the "
                              "update is not a number; lower train.lr (or lora.alpha / lora.r, the scale of the LoRA "
                              "update)")

    def on_save(self, args, state, control, **kwargs):
        from accelerate import PartialState

        PartialState().wait_for_everyone()  # every process's files are written before the record that lists them
        if state.is_world_process_zero:
            path = Path(args.output_dir) / f"{ckpt.PREFIX}{state.global_step}"
            with ckpt.writing(path, Path(args.output_dir)):
                for name, text in self.beside_adapter.items():  # before the record, which lists every file's size
                    (path / name).write_text(text)
                ckpt.write_state(path, dict(self.record, step=state.global_step, recipe=self.recipe.to_dict(True),
                                            world_size=args.world_size))
            self.log.write(event="checkpoint", step=state.global_step, path=str(path))
            ckpt.keep_newest(Path(args.output_dir), self.recipe.train.keep_checkpoints)


class RunLog:
    """Append-only JSON lines (main process only). ``held``: records are kept in memory until :meth:`open` (a run
    writes nothing into its folder before training has begun)."""

    def __init__(self, path: Path, enabled: bool, held: bool = False):
        self.path, self.enabled = path, enabled
        self.waiting: list[dict[str, Any]] | None = [] if held else None

    def write(self, **record: Any) -> None:
        if self.enabled:
            record.setdefault("time", round(time.time(), 3))
            if self.waiting is not None:
                self.waiting.append(record)
                return
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")

    def open(self) -> None:
        """Write the records held so far, and every later one as it comes."""
        waiting, self.waiting = self.waiting or [], None
        for record in waiting:
            self.write(**record)

    def truncate_after(self, step: int) -> None:
        """Drop step records past ``step`` (left by an interrupted run that is being resumed)."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not (rec.get("event") == "step" and rec.get("step", 0) > step):
                keep.append(line)
        self.path.write_text("".join(line + "\n" for line in keep))
