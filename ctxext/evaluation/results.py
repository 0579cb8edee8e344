"""Results that survive interruption and never destroy an earlier run.

``results.json`` gets ``results.jsonl`` beside it. The JSONL starts with a ``run`` line holding the run's
settings and the results file's name (two outputs that would share one rows file, ``X.json`` and ``X.txt``, are told
apart by it); every finished (model, method, factor, length) row is appended and flushed at once. ``resume=True``
keeps the rows of a previous run with the same settings and lets the evaluator skip them.

Nothing on disk changes until a run has a finished row to show for it: a fresh JSONL (header + first row) replaces
an old one atomically, appends to a resumed one start on a new line (a line cut by a kill is dropped first), and
the final JSON is written to a temporary file and renamed. :func:`check_output` refuses, before any work, an output
that cannot be written or that holds a finished run the user did not ask to resume or overwrite.
"""

from __future__ import annotations

import glob
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

from ..core.outputs import first_record, write_atomic
from .requests import FLAGS, Spelling
from .tasks.catalog import is_task

RowKey = tuple


def row_key(row: dict[str, Any]) -> RowKey:
    factor = row.get("factor")
    return (row.get("kind", "ppl"), row.get("model"), row.get("method"), None if factor is None else float(factor), int(row["length"]))


#: Settings keys newer than the rows files ctxext wrote before them: such a file still resumes.
ADDED_LATER = ("tokenizers",)


def jsonl_path(output: str | os.PathLike) -> Path:
    path = Path(output)
    return path.with_suffix(".jsonl") if path.suffix != ".jsonl" else path.with_suffix(".rows.jsonl")


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two settings differ, as dotted paths (``data.sha256``, ``models[0].weights``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "settings"]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: What a result row must hold: field -> (check, what it should be). Rows are written by ctxext.evaluation.runner.
_ROW_FIELDS = {
    "kind": (lambda v: isinstance(v, str) and (v in ("ppl", "passkey") or is_task(v)), "'ppl', 'passkey' or a task"),
    "model": (lambda v: isinstance(v, str) and bool(v), "a model label"),
    "method": (lambda v: isinstance(v, str) and bool(v), "a method name"),
    "label": (lambda v: isinstance(v, str) and bool(v), "a method label"),
    "factor": (lambda v: v is None or (_number(v) and v >= 1), "null or a number >= 1"),
    "length": (lambda v: _count(v) and v >= 2, "a whole number of tokens >= 2"),
    "spec": (lambda v: v is None or isinstance(v, dict), "null or a patch spec"),
}
_SCORE_FIELDS = {
    "ppl": {"ppl": (lambda v: _number(v) and v > 0, "a positive number"),
            "tokens": (_count, "a whole number"), "windows": (_count, "a whole number")},
    "passkey": {"accuracy": (lambda v: _number(v) and 0 <= v <= 1, "a number between 0 and 1"),
                "trials": (_count, "a whole number")},
}


def row_problem(row: Any) -> str | None:
    """Why ``row`` is not a result row ctxext wrote (None if it is one)."""
    if not isinstance(row, dict):
        return f"not a JSON object ({type(row).__name__})"
    fields = dict(_ROW_FIELDS)
    kind = row.get("kind")
    if "not_applicable" not in row and isinstance(kind, str) and (kind in _SCORE_FIELDS or is_task(kind)):
        fields.update(_SCORE_FIELDS.get(kind, _SCORE_FIELDS["passkey"]))  # a task's row: an accuracy, as passkey's
        if row["kind"] == "ppl" and row.get("tokens") == 0:
            fields["ppl"] = (lambda v: v is None, "null (no tokens)")
    for name, (ok, want) in fields.items():
        if name not in row:
            return f"no field {name!r}"
        if not ok(row[name]):
            return f"field {name!r} is {json.dumps(row[name])[:40]}, expected {want}"
    if "depths" in row and not _depth_scores(row["depths"]):  # a needle task's accuracy by depth (the heatmap's)
        return f"field 'depths' is {json.dumps(row['depths'])[:40]}, expected needle depth -> accuracy, both in [0, 1]"
    return None


def _depth_scores(value: Any) -> bool:
    def depth(key: Any) -> bool:
        try:
            return 0 <= float(key) <= 1
        except (TypeError, ValueError):
            return False

    return isinstance(value, dict) and all(depth(k) and _number(v) and 0 <= v <= 1 for k, v in value.items())


def _read_lines(path: Path) -> tuple[list[tuple[int, Any]], int, bool]:
    """((line number, parsed line) pairs, unreadable lines, whether the file ends in a cut line)."""
    data = path.read_bytes()
    parsed, bad = [], 0
    lines = data.split(b"\n")
    cut = bool(lines[-1].strip())  # text after the last newline: a write that a kill interrupted
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            parsed.append((number, json.loads(line)))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            bad += 1
    return parsed, bad, cut


