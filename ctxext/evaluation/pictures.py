"""The pictures of a run, from its result rows: perplexity vs length (a marker at each measured length, no line across
an unmeasured one; the verdict's last-quarter measure and the whole window, each labelled) and needle accuracy by
depth x length (each cell with its accuracy and how many samples it holds). Each picture is a matplotlib ``Figure``
(``plot_figure``, ``needle_figure``: what it draws can be read back) and a function that writes it to a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from .requests import is_unpatched_label


def method_labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The method labels among ``rows``, in the order they first appear."""
    out: list[str] = []
    for r in rows:
        if r["label"] not in out:
            out.append(r["label"])
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


#: The measures the perplexity plot draws, one line of panels each: first the one the verdict ranks by
#: (``ctxext.evaluation.verdict``: the last quarter of each window, where the rows have it), then whole-window
#: perplexity. (row field, what the panels say it is)
PLOT_MEASURES = (("ppl_last_quarter", "last quarter of each window (the verdict's measure)"),
                 ("ppl", "whole window"))


def measured_segments(rows: Sequence[dict[str, Any]], label: str, field: str = "ppl",
                      trained: int | None = None) -> list[list[tuple[int, float]]]:
    """The points of one method's line in the perplexity plot: its measured (length, value) pairs, in runs that a
    line may join. ``rows``: one model's perplexity rows (every method: their lengths are the run's). A length of the
    run where this method has no value (not measured, n/a past a position table, None) ends a run, and so does an
    unmeasured ``trained`` length between two points: a straight line across it would draw values nobody measured,
    where a model changes most."""
    grid = sorted({int(r["length"]) for r in rows})
    values = {int(r["length"]): r[field] for r in rows if r["label"] == label and not r.get("not_applicable")
              and isinstance(r.get(field), (int, float)) and r[field] > 0}
    runs: list[list[tuple[int, float]]] = [[]]
    for n in grid:
        if n not in values:
            runs.append([])
            continue
        if runs[-1] and trained is not None and runs[-1][-1][0] < trained < n:
            runs.append([])
        runs[-1].append((n, values[n]))
    return [run for run in runs if run]


def plot_figure(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]], *, title: str = ""):
    """The perplexity-vs-length figure (a matplotlib ``Figure``): one column of panels per model, one line of
    panels per measure (``PLOT_MEASURES`` the rows hold), one line per method with a marker at each measured length
    and no line across an unmeasured one (``measured_segments``); the trained length marked."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullLocator

    def ppl_rows(model: dict[str, Any]) -> list[dict[str, Any]]:
        return [r for r in rows if r.get("model") == model["label"] and r.get("kind", "ppl") == "ppl"]

    # a model with no perplexity at all (e.g. only lengths past its position table) gets no empty, unscalable panel
    models = [m for m in models if any(r.get("ppl") for r in ppl_rows(m))]
    if not models:
        raise ValueError("nothing to plot: no perplexity results")
    measures = [(f, what) for f, what in PLOT_MEASURES if any(r.get(f) for m in models for r in ppl_rows(m))]
    fig = Figure(figsize=(6.6 * len(models), 4.4 * len(measures)))
    axes = fig.subplots(len(measures), len(models), squeeze=False)
    for line, (field, what) in enumerate(measures):
        for ax, model in zip(axes[line], models):
            mine = ppl_rows(model)
            trained = model.get("original_length")
            _draw_methods(ax, mine, field, trained)
            if not any(r.get(field) for r in mine):
                ax.text(0.5, 0.5, f"no {what} values", transform=ax.transAxes, ha="center", color="grey")
            for label, lengths_out in cannot_run(mine).items():  # e.g. GPT-2 unpatched past its position table
                ax.plot(lengths_out, [0.96] * len(lengths_out), linestyle="none", marker="x", color="black"
                        if is_unpatched_label(label) else "tab:red", markersize=8, transform=ax.get_xaxis_transform(),
                        clip_on=False, label=f"{label}: cannot run")
            lengths = sorted({int(r["length"]) for r in mine})
            ax.set_xscale("log", base=2)
            if any(r.get(field) for r in mine):
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
            ax.set_ylabel(f"perplexity, {what.split(' (')[0]}\n(log scale)", fontsize=9)
            ax.set_title(f"{model.get('title') or model['label']}: {what}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if line == 0:  # the same methods and styles in every line of panels: one legend per model
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    if title:  # wrapped to the figure's width, so a one-panel plot does not cut it off
        import textwrap

        fig.suptitle("\n".join(textwrap.wrap(title, width=int(11 * fig.get_figwidth()))), fontsize=11)
    fig.tight_layout()
    return fig


def _draw_methods(ax, mine: list[dict[str, Any]], field: str, trained: int | None) -> None:
    """One model's methods on one panel: each a line per run of measured points (``measured_segments``), named once
    in the legend; ``gid`` is the method's label."""
    for k, label in enumerate(method_labels(mine)):
        # the baseline every method is read against: thick, grey-black, *under* the methods, so a method equal
        # to it (extrapolate) stays visible on top
        style = {"color": "black", "alpha": 0.55, "linestyle": "-", "marker": "o", "linewidth": 3.5,
                 "zorder": 1} if is_unpatched_label(label) else {
            "color": PALETTE[k % len(PALETTE)], "linestyle": LINESTYLES[k % len(LINESTYLES)],
            "marker": MARKERS[k % len(MARKERS)], "linewidth": 1.5, "zorder": 2,
            "markerfacecolor": "none" if k % 2 else None}  # hollow and filled alternate: equal lines stay visible
        for number, run in enumerate(measured_segments(mine, label, field, trained)):
            ax.plot([p[0] for p in run], [p[1] for p in run], label=label if number == 0 else "_nolegend_",
                    gid=label, markersize=6, **style)


