"""Resumable checkpoints, written by accelerate's ``save_state`` and read back by ``load_state``: trainable weights,
optimizer (sharded as accelerate shards it under FSDP / DeepSpeed), the schedule, the gradient scaler and the random
state of every process. ctxext adds the step (which is also the data position: see
:class:`ctxext.finetune.data.PackedData`), the recipe and keep-last-N.

Layout: ``OUT/checkpoints/step-000100/`` with accelerate's files (``model.safetensors``, ``optimizer.bin``,
``custom_checkpoint_0.pkl`` for the schedule, ``random_states_<rank>.pkl``, ...) and ``state.json``, written last, so
a folder without it is an incomplete checkpoint and is ignored. Without sharding only the trainable parameters are
saved (LoRA and ``modules_to_save``), not the frozen base model.
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
        record = dict(state, world_size=acc.num_processes, recipe=recipe.to_dict())
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
    acc.load_state(str(path))
    if saved_world != acc.num_processes:
        warnings.warn(f"checkpoint {Path(path).name} was written by {saved_world} process(es), this run has "
                      f"{acc.num_processes}: random state (dropout) is not carried over exactly", stacklevel=2)
