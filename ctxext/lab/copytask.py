"""`ctxext lab copy`: the write-up's encoder copy task (``encoder.py``), several seeds per scheme, evaluated at 1x,
2x and 4x the training length; writes copy.json / copy.md / copy.png and judges the write-up's result."""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..core.outputs import check_writable_folder, write_atomic
from .encoder import COPY_SCHEMES, IGNORE, VOCAB, build_encoder, copy_rows, digit_range
from .io import check_lab_folder, check_not_finished, format_rows, write_json
from .model import ModelConfig
from .run import machine_info
from .train import lr_at

#: A scheme "learns" the copy when its mean accuracy at 1x over the seeds is at least LEARN_MIN.
LEARN_MIN = 0.9
#: ALiBi "lags" when it learns slower or less than the three: its learning curve's mean accuracy (over the
#: checkpoints, the area under the curve) or its final 1x accuracy is below the lowest of sinusoidal, learned and
#: RoPE by at least LAG_MARGIN. Both forms are the write-up's "lagged behind"; the verdict says which one held.
LAG_MARGIN = 0.05
#: The write-up's three schemes that learn, and the two that lag.
LEARNERS = ("sinusoidal", "learned", "rope")
LAGGERS = ("alibi", "alibi-causal")
#: Accuracy checkpoints per training run (the learning curve).
CURVE_POINTS = 10
#: Files ``ctxext lab copy`` writes; copy.json last (its presence marks a finished run).
COPY_FILES = ("copy.json", "copy.md", "copy.png")


@dataclass(frozen=True)
class CopySettings:
    max_digits: int = 8  # training rows hold 1..max_digits digits; training length 2 * max_digits + 1
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    batch: int = 64
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 50
    seeds: int = 3
    factors: tuple[int, ...] = (1, 2, 4)
    eval_rows: int = 256
    curve_rows: int = 128

    @property
    def train_len(self) -> int:
        return 2 * self.max_digits + 1

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=VOCAB, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                           d_ff=self.d_ff, train_len=self.train_len)

    def check(self) -> None:
        for name in ("max_digits", "d_model", "n_layers", "n_heads", "d_ff", "batch", "steps", "seeds", "eval_rows",
                     "curve_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.n_heads} heads of even size")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup!r}")
        if not self.factors or 1 not in self.factors or any(not isinstance(f, int) or f < 1 for f in self.factors):
            raise ValueError(f"factors must be positive integers including 1, got {self.factors!r}")


#: ``ctxext lab copy``: 6 schemes x 3 seeds x 1000 steps, one torch thread: 6 min 6 s of CPU time (19 min 45 s wall on
#: 2 cores shared with other jobs, load average 7-8; 2026-11-28), so about 6 min on an idle core.
FULL = CopySettings()
#: ``ctxext lab copy --quick``: the same models and seeds at 800 steps, smaller evaluation sets (4 min 17 s of CPU
#: time, 2026-11-28). Noisy: there two of RoPE's three seeds were still learning (0.81, 0.80 at 1x), so the
#: write-up's result read "NOT held" where the full run's 1000 steps read "held"; ALiBi's lag showed in both.
QUICK = CopySettings(steps=800, eval_rows=128, curve_rows=64)


def parse_copy_schemes(text: str | None) -> list[str]:
    if text is None:
        return list(COPY_SCHEMES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in COPY_SCHEMES]
    if not names or bad:
        raise ValueError(f"unknown copy-task scheme(s) {', '.join(bad) or '(none given)'}; choose from "
                         f"{', '.join(COPY_SCHEMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--schemes names a scheme twice: {text}")
    return names


@torch.no_grad()
def accuracy(model, settings: CopySettings, factor: int, rows: int, seed: int) -> float:
    """Fraction of copied digits right (argmax) on ``rows`` fixed rows at ``factor`` x the training length.
    Raises ValueError where the scheme cannot run at that length (the learned table)."""
    was = model.training
    model.eval()
    ids, tgt = copy_rows(rows, factor * settings.train_len, digit_range(settings.max_digits, factor),
                         torch.Generator().manual_seed(seed))
    right = total = 0
    try:
        for i in range(0, rows, 64):
            pred = model(ids[i: i + 64]).argmax(-1)
            m = tgt[i: i + 64] != IGNORE
            right += int((pred[m] == tgt[i: i + 64][m]).sum())
            total += int(m.sum())
    finally:
        model.train(was)
    return right / total


