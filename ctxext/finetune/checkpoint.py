"""Resumable checkpoints, written by accelerate's ``save_state`` and read back by ``load_state``: trainable weights,
optimizer (sharded as accelerate shards it under FSDP / DeepSpeed), the schedule, the gradient scaler and the random
state of every process. ctxext adds the step (which is also the data position: see
:class:`ctxext.finetune.data.PackedData`), the recipe and keep-last-N.

Layout: ``OUT/checkpoints/step-000100/`` with accelerate's files (``model.safetensors``, ``optimizer.bin``,
``custom_checkpoint_0.pkl`` for the schedule, ``random_states_<rank>.pkl``, ...) and ``state.json``, written last, so
a folder without it is an incomplete checkpoint and is ignored. Without sharding only the trainable parameters are
saved (LoRA and ``modules_to_save``), not the frozen base model.

``state.json`` also lists the size of every file written beside it. ``--resume`` checks the newest checkpoint before
anything loads (:func:`damage`: the listed sizes, then each file's format: a safetensors header that covers its
tensors, a torch.save archive's directory and CRCs, state.json itself). A damaged one (a disk that filled up, a copy
cut short) is passed over for the newest intact one, and said so; it is renamed ``damaged-step-NNNNNN`` when training
starts, so that it is never taken for the newest again.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from .config import Recipe, RecipeError

DIRNAME = "checkpoints"
STATE = "state.json"
#: a damaged checkpoint passed over by --resume is renamed with this prefix (``checkpoints()`` ignores it)
DAMAGED_PREFIX = "damaged-"
WEIGHTS = "model.safetensors"  # accelerate's name for the first model's weights
#: Recipe keys that may change between an interrupted run and its resumption (they do not change the result).
RESUMABLE_CHANGES = {
    "eval", "output.merged", "output.overwrite", "train.save_every", "train.keep_checkpoints", "train.log_every",
    "model.attn_implementation", "output.dir",  # output.dir is where the checkpoint was found (cwd may differ)
}


def checkpoints(out: Path) -> list[Path]:
    root = Path(out) / DIRNAME
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith("step-") and (p / STATE).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest(out: Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def _files(path: Path) -> dict[str, int]:
    """Size of every file of a checkpoint folder but state.json, by path relative to it."""
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(Path(path).rglob("*"))
            if f.is_file() and f.name != STATE}


def damage(path: Path) -> tuple[str, str] | None:
    """(file, what is wrong) when the checkpoint folder ``path`` cannot be resumed from, else None. Reads its files
    (sizes against the list in state.json, then each file's format: ``ctxext.core.outputs.file_damage``); loads nothing."""
    from ..core.outputs import file_damage

    path = Path(path)
    why = file_damage(path / STATE)
    if why is not None:
        return STATE, why
    record = json.loads((path / STATE).read_text(encoding="utf-8"))
    if not isinstance(record, dict) or not isinstance(record.get("step"), int) or not isinstance(
            record.get("recipe"), dict):
        return STATE, "not a checkpoint record (no step or recipe)"
    listed = record.get("files")
    if isinstance(listed, dict):  # checkpoints written before the list have only their formats checked
        for name, size in listed.items():
            f = path / name
            if not f.is_file():
                return name, "missing"
            actual = f.stat().st_size
            if actual != size:
                return name, (f"truncated: {actual} of {size} bytes" if actual < size
                              else f"{actual} bytes, {size} were written")
    for name in _files(path):
        why = file_damage(path / name)
        if why is not None:
            return name, why
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


def set_aside(paths: list[Path]) -> list[Path]:
    """Rename damaged checkpoint folders ``step-N`` -> ``damaged-step-N`` (kept for a look, never resumed from, and
    not counted by keep-last-N). Returns the new paths."""
    moved = []
    for path in paths:
        path = Path(path)
        if not path.is_dir():
            continue
        target, n = path.with_name(DAMAGED_PREFIX + path.name), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{DAMAGED_PREFIX}{path.name}-{n}")
        path.rename(target)
        moved.append(target)
    return moved


def remove_all(out: Path) -> None:
    shutil.rmtree(Path(out) / DIRNAME, ignore_errors=True)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "options":
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def register(acc, scheduler) -> None:
    """Teach ``acc.save_state`` / ``load_state`` this run's pieces: the hand-stepped schedule (stepped once per
    optimizer step, so it is not prepared by accelerate) and weights limited to the trainable parameters, saved
    under their unwrapped names so a checkpoint resumes under any number of processes."""
    acc.register_for_checkpointing(scheduler)

    def keep_trainable(models, weights, _dir):
        for i, model in enumerate(models[:len(weights)]):
            weights[i] = {n: p.detach().to("cpu").contiguous().clone()
                          for n, p in _trainable(acc.unwrap_model(model)).items()}

    def load_trainable(models, input_dir):
        from safetensors.torch import load_file

        path = Path(input_dir)
        for model in models:
            params = _trainable(acc.unwrap_model(model))
            weights = load_file(str(path / WEIGHTS))
            missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
            if missing or unexpected:
                raise RecipeError(f"checkpoint {path} does not match the model's trainable parameters "
                                  f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name].to(p.device, p.dtype))
        models.clear()  # loaded here: accelerate would load the partial weights strictly

    acc.register_save_state_pre_hook(keep_trainable)
    acc.register_load_state_pre_hook(load_trainable)