def plot(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]], path: str | Path, *,
         title: str = "") -> Path:
    """PNG of perplexity vs length (``plot_figure``) at ``path``."""
    fig = plot_figure(rows, models, title=title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # keeps the legends outside the axes in the picture
    return path


def _needle_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The rows the heatmap draws and what they are: the RULER-style needle tasks, or passkey where none ran (the
    first needle test, with one depth per prompt like theirs; not averaged with them: another template)."""
    with_depths = [r for r in rows if isinstance(r.get("depths"), dict) and r.get("kind", "ppl") != "ppl"]
    needles = [r for r in with_depths if r.get("kind") != "passkey"]
    if needles:
        return needles, "needle tasks"
    return [r for r in with_depths if r.get("kind") == "passkey"], "passkey"


def depth_samples(row: dict[str, Any]) -> dict[str, int]:
    """How many samples each depth of a passkey or needle-task row holds: the row's samples (``trials``) go to its
    depths in turn, in the order the row lists them (passkey: the same number at each; a task: ``plan_samples``).
    Empty where the row does not say how many it holds."""
    trials, depths = row.get("trials"), list(row.get("depths") or {})
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1 or not depths:
        return {}
    return {depth: len(range(k, trials, len(depths))) for k, depth in enumerate(depths)}


Cell = tuple[float, Optional[int]]


def needle_cells(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[tuple[float, int], Cell]]:
    """Per (model, method label): (accuracy, samples) by (depth, length): the accuracy averaged over the needle tasks
    that ran (passkey's where none ran), the samples summed over them (None where a row does not say)."""
    acc: dict[tuple[str, str], dict[tuple[float, int], list[tuple[float, int | None]]]] = {}
    for r in _needle_rows(rows)[0]:
        cell = acc.setdefault((r["model"], r["label"]), {})
        counts = depth_samples(r)
        for depth, value in r["depths"].items():
            cell.setdefault((float(depth), int(r["length"])), []).append((value, counts.get(depth)))
    return {k: {dl: (sum(v for v, _ in found) / len(found),
                     None if any(n is None for _, n in found) else sum(n for _, n in found))
                for dl, found in cells.items()} for k, cells in acc.items()}


def needle_depths(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[tuple[float, int], float]]:
    """Per (model, method label): needle-task accuracy by (depth, length), averaged over the needle tasks that ran;
    passkey accuracy where no needle task ran."""
    return {k: {dl: value for dl, (value, _) in cells.items()} for k, cells in needle_cells(rows).items()}


def cell_text(value: float, samples: int | None) -> str:
    """A heatmap cell: its accuracy and how many samples it holds (colours alone hide 40% vs 60%, and 100% of 1
    sample is not 100% of 40)."""
    return f"{100 * value:.0f}%" + (f"\nn={samples}" if samples is not None else "")


#: Methods side by side in the needle heatmap before the next line (the demo's 14 would make one unreadable strip).
HEATMAP_PANELS_PER_LINE = 5


def needle_figure(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]]):
    """The needle heatmap (a matplotlib ``Figure``), the picture NIAH users know: depth (rows) x length (columns),
    green = found, each cell's accuracy and samples written in it (``cell_text``); one panel per method, the panels of
    each model on lines of at most ``HEATMAP_PANELS_PER_LINE``."""
    from matplotlib.figure import Figure

    grid = needle_cells(rows)
    if not grid:
        raise ValueError("nothing to draw: no needle-task results")
    names = [m["label"] for m in models if any(k[0] == m["label"] for k in grid)]
    lines = []  # (model, its panels on this line)
    for name in names:
        keys = [k for k in grid if k[0] == name]
        lines += [(name, keys[i : i + HEATMAP_PANELS_PER_LINE]) for i in range(0, len(keys), HEATMAP_PANELS_PER_LINE)]
    width = max(len(keys) for _, keys in lines)
    fig = Figure(figsize=(2.8 * width + 1.2, 2.6 * len(lines) + 0.8), layout="constrained")
    axes = fig.subplots(len(lines), width, squeeze=False)
    image = None
    for row_axes, (name, keys) in zip(axes, lines):
        trained = next((m.get("original_length") for m in models if m["label"] == name), None)
        for ax, key in zip(row_axes, keys):
            cells = grid[key]
            depths = sorted({d for d, _ in cells})
            lengths = sorted({n for _, n in cells})
            data = [[cells[(d, n)][0] if (d, n) in cells else float("nan") for n in lengths] for d in depths]
            image = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for i, d in enumerate(depths):
                for j, n in enumerate(lengths):
                    if (d, n) in cells:
                        ax.text(j, i, cell_text(*cells[(d, n)]), ha="center", va="center", fontsize=7,
                                linespacing=0.9)
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
    fig.suptitle(f"Needle retrieval ({what}) by depth and length; each cell: accuracy, n = samples (dotted: trained "
                 "length)", fontsize=10)
    return fig


def needle_heatmap(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """PNG of the needle heatmap (``needle_figure``) at ``path``."""
    fig = needle_figure(rows, models)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
