"""Processes and devices: accelerate's PartialState, dtype names, and from_pretrained placement kwargs."""

from __future__ import annotations

import os
from typing import Any

import torch

DEVICES = ("cpu", "cuda", "auto")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device in ("cuda", "auto") and not torch.cuda.is_available():
        if device == "cuda":
            raise ValueError("--device cuda: no CUDA device is available")
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
