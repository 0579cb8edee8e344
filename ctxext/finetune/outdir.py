"""What a run's output folder holds decides how it starts: a finished run, an earlier run's checkpoints (resumed
with --resume, refused otherwise), damaged checkpoints (passed over), the user's own files (refused); and what
--overwrite removes. ``--check`` reports the same refusals a run would meet there."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.outputs import first_record
from ..export import ADAPTER_RECORD as PATCH_FILE  # the adapter's patch record
from . import checkpoint as ckpt
from .config import Recipe, RecipeError
from .model import model_source

#: What a run writes in output.dir besides its checkpoint folders: the log (written first, so it marks a run's folder),
#: the summary, the recipe, the adapter (peft writes a README.md model card beside it), the tokenizer, the merged
#: model. --overwrite removes all of it before the new run writes anything, so no part of the old run (an adapter
#: without its patch file) outlives a new run that stops early.
RUN_LOG = "log.jsonl"
RUN_FILES = (RUN_LOG, "results.json", "recipe.yaml", PATCH_FILE, "adapter_config.json", "adapter_model.safetensors",
             "adapter_model.bin", "README.md", "tokenizer", "merged")



def start_state(recipe: Recipe, out: Path, resume: bool, say) -> tuple[Path | None, list, dict | None]:
    """What output.dir holds decides the start: a finished run (returned as the summary when resuming), checkpoints
    of an earlier run (resumed with --resume, refused otherwise), damaged checkpoints (passed over). Returns (the
    checkpoint to resume, the damaged ones newer than it, a finished run's summary)."""
    _refuse_foreign_folder(out)
    finished = out / "results.json"
    if finished.exists() and not recipe.output.overwrite:
        if resume:
            saved = out / "recipe.yaml"  # the finished run's recipe: --resume with another one is not this run
            if saved.is_file():
                ckpt.check_compatible(out, recipe, finished_record(saved), finished=True)
            if recipe.output.merged and not (out / "merged").is_dir():
                raise RecipeError(
                    f"output.merged: the run in {str(out)!r} finished without a merged model, and --resume has nothing "
                    "left to run (the merged model is written at the end of training); nothing was changed. Load it "
                    "merged with ctxext.from_pretrained(BASE, adapter=DIR).merge_and_unload(), or run the recipe "
                    "into another output.dir")
            say(f"{out} holds a finished run; nothing to resume")
            return None, [], finished_record(finished)
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
    recorded, now = ckpt.read_state(latest).get("model_files"), model_files(recipe)
    if recorded is not None and recorded != now:  # a run begun on other weights: its adapter would mix two bases
        raise RecipeError(
            f"cannot resume from {latest}: the model {recipe.model.name} is not the one the run began with (its "
            "config.json or weight files differ in content, size or modification time); resume with the same files "
            "(copies made with `cp -p` keep their times), or start over with --set output.overwrite=true")
    return latest, damaged, None


def model_files(recipe: Recipe) -> dict:
    """What identifies the base model's files (eval's and search's fingerprint: config.json's sha256, each weight
    file's name, size and modification time; a hub model's cached commit)."""
    from ..evaluation.fingerprint import model_fingerprint

    m = recipe.model
    return model_fingerprint({"model": model_source(m), "gguf_file": m.gguf_file, "revision": m.revision})


def finished_record(path: Path) -> dict:
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
    if not out.is_dir() or ckpt.checkpoints(out) or ckpt.old_layout(out):
        return
    if (first_record(out / RUN_LOG) or {}).get("event") in ("start", "eval"):  # a run's log, not a user's log.jsonl
        return
    held = sorted(p.name for p in out.iterdir())
    if held:
        listed = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise RecipeError(f"output.dir {str(out)!r} holds files that are not a ctxext finetune run ({listed}); a run "
                          "writes README.md, recipe.yaml and the adapter there and would replace files of the same "
                          "name: give a new or empty folder")


def check_output_folder(recipe: Recipe) -> None:
    """What ``--check`` says about output.dir beyond "it can be written": the refusals a run (without --resume) would
    meet there (a folder that is not a run, a finished run, checkpoints, the old layout)."""
    try:
        start_state(recipe, Path(recipe.output.dir), False, lambda message: None)
    except RecipeError as exc:
        raise recipe.error(str(exc)) from None


def remove_if_made(out: Path, existed: bool) -> None:
    """``out`` as an empty folder Trainer made for a run that then failed to start: removed (main process)."""
    from accelerate import PartialState

    if not existed and PartialState().is_main_process and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def clear_run(out: Path) -> None:
    """Remove an earlier run from ``out`` (--overwrite): its checkpoints and every file in RUN_FILES."""
    import shutil

    ckpt.remove_all(out)
    for name in RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