def _is_rows_file(path: Path) -> bool:
    """Whether ``path`` starts with the run header ctxext eval writes first."""
    first = first_record(path) or {}
    return first.get("kind") == "run" and isinstance(first.get("settings"), dict)


def _rows_owner(path: Path) -> str | None:
    """The results file name a rows file's header records (None: not recorded, as in files before ctxext wrote it)."""
    owner = (first_record(path) or {}).get("output")
    return owner if isinstance(owner, str) else None


def _result_document(path: Path) -> dict | None:
    """The results JSON ctxext eval wrote at ``path``, or None (absent, unreadable, someone else's)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and "ctxext_version" in doc and isinstance(doc.get("results"), list) else None


def _is_result_file(path: Path) -> bool:
    """Whether ``path`` holds a results JSON ctxext eval wrote."""
    return _result_document(path) is not None


def finished_rows(output: str | os.PathLike) -> int:
    """Rows of a run already at ``output`` (its JSONL rows, or the final JSON's), 0 if none."""
    jsonl, final = jsonl_path(output), Path(output)
    count = 0
    if jsonl.is_file():
        count = sum(1 for _, row in _read_lines(jsonl)[0] if isinstance(row, dict) and row.get("kind") != "run")
    if not count and _is_result_file(final):
        count = len(json.loads(final.read_text(encoding="utf-8"))["results"])
    return count


def check_file_target(path: str | os.PathLike, arg: str, example: str, spelling: Spelling = FLAGS) -> Path:
    """Raise ValueError unless ``path`` (given as the argument ``arg``: ``output``, ``plot``) names a file that can
    be created or replaced (not a directory, not under a file, in a writable folder). Touches nothing."""
    from ..core.outputs import check_regular_file

    target, given = Path(path), spelling.given(arg, path)
    if str(path).endswith(("/", os.sep)) or target.is_dir():
        raise ValueError(f"{given} is a directory; give a file name, e.g. {target / example}")
    check_regular_file(target, spelling.name(arg), subject=given)
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{given}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{given}: cannot write in {parent}")
    return target


def check_output(output: str | os.PathLike, *, resume: bool, overwrite: bool, spelling: Spelling = FLAGS) -> None:
    """Raise ValueError if ``output`` cannot take this run's results, or holds a finished run that neither
    ``resume`` nor ``overwrite`` allows replacing (not both: the request refuses that). Touches nothing.
    ``spelling``: how the messages name output, resume and overwrite (flags or ``ctxext.evaluate``'s keywords)."""
    from ..core.outputs import check_regular_file

    flag, given = spelling.name("output"), spelling.given("output", output)
    out = check_file_target(output, "output", "eval.json", spelling)
    jsonl = jsonl_path(out)
    if jsonl.is_dir():
        raise ValueError(f"{given}: its rows file {jsonl} is a directory; choose another {flag}")
    check_regular_file(jsonl, flag, subject=f"{given}: its rows file {jsonl}")
    # never resume, replace or append to a file ctxext did not write
    if out.is_file() and out.stat().st_size and not _is_result_file(out):
        raise ValueError(f"{given} exists and is not a ctxext eval result; ctxext will not replace it: "
                         f"choose another {flag}")
    if jsonl.is_file() and jsonl.stat().st_size and not _is_rows_file(jsonl):
        raise ValueError(f"{given}: {jsonl} exists and is not a ctxext eval rows file; ctxext will not "
                         f"replace it: choose another {flag}")
    owner = _rows_owner(jsonl) if jsonl.is_file() else None
    if owner is None and jsonl.is_file() and jsonl.stat().st_size and not (out.is_file() and _is_result_file(out)):
        # a header written before it named its owner: the ctxext result beside it with the same stem (X.json for
        # X.jsonl; not a backup such as X.json.bak)
        owner = next((p.name for p in sorted(jsonl.parent.glob(glob.escape(jsonl.stem) + ".*"))
                      if p.name not in (out.name, jsonl.name) and p.name == jsonl.stem + p.suffix and p.is_file()
                      and _is_result_file(p)), None)
    if owner is not None and owner != out.name:  # X.json and X.txt share X.jsonl: --overwrite would replace the other's
        raise ValueError(f"{given}: its rows file {jsonl} holds the rows of another run, whose results are "
                         f"{jsonl.with_name(owner)} (both names keep their rows in {jsonl.name}); choose a {flag} whose name "
                         "differs before its suffix")
    if not (resume or overwrite):
        rows = finished_rows(out)
        if rows:
            raise ValueError(
                f"{given} holds a finished run ({rows} row{'s' if rows != 1 else ''}); pass {spelling.on('resume')} "
                f"to continue it, {spelling.on('overwrite')} to replace it, or choose another {flag}"
            )
    elif resume and not (jsonl.is_file() and jsonl.stat().st_size) and finished_rows(out):
        # a resume reads the rows file (and its header: model, data, plan); without it, it would replace the results
        raise ValueError(
            f"{spelling.name('resume')}: {given} holds a finished run, but its rows file {jsonl} is missing or empty, "
            f"and a resume continues from that file (it checks the model, data and plan there); restore it, or pass "
            f"{spelling.on('overwrite')} to replace the results, or choose another {flag}")


def recorded_pictures(output: str | os.PathLike) -> set[str] | None:
    """The picture files (resolved paths) that the run at ``output`` recorded as its own, in its results JSON and
    its rows header; None where neither records any (nothing there, or a run from before ctxext recorded them)."""
    found: set[str] | None = None
    out = Path(output)
    for record in (_result_document(out), first_record(jsonl_path(out))):
        pictures = record.get("pictures") if isinstance(record, dict) else None
        if isinstance(pictures, list):
            found = (found or set()) | {p for p in pictures if isinstance(p, str)}
    return found


class ResultStore:
    def __init__(self, output: str | os.PathLike | None, settings: dict[str, Any], *, resume: bool = False, enabled: bool = True,
                 pictures: list[str] | None = None, spelling: Spelling = FLAGS):
        """``enabled=False`` (non-main processes) keeps rows in memory and writes nothing. Reads only: nothing
        is written before the first :meth:`add`. ``pictures``: the files this run draws (recorded in the header,
        so that a --resume may replace them and no other file). ``spelling``: how messages name the arguments."""
        self.pictures = list(pictures or [])
        self.spelling = spelling
        # no output (``ctxext.evaluate`` without ``output=``): rows are kept in memory only
        self.output = Path(output) if output is not None else None
        self.jsonl = jsonl_path(self.output) if output is not None else None
        self.settings = json.loads(json.dumps(settings, default=str))
        self.enabled = enabled and output is not None
        self.rows: dict[RowKey, dict[str, Any]] = {}
        self.resumed = 0
        #: Unreadable lines of the resumed JSONL (a cut last line included); they are recomputed.
        self.dropped = 0
        #: Rows of the resumed JSONL that do not fit the row schema ("line N of FILE: why"); they are recomputed.
        self.rejected: list[str] = []
        self._append = False  # True once self.jsonl holds this run's header and ends with a newline
        self._cut = False
        if resume and self.jsonl is not None and self.jsonl.is_file():
            self._load_previous()

    def _load_previous(self) -> None:
        lines, self.dropped, self._cut = _read_lines(self.jsonl)
        header = None
        for number, row in lines:
            if isinstance(row, dict) and row.get("kind") == "run":
                header = row.get("settings", {})
                continue
            problem = row_problem(row)
            if problem:  # a hand-edited or damaged row: never copied, recomputed
                self.rejected.append(f"line {number} of {self.jsonl}: {problem}")
            else:
                self.rows[row_key(row)] = row
        settings = self.settings
        if isinstance(header, dict):  # a key added to the settings later is compared only where the run recorded it
            settings = {k: v for k, v in settings.items() if k in header or k not in ADDED_LATER}
        s = self.spelling
        if header is not None and header != settings:
            raise ValueError(
                f"{s.name('resume')}: {self.jsonl} was written by a run with other settings "
                f"({', '.join(_differences(header, settings))}); use another {s.name('output')} or drop "
                f"{s.on('resume')}"
            )
        if header is None and self.rows:
            raise ValueError(f"{s.name('resume')}: {self.jsonl} has no run header; it was not written by ctxext eval")
        self.resumed = len(self.rows)
        self._append = header is not None

    def done(self, key: RowKey) -> dict[str, Any] | None:
        return self.rows.get(key)

    def add(self, row: dict[str, Any]) -> None:
        row = json.loads(json.dumps(row, default=str))
        self.rows[row_key(row)] = row
        if not self.enabled:
            return
        try:
            self._write(row)
        except OSError as exc:  # a full disk names no file: say which, and what is kept
            s = self.spelling
            raise OSError(f"{s.given('output', str(self.output))}: a finished row could not be written to its rows "
                          f"file {self.jsonl} ({exc.strerror or exc}); the rows written before it are kept: "
                          f"{s.again()} with {s.on('resume')} to continue") from exc

    def _write(self, row: dict[str, Any]) -> None:
        line = json.dumps(row) + "\n"
        if not self._append:  # a fresh run: header and first row replace whatever was there, in one rename
            self.output.parent.mkdir(parents=True, exist_ok=True)
            header = {"kind": "run", "output": self.output.name, "settings": self.settings, "pictures": self.pictures}
            write_atomic(self.jsonl, json.dumps(header) + "\n" + line)
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
        try:
            write_atomic(self.output, json.dumps(document, indent=2, default=str) + "\n")
        except OSError as exc:  # a full disk names no file: say which, and that the rows are safe
            s = self.spelling
            raise OSError(f"{s.given('output', str(self.output))}: not written ({exc.strerror or exc}); the finished "
                          f"rows are kept in {self.jsonl}: {s.again()} with {s.on('resume')} to write it (no row "
                          "is computed again)") from exc
        return self.output
