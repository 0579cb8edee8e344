"""The never-overwrite rule for the lab's output folder, which holds only a lab run, and its JSON writes (whole or not
at all, through :func:`ctxext.core.outputs.write_atomic`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.outputs import write_atomic

#: Files whose presence marks a folder as a lab run: written before the first model is trained (models/, by
#: ``ctxext lab``; shift-models/, by ``lab shift`` training its own), or at the end of a run (lab.json, shift.json,
#: copy.json: ``lab copy`` keeps no models).
RUN_MARKERS = ("models/settings.json", "shift-models/settings.json", "lab.json", "shift.json", "copy.json")
#: What ``ctxext lab`` writes, apart from models/<scheme>.pt: removed before an --overwrite run trains anything.
LAB_FILES = ("lab.json", "lab.md", "lab.png", "models/settings.json")


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def check_not_finished(out: Path, name: str, overwrite: bool) -> None:
    """Refuse (ValueError) when ``out/name`` holds a finished result and ``overwrite`` is false."""
    target = Path(out) / name
    if target.exists() and not overwrite:
        raise ValueError(f"{target} already holds a finished result; pass --overwrite to replace it or choose another --out")


def _is_marker(path: Path) -> bool:
    """A JSON file the lab wrote: each marker records the run's settings."""
    try:
        return isinstance(json.loads(path.read_text(encoding="utf-8")).get("settings"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def check_lab_folder(out: Path) -> None:
    """Refuse (ValueError) a folder that holds files but no lab run: a run would replace the user's lab.md, lab.png
    or models/*.pt of the same name. A missing or empty folder is fine. Touches nothing."""
    out = Path(out)
    if not out.is_dir() or any(_is_marker(out / name) for name in RUN_MARKERS):
        return
    held = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
    if held:
        listed = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(f"--out {out} holds files that are not a ctxext lab run ({listed}); a run writes lab.json, "
                         "lab.md, lab.png and models/ there and would replace files of the same name: give a new or "
                         "empty folder")


def clear_lab_run(out: Path, schemes) -> None:
    """Remove an earlier lab run's results and models (lab.json first: a run cut short never looks finished), so
    that nothing of it is left beside the new run's files. Files that are not the lab's stay."""
    out = Path(out)
    for name in LAB_FILES:
        (out / name).unlink(missing_ok=True)
    for scheme in schemes:
        (out / "models" / f"{scheme}.pt").unlink(missing_ok=True)


def format_rows(title: str, head: list[str], rows: list[list[str]], *, markdown: bool = False) -> str:
    """A lab table: Markdown, or plain text with the first column left-aligned and the others right-aligned."""
    if markdown:
        return "\n".join([title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join([title] + ["  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
                                for r in [head] + rows])

