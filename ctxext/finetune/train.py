"""The fine-tune recipe script: prepare (check, load, patch, evaluate, data, LoRA) -> train (transformers' Trainer)
-> finish (save, evaluate, summary).

:func:`run` over the plain components in ``checks``, ``outdir``, ``model``, ``data``, ``trainer`` and
``checkpoint``. It runs the same under ``python -m ctxext finetune``, ``accelerate launch -m ctxext
finetune`` and ``torchrun --nproc_per_node N -m ctxext finetune``: the global batch is fixed by the recipe,
and each optimizer step consumes the same sequences whatever the number of processes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..attention.shifted_sparse import enable_shift_attention
from . import checkpoint as ckpt
from .checks import check, check_data_size, check_eval_windows, check_output, check_patched, check_recipe, world_size
from .config import Recipe, RecipeError, check_model_sources
from .data import RunSamples, build_packed_data, read_eval_tokens
from .model import add_lora, apply_patch, check_lora, check_patch, load_model, load_tokenizer, model_source
from .outdir import PATCH_FILE, RUN_LOG, clear_run, model_files, remove_if_made, start_state

__all__ = ["Job", "check", "finish", "format_summary", "prepare", "run", "train"]


@dataclass
class Job:
    """One invocation of a recipe, as :func:`prepare` leaves it for :func:`train` and :func:`finish`."""

    recipe: Recipe
    resume: bool
    progress: bool
    checked: dict
    args: Any  # transformers.TrainingArguments
    state: Any  # accelerate.PartialState: the process group TrainingArguments set up
    latest: Path | None = None  # the checkpoint resumed from
    damaged: list = field(default_factory=list)  # damaged checkpoints newer than it, set aside when training starts
    finished: dict | None = None  # a finished run's summary (--resume has nothing left to do)
    saved: dict | None = None  # the interrupted run's record
    record: dict = field(default_factory=dict)
    tokenizer: Any = None
    model: Any = None
    spec: dict | None = None
    seq_length: int | None = None
    pose_target: int | None = None
    eval_tokens: torch.Tensor | None = None
    eval_label: str | None = None
    eval_lengths: list = field(default_factory=list)
    data: Any = None
    log: Any = None

    @property
    def out(self) -> Path:
        return Path(self.recipe.output.dir)

    @property
    def main(self) -> bool:
        return self.state.is_main_process

    def say(self, msg: str) -> None:
        if self.main:
            print(f"[finetune] {msg}", file=sys.stderr, flush=True)


def run(recipe: Recipe, *, resume: bool = False, stop_after: int | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Run a recipe. ``resume`` continues from the newest checkpoint in ``output.dir``; ``stop_after`` ends
    this invocation after that many optimizer steps (with a checkpoint), as an interruption would.
    Returns the run summary (also written to ``output.dir/results.json``)."""
    job = prepare(recipe, resume=resume, progress=progress)
    if job.finished is not None:
        return job.finished
    trainer = train(job, stop_after)
    return finish(job, trainer)


# ---------------------------------------------------------------------------------------------------- prepare


def prepare(recipe: Recipe, *, resume: bool = False, progress: bool = True) -> Job:
    """Every check, once; then the model loaded, patched and evaluated, the data packed, LoRA added. Nothing is
    written into output.dir yet (that waits for Trainer's first step)."""
    from accelerate import PartialState

    check_output(recipe)  # before anything is fetched or loaded: a run that could not save must not start

    def refuse(message, _key):
        raise RecipeError(message)

    # hub ids (the recipe checked local paths): a model that cannot load fails now, not after retries
    check_model_sources(recipe.model, refuse, hub=True)
    checked, args = check_recipe(recipe, progress)
    if args.n_gpu > 1:  # Trainer would wrap the model in DataParallel: n_gpu x the batch, samples read twice
        raise RecipeError(f"{args.n_gpu} GPUs are visible to one process: run one process per GPU with "
                          f"`torchrun --nproc_per_node {args.n_gpu} -m ctxext finetune ...` or `accelerate launch -m "
                          "ctxext finetune ...` (train.batch_size stays the global batch), or pick one GPU with "
                          "CUDA_VISIBLE_DEVICES=0")
    job = Job(recipe, resume, progress, checked, args, PartialState())
    job.latest, job.damaged, job.finished = start_state(recipe, job.out, resume, job.say)
    if job.finished is None:
        _load(job)
        _patch_and_pack(job)
        _add_lora(job)
    return job