def train_encoder(model, settings: CopySettings, seed: int):
    """Train in place on a batch sequence fixed by ``seed`` (the same rows for every scheme); returns
    (last loss, learning curve [(step, 1x accuracy)] at CURVE_POINTS evenly spaced steps, the last one final)."""
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + seed)
    marks = {round(settings.steps * (i + 1) / CURVE_POINTS) for i in range(CURVE_POINTS)}
    curve, loss = [], float("nan")
    model.train()
    for step in range(1, settings.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, settings.steps, settings.lr, min(settings.warmup, settings.steps))
        ids, tgt = copy_rows(settings.batch, settings.train_len, (1, settings.max_digits), gen)
        out = F.cross_entropy(model(ids).reshape(-1, VOCAB), tgt.reshape(-1), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = float(out.detach())
        if step in marks:
            curve.append((step, accuracy(model, settings, 1, settings.curve_rows, seed=7)))
    model.eval()
    return loss, curve


def _stats(values: list[float]) -> dict:
    """Per-seed values and their mean, sample standard deviation (0 for one seed), min and max."""
    return {"per_seed": values, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values)}


def run_scheme(scheme: str, settings: CopySettings, log) -> dict:
    """Train ``settings.seeds`` encoders of ``scheme`` and evaluate each at every factor."""
    runs = []
    for seed in range(settings.seeds):
        model = build_encoder(settings.model_config(), scheme, seed=seed)
        t = time.perf_counter()
        loss, curve = train_encoder(model, settings, seed)
        secs = time.perf_counter() - t
        acc = {}
        for f in settings.factors:
            try:
                acc[f"{f}x"] = accuracy(model, settings, f, settings.eval_rows, seed=100 + f)
            except ValueError as exc:
                acc[f"{f}x"] = {"cannot_run": str(exc)}
        runs.append({"seed": seed, "final_train_loss": loss, "train_seconds": secs, "curve": curve, "accuracy": acc})
        log(f"lab copy: {scheme} seed {seed}: loss {loss:.3f}, accuracy " +
            ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} n/a" for k, v in acc.items()) + f" ({secs:.0f}s)")
    lengths = {}
    for f in settings.factors:
        vals = [r["accuracy"][f"{f}x"] for r in runs]
        if all(isinstance(v, float) for v in vals):
            lengths[f"{f}x"] = {"length": f * settings.train_len, **_stats(vals)}
        else:
            why = next(v["cannot_run"] for v in vals if isinstance(v, dict))
            lengths[f"{f}x"] = {"length": f * settings.train_len, "cannot_run": why}
    curve_mean = [statistics.fmean(r["curve"][i][1] for r in runs) for i in range(len(runs[0]["curve"]))]
    return {"runs": runs, "lengths": lengths, "curve_steps": [s for s, _ in runs[0]["curve"]],
            "curve_mean": curve_mean, "curve_auc": statistics.fmean(curve_mean),
            "parameters": sum(p.numel() for p in model.parameters())}


