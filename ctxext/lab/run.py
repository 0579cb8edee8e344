"""Train one tiny decoder per position scheme at one length, evaluate at 1x-8x, write lab.json / lab.md / lab.png."""

from __future__ import annotations

import dataclasses
import datetime
import io
import math
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.outputs import check_writable_folder, write_atomic
from .data import COPY_RANGE, corpus, warmup_spans
from .io import check_lab_folder, check_not_finished, clear_lab_run, format_rows, write_json
from .model import ModelConfig, build_model
from .positions import DEFAULT_SCHEMES, SCHEMES
from .train import copy_accuracy, evaluate, train_model

#: A scheme "degrades" when its last-quarter perplexity at DEGRADE_FACTOR x the training length is at least
#: DEGRADE_RATIO times its value at 1x.
DEGRADE_FACTOR = 4
DEGRADE_RATIO = 2.0
#: A scheme "extrapolates" when its last-quarter perplexity at the longest length is at most EXTRAPOLATE_RATIO
#: times its value at 1x.
EXTRAPOLATE_RATIO = 1.25
#: NoPE "generalises on a task" when, at 2x, its copy accuracy keeps at least NOPE_COPY_KEEP of its 1x accuracy
#: (and that is at least NOPE_COPY_MIN) or its last-quarter perplexity stays within EXTRAPOLATE_RATIO.
NOPE_COPY_KEEP = 0.5
NOPE_COPY_MIN = 0.05
#: ... or when its copy accuracy falls from at least RECALL_HIGH at 1x to at most RECALL_LOW at 2x (the issue's
#: recall form of the same claim: the model read far context at 1x and cannot past it).
RECALL_HIGH = 0.9
RECALL_LOW = 0.2
#: A claim about what happens past the training length is only judged for a scheme that reads far context: one
#: that learned the copy task at 1x (copy accuracy at least CONTEXT_COPY_MIN). A model that does not use context
#: cannot show context extension either way; its verdict says "inconclusive" with the number.
CONTEXT_COPY_MIN = 0.5
#: An inconclusive verdict shows the 1x copy-accuracy curve (``LabSettings.curve_points`` checkpoints): "still
#: rising" when its last point is its highest and at least RISE_MIN above the point two checkpoints earlier (more
#: steps would likely have helped), "flat" otherwise.
RISE_MIN = 0.02


@dataclass(frozen=True)
class LabSettings:
    train_len: int = 128
    d_model: int = 128
    n_layers: int = 3  # NoPE needs a layer to recover positions before a 2-layer induction circuit (issue 50)
    n_heads: int = 4
    d_ff: int = 512
    batch: int = 24
    steps: int = 500
    lr: float = 2e-3
    warmup: int = 30
    copy_fraction: float = 0.5
    copy_warmup: int = 500  # copy-only steps before the mixed ones, spans growing 8, 16, ... (data.copy_warmup_batches)
    curve_points: int = 5  # 1x copy-accuracy checkpoints during training (the learning curve)
    factors: tuple[int, ...] = (1, 2, 4, 8)
    eval_windows: int = 16
    copy_seqs: int = 32
    seed: int = 0

    def model_config(self) -> ModelConfig:
        return ModelConfig(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, d_ff=self.d_ff,
                           train_len=self.train_len)

    def check(self) -> None:
        for name in ("train_len", "d_model", "n_layers", "n_heads", "d_ff", "batch", "steps", "eval_windows",
                     "copy_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.n_heads} heads of even size")
        if self.train_len < 8:
            raise ValueError(f"train_len must be at least 8, got {self.train_len}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not 0 <= self.copy_fraction <= 1:
            raise ValueError(f"copy_fraction must be in [0, 1], got {self.copy_fraction!r}")
        if not isinstance(self.copy_warmup, int) or isinstance(self.copy_warmup, bool) or self.copy_warmup < 0:
            raise ValueError(f"copy_warmup must be an integer >= 0, got {self.copy_warmup!r}")
        if not isinstance(self.curve_points, int) or isinstance(self.curve_points, bool) or self.curve_points < 0:
            raise ValueError(f"curve_points must be an integer >= 0, got {self.curve_points!r}")
        if not self.factors or any(not isinstance(f, int) or f < 1 for f in self.factors):
            raise ValueError(f"factors must be positive integers, got {self.factors!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup!r}")

    @staticmethod
    def from_dict(d: dict) -> "LabSettings":
        d = dict(d)
        d["factors"] = tuple(d.get("factors", (1, 2, 4, 8)))
        return LabSettings(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(LabSettings)}})


