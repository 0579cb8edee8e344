"""`ctxext lab shift`: the start-offset probe. The same held-out windows of W tokens are read at positions
k..k+W-1 for several k. A learned absolute table sees rows it never saw at a window start, so perplexity
rises with k; ALiBi's bias depends only on distances (exactly flat), RoPE's scores only on m - n (flat up to
rounding)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from ..core.outputs import check_writable_folder, write_atomic
from ..core.torch_files import UNREADABLE, unreadable_reason
from .data import corpus, eval_windows
from .io import check_lab_folder, check_not_finished, format_rows, write_json
from .model import build_model
from .run import (
    FULL,
    QUICK,
    LabSettings,
    about,
    estimated_train_seconds,
    machine_info,
    model_path,
    parse_schemes,
    save_model,
    train_scheme,
)
from .train import perplexity

DEFAULT_SHIFT_SCHEMES = ("learned", "sinusoidal", "rope", "alibi")
#: A scheme is "flat" when its perplexity at every offset is within FLAT_TOLERANCE (relative) of offset 0,
#: and "rises" when the perplexity at the largest offset is at least RISE_RATIO times the one at offset 0.
FLAT_TOLERANCE = 1e-3
RISE_RATIO = 1.1


def default_window(settings: LabSettings) -> int:
    return max(8, settings.train_len // 8)


def default_offsets(settings: LabSettings, window: int) -> list[int]:
    top = max(0, settings.train_len - window)  # a window past the training length: no negative offset
    return sorted({0, *[k for k in (16, 32, 64) if k < top], top})


def parse_offsets(text: str | None):
    if text is None:
        return None
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--offsets must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise ValueError(f"--offsets must be non-negative integers, got {text!r}")
    return sorted(set(vals))


def check_offsets(settings: LabSettings, schemes, window: int, offsets) -> None:
    if window < 2:
        raise ValueError(f"--window must be at least 2, got {window}")
    if "learned" in schemes and max(offsets) + window > settings.train_len:
        raise ValueError(f"offset {max(offsets)} + window {window} exceeds the learned table's {settings.train_len} "
                         f"rows; use offsets <= {settings.train_len - window}")


def check_window_fits(window: int, held: torch.Tensor) -> None:
    """Refuse a window the held-out text cannot fill once (each window reads ``window`` + 1 tokens), before training."""
    if window + 1 > len(held):
        raise ValueError(f"--window {window} is longer than the held-out text ({len(held)} tokens); the longest "
                         f"window that fits is {len(held) - 1}")


def shift_perplexities(model, windows: torch.Tensor, offsets) -> list[dict]:
    out = []
    for k in offsets:
        ppl, lq = perplexity(model, windows, offset=k)
        out.append({"offset": k, "ppl": ppl, "ppl_last_quarter": lq})
    return out


def lab_schemes(out: Path) -> list[str]:
    """The schemes whose models the lab run in ``out`` saved: those its settings.json lists and whose file is there
    (a models/*.pt it does not list is another run's)."""
    meta = json.loads((Path(out) / "models" / "settings.json").read_text())
    return [s for s in meta.get("schemes", []) if model_path(out, s).exists()]


def _load_model(settings: LabSettings, out: Path, scheme: str):
    path, meta = model_path(out, scheme), Path(out) / "models" / "settings.json"
    model = build_model(settings.model_config(), scheme, seed=settings.seed)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        why = str(exc)
    except UNREADABLE as exc:
        why = unreadable_reason(path, exc)
    else:
        try:
            model.load_state_dict(state)
            why = None
        except RuntimeError as exc:
            lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
            why = lines[1] if len(lines) > 1 else (lines[0] if lines else type(exc).__name__)  # the first mismatch
    if why is not None:
        raise ValueError(f"{path} does not match the settings in {meta} ({why}); rerun `ctxext lab --overwrite "
                         f"--out {out}`, or pass --steps N to train new models") from None
    return model.eval()


def load_lab_models(out: Path, schemes):
    """The lab's saved models under ``out/models`` (and their settings), or None when any is missing."""
    meta = Path(out) / "models" / "settings.json"
    if not meta.exists() or not set(schemes) <= set(lab_schemes(out)):
        return None
    settings = LabSettings.from_dict(json.loads(meta.read_text())["settings"])
    return settings, {s: _load_model(settings, out, s) for s in schemes}


def shift_verdicts(results: dict) -> list[str]:
    out = []
    for s, rows in results.items():
        base = rows[0]["ppl"]
        dev = max(abs(r["ppl"] / base - 1) for r in rows)
        last = rows[-1]
        ratio = last["ppl"] / base
        if s == "learned":
            out.append(f"learned: ppl x{ratio:.2f} at k={last['offset']} vs k=0 "
                       f"(rises, >= x{RISE_RATIO:g}: {'held' if ratio >= RISE_RATIO else 'NOT held'})")
        elif s in ("alibi", "rope", "nope", "t5"):
            out.append(f"{s}: largest relative change {dev:.1e} over offsets "
                       f"(flat, <= {FLAT_TOLERANCE:g}: {'held' if dev <= FLAT_TOLERANCE else 'NOT held'})")
        else:
            out.append(f"{s}: ppl x{ratio:.2f} at k={last['offset']} vs k=0")
    return out


def format_shift(doc: dict, markdown: bool = False) -> str:
    offsets = [r["offset"] for r in next(iter(doc["results"].values()))]
    head = ["scheme"] + [f"k={k}" for k in offsets]
    rows = [[s] + [f"{r['ppl']:.2f}" for r in rows] for s, rows in doc["results"].items()]
    title = (f"Perplexity of {doc['n_windows']} held-out windows of {doc['window']} tokens read at positions k..k+"
             f"{doc['window'] - 1} (trained at {doc['settings']['train_len']})")
    return format_rows(title, head, rows, markdown=markdown)


def run_shift(out, *, quick=False, schemes=None, offsets=None, window=None, n_windows=32, steps=None,
              overwrite=False, plot=True, progress=True, settings: LabSettings | None = None) -> dict:
    """Reuse the lab models in ``out/models`` when present (else train them with the quick or full settings),
    and measure perplexity at each start offset."""
    if schemes is None:
        schemes = list(DEFAULT_SHIFT_SCHEMES)
    schemes = parse_schemes(schemes if isinstance(schemes, str) else ",".join(schemes))
    if n_windows < 1:
        raise ValueError(f"--windows must be positive, got {n_windows}")
    out = Path(out)
    check_writable_folder(out, "--out")  # before training: the models and results must have somewhere to go
    check_lab_folder(out)
    check_not_finished(out, "shift.json", overwrite)
    asked = settings is not None or steps is not None  # new models asked for, rather than the lab's reused
    loaded = load_lab_models(out, schemes) if not asked else None
    if loaded is None and settings is None and steps is None and (out / "models" / "settings.json").exists():
        have = sorted(lab_schemes(out))
        raise ValueError(f"the lab models in {out / 'models'} are {', '.join(have) or 'none'}; they lack "
                         f"{', '.join(s for s in schemes if s not in have)}: pass --schemes from those, or "
                         f"--steps N to train new models")
    if loaded is not None:
        settings, models = loaded
    else:
        settings = settings or (QUICK if quick else FULL)
        if steps is not None:
            settings = dataclasses.replace(settings, steps=steps)
        settings.check()
        models = None
    window = default_window(settings) if window is None else window  # 0 is refused below, not the default
    offsets = offsets or default_offsets(settings, window)
    check_offsets(settings, schemes, window, offsets)
    t0 = time.perf_counter()
    train, held = corpus()
    check_window_fits(window, held)
    if models is None and progress:  # say so before minutes of training, not after
        if steps is not None:
            why = "--steps was given, so it trains new models"
        elif asked:
            why = "training new models"
        else:
            why = f"no trained lab models in {out / 'models'}, so it must train its own"
        reuse = "" if asked else (f"; to reuse a lab's models instead, run `ctxext lab{' --quick' if quick else ''} "
                                  f"--out {out}` first")
        print(f"lab shift: {why}: {len(schemes)} models ({', '.join(schemes)}) x {settings.steps} steps at "
              f"training length {settings.train_len}, {about(estimated_train_seconds(settings, len(schemes)))} on 2 "
              f"idle CPU cores, saved in {out / 'shift-models'}{reuse}", file=sys.stderr, flush=True)
    if models is None:
        # marks the folder a lab run before the first model lands (an interrupted run may be rerun there)
        write_json(out / "shift-models" / "settings.json", {"settings": dataclasses.asdict(settings),
                                                             "schemes": schemes})
        models = {}
        for s in schemes:
            models[s], loss, secs, _ = train_scheme(s, settings, train)
            if progress:
                print(f"lab shift: {s}: trained {settings.steps} steps, loss {loss:.3f} ({secs:.0f}s)", file=sys.stderr,
                      flush=True)
            save_model(models[s], out / "shift-models" / f"{s}.pt")
    elif progress:
        print(f"lab shift: reusing the lab models in {out / 'models'}", file=sys.stderr, flush=True)
    windows = eval_windows(held, window, n_windows)
    results = {s: shift_perplexities(models[s], windows, offsets) for s in schemes}
    doc = {"settings": dataclasses.asdict(settings), "reused_lab_models": loaded is not None, "window": window,
           "n_windows": len(windows), "offsets": offsets, "machine": machine_info(), "results": results,
           "verdicts": shift_verdicts(results),
           "thresholds": {"FLAT_TOLERANCE": FLAT_TOLERANCE, "RISE_RATIO": RISE_RATIO},
           "wall_seconds": time.perf_counter() - t0}
    write_atomic(out / "shift.md", format_shift(doc, markdown=True) + "\n\n" + "\n".join(f"- {v}" for v in doc["verdicts"]) + "\n")
    if plot:
        from .plot import plot_shift

        plot_shift(doc, out / "shift.png")
    write_json(out / "shift.json", doc)
    return doc
