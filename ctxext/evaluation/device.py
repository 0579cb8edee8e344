"""Processes and devices: accelerate's PartialState, dtype names, and from_pretrained placement kwargs."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from .requests import FLAGS, Spelling

DEVICES = ("cpu", "cuda", "auto")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def resolve_device(device: str | None, spelling: Spelling = FLAGS) -> str:
    """``device``, or the one this machine has; ``spelling``: how messages name the argument."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in DEVICES:
        raise ValueError(f"{spelling.name('device')} must be one of {', '.join(DEVICES)}, got {device!r}")
    if device in ("cuda", "auto") and not torch.cuda.is_available():
        if device == "cuda":
            raise ValueError(f"{spelling.given('device', device)}: no CUDA device is available")
    return device


def make_state(device: str):
    """The accelerate PartialState for this process: gloo on CPU (``torchrun`` starts the processes)."""
    from accelerate import PartialState

    if device == "cpu":
        return PartialState(cpu=True)
    return PartialState()


def resolve_dtype(name: str | None):
    name = name or "float32"
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def placement_kwargs(device: str, state) -> dict[str, Any]:
    """``from_pretrained`` kwargs putting the model where this process computes."""
    if device == "auto":
        if state.num_processes > 1:  # one full copy per process, each on its own device
            return {"device_map": {"": str(state.device)}}
        return {"device_map": "auto"}
    return {}


def move_model(model, device: str, state):
    if device == "cpu":
        return model.to("cpu")
    if device == "cuda":
        return model.to(state.device)
    return model  # device_map placed it


def is_distributed_launch() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def map_over_processes(items: Sequence[Any], work: Callable[[list[Any]], list[Any]], *, state=None,
                       batch_size: int = 1, progress: bool = True, desc: str = "", unit: str = "it") -> list[Any]:
    """``work`` over ``items``, in batches of ``batch_size``, split between the processes of ``state`` (an
    accelerate ``PartialState``; each takes a contiguous share); every process returns all results, in item order.

    ``work`` takes a list of items and returns one result per item. The progress bar (main process only) counts
    every process's items, assuming the shares move at the same pace."""
    from tqdm.auto import tqdm

    indexed = list(enumerate(items))
    processes = state.num_processes if state is not None else 1
    if processes > 1:
        with state.split_between_processes(indexed) as mine:
            mine = list(mine)
    else:
        mine = indexed
    is_main = state is None or state.is_main_process
    done: list[tuple[int, Any]] = []
    bar = tqdm(total=len(indexed), desc=desc, unit=unit, disable=not (progress and is_main), leave=False)
    for lo in range(0, len(mine), batch_size):
        batch = mine[lo : lo + batch_size]
        done += zip((index for index, _ in batch), work([item for _, item in batch]), strict=True)
        bar.update(len(batch) * processes)
    bar.close()
    if processes > 1:
        from accelerate.utils import gather_object

        done = gather_object(done)
    done.sort(key=lambda d: d[0])
    return [result for _, result in done]
