"""Results that survive interruption and never destroy an earlier run.

``results.json`` gets ``results.jsonl`` beside it. The JSONL starts with a ``run`` line holding the run's
settings; every finished (model, method, factor, length) row is appended and flushed at once. ``resume=True``
keeps the rows of a previous run with the same settings and lets the evaluator skip them.

Nothing on disk changes until a run has a finished row to show for it: a fresh JSONL (header + first row) replaces
an old one atomically, appends to a resumed one start on a new line (a line cut by a kill is dropped first), and
the final JSON is written to a temporary file and renamed. :func:`check_output` refuses, before any work, an output
that cannot be written or that holds a finished run the user did not ask to resume or overwrite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

RowKey = tuple


def row_key(row: dict[str, Any]) -> RowKey:
    factor = row.get("factor")
    return (row.get("kind", "ppl"), row.get("model"), row.get("method"), None if factor is None else float(factor), int(row["length"]))


def jsonl_path(output: str | os.PathLike) -> Path:
    path = Path(output)
    return path.with_suffix(".jsonl") if path.suffix != ".jsonl" else path.with_suffix(".rows.jsonl")


def _differences(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _read_lines(path: Path) -> tuple[list[dict[str, Any]], int, bool]:
    """(parsed lines, unreadable lines, whether the file ends in a cut line)."""
    data = path.read_bytes()
    parsed, bad = [], 0
    lines = data.split(b"\n")
    cut = bool(lines[-1].strip())  # text after the last newline: a write that a kill interrupted
    for line in lines:
        if not line.strip():
            continue
        try:
            parsed.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            bad += 1
    return parsed, bad, cut


def finished_rows(output: str | os.PathLike) -> int:
    """Rows of a run already at ``output`` (its JSONL rows, or the final JSON's), 0 if none."""
    jsonl, final = jsonl_path(output), Path(output)
    count = 0
    if jsonl.is_file():
        count = sum(1 for row in _read_lines(jsonl)[0] if isinstance(row, dict) and row.get("kind") != "run")
    if not count and final.is_file():
        try:
            count = len(json.loads(final.read_text(encoding="utf-8")).get("results") or [])
        except (ValueError, AttributeError, UnicodeDecodeError):
            count = 1  # a file we cannot read is still not ours to destroy
    return count


def check_file_target(path: str | os.PathLike, flag: str, example: str) -> Path:
    """Raise ValueError unless ``path`` names a file that can be created or replaced (not a directory, not under a
    file, in a writable folder). Touches nothing."""
    target = Path(path)
    if str(path).endswith(("/", os.sep)) or target.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name, e.g. {target / example}")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot write in {parent}")
    return target


def check_output(output: str | os.PathLike, *, resume: bool, overwrite: bool, flag: str = "--output") -> None:
    """Raise ValueError if ``output`` cannot take this run's results, or holds a finished run that neither
    ``resume`` nor ``overwrite`` allows replacing. Touches nothing."""
    if resume and overwrite:
        raise ValueError("--resume keeps the finished rows and --overwrite discards them: give one of them")
    out = check_file_target(output, flag, "eval.json")
    jsonl = jsonl_path(out)
    if jsonl.is_dir():
        raise ValueError(f"{flag} {output}: its rows file {jsonl} is a directory; choose another {flag}")
    if not (resume or overwrite):
        rows = finished_rows(out)
        if rows:
            raise ValueError(
                f"{flag} {output} holds a finished run ({rows} row{'s' if rows != 1 else ''}); pass --resume to "
                f"continue it, --overwrite to replace it, or choose another {flag}"
            )


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class ResultStore:
    def __init__(self, output: str | os.PathLike, settings: dict[str, Any], *, resume: bool = False, enabled: bool = True):
        """``enabled=False`` (non-main processes) keeps rows in memory and writes nothing. Reads only: nothing
        is written before the first :meth:`add`."""
        self.output = Path(output)
        self.jsonl = jsonl_path(self.output)
        self.settings = json.loads(json.dumps(settings, default=str))
        self.enabled = enabled
        self.rows: dict[RowKey, dict[str, Any]] = {}
        self.resumed = 0
        #: Unreadable lines of the resumed JSONL (a cut last line included); they are recomputed.
        self.dropped = 0
        self._append = False  # True once self.jsonl holds this run's header and ends with a newline
        self._cut = False
        if resume and self.jsonl.is_file():
            self._load_previous()

    def _load_previous(self) -> None:
        lines, self.dropped, self._cut = _read_lines(self.jsonl)
        header = None
        for row in lines:
            if not isinstance(row, dict):
                self.dropped += 1
            elif row.get("kind") == "run":
                header = row.get("settings", {})
            elif "length" in row:
                self.rows[row_key(row)] = row
        if header is not None and header != self.settings:
            raise ValueError(
                f"--resume: {self.jsonl} was written by a run with other settings "
                f"({', '.join(_differences(header, self.settings))}); use another --output or drop --resume"
            )
        if header is None and self.rows:
            raise ValueError(f"--resume: {self.jsonl} has no run header; it was not written by ctxext eval")
        self.resumed = len(self.rows)
        self._append = header is not None

    def done(self, key: RowKey) -> dict[str, Any] | None:
        return self.rows.get(key)

    def add(self, row: dict[str, Any]) -> None:
        row = json.loads(json.dumps(row, default=str))
        self.rows[row_key(row)] = row
        if not self.enabled:
            return
        line = json.dumps(row) + "\n"
        if not self._append:  # a fresh run: header and first row replace whatever was there, in one rename
            self.output.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.jsonl, json.dumps({"kind": "run", "settings": self.settings}) + "\n" + line)
            self._append = True
            return
        if self._cut:
            self._drop_cut_line()
        with self.jsonl.open("a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def _drop_cut_line(self) -> None:
        """Truncate the JSONL after its last newline: a kill cut the line after it mid-write."""
        with self.jsonl.open("r+b") as fh:
            data = fh.read()
            fh.truncate(data.rfind(b"\n") + 1)
            fh.flush()
            os.fsync(fh.fileno())
        self._cut = False

    def ordered(self, order: Iterable[RowKey] | None = None) -> list[dict[str, Any]]:
        """Rows in ``order`` (planned keys first), then any others in insertion order."""
        seen, out = set(), []
        for key in order or []:
            if key in self.rows and key not in seen:
                out.append(self.rows[key])
                seen.add(key)
        out.extend(row for key, row in self.rows.items() if key not in seen)
        return out

    def write_final(self, document: dict[str, Any]) -> Path | None:
        """Write the final JSON atomically (temp file + rename), and only once this run has rows to show: a run
        that produced nothing leaves an earlier result in place."""
        if not self.enabled or not self.rows or not self._append:
            return None
        _atomic_write(self.output, json.dumps(document, indent=2, default=str) + "\n")
        return self.output