def save(out: Path, acc, state: dict, recipe: Recipe, keep: int) -> Path:
    """Write a checkpoint for ``state['step']`` (collective: every process calls it)."""
    path = Path(out) / DIRNAME / f"step-{state['step']:06d}"
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(path, ignore_errors=True)
    acc.wait_for_everyone()
    acc.save_state(str(path))
    acc.wait_for_everyone()
    if acc.is_main_process:
        record = dict(state, world_size=acc.num_processes, recipe=recipe.to_dict(), files=_files(path))
        (path / STATE).write_text(json.dumps(record, indent=1) + "\n")
        if keep:
            for old in checkpoints(out)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return path


def read_state(path: Path) -> dict[str, Any]:
    record = json.loads((Path(path) / STATE).read_text())
    return {k: record[k] for k in ("step", "tokens", "elapsed", "unpatched", "before", "losses") if k in record}


def check_compatible(path: Path, recipe: Recipe) -> None:
    """A resumed run must be the same run: only keys that do not change the result may differ."""
    saved = _flatten(json.loads((Path(path) / STATE).read_text()).get("recipe", {}))
    now = _flatten(recipe.to_dict())
    changed = sorted(
        k for k in set(saved) | set(now)
        if saved.get(k) != now.get(k) and not any(k == r or k.startswith(r + ".") for r in RESUMABLE_CHANGES)
    )
    if changed:
        diffs = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise RecipeError(
            f"cannot resume from {path}: the recipe changed ({diffs}); resume with the recipe that started the run, "
            "or start over with --set output.overwrite=true"
        )


def load(path: Path, acc) -> None:
    """Restore a checkpoint into the prepared model / optimizer and the registered schedule (every process)."""
    saved_world = json.loads((Path(path) / STATE).read_text()).get("world_size", 1)
    if (Path(path) / "trainable.safetensors").exists():
        raise RecipeError(f"checkpoint {path} was written by an earlier ctxext (before accelerate's save_state) and "
                          "cannot be resumed: start over with --set output.overwrite=true")
    try:
        acc.load_state(str(path))
    except RecipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - damage the checks before loading could not see (torch, pickle, ...)
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise RecipeError(f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {first}); resume from an "
                          "earlier checkpoint by removing this folder, or start over with "
                          "--set output.overwrite=true") from exc
    if saved_world != acc.num_processes:
        warnings.warn(f"checkpoint {Path(path).name} was written by {saved_world} process(es), this run has "
                      f"{acc.num_processes}: random state (dropout) is not carried over exactly", stacklevel=2)
