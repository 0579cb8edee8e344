"""Resumable checkpoints in Trainer's layout, with ctxext's record beside them.

``OUT/checkpoint-100/`` is what ``transformers.Trainer`` saves (the peft adapter with its ``modules_to_save``, not
the frozen base model; ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``trainer_state.json``) plus
``ctxext_state.json``, written last by :class:`ctxext.finetune.trainer.RunCallback`: the recipe snapshot, the run's
record (losses, evaluations before training) and the size of every file beside it. A folder without it is an
incomplete checkpoint and is ignored.

``--resume`` checks the newest checkpoint before anything loads (:func:`damage`: the listed sizes, then each file's
format: a safetensors header that covers its tensors, a torch.save archive's directory and CRCs, the JSON files). A
damaged one (a disk that filled up, a copy cut short) is passed over for the newest intact one, and said so; it is
renamed ``damaged-checkpoint-N`` when training starts (Trainer's rotation and resume only see ``checkpoint-N``).
A write that fails while a checkpoint is saved (a full disk) stops the run with one line that names the folder and
the checkpoint ``--resume`` continues from (:func:`write_failure`).
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .config import Recipe, RecipeError
from .errors import WriteError

PREFIX = f"{PREFIX_CHECKPOINT_DIR}-"  # Trainer's folder names: checkpoint-N
STATE = "ctxext_state.json"
DAMAGED_PREFIX = "damaged-"
#: the layout of ctxext before Trainer (``OUT/checkpoints/step-000100``): not resumable, named in the refusal
OLD_LAYOUT = "checkpoints"
#: Recipe keys that may change between an interrupted run and its resumption (they do not change the result).
RESUMABLE_CHANGES = {
    "eval", "output.merged", "output.overwrite", "train.save_every", "train.keep_checkpoints", "train.log_every",
    "model.attn_implementation", "output.dir",  # output.dir is where the checkpoint was found (cwd may differ)
    "train.args.report_to", "train.args.logging_dir", "train.args.run_name",
}


def _step(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def _folders(out: Path) -> list[Path]:
    """Every ``checkpoint-N`` folder Trainer began, complete or not, oldest first."""
    out = Path(out)
    if not out.is_dir():
        return []
    return sorted((p for p in out.iterdir() if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()), key=_step)


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints (with ctxext's record), oldest first. Not Trainer's ``get_last_checkpoint``: that takes
    a folder a kill left without the record."""
    return [p for p in _folders(out) if (p / STATE).exists()]


def latest(out: Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def keep_newest(out: Path, keep: int) -> None:
    """``train.keep_checkpoints``: remove the oldest complete checkpoints past ``keep`` (0 keeps all), only ever
    after a newer one is complete. A folder a kill left without its record goes too once a newer one is complete."""
    if keep <= 0:
        return
    complete = checkpoints(out)
    newest = _step(complete[-1]) if complete else -1
    partial = [p for p in _folders(out) if not (p / STATE).exists() and _step(p) < newest]
    for path in complete[:-keep] + partial:
        shutil.rmtree(path, ignore_errors=True)


def old_layout(out: Path) -> list[Path]:
    """The ``checkpoints/step-N`` folders of ctxext's layout before Trainer (a ``checkpoints`` folder of anything
    else is the user's)."""
    old = Path(out) / OLD_LAYOUT
    return sorted(p for p in old.iterdir() if p.is_dir() and p.name.startswith("step-")) if old.is_dir() else []


def refuse_old_layout(out: Path) -> None:
    if old_layout(out):
        raise RecipeError(
            f"output.dir {str(out)!r} holds checkpoints in ctxext's old layout ({OLD_LAYOUT}/step-N/), written before "
            f"fine-tuning ran on transformers' Trainer; they cannot be resumed: ctxext now writes Trainer's "
            f"{PREFIX}N/ folders. Start over with --set output.overwrite=true (or another output.dir)")


def files(path: Path) -> dict[str, int]:
    """Size of every file of a checkpoint folder but ctxext's record, by path relative to it."""
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(Path(path).rglob("*"))
            if f.is_file() and f.name != STATE}


def write_state(path: Path, record: dict[str, Any]) -> None:
    """ctxext's record, written last: its presence marks the checkpoint complete (a write that fails, a full disk,
    leaves none)."""
    target = Path(path) / STATE
    try:
        target.write_text(json.dumps(dict(record, files=files(path)), indent=1) + "\n")
    except BaseException:
        target.unlink(missing_ok=True)
        raise


