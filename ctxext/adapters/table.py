"""The method x family table: each adapter says what each declared method does on its family, or why it does not
apply. ``ctxext methods`` prints it; docs/methods.md shows its Markdown form, README.md its yes / no form."""

from __future__ import annotations

from ..methods.registry import METHODS
from . import ADAPTERS


def method_table(adapters=None) -> list[dict[str, str]]:
    """One row per method: for each family, 'yes' or why not."""
    adapters = ADAPTERS if adapters is None else adapters
    rows = []
    for m in METHODS.values():
        row = {"method": m.name, "summary": m.summary}
        for adapter in adapters:
            row[adapter.family] = adapter.support(m)
        rows.append(row)
    return rows


def format_method_table(markdown: bool = False) -> str:
    header = ["method"] + [a.title for a in ADAPTERS] + ["temperature"]
    body = [[r["method"]] + [r[a.family] for a in ADAPTERS] + [_temperature_cell(r["method"])] for r in method_table()]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(f"`{c}`" if i == 0 else c for i, c in enumerate(row)) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in body])


def _temperature_cell(name: str) -> str:
    """Whether ``name`` takes ``temperature=...`` (``ctxext.methods.temperature``), on the families that carry one."""
    from ..methods.temperature import FORMS, takes_temperature

    if not takes_temperature(METHODS[name]):
        return "no"
    families = ", ".join(a.family for a in ADAPTERS if a.takes_temperature and a.supports(name))
    return f"{' / '.join(FORMS)} ({families})"
