"""Run a RULER-style task on a model: generate each sample, decode greedily, score as RULER does."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..device import map_over_processes
from ..perplexity import _input_device
from .ruler import TASKS, Sources, TooShort, generate
from .scoring import METRICS

#: Characters of each answer kept in the result row.
PREDICTION_CHARS = 300


def plan_samples(samples: int, depths: Sequence[float]) -> list[float]:
    """Sample i's needle depth: the depths in turn."""
    return [depths[i % len(depths)] for i in range(samples)]


#: Tokens a length must hold beyond what sample 0 needs (at least; an eighth of the length for long ones): samples
#: differ by their keys, values and words, and a length where one barely fits leaves no haystack to search anyway.
MARGIN = 128


def _margin(length: int) -> int:
    return max(MARGIN, length // 8)


def check_length(task: str, src: Sources, length: int, *, seed: int = 0) -> None:
    """Raise ValueError if ``task`` cannot fit ``length`` tokens with this tokenizer, with room for every sample."""
    margin = _margin(length)
    try:
        generate(TASKS[task], src, length - margin, seed=seed, index=0, depth=0.5)
    except TooShort as exc:  # the fixed parts alone: the shortest length that fits them and the margin is known
        shortest = exc.minimum + MARGIN
        while shortest - _margin(shortest) < exc.minimum:
            shortest += 1
        raise ValueError(f"{task} needs about {shortest} tokens or more with this tokenizer, got {length} (its "
                         f"instructions, question and answer take {exc.minimum - 1} here, a few more or less with "
                         f"each sample's keys, and every sample keeps at least {MARGIN} tokens of haystack)") from None
    except ValueError as exc:
        raise ValueError(f"{task} does not fit {length} tokens with this tokenizer, keeping {margin} tokens of "
                         f"haystack spare for the other samples ({exc})") from None


@torch.no_grad()
def task_accuracy(model, src: Sources, task: str, length: int, *, samples: int = 10,
                  depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), seed: int = 0, state=None,
                  progress: bool = True) -> dict[str, Any]:
    """Mean RULER score of ``samples`` greedy generations at ``length`` tokens: overall, and per needle depth.

    With an accelerate ``PartialState`` of several processes the samples are split between them; the result does not
    depend on the process count (each sample is drawn from its own seed)."""
    if samples < 1:
        raise ValueError(f"{task}: samples must be at least 1, got {samples}")
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise ValueError(f"{task}: needle depths must be fractions of the haystack between 0 and 1, got {list(depths)}")
    spec = TASKS[task]
    metric = METRICS[spec.metric]
    tokenizer = src.encoder.tokenizer
    device = _input_device(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def work(batch):
        (index, depth), = batch
        try:
            sample = generate(spec, src, length, seed=seed, index=index, depth=depth)
        except ValueError as exc:  # told to every process after the gather, so none is left waiting in it
            return [(index, depth, None, None, 0, {"error": str(exc)})]
        ids = torch.tensor([sample.ids], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sample.max_new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=pad)
        text = src.encoder.decode(out[0, ids.shape[1]:].tolist())
        return [(index, depth, sample.depth, metric(text, sample.answers), len(sample.ids),
                 {"expected": sample.answers, "output": text[:PREDICTION_CHARS]})]

    outcomes = map_over_processes(list(enumerate(plan_samples(samples, depths))), work, state=state,
                                  progress=progress, desc=f"{task} L={length}")
    failed = [o for o in outcomes if o[3] is None]
    if failed:
        raise ValueError(f"{task} at {length}: sample {failed[0][0]} does not fit ({failed[0][5]['error']})")
    row: dict[str, Any] = {
        "accuracy": sum(o[3] for o in outcomes) / len(outcomes),
        "trials": len(outcomes),
        "prompt_tokens": max(o[4] for o in outcomes),
        "seed": seed,
        "metric": f"string_match_{spec.metric}",
        "chat_template": src.encoder.chat,
        # what the model answered, so a 0% can be read (cut to PREDICTION_CHARS characters)
        "predictions": [dict(o[5], score=o[3]) for o in outcomes],
    }
    if spec.has_depth:
        per_depth = {}
        for depth in dict.fromkeys(o[1] for o in outcomes):
            scores = [o[3] for o in outcomes if o[1] == depth]
            per_depth[f"{depth:g}"] = sum(scores) / len(scores)
        row["depths"] = per_depth
        row["needle_depths"] = [round(o[2], 4) for o in outcomes]
    return row
