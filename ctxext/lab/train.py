"""Training and evaluation of one tiny decoder."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import itertools

from .data import IGNORE, copy_batch, copy_warmup_batches, eval_windows, training_batches


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to lr/10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_model(model, stream, *, steps, batch, length, lr, warmup, seed, copy_fraction=0.5, weight_decay=0.01,
                copy_warmup=0, checkpoint=None, checkpoints=0):
    """Train ``model`` in place: ``copy_warmup`` copy-only steps (``data.copy_warmup_batches``), then ``steps``
    steps of the fixed mixed batch sequence given by ``seed``, each phase with its own learning-rate schedule
    (``lr_at``: the mixed phase learns as a run without warm-up would, text included). Returns the
    last loss. ``checkpoint(model, step)``, if given, is called (in eval mode) after each of ``checkpoints`` evenly
    spaced mixed steps, the last one included, with the step counted from the start of the warm-up: a learning
    curve."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    model.train()
    loss = float("nan")
    at = {copy_warmup + round(steps * (i + 1) / checkpoints) for i in range(checkpoints)} \
        if checkpoint and checkpoints else set()
    batches = itertools.chain(copy_warmup_batches(copy_warmup, batch, length, seed + 1),
                              training_batches(stream, steps, batch, length, seed, copy_fraction))
    for step, (ids, tgt) in enumerate(batches):
        # the warm-up has its own schedule; the mixed steps then get the schedule a run without warm-up has
        if step < copy_warmup:
            rate = lr_at(step, copy_warmup, lr, warmup)
        else:
            rate = lr_at(step - copy_warmup, steps, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = rate
        logits = model(ids)
        out = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = float(out.detach())
        if step + 1 in at:
            model.eval()
            checkpoint(model, step + 1)
            model.train()
    model.eval()
    return loss


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, offset: int = 0, batch: int = 8) -> tuple[float, float]:
    """(whole-window perplexity, last-quarter perplexity) of ``windows`` (N, T+1) read at positions
    offset..offset+T-1. Raises ValueError when the model cannot take those positions."""
    t = windows.shape[1] - 1
    pos = torch.arange(offset, offset + t)
    nll = []
    for i in range(0, len(windows), batch):
        w = windows[i: i + batch]
        logits = model(w[:, :-1], position_ids=pos).float()
        nll.append(F.cross_entropy(logits.transpose(1, 2), w[:, 1:], reduction="none"))
    nll = torch.cat(nll)
    q = t - t // 4
    return math.exp(float(nll.mean())), math.exp(float(nll[:, q:].mean()))


@torch.no_grad()
def copy_accuracy(model, length: int, count: int, seed: int, batch: int = 16) -> float:
    """Fraction of copied tokens predicted correctly (argmax) given the prefix, on ``count`` copy sequences."""
    gen = torch.Generator().manual_seed(seed)
    right = total = 0
    for i in range(0, count, batch):
        ids, tgt = copy_batch(min(batch, count - i), length, gen)
        pred = model(ids).argmax(-1)
        m = tgt != IGNORE
        right += int((pred[m] == tgt[m]).sum())
        total += int(m.sum())
    return right / total


def evaluate(model, held, *, train_len, factors, windows, copy_seqs, seed):
    """Per factor: {"length", "ppl", "ppl_last_quarter", "copy_accuracy"} or {"length", "cannot_run": reason}."""
    out = {}
    for f in factors:
        n = train_len * f
        try:
            ppl, lq = perplexity(model, eval_windows(held, n, windows))
            acc = copy_accuracy(model, n, copy_seqs, seed + f)
        except ValueError as exc:
            out[f"{f}x"] = {"length": n, "cannot_run": str(exc)}
            continue
        out[f"{f}x"] = {"length": n, "ppl": ppl, "ppl_last_quarter": lq, "copy_accuracy": acc}
    return out
