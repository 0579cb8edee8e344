"""Figures in the style of the ALiBi paper's 'perplexity vs validation length' plot."""

from __future__ import annotations

from pathlib import Path

from ..core.outputs import write_atomic

MARKERS = {"sinusoidal": "o", "learned": "s", "rope": "^", "alibi": "D", "nope": "v", "t5": "P"}


def _figure(ncols, width):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, 4), squeeze=False)
    return plt, fig, axes[0]


def _save(plt, fig, path):
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    write_atomic(Path(path), buf.getvalue())


def plot_lab(doc: dict, path) -> None:
    """Last-quarter perplexity vs validation length (log y), one line per scheme; copy accuracy beside it.
    A length a scheme cannot run at is drawn as an x at the top of the panel."""
    plt, fig, (ax, ax2) = _figure(2, 12)
    factors = doc["settings"]["factors"]
    T = doc["settings"]["train_len"]
    lengths = [T * f for f in factors]
    finite = [r["ppl_last_quarter"] for res in doc["results"].values() for r in res["lengths"].values()
              if "cannot_run" not in r]
    top = max(finite) * 2 if finite else 10
    for s, res in doc["results"].items():
        rows = [res["lengths"][f"{f}x"] for f in factors]
        ok = [(n, r) for n, r in zip(lengths, rows) if "cannot_run" not in r]
        bad = [n for n, r in zip(lengths, rows) if "cannot_run" in r]
        (line,) = ax.plot([n for n, _ in ok], [r["ppl_last_quarter"] for _, r in ok], marker=MARKERS.get(s, "o"),
                          label=s)
        ax2.plot([n for n, _ in ok], [r["copy_accuracy"] for _, r in ok], marker=MARKERS.get(s, "o"), label=s,
                 color=line.get_color())
        if bad:
            ax.scatter(bad, [top] * len(bad), marker="x", s=80, color=line.get_color(),
                       label=f"{s}: cannot run")
            ax2.scatter(bad, [0] * len(bad), marker="x", s=80, color=line.get_color())
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(lengths, [str(n) for n in lengths])
        a.axvline(T, color="gray", linestyle=":", linewidth=1)
        a.set_xlabel("validation length (tokens)")
    ax.set_yscale("log")
    ax.set_ylabel("last-quarter perplexity (held-out Emma)")
    ax.set_title(f"Perplexity vs validation length (trained at {T})")
    ax2.set_ylabel("copy accuracy")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_title("Copy task: accuracy on the copy")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    fig.tight_layout()
    _save(plt, fig, path)


def plot_shift(doc: dict, path) -> None:
    plt, fig, (ax,) = _figure(1, 7)
    for s, rows in doc["results"].items():
        ax.plot([r["offset"] for r in rows], [r["ppl"] for r in rows], marker=MARKERS.get(s, "o"), label=s)
    ax.set_yscale("log")
    ax.set_xlabel("start offset k (positions k .. k+W-1)")
    ax.set_ylabel("perplexity (held-out Emma)")
    ax.set_title(f"Start-offset probe: windows of {doc['window']} tokens, trained at {doc['settings']['train_len']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    _save(plt, fig, path)


def plot_copy(doc: dict, path) -> None:
    """The encoder copy task as in the write-up: one bar per scheme (mean accuracy at each length, std as error bar,
    each seed a dot; "n/a" where the scheme cannot run), and the mean learning curves beside it."""
    plt, fig, (ax, ax2) = _figure(2, 13)
    factors = doc["settings"]["factors"]
    schemes = list(doc["results"])
    width = 0.8 / len(factors)
    for j, f in enumerate(factors):
        xs = [i + (j - (len(factors) - 1) / 2) * width for i in range(len(schemes))]
        for x, s in zip(xs, schemes):
            cell = doc["results"][s]["lengths"][f"{f}x"]
            if "cannot_run" in cell:
                ax.text(x, 0.02, "n/a", ha="center", va="bottom", rotation=90, fontsize="small")
                continue
            ax.bar(x, cell["mean"], width, yerr=cell["std"], capsize=3, color=f"C{j}",
                   label=f"{f}x ({cell['length']} tokens)" if s == next(
                       t for t in schemes if "cannot_run" not in doc["results"][t]["lengths"][f"{f}x"]) else None)
            ax.scatter([x] * len(cell["per_seed"]), cell["per_seed"], s=10, color="black", zorder=3)
    ax.axhline(0.1, color="gray", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(schemes)), schemes)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("copy accuracy (chance 0.1, dotted)")
    ax.set_title(f"Encoder copy task: {doc['settings']['seeds']} seeds per scheme, mean ± std")
    ax.legend(loc="upper right", fontsize="small")
    for s in schemes:
        r = doc["results"][s]
        ax2.plot(r["curve_steps"], r["curve_mean"], marker=MARKERS.get(s.removesuffix("-causal"), "o"),
                 linestyle="--" if s.endswith("-causal") else "-", label=s)
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_xlabel("training step")
    ax2.set_ylabel("1x copy accuracy (mean over seeds)")
    ax2.set_title("Learning curves")
    ax2.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    _save(plt, fig, path)
