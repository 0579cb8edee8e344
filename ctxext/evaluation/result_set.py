"""What ``ctxext.evaluate`` returns: the rows, the tables and verdicts ``ctxext eval`` prints, and ways to save them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class EvalResults:
    """The finished rows of one evaluation (the records the results JSON holds under ``results``), in plan order.

    ``table()`` is the text ``ctxext eval`` prints; ``verdicts`` its verdict lines; ``to_json`` writes the results
    JSON, ``plot`` the perplexity plot (and the needle heatmap where needles ran), ``to_pandas`` a DataFrame."""

    rows: list[dict[str, Any]]
    #: What each model was (architecture, trained length, the patch it came with, the patches it ran with).
    models: list[dict[str, Any]]
    #: The results JSON, as ``output=`` writes it.
    document: dict[str, Any]
    #: The results file this run wrote; None without ``output=`` (or where nothing finished).
    output: Path | None = None
    errors: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def verdicts(self) -> list[str]:
        from .verdict import verdicts

        saved = self.document.get("verdicts")
        return list(saved) if isinstance(saved, list) else verdicts(self.rows, self.models)

    def table(self) -> str:
        """The tables and the verdict, as ``ctxext eval`` prints them."""
        from .report import format_report
        from .verdict import format_verdicts

        parts = [format_report(self.rows, self.models, self.document["protocol"]),
                 format_verdicts(self.rows, self.models)]
        return "\n\n".join(p for p in parts if p)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython / Jupyter show the table
        printer.text(self.table() if not cycle else "EvalResults(...)")

    def to_json(self, path: str | Path) -> Path:
        """Write the results JSON to ``path`` whole (a temporary file renamed into place)."""
        from ..core.outputs import write_atomic

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(self.document, indent=2, default=str) + "\n")
        return path

    def plot(self, path: str | Path, *, heatmap: str | Path | None = None) -> Path:
        """Draw perplexity against length to ``path`` (and, with ``heatmap``, needle accuracy by depth x length);
        needs matplotlib (``pip install 'ctxext[eval]'``)."""
        from .report import needle_depths, needle_heatmap, plot, plot_title

        if not any(r.get("kind", "ppl") == "ppl" and r.get("ppl") for r in self.rows):
            raise ValueError("plot: no perplexity rows to draw")
        written = plot(self.rows, self.models, path, title=plot_title(self.document))
        if heatmap is not None:
            if not needle_depths(self.rows):
                raise ValueError("heatmap: no passkey or needle-task rows to draw")
            needle_heatmap(self.rows, self.models, heatmap)
        return Path(written)

    def to_pandas(self):
        """The rows as a pandas DataFrame, one per row (pandas must be installed)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("to_pandas needs pandas: pip install pandas") from None
        return pd.DataFrame(self.rows)