def _load(job: Job) -> None:
    """The tokenizer, the evaluation text, the model (with the checks that need it), the interrupted run's record."""
    from transformers import set_seed

    from .trainer import RunLog

    recipe = job.recipe
    job.log = RunLog(job.out / RUN_LOG, job.main, held=True)  # written from the first training step (``begin``)
    set_seed(recipe.train.seed)
    source = model_source(recipe.model)
    job.say(f"loading {recipe.model.name}" + (f" ({source})" if source != recipe.model.name else ""))
    job.tokenizer = load_tokenizer(recipe.model)
    if recipe.eval.enabled:
        job.eval_tokens, job.eval_label = read_eval_tokens(recipe, job.tokenizer)
        n = job.eval_tokens.numel()
        too_long = [length for length in recipe.eval.lengths if length > n]
        if too_long:  # such a length scores nothing (perplexity n/a): say so before the model loads
            raise RecipeError(f"eval.lengths: {', '.join(map(str, too_long))} longer than the {n} tokens of the "
                              f"evaluation text ({job.eval_label}), which would score nothing; use lengths up to {n} "
                              "or more eval.data")
    job.model = load_model(recipe.model)
    if not job.checked["checked_architecture"]:  # what the skeleton could not tell
        check_patch(recipe, job.model)
        check_lora(recipe, job.model)
    job.record = {"elapsed": 0.0, "unpatched": None, "before": None, "losses": [], "data_sha256": None,
                  "model_files": model_files(recipe)}
    job.model.to(job.args.device)
    job.saved = ckpt.read_state(job.latest) if job.latest is not None else None
    if job.saved is not None:
        # eval settings may change on resume: numbers measured under the old ones are measured again
        kept = ("before", "unpatched") if ckpt.same_eval(job.saved, recipe) else ()
        job.record.update({k: v for k, v in job.saved.items()
                           if k in job.record and (k not in ("before", "unpatched") or k in kept)})
        if not kept and recipe.eval.enabled:
            job.say("eval settings changed since the run started: the perplexity before training is measured again")


def _patch_and_pack(job: Job) -> None:
    """The evaluation of the model as loaded, the patch (and the checks on the patched model), the packed data."""
    recipe, e = job.recipe, job.recipe.eval
    checked = job.checked
    job.eval_lengths = list(e.lengths) or ([checked.get("pose_target") or checked["seq_length"]]
                                           if checked.get("seq_length") else [])
    if recipe.patch.method is None:  # nothing to patch: the probe runs before any evaluation
        _patch(job)
    if job.record["unpatched"] is None and e.enabled and e.unpatched and job.eval_lengths:
        job.say(f"perplexity of the unpatched model on {job.eval_label} at {', '.join(map(str, job.eval_lengths))} "
                "tokens")
        job.record["unpatched"] = _evaluate(job, job.model, job.eval_lengths, tolerant=True)
    if recipe.patch.method is not None:
        _patch(job)
    if not job.eval_lengths:
        job.eval_lengths = [job.pose_target or job.seq_length]
        check_eval_windows(recipe, job.eval_lengths)
    elif not checked["checked_architecture"]:
        check_eval_windows(recipe, job.eval_lengths)
    job.data = build_packed_data(recipe, job.tokenizer, job.seq_length, job.pose_target)
    check_data_size(recipe, len(job.data), job.seq_length)
    digest = hashlib.sha256(job.data.sequences.numpy().tobytes()).hexdigest()  # the training tokens, as packed
    if job.saved is not None and job.saved.get("data_sha256") not in (None, digest):  # None: a record without it
        raise recipe.error("cannot resume: the training data changed since the run started (the packed tokens "
                           "differ: a data file's content, or the tokenizer); resume with the data the run started "
                           "with, or start over with --set output.overwrite=true")
    job.record["data_sha256"] = digest
    _evaluate_before(job)


def _patch(job: Job) -> None:
    job.spec = apply_patch(job.recipe, job.model)
    job.model.to(job.args.device)
    job.seq_length, job.pose_target = check_patched(job.recipe, job.model, job.checked, job.spec)


def _evaluate_before(job: Job) -> None:
    """The run's first log records (held until training begins), and the perplexity before training."""
    recipe, t, spec = job.recipe, job.recipe.train, job.spec
    accum = job.args.gradient_accumulation_steps
    job.say(
        f"patch: {spec['method'] + ' x' + format(spec['factor'] or 1, 'g') if spec else 'none'}; "
        f"{len(job.data)} sequences of {job.seq_length} tokens"
        + (f" (PoSE: positions spanning {job.pose_target}, {t.pose.chunks} chunks)" if job.pose_target else "")
        + f"; global batch {t.batch_size} = {world_size()} process(es) x "
        f"{accum} accumulation x {t.micro_batch_size} micro-batch; {t.steps} steps"
    )
    if job.latest is None:
        if job.record["unpatched"] is not None:
            job.log.write(event="eval", when="unpatched", results=job.record["unpatched"])
        job.log.write(event="start", recipe=recipe.to_dict(), world_size=world_size(), accumulation=accum,
                      seq_length=job.seq_length, pose_target=job.pose_target, sequences=len(job.data),
                      patch=spec, device=str(job.args.device))
    if recipe.eval.enabled and recipe.eval.before and job.record["before"] is None:
        job.say(f"perplexity before training on {job.eval_label} at {', '.join(map(str, job.eval_lengths))} tokens")
        job.record["before"] = _evaluate(job, job.model, job.eval_lengths)
        job.log.write(event="eval", when="before", results=job.record["before"])


