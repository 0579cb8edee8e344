"""The fine-tune recipe script: load -> patch -> evaluate -> LoRA -> train (transformers' Trainer) -> save -> evaluate.

One function, :func:`run`, over the plain components in ``config``, ``model``, ``data``, ``trainer`` and
``checkpoint``. It runs the same under ``python -m ctxext finetune``, ``accelerate launch -m ctxext
finetune`` and ``torchrun --nproc_per_node N -m ctxext finetune``: the global batch is fixed by the recipe,
and each optimizer step consumes the same sequences whatever the number of processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..attention.shifted_sparse import check_shift_attention, enable_shift_attention
from ..core.errors import PatchError
from ..core.outputs import first_record
from ..export import ADAPTER_RECORD as PATCH_FILE  # the adapter's patch record
from . import checkpoint as ckpt
from .config import Recipe, RecipeError, check_model_sources
from .data import RunSamples, build_packed_data, read_eval_tokens
from .model import (
    add_lora,
    apply_patch,
    bake_position_tables,
    check_lora,
    check_patch,
    check_position_input,
    count_parameters,
    load_model,
    load_tokenizer,
    model_source,
    skeleton,
)

#: What a run writes in output.dir besides its checkpoint folders: the log (written first, so it marks a run's folder),
#: the summary, the recipe, the adapter (peft writes a README.md model card beside it), the tokenizer, the merged
#: model. --overwrite removes all of it before the new run writes anything, so no part of the old run (an adapter
#: without its patch file) outlives a new run that stops early.
RUN_LOG = "log.jsonl"
RUN_FILES = (RUN_LOG, "results.json", "recipe.yaml", PATCH_FILE, "adapter_config.json", "adapter_model.safetensors",
             "adapter_model.bin", "README.md", "tokenizer", "merged")


def check_output(recipe: Recipe) -> None:
    """output.dir can be made and written: probed (a temporary file created and removed in it, or in the nearest
    folder that exists on the way), so a run that could not save fails before any model loads."""
    from ..core.outputs import check_writable_folder

    try:
        check_writable_folder(recipe.output.dir, "output.dir")
    except ValueError as exc:
        raise recipe.error(str(exc)) from None


def check_data_size(recipe: Recipe, sequences: int, seq_length: int) -> None:
    """The global batch fits in the data: one optimizer step must not use a packed sequence twice."""
    batch = recipe.train.batch_size
    if batch > sequences:
        raise RecipeError(
            f"train.batch_size ({batch}) is larger than the {sequences} packed sequences of {seq_length} tokens in "
            f"the data: one optimizer step would use some of them twice; lower train.batch_size to at most "
            f"{sequences}, add data, or shorten data.seq_length"
        )


def check(recipe: Recipe) -> dict[str, Any]:
    """Every check that needs no weights: the output folder can be written, the training settings (transformers'
    TrainingArguments built from them), the recipe, the patch against the architecture, the LoRA targets. Returns
    what the run would record (the patch spec and the training length)."""
    from .trainer import training_arguments

    check_output(recipe)
    training_arguments(recipe, _accumulation(recipe, int(os.environ.get("WORLD_SIZE", "1"))), False,
                       use_cpu=recipe.train.cpu or not _has_accelerator())
    model = skeleton(recipe.model)
    if model is None:
        return {"checked_architecture": False}
    problems: list[str] = []
    spec = None
    try:
        spec = check_patch(recipe, model)
    except RecipeError as exc:
        problems.extend(exc.problems)
    try:
        check_lora(recipe, model)
    except RecipeError as exc:
        problems.extend(exc.problems)
    if problems:
        count = f"{len(problems)} problems: " if len(problems) > 1 else ""
        raise recipe.error(count + "; ".join(problems), problems)
    if recipe.patch.method is not None and spec is None:
        return {"checked_architecture": False}
    seq_length = _seq_length(recipe, spec, model)
    checked = {"checked_architecture": True, "patch": spec, "seq_length": seq_length}
    _check_shift_length(recipe, seq_length)  # the length the patch sets
    if recipe.train.pose is not None:
        try:
            _check_pose_chunks(recipe, seq_length)
            checked["pose_target"] = _pose_target(recipe, spec, model, seq_length)
        except RecipeError as exc:
            raise recipe.error(str(exc), exc.problems) from None
    _check_eval_windows(recipe, list(recipe.eval.lengths) or [checked.get("pose_target") or seq_length])
    return checked


def _check_eval_windows(recipe: Recipe, lengths: list[int]) -> None:
    """eval.stride fits every evaluation length (a sliding window's stride is below its length): checked before
    training, not found after it."""
    from ..evaluation.windows import check_protocol

    e = recipe.eval
    for length in lengths if e.enabled else ():
        try:
            check_protocol(e.protocol, int(length), e.stride)
        except ValueError as exc:
            raise recipe.error(f"eval.stride: {exc} (eval.lengths, default: the training length)") from None


def _check_shift_length(recipe: Recipe, seq_length: int, model=None) -> None:
    """train.shift_attention: the training length splits into groups (LongLoRA's S²-Attn), the model's attention
    can be replaced (with ``model``)."""
    if recipe.train.shift_attention:
        try:
            check_shift_attention(seq_length, recipe.train.shift_group_ratio, recipe.patch.method, model=model)
        except PatchError as exc:
            raise recipe.error(f"train.shift_attention: {exc}") from None


def _advertised_length(model) -> int | None:
    """The context length the model advertises: its family's answer (``ctxext.adapters``); for a model no family
    claims, the first of the two attributes the fine-tune has always read there."""
    from ..adapters import adapter_for, config_length

    adapter = adapter_for(model)
    if adapter.family:
        length = adapter.original_length(model)
    else:
        length = config_length(model.config, ("max_position_embeddings", "n_positions"))
    return int(length) if length else None


def _seq_length(recipe: Recipe, spec: dict | None, model) -> int:
    """The training length: data.seq_length; else the patched length; with PoSE, the original length (PoSE trains
    at the length the model was trained at and moves the positions instead)."""
    if recipe.data.seq_length:
        return recipe.data.seq_length
    if recipe.train.pose is not None:
        if spec and spec.get("original_length"):
            return int(spec["original_length"])
        if spec is None and _advertised_length(model):
            return _advertised_length(model)
        raise RecipeError("data.seq_length is required with train.pose: the patch records no original length")
    if spec and spec.get("patched_length"):
        return int(spec["patched_length"])
    length = _advertised_length(model)
    if length:
        return length
    raise RecipeError("data.seq_length is required: the patch gives no target length for this model")


def _check_pose_chunks(recipe: Recipe, seq_length: int) -> None:
    """train.pose.chunks fits the training window (each chunk holds at least one token); a data.seq_length given is
    checked with the recipe, the default one (the model's original length) here."""
    chunks = recipe.train.pose.chunks
    if chunks > seq_length:
        given = "data.seq_length" + ("" if recipe.data.seq_length else ", by default the model's original length")
        raise RecipeError(f"train.pose.chunks ({chunks}) is more than the {seq_length} tokens of the training window "
                          f"({given}): each chunk holds at least one token; use at most {seq_length} chunks (the "
                          "PoSE paper uses 2)")


def _pose_target(recipe: Recipe, spec: dict | None, model, seq_length: int) -> int:
    """PoSE's target length (train.pose.target_length, else the patched length), checked against the window and
    against the length the patched model advertises: positions past it would index past a learned position table
    (GPT-2's ``wpe``; ctxext's patched table clamps them) or train a rotary model where no patch put them."""
    from ..adapters import config_length

    pose = recipe.train.pose
    # Unpatched, the cap is the length the config itself advertises (a rotary model's, a position table's); not
    # the family's training length, which BLOOM / MPT state without a position limit (ALiBi positions are unbounded)
    advertised = (int(spec["patched_length"]) if spec and spec.get("patched_length")
                  else config_length(model.config, ("max_position_embeddings", "n_positions")))
    target = pose.target_length or (int(spec["patched_length"]) if spec and spec.get("patched_length") else None)
    if target is None:
        raise RecipeError("train.pose.target_length is required: the patch gives no target length for this model")
    if target <= seq_length:
        raise RecipeError(f"train.pose.target_length ({target}) must be longer than the training window "
                          f"data.seq_length ({seq_length}): PoSE spreads a short window over a longer span")
    if advertised is not None and target > advertised:
        how = (f"patch.factor >= {target / (spec.get('original_length') or advertised):g}" if spec
               else "a patch that reaches it (e.g. patch.method: pi or extrapolate, with a factor)")
        raise RecipeError(f"train.pose.target_length ({target}) is past the {advertised} positions the "
                          f"{'patched ' if spec else ''}model has; use {how}, or a shorter target")
    return target


def _accumulation(recipe: Recipe, world: int) -> int:
    t = recipe.train
    if t.batch_size % world:
        raise RecipeError(f"train.batch_size ({t.batch_size}) must be a multiple of the number of processes ({world})")
    per_rank = t.batch_size // world
    if per_rank % t.micro_batch_size:
        raise RecipeError(
            f"train.batch_size / processes = {per_rank} must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size})"
        )
    return per_rank // t.micro_batch_size


def _evaluate(recipe: Recipe, model, tokens: torch.Tensor, lengths: list[int], state, progress: bool,
              tolerant: bool = False) -> dict:
    """Perplexity at each length. ``tolerant``: a length the model cannot run (GPT-2 past its position table)
    is recorded as ``ppl: None`` with the reason instead of raising."""
    from ..evaluation.perplexity import perplexity

    e = recipe.eval
    was_training = model.training
    model.eval()
    results = {}
    try:
        for length in lengths:
            try:
                r = perplexity(
                    model, tokens, length, protocol=e.protocol, stride=e.stride, max_windows=e.max_windows,
                    batch_size=e.batch_size, progress=progress, state=state,
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


def _refuse_finished_or_stale(recipe: Recipe, out: Path, resume: bool, say) -> tuple[Path | None, list, dict | None]:
    """What output.dir holds decides the start: a finished run (returned as the summary when resuming), checkpoints
    of an earlier run (resumed with --resume, refused otherwise), damaged checkpoints (passed over). Returns (the
    checkpoint to resume, the damaged ones newer than it, a finished run's summary)."""
    _refuse_foreign_folder(out)
    finished = out / "results.json"
    if finished.exists() and not recipe.output.overwrite:
        if resume:
            saved = out / "recipe.yaml"  # the finished run's recipe: --resume with another one is not this run
            if saved.is_file():
                ckpt.check_compatible(out, recipe, _finished_record(saved), finished=True)
            if recipe.output.merged and not (out / "merged").is_dir():
                raise RecipeError(
                    f"output.merged: the run in {str(out)!r} finished without a merged model, and --resume has nothing "
                    "left to run (the merged model is written at the end of training); nothing was changed. Load it "
                    "merged with ctxext.from_pretrained(BASE, adapter=DIR).merge_and_unload(), or run the recipe "
                    "into another output.dir")
            say(f"{out} holds a finished run; nothing to resume")
            return None, [], _finished_record(finished)
        raise RecipeError(
            f"output.dir {str(out)!r} holds a finished run; choose another folder or --set output.overwrite=true")
    if not recipe.output.overwrite:
        ckpt.refuse_old_layout(out)
    latest = ckpt.latest(out)
    if latest is not None and not resume and not recipe.output.overwrite:
        raise RecipeError(
            f"output.dir {str(out)!r} holds checkpoints of an earlier run ({latest.name}); pass --resume to continue "
            "it, or --set output.overwrite=true to start over")
    if not (resume and latest is not None):
        return None, [], None
    latest, damaged = ckpt.newest_intact(out)
    if latest is None:
        path, name, why = damaged[0]
        more = f"; the {len(damaged) - 1} earlier checkpoint(s) are damaged too" if len(damaged) > 1 else ""
        raise RecipeError(
            f"cannot resume: checkpoint file {path / name} is damaged ({why}){more}, and no intact checkpoint is "
            f"left in {out}; start over with --set output.overwrite=true")
    for path, name, why in damaged:
        say(f"checkpoint {path} is damaged ({name}: {why}); resuming from {latest.name}, the newest intact one "
            f"(the damaged folder is set aside as {ckpt.DAMAGED_PREFIX}{path.name} when training starts)")
    ckpt.check_compatible(latest, recipe)
    recorded, now = ckpt.read_state(latest).get("model_files"), _model_files(recipe)
    if recorded is not None and recorded != now:  # a run begun on other weights: its adapter would mix two bases
        raise RecipeError(
            f"cannot resume from {latest}: the model {recipe.model.name} is not the one the run began with (its "
            "config.json or weight files differ in content, size or modification time); resume with the same files "
            "(copies made with `cp -p` keep their times), or start over with --set output.overwrite=true")
    return latest, damaged, None


def _model_files(recipe: Recipe) -> dict:
    """What identifies the base model's files (eval's and search's fingerprint: config.json's sha256, each weight
    file's name, size and modification time; a hub model's cached commit)."""
    from ..evaluation.fingerprint import model_fingerprint

    m = recipe.model
    return model_fingerprint({"model": model_source(m), "gguf_file": m.gguf_file, "revision": m.revision})


def _finished_record(path: Path) -> dict:
    """A finished run's recipe.yaml or results.json as a mapping; a damaged one is refused by name, not a traceback
    (and not with "overwrite": that would delete the run)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
        record = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, yaml.YAMLError) as exc:
        record = exc
    if not isinstance(record, dict):
        why = f": {(str(record).splitlines() or [type(record).__name__])[0]}" if isinstance(record, Exception) else ""
        raise RecipeError(f"cannot resume: {path} of the finished run there is unreadable or not a mapping{why}; "
                          "nothing was changed. Repair or remove that file, or give another output.dir")
    return record


def _refuse_foreign_folder(out: Path) -> None:
    """A folder that holds files but no run (no run log, no checkpoints) is the user's: a run would replace its
    README.md and recipe.yaml, so it is refused, with --overwrite too."""
    if not out.is_dir() or _is_run_log(out / RUN_LOG) or ckpt.checkpoints(out) or ckpt.old_layout(out):
        return
    held = sorted(p.name for p in out.iterdir())
    if held:
        listed = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise RecipeError(f"output.dir {str(out)!r} holds files that are not a ctxext finetune run ({listed}); a run "
                          "writes README.md, recipe.yaml and the adapter there and would replace files of the same "
                          "name: give a new or empty folder")


def _is_run_log(path: Path) -> bool:
    """Whether ``path`` is the log a run writes (its first line the run's start or its evaluation before the patch):
    a ``log.jsonl`` of the user's does not make the folder a run's."""
    return (first_record(path) or {}).get("event") in ("start", "eval")


def check_output_folder(recipe: Recipe) -> None:
    """What ``--check`` says about output.dir beyond "it can be written": the refusals a run (without --resume) would
    meet there (a folder that is not a run, a finished run, checkpoints, the old layout)."""
    try:
        _refuse_finished_or_stale(recipe, Path(recipe.output.dir), False, lambda message: None)
    except RecipeError as exc:
        raise recipe.error(str(exc)) from None


def _remove_if_made(out: Path, existed: bool) -> None:
    """``out`` as an empty folder Trainer made for a run that then failed to start: removed (main process)."""
    from accelerate import PartialState

    if not existed and PartialState().is_main_process and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _clear_run(out: Path) -> None:
    """Remove an earlier run from ``out`` (--overwrite): its checkpoints and every file in RUN_FILES."""
    import shutil

    ckpt.remove_all(out)
    for name in RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def run(
    recipe: Recipe,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run a recipe. ``resume`` continues from the newest checkpoint in ``output.dir``; ``stop_after`` ends
    this invocation after that many optimizer steps (with a checkpoint), as an interruption would.
    Returns the run summary (also written to ``output.dir/results.json``)."""
    from accelerate import PartialState
    from transformers import default_data_collator, set_seed

    from .trainer import LossBar, RunCallback, RunLog, RunTrainer, training_arguments

    t = recipe.train
    out = Path(recipe.output.dir)
    check_output(recipe)  # before anything is fetched or loaded: a run that could not save must not start
    def refuse(message, _key):
        raise RecipeError(message)

    check_model_sources(recipe.model, refuse, hub=True)  # a model that cannot load fails now, not after retries
    checked = check(recipe)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun / accelerate launch set it
    accum = _accumulation(recipe, world)
    args = training_arguments(recipe, accum, progress, use_cpu=t.cpu or not _has_accelerator())
    if args.n_gpu > 1:  # Trainer would wrap the model in DataParallel: n_gpu x the batch, samples read twice
        raise RecipeError(f"{args.n_gpu} GPUs are visible to one process: run one process per GPU with "
                          f"`torchrun --nproc_per_node {args.n_gpu} -m ctxext finetune ...` or `accelerate launch -m "
                          "ctxext finetune ...` (train.batch_size stays the global batch), or pick one GPU with "
                          "CUDA_VISIBLE_DEVICES=0")
    state = PartialState()  # the process group TrainingArguments set up; evaluation splits its windows over it
    main = state.is_main_process

    def say(msg: str) -> None:
        if main:
            print(f"[finetune] {msg}", file=sys.stderr, flush=True)

    latest, damaged, finished = _refuse_finished_or_stale(recipe, out, resume, say)
    if finished is not None:
        return finished
    log = RunLog(out / RUN_LOG, main, held=True)  # written from the first training step (``begin`` below)

    # -- model, patch, data
    set_seed(t.seed)
    source = model_source(recipe.model)
    say(f"loading {recipe.model.name}" + (f" ({source})" if source != recipe.model.name else ""))
    tokenizer = load_tokenizer(recipe.model)
    eval_tokens = eval_label = None
    if recipe.eval.enabled:
        eval_tokens, eval_label = read_eval_tokens(recipe, tokenizer)
        too_long = [n for n in recipe.eval.lengths if n > eval_tokens.numel()]
        if too_long:  # such a length scores nothing (perplexity n/a): say so before the model loads
            raise RecipeError(f"eval.lengths: {', '.join(map(str, too_long))} longer than the {eval_tokens.numel()} "
                              f"tokens of the evaluation text ({eval_label}), which would score nothing; use "
                              f"lengths up to {eval_tokens.numel()} or more eval.data")
    model = load_model(recipe.model)
    if not checked["checked_architecture"]:
        check_patch(recipe, model)
        check_lora(recipe, model)
    seq_length = checked.get("seq_length")
    pose_target = checked.get("pose_target")
    eval_lengths = list(recipe.eval.lengths) or ([pose_target or seq_length] if seq_length else [])
    record: dict[str, Any] = {"elapsed": 0.0, "unpatched": None, "before": None, "losses": [], "data_sha256": None,
                              "model_files": _model_files(recipe)}
    model.to(args.device)
    if t.pose is not None and recipe.patch.method is None and pose_target:
        # no patch to wait for: probe before any evaluation (it runs again after the no-op patch: two tiny passes)
        check_position_input(model, pose_target)
    saved = ckpt.read_state(latest) if latest is not None else None  # the interrupted run's record
    if saved is not None:
        # eval settings may change on resume: numbers measured under the old ones are measured again
        kept = ("before", "unpatched") if ckpt.same_eval(saved, recipe) else ()
        record.update({k: v for k, v in saved.items() if k in record and (k not in ("before", "unpatched")
                                                                            or k in kept)})
        if not kept and recipe.eval.enabled:
            say("eval settings changed since the run started: the perplexity before training is measured again")
    if record["unpatched"] is None and recipe.eval.enabled and recipe.eval.unpatched and eval_lengths:
        say(f"perplexity of the unpatched model on {eval_label} at {', '.join(map(str, eval_lengths))} tokens")
        record["unpatched"] = _evaluate(recipe, model, eval_tokens, eval_lengths, state, progress, tolerant=True)
    spec = apply_patch(recipe, model)
    seq_length = _seq_length(recipe, spec, model)
    if t.pose is not None:
        _check_pose_chunks(recipe, seq_length)
        pose_target = _pose_target(recipe, spec, model, seq_length)
        model.to(args.device)
        check_position_input(model, pose_target, recipe.patch.method)
    eval_lengths = eval_lengths or [pose_target or seq_length]
    _check_eval_windows(recipe, eval_lengths)
    data = build_packed_data(recipe, tokenizer, seq_length, pose_target)
    check_data_size(recipe, len(data), seq_length)
    digest = hashlib.sha256(data.sequences.numpy().tobytes()).hexdigest()  # the training tokens, as packed
    if saved is not None and saved.get("data_sha256") not in (None, digest):  # None: a checkpoint without it
        raise recipe.error("cannot resume: the training data changed since the run started (the packed tokens "
                           "differ: a data file's content, or the tokenizer); resume with the data the run started "
                           "with, or start over with --set output.overwrite=true")
    record["data_sha256"] = digest
    _check_shift_length(recipe, seq_length, model)  # the length is known only now (the patch can set it)
    say(
        f"patch: {spec['method'] + ' x' + format(spec['factor'] or 1, 'g') if spec else 'none'}; "
        f"{len(data)} sequences of {seq_length} tokens"
        + (f" (PoSE: positions spanning {pose_target}, {t.pose.chunks} chunks)" if pose_target else "")
        + f"; global batch {t.batch_size} = {world} process(es) x "
        f"{accum} accumulation x {t.micro_batch_size} micro-batch; {t.steps} steps"
    )
    model.to(args.device)
    if latest is None:
        if record["unpatched"] is not None:
            log.write(event="eval", when="unpatched", results=record["unpatched"])
        log.write(event="start", recipe=recipe.to_dict(), world_size=world, accumulation=accum,
                  seq_length=seq_length, pose_target=pose_target, sequences=len(data), patch=spec,
                  device=str(args.device))
    if recipe.eval.enabled and recipe.eval.before and record["before"] is None:
        say(f"perplexity before training on {eval_label} at {', '.join(map(str, eval_lengths))} tokens")
        record["before"] = _evaluate(recipe, model, eval_tokens, eval_lengths, state, progress)
        log.write(event="eval", when="before", results=record["before"])

    # -- LoRA, then Trainer
    model.config.use_cache = False
    set_seed(t.seed)
    model = add_lora(recipe, model, source)
    n_train, n_total = count_parameters(model)
    say(f"LoRA r={recipe.lora.r}: {n_train:,} trainable of {n_total:,} parameters "
        f"({100 * n_train / n_total:.2f}%)")
    tokens_per_step = t.batch_size * seq_length
    beside = {"recipe.yaml": recipe.to_yaml(absolute_paths=True)}
    if spec is not None:
        beside[PATCH_FILE] = json.dumps(spec, indent=2) + "\n"

    def begin() -> None:
        """The first write into output.dir, once Trainer is at its first step: a run that fails before (a model that
        does not load, Trainer refusing train.args, an interrupted evaluation) leaves output.dir exactly as it was,
        an earlier run that --overwrite would replace included."""
        state.wait_for_everyone()
        if main:
            out.mkdir(parents=True, exist_ok=True)
            if recipe.output.overwrite and not resume:
                _clear_run(out)
            ckpt.set_aside([path for path, _, _ in damaged])  # newer than the one resumed: not to count as newest
            if latest is None:
                (out / "recipe.yaml").write_text(recipe.to_yaml(absolute_paths=True))
            else:
                log.truncate_after(saved["step"])
        log.open()
        state.wait_for_everyone()

    callback = RunCallback(recipe, record, log, tokens_per_step, stop_after, beside, begin=begin)
    existed = out.exists()
    try:
        trainer = RunTrainer(model=model, args=args, train_dataset=RunSamples(data, t.steps * t.batch_size),
                             data_collator=default_data_collator, callbacks=[callback])
    except Exception as exc:  # noqa: BLE001 - whatever Trainer refuses (an offline push_to_hub, a missing package)
        _remove_if_made(out, existed)  # Trainer makes output.dir first: a fresh run leaves no empty folder
        raise RecipeError(f"transformers' Trainer refused the training settings (train keys and train.args): "
                          f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from None
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for printing in (PrinterCallback, ProgressCallback):  # the step records go to log.jsonl, not stdout
        trainer.remove_callback(printing)
    if progress:
        trainer.add_callback(LossBar)
    if latest is not None:
        log.write(event="resume", step=saved["step"], checkpoint=latest.name, world_size=world)
        say(f"resuming from {latest}")
    # S²-Attn while training only: evaluation (model.eval()) already runs full attention; undone before the save
    undo_shift = enable_shift_attention(model, t.shift_group_ratio) if t.shift_attention else None
    try:
        trainer.train(resume_from_checkpoint=str(latest) if latest is not None else None)
    except BaseException:
        if callback.begin is not None:  # failed before its first step: nothing of this run is in output.dir
            _remove_if_made(out, existed)
        raise
    finally:
        if undo_shift is not None:
            undo_shift()
    if callback.begin is not None:  # no step ran in this invocation (nothing was left to train)
        begin()
    step = trainer.state.global_step
    if step < t.steps:
        say(f"stopped after step {step} of {t.steps}; continue with --resume")
        return {"finished": False, "step": step, "losses": record["losses"], "output": str(out)}

    # -- save the adapter and the patch spec
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    state.wait_for_everyone()
    if main:
        with ckpt.writing(out, out, "the adapter"):  # a full disk: one line; --resume trains from the last checkpoint
            peft_model.save_pretrained(str(out))
            tokenizer.save_pretrained(str(out / "tokenizer"))
            if spec is not None:
                (out / PATCH_FILE).write_text(json.dumps(spec, indent=2) + "\n")
            else:
                (out / PATCH_FILE).unlink(missing_ok=True)
    state.wait_for_everyone()
    say(f"adapter saved to {out}")

    after = None
    if recipe.eval.enabled:
        say(f"perplexity after training on {eval_label} at {', '.join(map(str, eval_lengths))} tokens")
        after = _evaluate(recipe, peft_model, eval_tokens, eval_lengths, state, progress)
        log.write(event="eval", when="after", results=after)

    summary = {
        "finished": True,
        "output": str(out),
        "model": recipe.model.name,
        "patch": spec,
        "seq_length": seq_length,
        "pose": None if pose_target is None else {"target_length": pose_target, "chunks": t.pose.chunks},
        "steps": step,
        "tokens": step * tokens_per_step,
        "train_seconds": round(record["elapsed"], 2),
        "world_size": world,
        "final_loss": record["losses"][-1] if record["losses"] else None,
        "losses": record["losses"],
        "eval_data": eval_label,
        "unpatched": record["unpatched"],
        "before": record["before"],
        "after": after,
    }
    if recipe.output.merged:
        merged_dir = out / "merged"
        if main:
            merged = peft_model.merge_and_unload()
            merged.config.use_cache = True
            if bake_position_tables(merged):
                say("merged: the trained position table is saved as the model's own (no patch to re-apply)")
            merged.save_pretrained(str(merged_dir))
            tokenizer.save_pretrained(str(merged_dir))
        state.wait_for_everyone()
        summary["merged"] = str(merged_dir)
        say(f"merged model saved to {merged_dir}")
    if main:
        (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.write(event="end", final_loss=summary["final_loss"], steps=step, before=record["before"], after=after)
        print(format_summary(summary), flush=True)
    state.wait_for_everyone()
    return summary


def _has_accelerator() -> bool:
    probe = getattr(getattr(torch, "accelerator", None), "is_available", None)
    return bool(probe()) if callable(probe) else torch.cuda.is_available()


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
