"""What a run shows and leaves, from its result rows: the console tables, the pictures (perplexity vs length,
needle accuracy by depth x length) and the final results document."""

from __future__ import annotations

import errno
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from .plan import picture_file
from .requests import is_unpatched_label


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind != "ppl":  # passkey and tasks: an accuracy
        return f"{100 * value:.0f}%"
    if value >= 1e5:
        return f"{value:.2e}"
    return f"{value:.2f}" if value < 1000 else f"{value:.0f}"


def _labels(rows) -> list[str]:
    out = []
    for r in rows:
        if r["label"] not in out:
            out.append(r["label"])
    return out


def format_table(rows: Sequence[dict[str, Any]], *, kind: str = "ppl", field: str = "ppl", title: str = "") -> str:
    """Methods as rows, lengths as columns."""
    rows = [r for r in rows if r.get("kind", "ppl") == kind]
    if not rows:
        return ""
    lengths = sorted({int(r["length"]) for r in rows})
    cells = {(r["label"], int(r["length"])): "n/a" if r.get("not_applicable") else _fmt(r.get(field), kind) for r in rows}
    header = ["method"] + [str(n) for n in lengths]
    body = [[label] + [cells.get((label, n), "") for n in lengths] for label in _labels(rows)]
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


def task_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The RULER-style tasks among the rows, in the order they ran."""
    from .tasks.catalog import is_task

    out: list[str] = []
    for r in rows:
        if is_task(r.get("kind", "ppl")) and r["kind"] not in out:
            out.append(r["kind"])
    return out


def _samples(rows, task: str) -> str:
    counts = sorted({r.get("trials") for r in rows if r.get("kind") == task and r.get("trials")})
    if not counts:
        return "no samples"
    return f"{'/'.join(map(str, counts))} sample{'' if counts == [1] else 's'}"


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


MARKERS = ["s", "^", "v", "D", "P", "X", "<", ">", "h", "*", "p", "d"]
LINESTYLES = ["-", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]
PALETTE = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "tab:gray"]


def cannot_run(rows: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    """Per method label, the lengths the model cannot run at (e.g. past a learned position table)."""
    out: dict[str, list[int]] = {}
    for r in rows:
        if r.get("not_applicable"):
            out.setdefault(r["label"], []).append(int(r["length"]))
    return {label: sorted(v) for label, v in out.items()}


def plot(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """PNG of perplexity vs length, one line per method, one panel per model; training length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    # a model with no perplexity at all (e.g. only lengths past its position table) gets no empty, unscalable panel
    models = [m for m in models if any(r.get("model") == m["label"] and r.get("kind", "ppl") == "ppl" and r.get("ppl")
                                       for r in rows)]
    if not models:
        raise ValueError("nothing to plot: no perplexity results")
    fig, axes = plt.subplots(1, len(models), figsize=(6.6 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r.get("model") == model["label"] and r.get("kind", "ppl") == "ppl"]
        drawn = [r for r in mine if r.get("ppl")]
        for k, label in enumerate(_labels(drawn)):
            pts = sorted((int(r["length"]), r["ppl"]) for r in drawn if r["label"] == label)
            # the baseline every method is read against: thick, grey-black, *under* the methods, so a method equal
            # to it (extrapolate) stays visible on top
            unpatched = is_unpatched_label(label)
            style = {"color": "black", "alpha": 0.55, "linestyle": "-", "marker": "o", "linewidth": 3.5,
                     "zorder": 1} if unpatched else {
                "color": PALETTE[k % len(PALETTE)], "linestyle": LINESTYLES[k % len(LINESTYLES)],
                "marker": MARKERS[k % len(MARKERS)], "linewidth": 1.5, "zorder": 2,
                "markerfacecolor": "none" if k % 2 else None}  # hollow and filled alternate: equal lines stay visible
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, markersize=6, **style)
        for label, lengths_out in cannot_run(mine).items():  # e.g. GPT-2 unpatched past its position table
            ax.plot(lengths_out, [0.96] * len(lengths_out), linestyle="none", marker="x", color="black"
                    if is_unpatched_label(label) else "tab:red", markersize=8, transform=ax.get_xaxis_transform(), clip_on=False,
                    label=f"{label}: cannot run")
        trained = model.get("original_length")
        lengths = sorted({int(r["length"]) for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if lengths:
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.set_xlim(min(lengths + [trained or lengths[0]]) / 1.25, max(lengths) * 1.25)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.tick_params(axis="y", which="major", labelsize=8)  # a decade label no louder than the others
        if trained:
            ax.axvline(trained, color="grey", linestyle=":", linewidth=1.5)
            ax.text(trained, 0.02, " trained length", transform=ax.get_xaxis_transform(), rotation=90,
                    fontsize=8, color="grey", va="bottom", ha="right")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("perplexity (log scale)")
        ax.set_title(model.get("title") or model["label"], fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    if title:  # wrapped to the figure's width, so a one-panel plot does not cut it off
        import textwrap

        fig.suptitle("\n".join(textwrap.wrap(title, width=int(11 * fig.get_figwidth()))), fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # keeps the legends outside the axes in the picture
    plt.close(fig)
    return path


def _needle_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The rows the heatmap draws and what they are: the RULER-style needle tasks, or passkey where none ran (the
    first needle test, with one depth per prompt like theirs; not averaged with them: another template)."""
    with_depths = [r for r in rows if isinstance(r.get("depths"), dict) and r.get("kind", "ppl") != "ppl"]
    needles = [r for r in with_depths if r.get("kind") != "passkey"]
    if needles:
        return needles, "needle tasks"
    return [r for r in with_depths if r.get("kind") == "passkey"], "passkey"


def needle_depths(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[tuple[float, int], float]]:
    """Per (model, method label): needle-task accuracy by (depth, length), averaged over the needle tasks that ran;
    passkey accuracy where no needle task ran."""
    acc: dict[tuple[str, str], dict[tuple[float, int], list[float]]] = {}
    for r in _needle_rows(rows)[0]:
        cell = acc.setdefault((r["model"], r["label"]), {})
        for depth, value in r["depths"].items():
            cell.setdefault((float(depth), int(r["length"])), []).append(value)
    return {k: {dl: sum(v) / len(v) for dl, v in cells.items()} for k, cells in acc.items()}


#: Methods side by side in the needle heatmap before the next line (the demo's 14 would make one unreadable strip).
HEATMAP_PANELS_PER_LINE = 5


def needle_heatmap(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """PNG of needle retrieval, the picture NIAH users know: depth (rows) x length (columns), green = found, one panel
    per method, the panels of each model on lines of at most ``HEATMAP_PANELS_PER_LINE``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = needle_depths(rows)
    if not grid:
        raise ValueError("nothing to draw: no needle-task results")
    names = [m["label"] for m in models if any(k[0] == m["label"] for k in grid)]
    lines = []  # (model, its panels on this line)
    for name in names:
        keys = [k for k in grid if k[0] == name]
        lines += [(name, keys[i : i + HEATMAP_PANELS_PER_LINE]) for i in range(0, len(keys), HEATMAP_PANELS_PER_LINE)]
    width = max(len(keys) for _, keys in lines)
    fig, axes = plt.subplots(len(lines), width, figsize=(2.8 * width + 1.2, 2.6 * len(lines) + 0.8), squeeze=False,
                             constrained_layout=True)
    image = None
    for row_axes, (name, keys) in zip(axes, lines):
        trained = next((m.get("original_length") for m in models if m["label"] == name), None)
        for ax, key in zip(row_axes, keys):
            cells = grid[key]
            depths = sorted({d for d, _ in cells})
            lengths = sorted({n for _, n in cells})
            data = [[cells.get((d, n), float("nan")) for n in lengths] for d in depths]
            image = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for i, line in enumerate(data):  # the number in each cell: colours alone hide 40% vs 60%
                for j, value in enumerate(line):
                    if value == value:
                        ax.text(j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7, rotation=45)
            ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths], fontsize=7)
            if trained and trained in lengths:
                ax.axvline(lengths.index(trained) + 0.5, color="black", linestyle=":", linewidth=1)
            ax.set_title(f"{name}: {key[1]}" if len(names) > 1 else key[1], fontsize=9)
            ax.set_xlabel("context length (tokens)", fontsize=7)
            if ax is row_axes[0]:
                ax.set_ylabel("needle depth", fontsize=7)
        for ax in row_axes[len(keys):]:
            ax.axis("off")
    what = _needle_rows(rows)[1]
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy (RULER score)" if what == "needle tasks" else "accuracy")
    fig.suptitle(f"Needle retrieval ({what}) by depth and length (dotted: trained length)", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


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
    from .. import __version__

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
        pictures.append(("plot", "--plot", plan.plot, lambda tmp: plot(rows, models, tmp, title=plot_title(document))))
    if plan.heatmap and needle_depths(rows):
        pictures.append(("needle heatmap", "--heatmap", plan.heatmap, lambda tmp: needle_heatmap(rows, models, tmp)))
    for what, flag, target, draw in pictures:
        try:
            yield what, _replace(target, draw), None
        except OSError as exc:
            yield what, str(picture_file(Path(target))), unwritten_picture(flag, target, exc, plan)


def unwritten_picture(flag: str, target: str, exc: OSError, plan) -> str:
    """What to say where a picture could not be written: its file, why, and that ``--resume`` draws it."""
    from .results import jsonl_path

    why = exc.strerror or str(exc) or type(exc).__name__
    space = "free some space, then " if exc.errno == errno.ENOSPC else ""
    resume = "with --resume in place of --overwrite" if plan.overwrite else "with --resume"
    return (f"{flag} {picture_file(Path(target))}: not written ({why}); the results are kept in {plan.output} "
            f"(rows: {jsonl_path(plan.output)}): {space}run the same command again {resume} to draw it (no row is "
            "computed again)")


def _replace(target: str, draw) -> str:
    """Draw into a temporary file beside ``target`` and rename it into place; returns the file written
    (``plan.picture_file``: the name the pre-run check expects)."""
    path = picture_file(Path(target))
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # the suffix tells the format
    try:
        draw(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return str(path)


def plot_title(document: dict[str, Any]) -> str:
    proto = document["protocol"]
    what = "sliding window" if proto["name"] == "sliding" else "chunks"
    return f"Perplexity vs context length ({what}) on {document['data'].get('data', 'data')}"