def _add_lora(job: Job) -> None:
    from transformers import set_seed

    recipe = job.recipe
    job.model.config.use_cache = False
    set_seed(recipe.train.seed)
    job.model = add_lora(recipe, job.model, model_source(recipe.model))
    n_train, n_total = job.model.get_nb_trainable_parameters()  # peft's count
    job.say(f"LoRA r={recipe.lora.r}: {n_train:,} trainable of {n_total:,} parameters "
            f"({100 * n_train / n_total:.2f}%)")


# ------------------------------------------------------------------------------------------------------ train


def train(job: Job, stop_after: int | None = None):
    """transformers' Trainer over the prepared job, from the checkpoint resumed (if any). Returns the Trainer."""
    from transformers import default_data_collator
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from .trainer import LossBar, RunCallback, RunTrainer

    recipe, t, out = job.recipe, job.recipe.train, job.out
    beside = {"recipe.yaml": recipe.to_yaml(absolute_paths=True)}
    if job.spec is not None:
        beside[PATCH_FILE] = json.dumps(job.spec, indent=2) + "\n"
    callback = RunCallback(recipe, job.record, job.log, t.batch_size * job.seq_length, stop_after, beside,
                           begin=lambda: _begin(job))
    existed = out.exists()
    try:
        trainer = RunTrainer(model=job.model, args=job.args, data_collator=default_data_collator,
                             train_dataset=RunSamples(job.data, t.steps * t.batch_size), callbacks=[callback])
    except Exception as exc:  # noqa: BLE001 - whatever Trainer refuses (an offline push_to_hub, a missing package)
        remove_if_made(out, existed)  # Trainer makes output.dir first: a fresh run leaves no empty folder
        raise RecipeError(f"transformers' Trainer refused the training settings (train keys and train.args): "
                          f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from None
    for printing in (PrinterCallback, ProgressCallback):  # the step records go to log.jsonl, not stdout
        trainer.remove_callback(printing)
    if job.progress:
        trainer.add_callback(LossBar)
    if job.latest is not None:
        job.log.write(event="resume", step=job.saved["step"], checkpoint=job.latest.name, world_size=world_size())
        job.say(f"resuming from {job.latest}")
    # S²-Attn while training only: evaluation (model.eval()) already runs full attention; undone before the save
    undo_shift = enable_shift_attention(job.model, t.shift_group_ratio) if t.shift_attention else None
    try:
        trainer.train(resume_from_checkpoint=str(job.latest) if job.latest is not None else None)
    except BaseException:
        if callback.begin is not None:  # failed before its first step: nothing of this run is in output.dir
            remove_if_made(out, existed)
        raise
    finally:
        if undo_shift is not None:
            undo_shift()
    if callback.begin is not None:  # no step ran in this invocation (nothing was left to train)
        _begin(job)
    return trainer


def _begin(job: Job) -> None:
    """The first write into output.dir, once Trainer is at its first step: a run that fails before (a model that
    does not load, Trainer refusing train.args, an interrupted evaluation) leaves output.dir exactly as it was,
    an earlier run that --overwrite would replace included."""
    job.state.wait_for_everyone()
    if job.main:
        job.out.mkdir(parents=True, exist_ok=True)
        if job.recipe.output.overwrite and not job.resume:
            clear_run(job.out)
        ckpt.set_aside([path for path, _, _ in job.damaged])  # newer than the one resumed: not to count as newest
        if job.latest is None:
            (job.out / "recipe.yaml").write_text(job.recipe.to_yaml(absolute_paths=True))
        else:
            job.log.truncate_after(job.saved["step"])
    job.log.open()
    job.state.wait_for_everyone()


# ----------------------------------------------------------------------------------------------------- finish


def finish(job: Job, trainer) -> dict[str, Any]:
    """The adapter and its patch record saved, the perplexity after training, the merged model, the summary. A run
    stopped early (--stop-after) returns where it stopped."""
    recipe, t, out, state = job.recipe, job.recipe.train, job.out, job.state
    step = trainer.state.global_step
    if step < t.steps:
        job.say(f"stopped after step {step} of {t.steps}; continue with --resume")
        return {"finished": False, "step": step, "losses": job.record["losses"], "output": str(out)}
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    state.wait_for_everyone()
    if job.main:
        with ckpt.writing(out, out, "the adapter"):  # a full disk: one line; --resume trains from the last checkpoint
            peft_model.save_pretrained(str(out))
            job.tokenizer.save_pretrained(str(out / "tokenizer"))
            if job.spec is not None:
                (out / PATCH_FILE).write_text(json.dumps(job.spec, indent=2) + "\n")
            else:
                (out / PATCH_FILE).unlink(missing_ok=True)
    state.wait_for_everyone()
    job.say(f"adapter saved to {out}")
    after = None
    if recipe.eval.enabled:
        job.say(f"perplexity after training on {job.eval_label} at {', '.join(map(str, job.eval_lengths))} tokens")
        after = _evaluate(job, peft_model, job.eval_lengths)
        job.log.write(event="eval", when="after", results=after)
    summary = _summary(job, step, after)
    if recipe.output.merged:
        summary["merged"] = _save_merged(job, peft_model)
    if job.main:
        (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
        job.log.write(event="end", final_loss=summary["final_loss"], steps=step, before=job.record["before"],
                      after=after)
        print(format_summary(summary), flush=True)
    state.wait_for_everyone()
    return summary


def _summary(job: Job, step: int, after: dict | None) -> dict[str, Any]:
    recipe, record, t = job.recipe, job.record, job.recipe.train
    return {
        "finished": True,
        "output": str(job.out),
        "model": recipe.model.name,
        "patch": job.spec,
        "seq_length": job.seq_length,
        "pose": None if job.pose_target is None else {"target_length": job.pose_target, "chunks": t.pose.chunks},
        "steps": step,
        "tokens": step * t.batch_size * job.seq_length,
        "train_seconds": round(record["elapsed"], 2),
        "world_size": world_size(),
        "final_loss": record["losses"][-1] if record["losses"] else None,
        "losses": record["losses"],
        "eval_data": job.eval_label,
        "unpatched": record["unpatched"],
        "before": record["before"],
        "after": after,
    }


def _save_merged(job: Job, peft_model) -> str:
    from ..adapters import adapter_for

    merged_dir = job.out / "merged"
    if job.main:
        merged = peft_model.merge_and_unload()
        merged.config.use_cache = True
        if adapter_for(merged).bake_trained(merged):  # the family makes trained patched modules the model's own
            job.say("merged: the trained position table is saved as the model's own (no patch to re-apply)")
        merged.save_pretrained(str(merged_dir))
        job.tokenizer.save_pretrained(str(merged_dir))
    job.state.wait_for_everyone()
    job.say(f"merged model saved to {merged_dir}")
    return str(merged_dir)


def _evaluate(job: Job, model, lengths: list[int], tolerant: bool = False) -> dict:
    """Perplexity at each length. ``tolerant``: a length the model cannot run (GPT-2 past its position table)
    is recorded as ``ppl: None`` with the reason instead of raising."""
    from ..evaluation.perplexity import perplexity

    e = job.recipe.eval
    was_training = model.training
    model.eval()
    results = {}
    try:
        for length in lengths:
            try:
                r = perplexity(
                    model, job.eval_tokens, length, protocol=e.protocol, stride=e.stride, max_windows=e.max_windows,
                    batch_size=e.batch_size, progress=job.progress, state=job.state,
                )
            except (IndexError, RuntimeError) as exc:
                if not tolerant:
                    raise
                results[str(length)] = {"ppl": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
                continue
            results[str(length)] = {k: r[k] for k in ("ppl", "ppl_last_quarter", "tokens", "windows", "nll_sum")}
    finally:
        model.train(was_training)
    return results



def format_summary(summary: dict[str, Any]) -> str:
    patch = summary["patch"]
    label = f"{patch['method']} x{patch['factor']:g}" if patch and patch.get("factor") else (
        patch["method"] if patch else "no patch")
    pose = summary.get("pose")
    if pose:
        label += f" + PoSE to {pose['target_length']}"
    lines = [
        f"fine-tuned {summary['model']} ({label} + LoRA): {summary['steps']} steps, {summary['tokens']:,} tokens, "
        f"{summary['train_seconds']:.0f} s, final loss "
        + ("n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"),
        f"adapter: {summary['output']}",
    ]
    unpatched = summary.get("unpatched") or {}
    before, after = summary.get("before") or {}, summary.get("after") or {}
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    for length in after or before:
        b = before.get(length, {}).get("ppl")
        a = after.get(length, {}).get("ppl")
        u = f"unpatched {fmt(unpatched[length].get('ppl'))}, " if length in unpatched else ""
        lines.append(f"perplexity at {length} tokens on {summary['eval_data']}: {u}"
                     f"before training {fmt(b)} -> after {fmt(a)}")
    return "\n".join(lines)