#: ``ctxext lab --quick``: <= 5 minutes on 2 CPU cores.
QUICK = LabSettings(train_len=64, batch=24, steps=200, warmup=20, eval_windows=16, copy_seqs=32, copy_warmup=150)
#: ``ctxext lab``: <= 30 minutes on 2 CPU cores.
FULL = LabSettings()

#: Seconds one training step at the FULL settings takes on 2 idle CPU cores, one torch thread per process, two
#: processes at once (``--jobs 2``), measured: the six schemes' mean train_seconds (370 s) over training_flops(FULL)
#: in full steps (735: 500 mixed steps and the warm-up's shorter rows) in benchmarks/results/lab/lab.json
#: (2026-11-28; an earlier run of the same settings that day took 325 s). Other settings are scaled by their
#: multiply-adds (:func:`training_flops`). An estimate, not a promise: busy cores are slower (about 1.8x in an
#: earlier measurement).
FULL_STEP_SECONDS = 0.503


def step_flops(settings: LabSettings, length: int | None = None) -> float:
    """Multiply-adds of one training step on rows of ``length`` (default the training length; forward and
    backward, about 3x the forward): per token, each layer's projections, MLP and attention over the window, and
    the tied output head."""
    cfg = settings.model_config()
    d, t = settings.d_model, settings.train_len if length is None else length
    per_token = settings.n_layers * (4 * d * d + 2 * d * settings.d_ff + 2 * t * d) + d * cfg.vocab_size
    return 3.0 * per_token * t * settings.batch


