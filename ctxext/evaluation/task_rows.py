"""The RULER-style task rows of a run: which tasks ran, and their average per cell (read by tables and verdicts)."""

from __future__ import annotations

from typing import Any, Sequence


def task_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The RULER-style tasks among the rows, in the order they ran."""
    from .tasks.catalog import is_task

    out: list[str] = []
    for r in rows:
        if is_task(r.get("kind", "ppl")) and r["kind"] not in out:
            out.append(r["kind"])
    return out


def task_average(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, method label, length) with every task: the mean of the tasks' accuracies (RULER's
    average); a cell missing a task is left out rather than averaged over fewer tasks."""
    tasks = task_names(rows)
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("kind") in tasks and r.get("accuracy") is not None:
            cells.setdefault((r["model"], r["label"], int(r["length"])), {})[r["kind"]] = r["accuracy"]
    out = []
    for (model, label, length), scores in cells.items():
        if len(scores) == len(tasks):
            out.append({"kind": "average", "model": model, "label": label, "length": length,
                        "accuracy": sum(scores.values()) / len(scores)})
    return out
