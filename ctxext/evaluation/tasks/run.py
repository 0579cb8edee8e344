"""Run a RULER-style task on a model: generate each sample, decode greedily, score as RULER does."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .ruler import TASKS, Sources, generate
from .scoring import METRICS


def plan_samples(samples: int, depths: Sequence[float]) -> list[float]:
    """Sample i's needle depth: the depths in turn."""
    return [depths[i % len(depths)] for i in range(samples)]


def check_length(task: str, src: Sources, length: int, *, seed: int = 0) -> None:
    """Raise ValueError if ``task`` cannot fit ``length`` tokens with this tokenizer."""
    generate(TASKS[task], src, length, seed=seed, index=0, depth=0.5)


@torch.no_grad()
def task_accuracy(model, src: Sources, task: str, length: int, *, samples: int = 10,
                  depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), seed: int = 0, state=None,
                  progress: bool = True) -> dict[str, Any]:
    """Mean RULER score of ``samples`` greedy generations at ``length`` tokens: overall, and per needle depth.

    With an accelerate ``PartialState`` of several processes the samples are split between them; the result does not
    depend on the process count (each sample is drawn from its own seed)."""
    from tqdm.auto import tqdm

    spec = TASKS[task]
    metric = METRICS[spec.metric]
    tokenizer = src.encoder.tokenizer
    plan = list(enumerate(plan_samples(samples, depths)))
    distributed = state is not None and state.num_processes > 1
    if distributed:
        with state.split_between_processes(plan) as mine:
            mine = list(mine)
    else:
        mine = plan
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    is_main = state is None or state.is_main_process
    outcomes = []
    for index, depth in tqdm(mine, desc=f"{task} L={length}", disable=not (progress and is_main), leave=False):
        sample = generate(spec, src, length, seed=seed, index=index, depth=depth)
        ids = torch.tensor([sample.ids], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sample.max_new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=pad)
        text = src.encoder.decode(out[0, ids.shape[1]:].tolist())
        outcomes.append((index, depth, sample.depth, metric(text, sample.answers), len(sample.ids)))
    if distributed:
        from accelerate.utils import gather_object

        outcomes = gather_object(outcomes)
    outcomes.sort(key=lambda o: o[0])
    row: dict[str, Any] = {
        "accuracy": sum(o[3] for o in outcomes) / len(outcomes),
        "trials": len(outcomes),
        "prompt_tokens": max(o[4] for o in outcomes),
        "seed": seed,
        "metric": f"string_match_{spec.metric}",
        "chat_template": src.encoder.chat,
    }
    if spec.has_depth:
        per_depth = {}
        for depth in dict.fromkeys(o[1] for o in outcomes):
            scores = [o[3] for o in outcomes if o[1] == depth]
            per_depth[f"{depth:g}"] = sum(scores) / len(scores)
        row["depths"] = per_depth
        row["needle_depths"] = [round(o[2], 4) for o in outcomes]
    return row
