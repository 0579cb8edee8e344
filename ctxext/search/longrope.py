"""``ctxext search longrope``: LongRoPE's factor search on a Hugging Face model, written as a native ``longrope``
checkpoint.

    from ctxext.search import longrope_search, SearchSettings
    result = longrope_search(model, tokens, SearchSettings(factor=4, budget=48), "out/smollm2-longrope-4x")

The model is scored with each candidate in place (``longrope_factors.rescaled``: exactly the frequencies and attention
factor transformers' ``longrope`` uses past the trained length), by perplexity over ``max_windows`` windows of the
calibration tokens at the stage's length. The folder gets the log (``search.jsonl``, which ``resume`` continues), the
result (``search.json``: the best factors, every starting candidate's perplexity, the settings) and, once the search
ends, the checkpoint: the unchanged weights with a ``config.json`` holding the native ``longrope`` config (verified
against transformers' own rotary class before it is written), so plain ``AutoModelForCausalLM.from_pretrained(out)``
runs the found factors.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.active import ACTIVE
from ..core.outputs import first_record, staging_folder, write_atomic
from ..core.errors import PatchError
from .evolution import ScoreLog, SearchSettings, search
from .longrope_factors import native_changes, plain_rope_inputs, rescaled, start_points, verify_native

LOG = "search.jsonl"
RESULT = "search.json"
#: Written into the folder: the files the search wrote there, so ``overwrite`` replaces nothing else.
MARKER = ".ctxext-search.json"
#: Rows of a resumed log that are left out, named one per line (the rest counted).
SHOWN = 5


class SearchIncomplete(ValueError):
    """The search ended before it produced a result for the final factor (the budget or the clock ran out): no
    checkpoint is written; the log is kept for ``resume``. ``reason``: the message without the note on the log."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def is_search_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a ctxext search and nothing but the files its marker lists (or only its log)."""
    folder = Path(folder)
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()} - {MARKER}
    try:
        listed = set(json.loads((folder / MARKER).read_text(encoding="utf-8"))["files"])
    except (OSError, ValueError, KeyError, TypeError):
        listed = {LOG} if is_search_log(folder / LOG) else set()  # a search cut short: its log alone
    return present <= listed


def is_search_log(path: Path) -> bool:
    """Whether ``path`` starts with the header a search writes first (a user's ``search.jsonl`` does not)."""
    settings = (first_record(path) or {}).get("settings")
    return isinstance(settings, dict) and isinstance(settings.get("search"), dict)


def trained_length(model: nn.Module) -> int:
    from ..adapters import adapter_for

    if getattr(model, ACTIVE, None) is not None:
        raise PatchError("the model is patched by ctxext; the LongRoPE search starts from the unpatched model "
                         "(ctxext.unpatch(model) first)")
    length = adapter_for(model).original_length(model)
    if not isinstance(length, int) or length < 2:
        raise PatchError(f"{type(model).__name__} advertises no trained length (max_position_embeddings)")
    return length


def check_search(model: nn.Module, tokens: torch.Tensor, settings: SearchSettings, max_windows: int) -> int:
    """Every check that needs no scoring; returns the trained length. ``PatchError`` / ``ValueError`` with the reason."""
    length = trained_length(model)
    plain_rope_inputs(model, length)
    stages = settings.stages()
    for stage in stages:  # transformers' longrope uses short_factor up to the trained length, long_factor past it
        if int(round(stage * length)) <= length:
            raise ValueError(f"factor {stage:g} x the trained length {length} is {int(round(stage * length))} "
                             "tokens, not past it: the long factors searched would never be used; give a larger "
                             "--factor")
    target = max(int(round(stage * length)) for stage in stages)
    if max_windows < 1:
        raise ValueError(f"--max-windows must be at least 1, got {max_windows}")
    if len(stages) > 1:  # each earlier stage takes at least its starting points and one more (evolution.search)
        inputs = plain_rope_inputs(model, length)
        needed = sum(len(start_points(inputs, stage)) + 1 for stage in stages[:-1]) + 1
        if settings.budget < needed:
            raise ValueError(f"--progressive: --budget {settings.budget} cannot reach the last stage "
                             f"(x{stages[-1]:g}) through stages {', '.join(f'x{s:g}' for s in stages[:-1])}: it "
                             f"needs at least {needed} candidates; raise --budget or drop --progressive")
    if tokens.numel() < target:
        raise ValueError(f"the calibration text has {tokens.numel()} tokens, fewer than one window at the target "
                         f"length {target} (factor {settings.factor:g} x {length}); give more --data")
    return length


