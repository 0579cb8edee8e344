"""The census as a table: a model x method grid of ok / refused [n] / FAILED [n], the reasons below it, the models
not built tiny, and a summary (``ctxext methods --census``)."""

from __future__ import annotations

from .check import Row


def summarize(rows: list[Row]) -> dict[str, int]:
    """Counts of models: all ok / refused rows, any failure, skipped."""
    by_model: dict[str, list[Row]] = {}
    for row in rows:
        by_model.setdefault(row.model, []).append(row)
    counts = {"models": len(by_model), "skipped": 0, "with failures": 0, "patched by some method": 0,
              "refused every method": 0, "ok rows": 0, "refused rows": 0, "failed rows": 0}
    for model_rows in by_model.values():
        if model_rows[0].status == "skipped":
            counts["skipped"] += 1
            continue
        statuses = [r.status for r in model_rows]
        counts["ok rows"] += statuses.count("ok")
        counts["refused rows"] += statuses.count("refused")
        counts["failed rows"] += statuses.count("FAILED")
        if "FAILED" in statuses:
            counts["with failures"] += 1
        if "ok" in statuses:
            counts["patched by some method"] += 1
        elif "FAILED" not in statuses:
            counts["refused every method"] += 1
    return counts


def _generic(row: Row) -> str:
    """A row's reason with the class name generalised and the list of fitting methods dropped (one note for all
    the models refused for the same reason)."""
    import re

    reason = row.reason.split(" Methods that do: ")[0]
    reason = re.sub(r"method '[^']+'", "the method", reason)
    return reason.replace(row.cls, "<model>")


def format_census(rows: list[Row], markdown: bool = False, reasons: bool = True) -> str:
    """A model x method table: ``ok``, ``refused`` (reasons listed below the table), ``FAILED`` or skipped."""
    from ..methods.registry import METHODS

    methods = [m for m in METHODS if any(r.method == m for r in rows)]
    models: dict[str, dict[str, Row]] = {}
    skipped: dict[str, Row] = {}
    for row in rows:
        if row.status == "skipped":
            skipped[row.model] = row
        else:
            models.setdefault(row.model, {})[row.method] = row
    notes: dict[str, int] = {}

    def cell(row: Row | None) -> str:
        if row is None:
            return ""
        if row.status == "ok":
            return "ok"
        key = f"{row.status}: {_generic(row)}"
        if key not in notes:
            notes[key] = len(notes) + 1
        return f"{'refused' if row.status == 'refused' else 'FAILED'} [{notes[key]}]"

    header = ["model", "class"] + methods
    body = [[name, next(iter(cells.values())).cls] + [cell(cells.get(m)) for m in methods]
            for name, cells in models.items()]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in body]
    if reasons and notes:
        bullet = "- " if markdown else ""
        lines += ["", "Reasons:"] + [f"{bullet}[{n}] {text}" for text, n in notes.items()]
    if skipped:
        lines += ["", f"Not built tiny ({len(skipped)}):"]
        lines += [f"- {name} ({row.cls}): {row.reason}" for name, row in skipped.items()]
    counts = summarize(rows)
    lines += ["", "Summary: " + ", ".join(f"{k} {v}" for k, v in counts.items())]
    return "\n".join(lines)
