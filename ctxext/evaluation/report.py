"""What a run shows and leaves, from its result rows: the console tables, the final results document (with the
verdict sentences), and the pictures (drawn by ``ctxext.evaluation.pictures``) written whole."""

from __future__ import annotations

import errno
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from .plan import picture_file
from .pictures import cannot_run, method_labels, needle_depths, needle_heatmap, plot  # noqa: F401 (callers import them)
from .task_rows import task_average, task_names
from .verdict import verdicts


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind != "ppl":  # passkey and tasks: an accuracy
        return f"{100 * value:.0f}%"
    if value >= 1e5:
        return f"{value:.2e}"
    return f"{value:.2f}" if value < 1000 else f"{value:.0f}"


def format_table(rows: Sequence[dict[str, Any]], *, kind: str = "ppl", field: str = "ppl", title: str = "") -> str:
    """Methods as rows, lengths as columns."""
    rows = [r for r in rows if r.get("kind", "ppl") == kind]
    if not rows:
        return ""
    lengths = sorted({int(r["length"]) for r in rows})
    cells = {(r["label"], int(r["length"])): "n/a" if r.get("not_applicable") else _fmt(r.get(field), kind) for r in rows}
    header = ["method"] + [str(n) for n in lengths]
    body = [[label] + [cells.get((label, n), "") for n in lengths] for label in method_labels(rows)]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    line = lambda cols: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))
    out = [title] if title else []
    out += [line(header), line(["-" * w for w in widths])] + [line(b) for b in body]
    return "\n".join(out)


def format_report(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]], protocol: dict[str, Any]) -> str:
    """All tables of a run: per model, perplexity (and last-quarter perplexity, passkey accuracy)."""
    parts = []
    stride = protocol.get("stride")
    proto = protocol.get("name", "sliding") + (f", stride {stride}" if stride and protocol.get("name") == "sliding" else "")
    for model in models:
        mine = [r for r in rows if r.get("model") == model["label"]]
        trained = model.get("original_length")
        where = f"{model['label']}" + (f" with the LoRA adapter {model['adapter']}" if model.get("adapter") else "") \
            + (f" (trained to {trained} tokens)" if trained else "")
        for kind, field, what in (
            ("ppl", "ppl", f"perplexity ({proto})"),
            ("ppl", "ppl_last_quarter", "perplexity, last quarter of each window"),
            ("ppl", "ppl_key", "key-token perplexity (LongPPL: tokens that need long context)"),
            ("passkey", "accuracy", "passkey accuracy"),
        ):
            if field == "ppl_key":
                counts = sorted({r["key_tokens"] for r in mine if r.get("key_tokens") is not None})
                if not any(r.get("ppl_key") is not None for r in mine):
                    continue
                what += f"; {counts[0]}-{counts[-1]} key tokens per cell" if len(counts) > 1 else \
                    f"; {counts[0]} key tokens per cell"
            table = format_table(mine, kind=kind, field=field, title=f"{what} - {where}")
            if table:
                parts.append(table)
        tasks = task_names(mine)
        for task in tasks:
            parts.append(format_table(mine, kind=task, field="accuracy",
                                      title=f"{task} (RULER score, {_samples(mine, task)}) - {where}"))
        if len(tasks) > 1:
            parts.append(format_table(task_average(mine), kind="average", field="accuracy",
                                      title=f"average of {len(tasks)} tasks ({', '.join(tasks)}) - {where}"))
    return "\n\n".join(parts)


def _samples(rows, task: str) -> str:
    counts = sorted({r.get("trials") for r in rows if r.get("kind") == task and r.get("trials")})
    if not counts:
        return "no samples"
    return f"{'/'.join(map(str, counts))} sample{'' if counts == [1] else 's'}"