def longrope_search(model: nn.Module, tokens: torch.Tensor, settings: SearchSettings, out: str | Path, *,
                    tokenizer: Any = None, max_windows: int = 2, resume: bool = False, progress: bool = True,
                    describe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Search LongRoPE factors for ``model`` (plain RoPE, unpatched) at ``settings.factor`` x its trained length on
    ``tokens`` (1-D ids), and write the log, the result and the native checkpoint into ``out``. Returns the result.
    ``describe``: what produced the model and data (recorded, and compared on ``resume``)."""
    from tqdm.auto import tqdm

    from ..evaluation.perplexity import perplexity

    out = Path(out)
    length = check_search(model, tokens, settings, max_windows)
    inputs = plain_rope_inputs(model, length)
    header = {"settings": {"search": asdict(settings), "max_windows": max_windows, "trained_length": length,
                           "rope_theta": inputs.base, "rotary_dim": inputs.dim, "tokens": int(tokens.numel()),
                           **(describe or {})}}
    log = ScoreLog(out / LOG, header, resume)
    for problem in log.rejected[:SHOWN]:  # a damaged or hand-edited row: never a score, its candidate scored again
        print(f"search --resume: {problem}; left out of the log, its candidate is scored again if the search reaches "
              "it", file=sys.stderr, flush=True)
    if len(log.rejected) > SHOWN:
        print(f"search --resume: {len(log.rejected) - SHOWN} more rows of {out / LOG} left out likewise",
              file=sys.stderr, flush=True)
    model.eval()

    def score(stage: float, factors: list[float]) -> float:
        with torch.no_grad(), rescaled(model, inputs, factors, stage):
            result = perplexity(model, tokens, int(round(stage * length)), max_windows=max_windows, progress=False)
        return float(result["ppl"]) if result["ppl"] is not None else float("inf")

    bar = tqdm(total=settings.budget, desc="longrope search", unit="cand", disable=not progress, dynamic_ncols=True)
    best = [float("inf")]

    def step(scored: int, value: float) -> None:
        best[0] = min(best[0], value)
        bar.n = scored
        bar.set_postfix(best_ppl=f"{best[0]:.3f}")
        bar.refresh()

    try:
        result = search(score, lambda stage: start_points(inputs, stage), settings, log, step)
    finally:
        bar.close()
    final = settings.stages()[-1]
    if "best" not in result:
        raise SearchIncomplete("the search scored no candidate: "
                               + ("--minutes ran out before the first score" if result.get("out_of_time")
                                  else "the budget allowed none") + "; no checkpoint written")
    if result["stage"] != final:
        why = "--minutes" if result.get("out_of_time") else "--budget"
        reason = (f"--progressive: the search ran out of {why} at stage x{result['stage']:g} and never reached the "
                  f"final factor x{final:g}; no checkpoint written (its factors would not be the x{final:g} ones)")
        raise SearchIncomplete(f"{reason}. The log in {out} is kept: continue with --resume and a larger {why}",
                               reason)
    if not math.isfinite(result["best_score"]):  # every candidate failed to score: no factors were found
        raise SearchIncomplete(f"every candidate scored perplexity {result['best_score']} (the model's outputs are "
                               f"not finite at x{final:g}); no checkpoint written. The log in {out} is kept",
                               "every candidate scored a non-finite perplexity")
    changes = native_changes(model.config, inputs, result["best"], settings.factor)
    verify_native(model, inputs, result["best"], settings.factor, changes)
    result.update(trained_length=length, target_length=int(round(settings.factor * length)),
                  native_config=changes, **(describe or {}))
    _write_checkpoint(model, changes, out, tokenizer, result)
    return result


def _write_checkpoint(model: nn.Module, changes: dict[str, Any], out: Path, tokenizer, result: dict[str, Any]) -> None:
    """The weights as they are, the config with ``changes``, the tokenizer, the result and the marker; written in a
    staging folder beside ``out`` and moved in once all are written (the log stays where it is; a failure while
    writing leaves ``out`` as it was)."""
    from ..loading import make_saveable

    make_saveable(model)
    config = model.config
    missing = object()
    before = {key: getattr(config, key, missing) for key in changes}
    with staging_folder(out) as tmp:
        for key, value in changes.items():
            setattr(config, key, value)
        try:
            model.save_pretrained(tmp)
        finally:
            for key, value in before.items():
                if value is missing:
                    delattr(config, key)
                else:
                    setattr(config, key, value)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / RESULT).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
        written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        for name in written:
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(tmp / name), str(target))
        marker = {"written_by": "ctxext search longrope", "files": sorted([LOG, *written])}
        write_atomic(out / MARKER, json.dumps(marker, indent=1) + "\n")


__all__ = ["LOG", "MARKER", "RESULT", "SearchIncomplete", "check_search", "is_search_folder", "is_search_log", "longrope_search", "trained_length"]
