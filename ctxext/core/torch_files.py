"""Why a file that should hold ``torch.save`` weights did not load with torch's safe loader, in words a user can act
on: text where the weights belong (a failed copy, a Git LFS pointer never fetched), or torch's own reason without
its advice to load the file unsafely (``weights_only=False``) or to allowlist what it names."""

from __future__ import annotations

import contextlib
import pickle
import struct
from pathlib import Path

#: What torch's safe unpickler raises on bytes that are no torch.save file (a text file's bytes read as pickle
#: opcodes give a KeyError from a memo lookup, an IndexError, a struct.error, ...), besides its UnpicklingError.
UNREADABLE = (pickle.UnpicklingError, EOFError, KeyError, IndexError, ValueError, RuntimeError, struct.error)

#: Lines of torch's safe-loader message that advise rather than explain
_ADVICE = ("This file can still be loaded", "(1)", "(2)", "Please file an issue", "Check the documentation")


def text_in_place(path: Path) -> str | None:
    """What ``path`` is when it holds text where weights belong, or None."""
    head = b""
    with contextlib.suppress(OSError), Path(path).open("rb") as fh:
        head = fh.read(256)
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer, not the weights (fetch them with `git lfs pull`)"
    if head and all(b >= 32 or b in b"\t\n\r" for b in head):
        return "a text file, not weights torch.save wrote"
    return None


def safe_loader_reason(exc: BaseException) -> str:
    """torch's own reason in a safe-loader error ('Trying to load unsupported GLOBAL posix.system whose module
    posix is blocked'), without the advice around it."""
    for line in str(exc).splitlines():
        line = line.strip().removeprefix("Weights only load failed.").strip()
        line = line.removeprefix("WeightsUnpickler error:").strip()
        if line and "weights_only" not in line and not line.startswith(_ADVICE):
            return line.split(". ")[0].rstrip(".")
    return "it holds objects other than tensors"


def unreadable_reason(path: Path, exc: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` raised ``exc`` (one of :data:`UNREADABLE`)."""
    reason = safe_loader_reason(exc) if isinstance(exc, pickle.UnpicklingError) else None
    if reason is None or "GLOBAL" not in reason:  # a pickle naming code or a class is no text file
        text = text_in_place(path)
        if text is not None:
            return text
    if reason is not None:
        return reason
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return lines[0] if lines else f"not a torch weights file ({type(exc).__name__})"
