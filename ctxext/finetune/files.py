"""Which files a recipe's data names (folders searched, exclusions applied) and how each is read (plain or
``.xz``-compressed text)."""

from __future__ import annotations

import fnmatch
import lzma
from pathlib import Path

from .errors import RecipeError

TEXT_SUFFIXES = {".txt", ".md", ".text", ".rst"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
#: compressed files are read through lzma; the suffix before it decides text or JSONL (``book.txt.xz``)
COMPRESSED_SUFFIXES = {".xz"}


def _plain_name(path: Path) -> str:
    """The file name without a compression suffix: ``book.txt.xz`` -> ``book.txt``."""
    return path.stem if path.suffix.lower() in COMPRESSED_SUFFIXES else path.name


def _inner_suffix(path: Path) -> str:
    return Path(_plain_name(path)).suffix.lower()


def _open_text(path: Path):
    if path.suffix.lower() in COMPRESSED_SUFFIXES:
        return lzma.open(path, "rt", encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


def read_text(path: Path) -> str:
    try:
        with _open_text(path) as fh:
            return fh.read()
    except lzma.LZMAError as exc:
        raise RecipeError(f"data: {path}: not a valid .xz file ({exc})") from None


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
