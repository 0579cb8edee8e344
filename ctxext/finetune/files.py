"""Which files a recipe's data names (folders searched, exclusions applied); they are read by
``ctxext.textfiles``, as evaluation reads its files."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from .. import textfiles
from ..textfiles import inner_suffix as _inner_suffix
from ..textfiles import plain_name as _plain_name
from .errors import RecipeError

TEXT_SUFFIXES = {".txt", ".md", ".text", ".rst"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}


def read_text(path: Path) -> str:
    try:
        return textfiles.read_text(path, errors="replace")
    except ValueError as exc:
        raise RecipeError(f"data: {exc}") from None


def _excluded(path: Path, exclude: list[str]) -> bool:
    return any(fnmatch.fnmatch(path.name, pat) or fnmatch.fnmatch(_plain_name(path), pat) for pat in exclude)


def expand_files(paths: list[Path], exclude: list[str]) -> list[Path]:
    """Files to read, in order: folders searched recursively (sorted) for text, JSONL and their .xz forms, then
    ``exclude`` (glob patterns, matched with and without a .xz suffix) applied."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and _inner_suffix(f) in TEXT_SUFFIXES | JSONL_SUFFIXES and not f.name.startswith(".")
            )
            if not found:
                raise RecipeError(f"data.files: folder {str(p)!r} holds no .txt or .jsonl files")
            files.extend(found)
        else:
            files.append(p)
    kept = [f for f in files if not _excluded(f, exclude)]
    if not kept:
        raise RecipeError(f"data.files: every file is excluded by data.exclude {exclude}")
    return kept
