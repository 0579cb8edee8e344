"""Atomic writes and the never-overwrite rule for the lab's output folder."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``path`` via a temporary file in the same folder and ``os.replace``: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def check_not_finished(out: Path, name: str, overwrite: bool) -> None:
    """Refuse (ValueError) when ``out/name`` holds a finished result and ``overwrite`` is false."""
    target = Path(out) / name
    if target.exists() and not overwrite:
        raise ValueError(f"{target} already holds a finished result; pass --overwrite to replace it or choose another --out")
