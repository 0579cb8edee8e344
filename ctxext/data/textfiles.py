"""Reading text data from files, for evaluation and fine-tuning alike: plain or compressed (``.gz``, ``.xz``) text,
JSON lines and JSON lists holding the text in one field, and folders of them."""

from __future__ import annotations

import errno
import fnmatch
import gzip
import json
import lzma
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

#: Compressed files are opened through these; the suffix before it decides the kind (``book.txt.xz``).
COMPRESSED_SUFFIXES = {".gz": gzip.open, ".xz": lzma.open}


def check_data_path(path, flag: str = "data") -> None:
    """Raise ValueError naming ``flag`` where ``path`` cannot even be looked at: a link loop (``a -> b -> a``), a
    name too long, a folder on the way that cannot be read. A missing path passes (each reader says what it
    expected there). Touches nothing."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{flag} {path} is a loop of symbolic links ({exc.strerror}); give the file or folder "
                             "the link should point to") from None
        raise ValueError(f"{flag} {path} cannot be read ({exc.strerror or exc})") from None


def plain_name(path: Path) -> str:
    """The file name without a compression suffix: ``book.txt.xz`` -> ``book.txt``."""
    return path.stem if path.suffix.lower() in COMPRESSED_SUFFIXES else path.name


def inner_suffix(path: Path) -> str:
    """The suffix that says what the file holds: ``.txt`` for ``book.txt.xz``."""
    return Path(plain_name(path)).suffix.lower()


def open_text(path: Path, errors: str = "strict"):
    opener = COMPRESSED_SUFFIXES.get(path.suffix.lower())
    if opener is not None:
        return opener(path, "rt", encoding="utf-8", errors=errors)
    return path.open(encoding="utf-8", errors=errors)


#: What a damaged .xz / .gz file raises while it is read (a flipped byte in a gzip body is zlib's error).
DAMAGED_COMPRESSION = (lzma.LZMAError, gzip.BadGzipFile, EOFError, zlib.error)


def _damaged(path: Path, exc: Exception) -> ValueError:
    return ValueError(f"{path}: not a valid {path.suffix} file ({exc})")


def read_text(path: Path, errors: str = "strict") -> str:
    """The whole file as text; ValueError naming the file where a compressed file is damaged."""
    try:
        with open_text(path, errors) as fh:
            return fh.read()
    except DAMAGED_COMPRESSION as exc:
        raise _damaged(path, exc) from None


def iter_jsonl(path: Path, text_field: str, hint: str, errors: str = "strict") -> Iterator[str]:
    """The ``text_field`` of every non-blank line; ValueError with ``path:line`` (and ``hint``, how to choose
    another field) for a line that is not a JSON object holding it."""
    with open_text(path, errors) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            if not isinstance(row, dict) or text_field not in row:
                raise ValueError(f"{path}:{number}: no {text_field!r} field ({hint})")
            yield _text_value(row[text_field], f"{path}:{number}", text_field)


#: What a data folder is searched for (each also .gz / .xz compressed): text files (one document each) and JSON lines
#: (one document per line). A JSON list (.json) is read when named, not picked up from a folder (configs are JSON too).
TEXT_SUFFIXES = {".txt", ".md", ".text", ".rst"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}


def find_files(folder: Path) -> list[Path]:
    """The data files under ``folder``, searched recursively and sorted by path (hidden files and everything in
    hidden folders skipped: ``.git``, ``.ipynb_checkpoints`` hold copies and notes, not the data)."""
    folder = Path(folder)
    return sorted(f for f in folder.rglob("*")
                  if f.is_file() and inner_suffix(f) in TEXT_SUFFIXES | JSONL_SUFFIXES
                  and not any(part.startswith(".") for part in f.relative_to(folder).parts))


def read_documents(path: Path, text_field: str, hint: str, errors: str = "strict") -> Iterator[str]:
    """The documents of one file: the ``text_field`` of each JSON line (.jsonl, .ndjson) or of each object of a JSON
    list (.json; JSON lines saved as .json read as such), else the whole file as one document. ValueError naming the
    file for text that is not UTF-8 (UTF-16, a binary file)."""
    try:
        yield from _documents(path, text_field, hint, errors)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); convert it to UTF-8, e.g. "
                         f"iconv -f UTF-16 -t UTF-8") from None
    except DAMAGED_COMPRESSION as exc:  # JSON lines read as they stream
        raise _damaged(path, exc) from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None


def _text_value(value, where: str, text_field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(value).__name__}, not text")
    return value


def _documents(path: Path, text_field: str, hint: str, errors: str) -> Iterator[str]:
    kind = inner_suffix(path)
    if kind in JSONL_SUFFIXES:
        yield from iter_jsonl(path, text_field, hint, errors)
    elif kind == ".json":
        try:
            rows = json.loads(read_text(path, errors))
        except json.JSONDecodeError:
            yield from iter_jsonl(path, text_field, hint, errors)
            return
        rows = rows["data"] if isinstance(rows, dict) and isinstance(rows.get("data"), list) else rows
        rows = [rows] if isinstance(rows, dict) else rows
        if not isinstance(rows, list) or not all(isinstance(r, dict) and text_field in r for r in rows):
            raise ValueError(f"{path}: expected a list of objects with a {text_field!r} field ({hint})")
        yield from (_text_value(r[text_field], f"{path}: item {i}", text_field) for i, r in enumerate(rows))
    else:
        yield read_text(path, errors)


def select_files(paths: list[Path], exclude: list[str] = (), exclude_key: str = "exclude") -> list[Path]:
    """Files to read, in order: folders searched (:func:`find_files`), then ``exclude`` (glob patterns, matched with
    and without a compression suffix) applied. ValueError for a folder without data or nothing left."""
    files: list[Path] = []
    for p in paths:
        found = find_files(p) if p.is_dir() else [p]
        if not found:
            raise ValueError(f"folder {str(p)!r} holds no .txt or .jsonl files")
        files.extend(found)
    kept = [f for f in files
            if not any(fnmatch.fnmatch(f.name, pat) or fnmatch.fnmatch(plain_name(f), pat) for pat in exclude)]
    if not kept:
        raise ValueError(f"every file is excluded by {exclude_key} {list(exclude)}")
    return kept
