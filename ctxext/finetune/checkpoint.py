"""Resumable checkpoints: trainable weights, optimizer, schedule, RNG of every process, and the step
(which is also the data position: see :class:`ctxext.finetune.data.PackedData`).

Layout: ``OUT/checkpoints/step-000100/`` with ``trainable.safetensors``, ``optimizer.pt``,
``scheduler.pt``, ``rng-<rank>.pt`` and ``state.json``, written last, so a folder without it is an
incomplete checkpoint and is ignored. Only the trainable parameters are saved (LoRA and
``modules_to_save``), not the frozen base model.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import Recipe, RecipeError

DIRNAME = "checkpoints"
STATE = "state.json"
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


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(out: Path, acc, model, optimizer, scheduler, state: dict, recipe: Recipe, keep: int) -> Path:
    """Write a checkpoint for ``state['step']`` (collective: every process calls it)."""
    from safetensors.torch import save_file

    root = Path(out) / DIRNAME
    path = root / f"step-{state['step']:06d}"
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        weights = {n: p.detach().to("cpu").contiguous().clone() for n, p in _trainable(acc.unwrap_model(model)).items()}
        save_file(weights, str(path / "trainable.safetensors"))
        torch.save(optimizer.state_dict(), path / "optimizer.pt")
        torch.save(scheduler.state_dict(), path / "scheduler.pt")
    acc.wait_for_everyone()
    torch.save(_rng_state(), path / f"rng-{acc.process_index}.pt")
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


def load(path: Path, acc, model, optimizer, scheduler) -> None:
    """Restore a checkpoint into a freshly prepared model/optimizer/scheduler (every process calls it)."""
    from safetensors.torch import load_file

    path = Path(path)
    weights = load_file(str(path / "trainable.safetensors"))
    params = _trainable(acc.unwrap_model(model))
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise RecipeError(f"checkpoint {path} does not match the model's trainable parameters "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.device, p.dtype))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=False))
    rng = path / f"rng-{acc.process_index}.pt"
    saved_world = json.loads((path / STATE).read_text()).get("world_size", 1)
    if rng.exists() and saved_world == acc.num_processes:
        _set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
    else:
        warnings.warn(f"checkpoint {path.name} was written by {saved_world} process(es), this run has "
                      f"{acc.num_processes}: random state (dropout) is not restored", stacklevel=2)
