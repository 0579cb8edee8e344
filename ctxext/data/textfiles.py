"""Reading text data from files, for evaluation and fine-tuning alike: plain or compressed (``.gz``, ``.xz``) text,
JSON lines and JSON lists holding the text in one field, and folders of them."""

from __future__ import annotations

import codecs
import errno
import fnmatch
import gzip
import json
import lzma
import os
import shlex
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
                if "\0" in line:  # not JSON but UTF-16 without a byte-order mark: say so
                    raise ValueError(not_utf8_message(path)) from None
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
    file for text that is not UTF-8 (UTF-16, Latin-1, a binary file), with the offset of the first bad byte and the
    conversion that fits its bytes (:func:`not_utf8_message`)."""
    try:
        yield from _documents(path, text_field, hint, errors)
    except UnicodeDecodeError:
        raise ValueError(not_utf8_message(path)) from None
    except DAMAGED_COMPRESSION as exc:  # JSON lines read as they stream
        raise _damaged(path, exc) from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None


#: Bytes read to guess what a file that is not UTF-8 holds.
SNIFF_BYTES = 1 << 16
#: Byte-order marks, longest first (UTF-32's little-endian mark begins with UTF-16's).
BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
        (codecs.BOM_UTF16_BE, "UTF-16"))


def _open_bytes(path: Path):
    opener = COMPRESSED_SUFFIXES.get(path.suffix.lower())
    return opener(path, "rb") if opener is not None else path.open("rb")


def first_bad_byte(path: Path) -> tuple[int, bytes] | None:
    """The offset of the first byte of ``path`` (decompressed) that is not UTF-8 or is NUL (UTF-8, but never in text:
    ASCII in UTF-16 without a byte-order mark decodes as UTF-8 with a NUL after every letter), and the bytes from it on
    (at most ``SNIFF_BYTES``); None if there is none."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    read = 0
    with _open_bytes(path) as fh:
        while True:
            block = fh.read(1 << 20)
            pending = decoder.getstate()[0]  # the start of a character cut by the previous block
            nul = block.find(0)
            bad = read + nul if nul >= 0 else None
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                invalid = read - len(pending) + exc.start
                bad = invalid if bad is None else min(bad, invalid)
            if bad is not None:
                return bad, (pending + block)[bad - read + len(pending) :][:SNIFF_BYTES]
            if not block:
                return None
            read += len(block)


def guess_encoding(head: bytes, offset: int, bad: bytes) -> str:
    """What a file that is not UTF-8 most likely holds, from its first bytes (``head``), the offset of its first bad
    byte and the bytes from there on (``bad``): "UTF-32" or "UTF-16" (a byte-order mark), "UTF-16LE" or "UTF-16BE"
    (NUL bytes at every other place: ASCII text in UTF-16), "binary" (other NUL or control bytes), "mixed" (the bytes
    before the bad one hold UTF-8 characters beyond ASCII), "CP1252" (bytes 0x80-0x9F: Windows' quotes and dashes),
    else "LATIN1"."""
    for bom, name in BOMS:
        if head.startswith(bom):
            return name
    even, odd = head[0::2], head[1::2]
    if max(even.count(0), odd.count(0)) > len(head) // 4:
        return "UTF-16LE" if odd.count(0) > even.count(0) else "UTF-16BE"
    seen = head + bad
    if 0 in seen or sum(b < 32 and b not in b"\t\n\r\f" for b in seen) > len(seen) // 100:
        return "binary"
    if any(b >= 0x80 for b in head[:offset]):
        return "mixed"
    return "CP1252" if any(0x80 <= b <= 0x9F for b in seen) else "LATIN1"


#: How each guess of :func:`guess_encoding` that has a conversion is said.
ENCODING_NAMES = {
    "LATIN1": "Latin-1 (ISO-8859-1)", "CP1252": "Windows-1252 (bytes 0x80-0x9F are its quotes and dashes)",
    "UTF-16": "UTF-16 (it starts with a byte-order mark)", "UTF-32": "UTF-32 (it starts with a byte-order mark)",
    "UTF-16LE": "UTF-16 little-endian (NUL bytes at every other place)",
    "UTF-16BE": "UTF-16 big-endian (NUL bytes at every other place)",
}


def _convert_command(path: Path, encoding: str, drop_bad: bool = False) -> str:
    """The shell command that writes ``path`` as UTF-8 beside it (``book.txt`` -> ``book.utf8.txt``); ``drop_bad``:
    leaving out the bytes that are not ``encoding``."""
    plain = Path(plain_name(path))
    target = shlex.quote(str(path.with_name(f"{plain.stem}.utf8{plain.suffix}")))
    iconv = f"iconv -f {encoding} -t UTF-8" + (" -c" if drop_bad else "")
    if path.suffix.lower() in COMPRESSED_SUFFIXES:
        tool = {".gz": "gzip", ".xz": "xz"}[path.suffix.lower()]
        return f"{tool} -dc {shlex.quote(str(path))} | {iconv} > {target}"
    return f"{iconv} {shlex.quote(str(path))} > {target}"


def not_utf8_message(path: Path) -> str:
    """Why ``path`` cannot be read as UTF-8 text, where (the offset of its first bad byte), and how to convert it, the
    advice chosen from its bytes (:func:`guess_encoding`)."""
    try:
        found = first_bad_byte(path)
        with _open_bytes(path) as fh:
            head = fh.read(SNIFF_BYTES)
    except (OSError, *DAMAGED_COMPRESSION):  # damaged after the bad byte, or gone since: what is known
        found = None
    if found is None:
        return f"{path}: not UTF-8 text"
    offset, bad = found
    kind = guess_encoding(head, offset, bad)
    where = "of its decompressed text " if path.suffix.lower() in COMPRESSED_SUFFIXES else ""
    said = f"{path}: not UTF-8 text (byte {offset} {where}is 0x{bad[0]:02X})"
    if kind == "binary":
        return f"{said}; it looks like a binary file (NUL or control bytes), not text"
    if kind == "mixed":
        drop = _convert_command(path, "UTF-8", drop_bad=True)
        return (f"{said}; the text before it is UTF-8 beyond ASCII, so the file mixes encodings: fix the text at that "
                f"byte, or leave out every byte that is not UTF-8 with {drop}")
    return f"{said}; it looks like {ENCODING_NAMES[kind]}: convert it with {_convert_command(path, kind)}"


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
        text = read_text(path, errors)
        if errors == "strict" and "\0" in text:  # UTF-16 without a byte-order mark reads as UTF-8
            raise ValueError(not_utf8_message(path))
        yield text


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
