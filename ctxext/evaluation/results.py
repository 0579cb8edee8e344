"""Results that survive interruption: one JSONL line per finished row, then a final JSON.

``results.json`` gets ``results.jsonl`` beside it. The JSONL starts with a ``run`` line holding the
run's settings; every finished (model, method, factor, length) row is appended and flushed at once.
``resume=True`` keeps the rows of a previous run with the same settings and lets the evaluator skip
them; without it the JSONL starts afresh.
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


class ResultStore:
    def __init__(self, output: str | os.PathLike, settings: dict[str, Any], *, resume: bool = False, enabled: bool = True):
        """``enabled=False`` (non-main processes) keeps rows in memory and writes nothing."""
        self.output = Path(output)
        self.jsonl = jsonl_path(self.output)
        self.settings = json.loads(json.dumps(settings, default=str))
        self.enabled = enabled
        self.rows: dict[RowKey, dict[str, Any]] = {}
        self.resumed = 0
        if resume and self.jsonl.exists():
            self._load_previous()
        if enabled:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            if not self.rows:
                with self.jsonl.open("w", encoding="utf-8") as fh:
                    fh.write(json.dumps({"kind": "run", "settings": self.settings}) + "\n")

    def _load_previous(self) -> None:
        header = None
        with self.jsonl.open(encoding="utf-8") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interruption
                    continue
                if row.get("kind") == "run":
                    header = row.get("settings", {})
                    continue
                self.rows[row_key(row)] = row
        if header is not None and header != self.settings:
            raise ValueError(
                f"--resume: {self.jsonl} was written by a run with other settings "
                f"({', '.join(_differences(header, self.settings))}); use another --output or drop --resume"
            )
        self.resumed = len(self.rows)

    def done(self, key: RowKey) -> dict[str, Any] | None:
        return self.rows.get(key)

    def add(self, row: dict[str, Any]) -> None:
        row = json.loads(json.dumps(row, default=str))
        self.rows[row_key(row)] = row
        if self.enabled:
            with self.jsonl.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

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
        """Write the final JSON atomically (temp file + rename)."""
        if not self.enabled:
            return None
        tmp = self.output.with_suffix(self.output.suffix + ".tmp")
        tmp.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.output)
        return self.output
