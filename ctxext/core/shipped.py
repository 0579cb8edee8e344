"""The reference checkpoints shipped inside the package, by name: which names there are, how a model argument names
one (``reference:NAME``) and where its folder is. The layer below ``ctxext.loading`` (whose ``from_pretrained``
accepts ``reference:NAME``) and ``ctxext.reference`` (which loads them, through ``ctxext.loading``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The reference models, one per positional family.
REFERENCE_NAMES: tuple[str, ...] = ("llama", "gpt2", "bloom")
#: How a command names a shipped checkpoint instead of a hub id or folder (``ctxext.`` as the demo labels it).
MODEL_PREFIXES = ("reference:", "ctxext.reference:")
#: The folder of the shipped checkpoints (one folder per name) and of ``training.json``.
ROOT = Path(__file__).resolve().parent.parent / "assets" / "reference"


def check_name(name: str) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in REFERENCE_NAMES:
        raise ValueError(f"unknown reference model {name!r}; choose one of {', '.join(REFERENCE_NAMES)}")
    return key


def reference_path(name: str) -> Path:
    """The folder of the shipped checkpoint ``name`` (a ``save_pretrained`` directory)."""
    folder = ROOT / check_name(name)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"reference checkpoint {name!r} is missing from {folder}; the package was installed without its "
            "assets (reinstall ctxext, or rebuild them with benchmarks/train_reference.py)"
        )
    return folder


def reference_name(model: Any) -> str | None:
    """The NAME of a command's ``reference:NAME`` / ``ctxext.reference:NAME`` model argument (not yet checked), or
    None when ``model`` names no shipped checkpoint: the one test that eval, export, search and recipes share."""
    for prefix in MODEL_PREFIXES:
        if isinstance(model, str) and model.startswith(prefix):
            return model[len(prefix):]
    return None


def model_source(model: str) -> str:
    """A command's model argument as ``from_pretrained`` reads it: ``reference:NAME`` (or ``ctxext.reference:NAME``)
    becomes the shipped checkpoint's folder; anything else is returned as given. ValueError names the choices."""
    name = reference_name(model)
    return model if name is None else str(reference_path(name))
