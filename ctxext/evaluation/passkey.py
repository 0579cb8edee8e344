"""Synthetic passkey retrieval: a random number hidden at a depth of filler text, read back greedily.

The prompt (after Mohtashami & Jaggi, as used by the PI / YaRN / LongLoRA papers) is built to
``length`` tokens including the generated answer, so generation never runs past ``length``.
Passkeys are drawn from ``random.Random`` seeded by (seed, length, depth, trial): reproducible and
independent of the method, the process count and the order of evaluation.
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

import torch

from .device import map_over_processes

PREFIX = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])


def draw_passkey(seed: int, length: int, depth: float, trial: int) -> int:
    return random.Random(f"ctxext-passkey/{seed}/{length}/{depth:.4f}/{trial}").randint(10000, 99999)


def build_prompt(tokenizer, length: int, depth: float, key: int, answer_tokens: int) -> list[int]:
    """Token ids of a prompt of at most ``length - answer_tokens`` tokens with the needle at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be between 0 and 1, got {depth}")
    budget = length - answer_tokens
    needle = NEEDLE.format(key=key)
    fixed = _n_tokens(tokenizer, PREFIX + needle + QUESTION)
    per_filler = max(1, _n_tokens(tokenizer, FILLER * 8) // 8)
    total = max(0, (budget - fixed) // per_filler + 1)

    def make(n_fill: int) -> list[int]:
        before = int(round(depth * n_fill))
        text = PREFIX + FILLER * before + needle + FILLER * (n_fill - before) + QUESTION
        return tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]

    ids = make(total)
    while len(ids) > budget and total > 0:
        total -= 1
        ids = make(total)
    if len(ids) > budget:
        raise ValueError(f"passkey length {length} is too short for the prompt ({len(ids)} tokens)")
    return ids


def passkey_prompt_check(tokenizer, length: int) -> None:
    """Raise ValueError if no passkey prompt fits ``length`` tokens."""
    build_prompt(tokenizer, length, 0.5, 99999, _answer_tokens(tokenizer))


def _answer_tokens(tokenizer) -> int:
    return _n_tokens(tokenizer, " 12345.") + 2


def first_number(text: str) -> int | None:
    """The first number written in ``text``, as the integer it spells; None where there is none, or where it is not
    written as that integer is (``012345`` is not the key 12345: keys are drawn without leading zeros)."""
    match = re.search(r"\d+", text)
    if match is None or match.group() != str(int(match.group())):
        return None
    return int(match.group())


@torch.no_grad()
def passkey_accuracy(
    model,
    tokenizer,
    length: int,
    *,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 2,
    seed: int = 0,
    state=None,
    progress: bool = True,
) -> dict[str, Any]:
    """Accuracy of greedy passkey retrieval at ``length`` tokens: overall and per depth.

    With an accelerate ``PartialState`` of several processes the trials are split between them.
    """
    if trials < 1:
        raise ValueError(f"passkey trials must be >= 1, got {trials}")
    answer = _answer_tokens(tokenizer)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def work(batch):
        (depth, trial), = batch
        key = draw_passkey(seed, length, depth, trial)
        ids = torch.tensor([build_prompt(tokenizer, length, depth, key, answer)], device=device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=answer, do_sample=False,
            num_beams=1, pad_token_id=pad,
        )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        return [(depth, key, first_number(text), ids.shape[1])]

    outcomes = map_over_processes([(d, t) for d in depths for t in range(trials)], work, state=state,
                                  progress=progress, desc=f"passkey L={length}")
    per_depth = {}
    for depth in depths:
        hits = [got == key for d, key, got, _ in outcomes if d == depth]
        per_depth[f"{depth:g}"] = sum(hits) / len(hits)
    correct = sum(got == key for _, key, got, _ in outcomes)
    return {
        "accuracy": correct / len(outcomes),
        "correct": correct,
        "trials": len(outcomes),
        "depths": per_depth,
        "prompt_tokens": max(o[3] for o in outcomes),
        "length": length,
        "seed": seed,
    }
