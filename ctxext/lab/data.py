"""Token streams (the shipped Austen novels, held-out *Emma*) and copy-task batches.

A copy sequence of total length n is ``[SEP, x_1..x_L, SEP, x_1..x_L]`` with L = (n - 2) // 2 random tokens
drawn from ``COPY_RANGE``; only the second copy is scored (in training and in evaluation). Before the lab's mixed
training, a copy warm-up (``copy_warmup_batches``) trains on copy rows alone, one unit per row, the span growing
stage by stage: a decoder without a fixed-offset route (ALiBi, NoPE, a sinusoidal table) needs an induction circuit
to copy, and that circuit forms on short copies first (issue 50's probes).
"""

from __future__ import annotations

import functools
import lzma

import torch

#: Separator / start token of copy sequences (the tokenizer's only special token).
SEP = 0
#: Copy tokens are drawn uniformly from this id range (chance accuracy is 1 / its size).
COPY_RANGE = (1000, 1512)
IGNORE = -100


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(training ids, held-out ids): the five training novels concatenated, and *Emma*; tokenized once."""
    from ..reference import reference_text, reference_tokenizer, training_files

    tok = reference_tokenizer()
    train = []
    for path in training_files():
        with lzma.open(path, "rt", encoding="utf-8") as f:
            train.extend(tok(f.read())["input_ids"])
    held = tok(reference_text())["input_ids"]
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


def copy_batch(n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` copy sequences of total ``length`` and their targets (IGNORE except on the copies). An odd length
    ends in one unscored SEP."""
    L = (length - 2) // 2
    if L < 1:
        raise ValueError(f"copy sequences need length >= 4, got {length}")
    x = torch.randint(COPY_RANGE[0], COPY_RANGE[1], (n, L), generator=gen)
    sep = torch.full((n, 1), SEP, dtype=torch.long)
    parts = [sep, x, sep, x] + ([sep] if length - 2 * L - 2 else [])
    ids = torch.cat(parts, dim=1)
    t = torch.full_like(ids, IGNORE)
    # position p predicts token p+1: the second copy starts at index L + 2, predicted from index L + 1
    t[:, L + 1: 2 * L + 1] = x
    return ids, t


def warmup_spans(length: int) -> list[int]:
    """The copy warm-up's spans for rows of ``length``: 8, 16, 32, ... below the full span (length - 2) // 2, then
    the full span."""
    full = (length - 2) // 2
    spans, s = [], 8
    while s < full:
        spans.append(s)
        s *= 2
    return spans + [full]


def copy_warmup_batches(steps: int, batch: int, length: int, seed: int):
    """``steps`` copy-only batches of ``batch`` rows, each row one copy unit as long as its span needs
    (2 * span + 2 tokens); the span runs through ``warmup_spans(length)`` in equal stages."""
    gen = torch.Generator().manual_seed(seed)
    spans = warmup_spans(length)
    for step in range(steps):
        span = spans[min(len(spans) - 1, step * len(spans) // steps)]
        yield copy_batch(batch, 2 * span + 2, gen)


def text_batch(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random windows of ``length`` tokens from ``stream`` and their next-token targets."""
    starts = torch.randint(0, len(stream) - length - 1, (n,), generator=gen)
    win = torch.stack([stream[s: s + length + 1] for s in starts.tolist()])
    return win[:, :-1], win[:, 1:]


def training_batches(stream: torch.Tensor, steps: int, batch: int, length: int, seed: int, copy_fraction: float = 0.5):
    """The same sequence of (ids, targets) batches for every scheme: ``batch`` rows, the first
    round(batch * (1 - copy_fraction)) text windows, the rest copy sequences."""
    gen = torch.Generator().manual_seed(seed)
    n_copy = int(round(batch * copy_fraction))
    for _ in range(steps):
        parts = []
        if batch - n_copy:
            parts.append(text_batch(stream, batch - n_copy, length, gen))
        if n_copy:
            parts.append(copy_batch(n_copy, length, gen))
        yield torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def eval_windows(stream: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """``count`` windows of ``length`` + 1 tokens spread evenly over ``stream`` (the same for every scheme)."""
    if (length + 1) * count > len(stream):
        count = len(stream) // (length + 1)
    step = (len(stream) - length - 1) // max(count, 1)
    return torch.stack([stream[i * step: i * step + length + 1] for i in range(count)])
