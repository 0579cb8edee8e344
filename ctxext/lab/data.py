"""Token streams (the shipped Austen novels, held-out *Emma*) and copy-task batches.

A copy sequence of total length n is ``[SEP, x_1..x_L, SEP, x_1..x_L]`` with L = (n - 2) // 2 random tokens
drawn from ``COPY_RANGE``; only the second copy is scored (in training and in evaluation). A training row may
instead hold several shorter units ``[SEP, x, SEP, x]`` of span ``span`` back to back (the copy curriculum, see
``copy_span``): short distances first, growing to the full row.
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


def copy_batch(n: int, length: int, gen: torch.Generator, span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` copy sequences of total ``length`` and their targets (IGNORE except on the copies). ``span`` None (or
    the full span (length - 2) // 2): one unit per row. A shorter ``span``: units of that span back to back, the last
    one shortened to fill the row."""
    full = (length - 2) // 2
    if full < 1:
        raise ValueError(f"copy sequences need length >= 4, got {length}")
    span = full if span is None else max(1, min(int(span), full))
    rows, targets, at = [], [], 0
    while length - at >= 4:
        L = min(span, (length - at - 2) // 2)
        if length - at - (2 * L + 2) < 4:  # a remainder too short for a unit joins this one
            L = (length - at - 2) // 2
        x = torch.randint(COPY_RANGE[0], COPY_RANGE[1], (n, L), generator=gen)
        sep = torch.full((n, 1), SEP, dtype=torch.long)
        rows.append(torch.cat([sep, x, sep, x], dim=1))
        t = torch.full_like(rows[-1], IGNORE)
        # position p predicts token p+1: the second copy starts at index L + 2, predicted from index L + 1
        t[:, L + 1: 2 * L + 1] = x
        targets.append(t)
        at += 2 * L + 2
    if length - at:
        rows.append(torch.full((n, length - at), SEP, dtype=torch.long))
        targets.append(torch.full((n, length - at), IGNORE, dtype=torch.long))
    return torch.cat(rows, dim=1), torch.cat(targets, dim=1)


def copy_span(step: int, steps: int, length: int, curriculum: float, first: int = 8) -> int:
    """The copy span at ``step`` of ``steps``: ``first`` growing linearly to the full span (length - 2) // 2 over the
    first ``curriculum`` fraction of the steps, the full span after (and always, with ``curriculum`` 0)."""
    full = (length - 2) // 2
    ramp = curriculum * steps
    if ramp <= 0 or step >= ramp:
        return full
    return min(full, max(1, round(first + (full - first) * step / ramp)))


def text_batch(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random windows of ``length`` tokens from ``stream`` and their next-token targets."""
    starts = torch.randint(0, len(stream) - length - 1, (n,), generator=gen)
    win = torch.stack([stream[s: s + length + 1] for s in starts.tolist()])
    return win[:, :-1], win[:, 1:]


def training_batches(stream: torch.Tensor, steps: int, batch: int, length: int, seed: int, copy_fraction: float = 0.5,
                     curriculum: float = 0.0):
    """The same sequence of (ids, targets) batches for every scheme: ``batch`` rows, the first
    round(batch * (1 - copy_fraction)) text windows, the rest copy sequences (of span ``copy_span``)."""
    gen = torch.Generator().manual_seed(seed)
    n_copy = int(round(batch * copy_fraction))
    for step in range(steps):
        parts = []
        if batch - n_copy:
            parts.append(text_batch(stream, batch - n_copy, length, gen))
        if n_copy:
            c, ct = copy_batch(n_copy, length, gen, copy_span(step, steps, length, curriculum))
            parts.append((c, ct))
        yield torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def eval_windows(stream: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """``count`` windows of ``length`` + 1 tokens spread evenly over ``stream`` (the same for every scheme)."""
    if (length + 1) * count > len(stream):
        count = len(stream) // (length + 1)
    step = (len(stream) - length - 1) // max(count, 1)
    return torch.stack([stream[i * step: i * step + length + 1] for i in range(count)])