def training_flops(settings: LabSettings) -> float:
    """Multiply-adds of one model's training: the copy warm-up's short rows, then the mixed steps."""
    spans = warmup_spans(settings.train_len)
    warm = sum(step_flops(settings, 2 * spans[min(len(spans) - 1, i * len(spans) // settings.copy_warmup)] + 2)
               for i in range(settings.copy_warmup))
    return warm + settings.steps * step_flops(settings)


def estimated_train_seconds(settings: LabSettings, models: int = 1, jobs: int = 1) -> float:
    """Rough training time of ``models`` models at ``settings`` on 2 CPU cores, ``jobs`` at a time (see
    FULL_STEP_SECONDS)."""
    rounds = math.ceil(models / max(1, jobs))
    return rounds * FULL_STEP_SECONDS * training_flops(settings) / step_flops(FULL)


def about(seconds: float) -> str:
    """'about 40 s' / 'about 3 min' / 'about 2.5 h'."""
    if seconds < 90:
        return f"about {max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"about {round(seconds / 60)} min"
    return f"about {seconds / 3600:.1f} h"


def parse_schemes(text: str | None) -> list[str]:
    if text is None:
        return list(DEFAULT_SCHEMES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--schemes is empty")
    bad = [s for s in names if s not in SCHEMES]
    if bad:
        raise ValueError(f"unknown scheme(s) {', '.join(bad)}; choose from {', '.join(SCHEMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--schemes names a scheme twice: {text}")
    return names


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def model_path(out: Path, scheme: str) -> Path:
    return Path(out) / "models" / f"{scheme}.pt"


def save_model(model, path: Path) -> None:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    write_atomic(path, buf.getvalue())


def train_scheme(scheme, settings: LabSettings, stream):
    """(model, last loss, seconds, curve): the curve is [{"step", "copy_accuracy"}] at 1x, on the same sequences
    as the 1x evaluation (so its last point is the 1x copy accuracy)."""
    model = build_model(settings.model_config(), scheme, seed=settings.seed)
    curve, steps = [], settings.steps
    points = min(settings.curve_points, steps)

    def checkpoint(m, step):
        curve.append({"step": step, "copy_accuracy": copy_accuracy(m, settings.train_len, settings.copy_seqs,
                                                                   settings.seed + 100 + 1)})

    t = time.perf_counter()
    loss = train_model(model, stream, steps=steps, batch=settings.batch, length=settings.train_len,
                       lr=settings.lr, warmup=min(settings.warmup, steps), seed=settings.seed + 1,
                       copy_fraction=settings.copy_fraction, copy_warmup=settings.copy_warmup,
                       checkpoint=checkpoint, checkpoints=points)
    return model, loss, time.perf_counter() - t, curve


def _log(msg, progress):
    if progress:
        print(msg, file=sys.stderr, flush=True)


def train_and_evaluate(scheme: str, settings: LabSettings, out: Path, threads: int | None = None,
                       progress: bool = True) -> dict:
    """Train one scheme, save its model under ``out``, evaluate it: its entry of lab.json's "results". A
    function of its arguments alone (each scheme's batches come from the settings' seed), so that ``run_lab`` may
    run several in worker processes and get the numbers a serial run gets."""
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    train, held = corpus()
    model, loss, secs, curve = train_scheme(scheme, settings, train)
    _log(f"lab: {scheme}: trained {settings.copy_warmup} copy warm-up + {settings.steps} steps, loss {loss:.3f} "
         f"({secs:.0f}s)", progress)
    save_model(model, model_path(out, scheme))
    t = time.perf_counter()
    ev = evaluate(model, held, train_len=settings.train_len, factors=settings.factors,
                  windows=settings.eval_windows, copy_seqs=settings.copy_seqs, seed=settings.seed + 100)
    _log(f"lab: {scheme}: evaluated ({time.perf_counter() - t:.0f}s; {time.perf_counter() - t0:.0f}s for this "
         f"scheme)", progress)
    return {"final_train_loss": loss, "train_seconds": secs, "eval_seconds": time.perf_counter() - t,
            "parameters": sum(p.numel() for p in model.parameters()), "copy_curve": curve, "lengths": ev}


class _WorkerStopped(SystemExit):
    """SIGTERM or SIGINT in a lab worker: unwinds it (a half-written model file is removed), then ends the process.
    A SystemExit, so that a worker waiting for work ends quietly too."""


def _stop_on_signal(signum, frame):
    raise _WorkerStopped(128 + signum)


def _worker_signals() -> None:
    """A worker's SIGTERM and SIGINT end it cleanly (Python's default SIGTERM would leave a temporary file)."""
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, _stop_on_signal)


def _train_in_worker(*args) -> dict:
    try:
        return train_and_evaluate(*args)
    except _WorkerStopped as stop:
        os._exit(stop.code)  # the pool's loop would catch it, report it and take the next scheme


def _stop_workers(pool, grace: float = 5.0) -> None:
    """Cancel the schemes not started and end the workers: SIGTERM (each unwinds), SIGKILL after ``grace`` s."""
    workers = list((pool._processes or {}).values())  # private, but in every supported Python; gone after shutdown
    pool.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        w.terminate()
    deadline = time.monotonic() + grace
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
        if w.is_alive():
            w.kill()
            w.join(1.0)


def _train_all(schemes, settings: LabSettings, out: Path, jobs: int, progress: bool) -> dict:
    """{scheme: results}, in ``schemes`` order; ``jobs`` > 1 trains that many schemes at once in spawned worker
    processes (one torch thread each, as many threads as this process has otherwise). Ctrl-C, SIGTERM (handled as
    Ctrl-C by the CLI) or a failed scheme ends the workers at once: nothing more is trained."""
    if jobs <= 1 or len(schemes) <= 1:
        return {s: train_and_evaluate(s, settings, out, progress=progress) for s in schemes}
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a forked torch may hang in its thread pools
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(schemes)), mp_context=ctx,
                                                  initializer=_worker_signals)
    try:
        futures = {s: pool.submit(_train_in_worker, s, settings, out, torch.get_num_threads(), progress)
                   for s in schemes}
        results = {s: futures[s].result() for s in schemes}
    except BaseException:
        _stop_workers(pool)  # leaving the pool's own shutdown would wait for the running schemes to finish
        raise
    pool.shutdown()
    return results


def run_lab(settings: LabSettings, schemes, out, *, overwrite=False, plot=True, progress=True, jobs: int = 1) -> dict:
    """Train and evaluate every scheme; write lab.json, lab.md (and lab.png) under ``out``; return the results.
    ``jobs``: schemes trained at once, each in its own process (the numbers do not depend on it)."""
    settings.check()
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    schemes = parse_schemes(schemes if isinstance(schemes, str) else ",".join(schemes))
    out = Path(out)
    check_writable_folder(out, "--out")  # before training: the models and results must have somewhere to go
    check_lab_folder(out)
    check_not_finished(out, "lab.json", overwrite)
    t0 = time.perf_counter()
    train, _ = corpus()
    _log(f"lab: corpus {len(train)} training tokens ({time.perf_counter() - t0:.0f}s); {len(schemes)} schemes, "
         f"{min(jobs, len(schemes))} at a time, {about(estimated_train_seconds(settings, len(schemes), jobs))} of "
         f"training on 2 idle CPU cores", progress)
    # the earlier run goes before the first new model lands: `lab shift` must never pair its settings with new
    # models, nor reuse a model of a scheme this run does not train; settings.json then marks the folder a lab run
    clear_lab_run(out, SCHEMES)
    write_json(out / "models" / "settings.json", {"settings": dataclasses.asdict(settings), "schemes": schemes})
    results = _train_all(schemes, settings, out, jobs, progress)
    doc = {
        "settings": dataclasses.asdict(settings),
        "schemes": schemes,
        "copy_task": {"alphabet": list(COPY_RANGE), "chance_accuracy": 1 / (COPY_RANGE[1] - COPY_RANGE[0])},
        "machine": machine_info(),
        "results": results,
        "verdicts": verdicts(results, settings.train_len),
        "thresholds": {"DEGRADE_FACTOR": DEGRADE_FACTOR, "DEGRADE_RATIO": DEGRADE_RATIO,
                       "EXTRAPOLATE_RATIO": EXTRAPOLATE_RATIO, "NOPE_COPY_KEEP": NOPE_COPY_KEEP,
                       "CONTEXT_COPY_MIN": CONTEXT_COPY_MIN, "RECALL_HIGH": RECALL_HIGH, "RECALL_LOW": RECALL_LOW,
                       "NOPE_COPY_MIN": NOPE_COPY_MIN, "RISE_MIN": RISE_MIN},
        "wall_seconds": time.perf_counter() - t0,
    }
    write_atomic(out / "lab.md", format_table(doc, markdown=True) + "\n\n" + "\n".join(f"- {v}" for v in doc["verdicts"])
                 + "\n" + format_curves(results))
    if plot:
        from .plot import plot_lab

        plot_lab(doc, out / "lab.png")
    write_json(out / "lab.json", doc)  # last: its presence marks a finished run
    return doc


# ----------------------------------------------------------------------------------------------- table, verdicts

def _cell(r: dict, key: str, fmt: str) -> str:
    return "cannot run" if "cannot_run" in r else format(r[key], fmt)


def format_table(doc: dict, markdown: bool = False) -> str:
    factors = doc["settings"]["factors"]
    T = doc["settings"]["train_len"]
    head = ["scheme"] + [f"ppl {f}x" for f in factors] + [f"last-q ppl {f}x" for f in factors] + \
        [f"copy {f}x" for f in factors] + ["train s"]
    rows = []
    for s, res in doc["results"].items():
        L = res["lengths"]
        rows.append([s] + [_cell(L[f"{f}x"], "ppl", ".1f") for f in factors]
                    + [_cell(L[f"{f}x"], "ppl_last_quarter", ".1f") for f in factors]
                    + [_cell(L[f"{f}x"], "copy_accuracy", ".2f") for f in factors] + [f"{res['train_seconds']:.0f}"])
    title = f"Training length {T} tokens; evaluated at {', '.join(f'{f}x' for f in factors)} (ppl on held-out Emma)"
    return format_rows(title, head, rows, markdown=markdown)


def format_curves(results: dict) -> str:
    """lab.md's learning-curve section: each scheme's 1x copy accuracy at its checkpoints ('' without curves)."""
    lines = [f"- {s}: {' -> '.join(format(p['copy_accuracy'], '.2f') for p in r['copy_curve'])} (steps "
             f"{', '.join(str(p['step']) for p in r['copy_curve'])})" for s, r in results.items() if r.get("copy_curve")]
    return "\n1x copy accuracy during training:\n\n" + "\n".join(lines) + "\n" if lines else ""


def _lq(res, f):
    r = res["lengths"].get(f"{f}x")
    return None if r is None or "cannot_run" in r else r["ppl_last_quarter"]


def _judged(held: bool, res: dict) -> str:
    """'held' / 'NOT held', or 'inconclusive' where the scheme did not learn to read far context."""
    copy = res["lengths"].get("1x", {}).get("copy_accuracy")
    if copy is None or copy < CONTEXT_COPY_MIN:
        shown = "n/a" if copy is None else f"{copy:.2f}"
        return (f"inconclusive: copy accuracy {shown} at 1x < {CONTEXT_COPY_MIN:g}, the model does not read far "
                f"context (would read {'held' if held else 'NOT held'}){curve_note(res.get('copy_curve'))}")
    return "held" if held else "NOT held"


def curve_note(curve) -> str:
    """'; 1x copy curve still rising: a -> b -> c (steps ...)' or '...flat...'; '' without a curve."""
    if not curve:
        return ""
    acc = [p["copy_accuracy"] for p in curve]
    before = acc[-3] if len(acc) >= 3 else acc[0]
    rising = len(acc) >= 2 and acc[-1] >= max(acc[:-1]) and acc[-1] - before >= RISE_MIN
    shape = "still rising, the step budget was the limit" if rising else "flat"
    steps = ", ".join(str(p["step"]) for p in curve)
    return f"; 1x copy curve {shape}: {' -> '.join(f'{a:.2f}' for a in acc)} (steps {steps})"


def verdicts(results: dict, train_len: int) -> list[str]:
    """One plain sentence per textbook claim, computed from ``results`` (``run_lab``'s per-scheme dict)."""
    out = []
    for s, res in results.items():
        L = res["lengths"]
        factors = sorted(int(k[:-1]) for k in L)
        if s == "learned":
            runs1 = "cannot_run" not in L.get("1x", {"cannot_run": ""})
            longer = [f for f in factors if f > 1]
            blocked = [f for f in longer if "cannot_run" in L[f"{f}x"]]
            held = runs1 and longer and len(blocked) == len(longer)
            out.append(f"learned: cannot run past {train_len} positions ({'held' if held else 'NOT held'}: "
                       f"runs at 1x: {runs1}, refused at {', '.join(f'{f}x' for f in blocked) or 'none'})")
        elif s in ("rope", "sinusoidal"):
            base, f = _lq(res, 1), max((x for x in factors if x <= DEGRADE_FACTOR), default=None)
            if base is None or f is None or f == 1 or _lq(res, f) is None:
                out.append(f"{s}: degrades past the training length (not measured)")
                continue
            ratio = _lq(res, f) / base
            c1, c2 = L["1x"].get("copy_accuracy"), L.get("2x", {}).get("copy_accuracy")
            recall_lost = c1 is not None and c2 is not None and c1 >= RECALL_HIGH and c2 <= RECALL_LOW
            held = ratio >= DEGRADE_RATIO or recall_lost
            copy = "" if c2 is None or c1 is None else f"; copy accuracy {c1:.2f} at 1x -> {c2:.2f} at 2x"
            how = "held, on copy" if recall_lost and ratio < DEGRADE_RATIO else _judged(held, res)
            out.append(f"{s}: last-quarter ppl x{ratio:.2f} at {f}x{copy} (degrades, ppl >= x{DEGRADE_RATIO:g} or "
                       f"copy >= {RECALL_HIGH:g} -> <= {RECALL_LOW:g}: {how})")
        elif s == "alibi":
            f = max(factors)
            if _lq(res, 1) is None or f == 1 or _lq(res, f) is None:
                out.append("alibi: extrapolates (not measured)")
                continue
            ratio = _lq(res, f) / _lq(res, 1)
            held = ratio <= EXTRAPOLATE_RATIO
            out.append(f"alibi: last-quarter ppl x{ratio:.2f} at {f}x (extrapolates, <= x{EXTRAPOLATE_RATIO:g}: "
                       f"{_judged(held, res)})")
        elif s == "nope":
            if 2 not in factors or "cannot_run" in L["1x"] or "cannot_run" in L["2x"]:
                out.append("nope: generalises on some tasks (not measured)")
                continue
            a1, a2 = L["1x"]["copy_accuracy"], L["2x"]["copy_accuracy"]
            ratio = L["2x"]["ppl_last_quarter"] / L["1x"]["ppl_last_quarter"]
            copy_ok = a1 >= NOPE_COPY_MIN and a2 >= NOPE_COPY_KEEP * a1
            text_ok = ratio <= EXTRAPOLATE_RATIO
            tasks = [t for t, ok in (("copy", copy_ok), ("text", text_ok)) if ok]
            verdict = ("held, on " + " and ".join(tasks)) if copy_ok else _judged(bool(tasks), res)
            if not copy_ok and tasks and verdict == "held":
                verdict = "held, on text"
            out.append(f"nope: copy accuracy {a1:.2f} at 1x -> {a2:.2f} at 2x, last-quarter ppl x{ratio:.2f} at 2x "
                       f"(generalises on some task: {verdict})")
        else:
            f = max(factors)
            if _lq(res, 1) is not None and f > 1 and _lq(res, f) is not None:
                out.append(f"{s}: last-quarter ppl x{_lq(res, f) / _lq(res, 1):.2f} at {f}x (no textbook claim checked)")
    return out
