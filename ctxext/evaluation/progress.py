"""What a run says while it runs: row k of N, the time left, and one line per finished row."""

from __future__ import annotations

from typing import Any


class RowProgress:
    """Row k of N over the whole run, and an estimate of the time left once a row is timed (the mean time of this
    run's rows so far, times the rows left)."""

    def __init__(self) -> None:
        self.total = self.done = 0
        self.seconds = 0.0
        self.timed = 0

    def add(self, rows: int) -> None:
        self.total += rows

    def row_done(self, seconds: float | None) -> None:
        self.done += 1
        if seconds:
            self.seconds += seconds
            self.timed += 1

    def prefix(self) -> str:
        return f"[{self.done}/{self.total}]"

    def eta(self) -> str:
        left = self.total - self.done
        if not left or not self.timed:
            return ""
        return f"; about {_duration(self.seconds / self.timed * left)} left"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_line(row: dict[str, Any]) -> str:
    where = f"{row['model']}  {row['label']:<16} L={row['length']:<6}"
    if row["kind"] == "ppl":
        ppl = "-" if row["ppl"] is None else f"{row['ppl']:.2f}"
        return f"{where} ppl {ppl}  ({row['tokens']} tokens, {row['windows']} windows, {row['seconds']:.1f} s)"
    return f"{where} {row['kind']} {100 * row['accuracy']:.0f}%  ({row['trials']} trials, {row['seconds']:.1f} s)"