def verdicts(results: dict) -> list[str]:
    """The write-up's result as separate claims, each computed from ``results`` (scheme -> run_scheme's dict)."""
    out = []
    mean1 = {s: r["lengths"]["1x"]["mean"] for s, r in results.items()}
    learners = [s for s in LEARNERS if s in results]
    if len(learners) == len(LEARNERS):
        ok = all(mean1[s] >= LEARN_MIN for s in learners)
        out.append("sinusoidal, learned and RoPE learn the copy (mean 1x accuracy >= "
                   f"{LEARN_MIN:g}): {'held' if ok else 'NOT held'} (" +
                   ", ".join(f"{s} {mean1[s]:.2f}" for s in learners) + ")")
        low_auc = min(results[s]["curve_auc"] for s in learners)
        low_end = min(mean1[s] for s in learners)
        held = [ok]
        for s in (x for x in LAGGERS if x in results):
            auc, end = results[s]["curve_auc"], mean1[s]
            forms = [f for f, lag in (("slower", auc <= low_auc - LAG_MARGIN), ("lower at the end", end <= low_end
                                                                                 - LAG_MARGIN)) if lag]
            out.append(f"{s} lags behind them (at least {LAG_MARGIN:g} below their lowest: mean accuracy over the "
                       f"learning curve {auc:.2f} vs {low_auc:.2f}, 1x accuracy at the end {end:.2f} vs "
                       f"{low_end:.2f}): " + (f"held, {' and '.join(forms)}" if forms else "NOT held"))
            held.append(bool(forms))
        if len(held) == 1 + len(LAGGERS):
            out.append(f"the write-up's result (the three learn, ALiBi lags even with a causal mask): "
                       f"{'held' if all(held) else 'NOT held'}")
    else:
        out.append("the write-up's comparison needs sinusoidal, learned and rope (not measured)")
    if "nope" in results:
        out.append(f"nope (no claim in the write-up): 1x accuracy {mean1['nope']:.2f}; a bidirectional encoder "
                   "without positions gives every answer position the same output (at best the row's most common digit)")
    for s, r in results.items():
        longer = [(k, v) for k, v in r["lengths"].items() if k != "1x"]
        if longer:
            out.append(f"{s} past the training length: " + ", ".join(
                f"{k} n/a ({'cannot run past its table' if s == 'learned' else 'cannot run'})" if "cannot_run" in v
                else f"{k} {v['mean']:.2f} ± {v['std']:.2f}" for k, v in longer))
    return out


def _cell(v: dict) -> str:
    return "n/a" if "cannot_run" in v else f"{v['mean']:.2f} ± {v['std']:.2f}"


def format_copy(doc: dict, markdown: bool = False) -> str:
    st = doc["settings"]
    factors = st["factors"]
    head = ["scheme"] + [f"{f}x ({f * (2 * st['max_digits'] + 1)})" for f in factors] + ["curve mean", "per seed 1x",
                                                                                          "train s"]
    rows = [[s] + [_cell(r["lengths"][f"{f}x"]) for f in factors] + [f"{r['curve_auc']:.2f}",
            " ".join(f"{a:.2f}" for a in r["lengths"]["1x"]["per_seed"]),
            f"{sum(x['train_seconds'] for x in r['runs']):.0f}"] for s, r in doc["results"].items()]
    title = (f"Encoder copy task: copy accuracy, mean ± std over {st['seeds']} seeds, {st['steps']} steps; training "
             f"rows of 1-{st['max_digits']} digits (length {2 * st['max_digits'] + 1}); at fx every row is longer "
             "than any training row")
    return format_rows(title, head, rows, markdown=markdown)


def run_copy(settings: CopySettings, schemes, out, *, overwrite=False, plot=True, progress=True) -> dict:
    """Train and evaluate every scheme; write copy.json, copy.md (and copy.png) under ``out``; return the results."""
    settings.check()
    schemes = parse_copy_schemes(schemes if schemes is None or isinstance(schemes, str) else ",".join(schemes))
    out = Path(out)
    check_writable_folder(out, "--out")
    check_lab_folder(out)
    check_not_finished(out, "copy.json", overwrite)

    def log(msg):
        if progress:
            print(msg, file=sys.stderr, flush=True)

    log(f"lab copy: {len(schemes)} schemes x {settings.seeds} seeds x {settings.steps} steps "
        f"(training length {settings.train_len})")
    for name in COPY_FILES:  # copy.json first: a run cut short never looks finished
        (out / name).unlink(missing_ok=True)
    t0 = time.perf_counter()
    results = {s: run_scheme(s, settings, log) for s in schemes}
    doc = {"settings": dataclasses.asdict(settings), "schemes": schemes,
           "task": {"vocabulary": "digits 0-9, <copy>, <pad>", "chance_accuracy": 0.1, "train_len": settings.train_len,
                    "digits_per_row": {f"{f}x": list(digit_range(settings.max_digits, f)) for f in settings.factors}},
           "machine": machine_info(), "results": results, "verdicts": verdicts(results),
           "thresholds": {"LEARN_MIN": LEARN_MIN, "LAG_MARGIN": LAG_MARGIN}, "wall_seconds": time.perf_counter() - t0}
    write_atomic(out / "copy.md", format_copy(doc, markdown=True) + "\n\n" + "\n".join(f"- {v}" for v in doc["verdicts"])
                 + "\n")
    if plot:
        from .plot import plot_copy

        plot_copy(doc, out / "copy.png")
    write_json(out / "copy.json", doc)
    return doc