# -- the files a finished run leaves ----------------------------------------------------------------------------
def machine(device: str) -> dict[str, Any]:
    """Where the run ran (recorded, not compared: a resumed run may finish elsewhere)."""
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "device": device}
    if device != "cpu" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def results_document(plan, started, state, outcome, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The final results JSON of ``plan`` (an :class:`~.plan.EvalPlan`) after the runner's ``outcome``."""
    from ..version import __version__

    s = plan.settings
    sliding = s.protocol == "sliding"
    return {
        "ctxext_version": __version__,
        "created": started.isoformat(timespec="seconds"),
        "command": ["ctxext"] + sys.argv[1:] if sys.argv and "ctxext" in sys.argv[0] else sys.argv,
        "machine": machine(plan.device),
        "processes": state.num_processes,
        "model": outcome.models[0] if len(outcome.models) == 1 else None,
        "models": outcome.models,
        "data": plan.texts.info,
        "protocol": {"name": s.protocol, "stride": s.stride if sliding else None,
                     "default_stride": "half the length" if sliding and s.stride is None else None,
                     "max_windows": s.max_windows, "max_tokens": s.max_tokens, "batch_size": s.batch_size,
                     "last_quarter": "targets in the last quarter of their window"},
        "passkey": {"depths": list(s.passkey_depths), "trials": s.passkey_trials, "seed": s.seed}
        if s.passkey else None,
        "tasks": {"names": s.tasks, "samples": s.task_samples, "depths": list(s.task_depths),
                  "seed": s.seed, "chat_template": s.chat_template,
                  "source": "RULER (Hsieh et al. 2024; NVIDIA/RULER), generated offline: ctxext.evaluation.tasks"}
        if s.tasks else None,
        "pictures": plan.pictures,
        "results": rows,
        # the sentences ctxext eval prints under its tables, from these rows (ctxext.evaluation.verdict)
        "verdicts": verdicts(rows, outcome.models),
        "errors": outcome.errors,
        "interrupted": outcome.interrupted,
    }


def write_pictures(plan, rows: list[dict[str, Any]], models: list[dict[str, Any]],
                   document: dict[str, Any]) -> Iterator[tuple[str, str, str | None]]:
    """Draw the plan's pictures that the rows have data for, each written whole (a temporary file renamed into
    place); yields (what, file, None) after each, so the caller can name it before the next one is drawn, or
    (what, file, why) where it could not be written (a full disk: the file is named, the results are kept, and
    ``--resume`` draws it from them); the next picture is still drawn."""
    pictures = []
    if plan.plot and any(r.get("kind", "ppl") == "ppl" and r.get("ppl") for r in rows):
        pictures.append(("plot", "plot", plan.plot, lambda tmp: plot(rows, models, tmp, title=plot_title(document))))
    if plan.heatmap and needle_depths(rows):
        pictures.append(("needle heatmap", "heatmap", plan.heatmap, lambda tmp: needle_heatmap(rows, models, tmp)))
    for what, arg, target, draw in pictures:
        try:
            yield what, _replace(target, draw), None
        except OSError as exc:
            yield what, str(picture_file(Path(target))), unwritten_picture(arg, target, exc, plan)


def unwritten_picture(arg: str, target: str, exc: OSError, plan) -> str:
    """What to say where a picture could not be written: its file, why, and that a resume draws it. ``arg``: the
    argument that gave it (``plot``, ``heatmap``), named as the plan's command names it."""
    from .request import spelling_for
    from .results import jsonl_path

    s = spelling_for(getattr(plan, "command", "eval"))  # a plan-like object without one: the command's flags
    why = exc.strerror or str(exc) or type(exc).__name__
    space = "free some space, then " if exc.errno == errno.ENOSPC else ""
    resume = f"with {s.on('resume')} in place of {s.on('overwrite')}" if plan.overwrite else f"with {s.on('resume')}"
    return (f"{s.given(arg, str(picture_file(Path(target))))}: not written ({why}); the results are kept in "
            f"{plan.output} (rows: {jsonl_path(plan.output)}): {space}{s.again()} {resume} to draw it (no row is "
            "computed again)")


def _replace(target: str, draw) -> str:
    """Draw in a staging folder beside ``target``, then write the picture whole into place; returns the file written
    (``plan.picture_file``: the name the pre-run check expects)."""
    from ..core.outputs import staging_folder, write_atomic

    path = picture_file(Path(target))
    with staging_folder(path) as staging:
        drawn = staging / path.name  # the suffix tells matplotlib the format
        draw(drawn)
        write_atomic(path, drawn.read_bytes())
    return str(path)


def plot_title(document: dict[str, Any]) -> str:
    proto = document["protocol"]
    what = "sliding window" if proto["name"] == "sliding" else "chunks"
    return f"Perplexity vs context length ({what}) on {document['data'].get('data', 'data')}"