#: Free bytes below which the disk of a write that failed is taken as full. torch's zip writer keeps no errno: a
#: short write shows as "unexpected pos N vs M", and the file it cut short stays, so the full disk has about nothing
#: free afterwards.
FULL_BELOW = 1 << 20


def _errno(exc: BaseException | None) -> int | None:
    """The errno of a failed write: an OSError's in the exception's chain (cause, context), or the one safetensors'
    I/O error carries ("... (os error 28)")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        if type(exc).__name__ == "SafetensorError":
            found = re.search(r"\(os error (\d+)\)", str(exc))
            if found:
                return int(found.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def _from_a_writer(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by a file writer that reports no errno: torch.save's (raised in
    torch/serialization.py) or safetensors'."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    where = Path(last.tb_frame.f_code.co_filename).as_posix() if last is not None else ""
    return where.endswith("torch/serialization.py") or type(exc).__name__ == "SafetensorError"


def _free_bytes(folder: Path) -> int | None:
    """Free bytes on the disk of ``folder`` (or of its nearest folder that exists); None if that cannot be read."""
    for place in (folder, *folder.parents):
        if place.exists():
            try:
                return shutil.disk_usage(place).free
            except OSError:
                return None
    return None


def write_failure(exc: BaseException, folder: Path, out: Path, what: str = "checkpoint") -> WriteError | None:
    """The one-line error for ``exc``, raised while ``what`` (``checkpoint``: the checkpoint folder ``folder`` of the
    run in ``out``; or e.g. ``the adapter``, written into ``folder``) was written; None when ``exc`` is not a failed
    write (it is left as it is). The disk is said to be full by the failed write's errno (ENOSPC, EDQUOT), or, for a
    writer that keeps none (torch.save), by the little space left on it."""
    import errno

    folder, out = Path(folder), Path(out)
    code, free = _errno(exc), _free_bytes(folder)
    low = free is not None and free < FULL_BELOW
    if code is None and not isinstance(exc, OSError) and not _from_a_writer(exc) \
            and not (isinstance(exc, RuntimeError) and low):
        return None
    full = code in (errno.ENOSPC, errno.EDQUOT) or low
    if full:
        why = "the disk is full" + (f" ({free:,} bytes free)" if free is not None else "")
    else:
        why = "the write failed: " + (f"{type(exc).__name__}: " if not isinstance(exc, OSError) else "") \
            + " ".join((str(exc).splitlines() or [""])[0].split())
    complete = latest(out)
    then = (f"it continues from the last complete checkpoint, {complete.name}" if complete is not None
            else "no checkpoint is complete yet, so it starts the run over")
    if what == "checkpoint":
        head = f"writing checkpoint {folder} failed: {why}; that folder is incomplete and is not resumed from"
    else:
        head = f"writing {what} to {folder} failed: {why}"
    error = WriteError(f"{head}. {'Free some space' if full else 'Fix the write'} and run again with --resume: "
                       f"{then}")
    error.errno = errno.ENOSPC if full else code
    return error


@contextmanager
def writing(folder: Path, out: Path, what: str = "checkpoint"):
    """Runs the block that writes ``what`` into ``folder``; a write in it that fails is raised as
    :func:`write_failure`'s one line (anything else as it was)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - sorted by write_failure: what is not a failed write is raised again
        failed = write_failure(exc, folder, out, what)
        if failed is None:
            raise
        raise failed from None


def damage(path: Path) -> tuple[str, str] | None:
    """(file, what is wrong) when the checkpoint folder ``path`` cannot be resumed from, else None. Reads its files
    (sizes against the list in the record, then each file's format: ``ctxext.core.outputs.file_damage``)."""
    from ..core.outputs import file_damage

    path = Path(path)
    why = file_damage(path / STATE)
    if why is not None:
        return STATE, why
    record = json.loads((path / STATE).read_text(encoding="utf-8"))
    if not isinstance(record, dict) or not isinstance(record.get("recipe"), dict):
        return STATE, "not a checkpoint record (no recipe)"
    for name, size in (record.get("files") or {}).items():
        f = path / name
        if not f.is_file():
            return name, "missing"
        actual = f.stat().st_size
        if actual != size:
            return name, (f"truncated: {actual} of {size} bytes" if actual < size
                          else f"{actual} bytes, {size} were written")
    for name in files(path):
        why = file_damage(path / name)
        if why is not None:
            return name, why
    if (path / "trainer_state.json").is_file() and record.get("step") is not None:
        # Trainer resumes from its own global_step, ctxext's log and schedule from the record's: they must agree
        try:
            step = json.loads((path / "trainer_state.json").read_text(encoding="utf-8")).get("global_step")
        except (ValueError, AttributeError):
            return "trainer_state.json", "not a JSON object"
        if step != record["step"]:
            return "trainer_state.json", f"global_step {step}, where the checkpoint's record says {record['step']}"
    return None


def newest_intact(out: Path) -> tuple[Path | None, list[tuple[Path, str, str]]]:
    """The newest checkpoint that :func:`damage` passes (None if none does), and the damaged ones newer than it,
    newest first, each as (folder, file, what is wrong)."""
    damaged = []
    for path in reversed(checkpoints(out)):
        found = damage(path)
        if found is None:
            return path, damaged
        damaged.append((path, *found))
    return None, damaged


def set_aside(paths: list[Path]) -> None:
    """Rename damaged checkpoint folders ``checkpoint-N`` -> ``damaged-checkpoint-N`` (kept for a look, never
    resumed from, not counted by Trainer's ``save_total_limit``)."""
    for path in map(Path, paths):
        if path.is_dir():
            target, n = path.with_name(DAMAGED_PREFIX + path.name), 1
            while target.exists():
                n += 1
                target = path.with_name(f"{DAMAGED_PREFIX}{path.name}-{n}")
            path.rename(target)


def remove_all(out: Path) -> None:
    """Every checkpoint of an earlier run (also ctxext's old layout, and the damaged ones set aside)."""
    for path in old_layout(out):
        shutil.rmtree(path, ignore_errors=True)
    if (Path(out) / OLD_LAYOUT).is_dir() and not any((Path(out) / OLD_LAYOUT).iterdir()):
        (Path(out) / OLD_LAYOUT).rmdir()
    for path in Path(out).iterdir():  # Trainer's checkpoint-N, and set_aside's damaged-checkpoint-N[-n]; nothing else
        if path.is_dir() and re.fullmatch(f"{PREFIX}\\d+|{DAMAGED_PREFIX}{PREFIX}\\d+(-\\d+)?", path.name):
            shutil.rmtree(path, ignore_errors=True)


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE).read_text())


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "options":
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def _absolute(recorded: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """A recorded recipe with its data paths absolute: the run's own OUT/recipe.yaml holds them so; a state written
    before ctxext saved them so holds them as given, read from the current recipe's folder."""
    recorded = {k: dict(v) if isinstance(v, dict) else v for k, v in recorded.items()}
    for section, key in (("data", "files"), ("eval", "data")):
        if isinstance(recorded.get(section), dict) and key in recorded[section]:
            recorded[section][key] = recipe.absolute_data(recorded[section][key])
    return recorded


def same_eval(saved: dict[str, Any], recipe: Recipe) -> bool:
    """Whether a checkpoint's record was measured under the recipe's eval settings (data paths compared absolute)."""
    return _absolute(saved.get("recipe", {}), recipe).get("eval", {}) == recipe.to_dict(absolute_paths=True)["eval"]


def check_compatible(path: Path, recipe: Recipe, saved: dict[str, Any] | None = None, finished: bool = False) -> None:
    """A resumed run must be the same run: only keys that do not change the result may differ. ``saved``: the recipe
    the run at ``path`` recorded (default: the checkpoint's record); ``finished``: ``path`` is a finished run's
    folder, which a new run should not replace."""
    saved = _flatten(_absolute(read_state(path).get("recipe", {}) if saved is None else saved, recipe))
    now = _flatten(recipe.to_dict(absolute_paths=True))
    changed = sorted(
        k for k in set(saved) | set(now)
        if saved.get(k) != now.get(k) and not any(k == r or k.startswith(r + ".") for r in RESUMABLE_CHANGES)
    )
    if changed:
        diffs = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise RecipeError(
            f"cannot resume from {path}: the recipe changed ({diffs}); resume with the recipe that started the run, "
            + ("or give another output.dir for a new run (output.overwrite=true would delete this finished one)"
               if finished else "or start over with --set output.overwrite=true")
        )
