"""Key-token perplexity: perplexity on the tokens whose prediction needs long context.

After Fang et al. (ICLR 2025), "What is Wrong with Perplexity for Long-context Language Modeling?" (code:
PKU-ML/LongPPL, ``longppl`` on PyPI). An evaluator model scores each token twice: with a long context and with only
the last ``short`` tokens. With NLL in nats,

- LSD (long-short difference) = log P(x | long) - log P(x | short) = nll_short - nll_long,
- LCL (long-context likelihood) = log P(x | long) = -nll_long,

and a token is *key* when LSD > alpha (2) and LCL > beta (-2): the long context makes it much likelier, and the
evaluator then predicts it well. Key-token perplexity is the evaluated model's perplexity over the key tokens alone,
each read with the model's own window. Perplexity over all tokens is dominated by tokens that need only local
context, so a model that ignores far context can hold it; key-token perplexity cannot be held that way.

How ctxext differs from the package (which scores one text in one forward pass, through text offsets): the evaluator
reads each token with a long context of ``context`` tokens (windows of ``context``, stride ``context // 2``: at least
half of it) and a short one of ``short`` to ``short + short // 4`` tokens (the package: ``trunc_len`` 4096 to
4096 + 1024), only where the evaluation's windows have targets; the evaluator must share the model's tokenizer (ids
are compared token by token, not through text offsets). The default evaluator is the model itself, unpatched, with
``context`` its trained length and ``short`` an eighth of it (the paper's 4k of 32k).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .device import map_over_processes
from .requests import FLAGS, Spelling
from .perplexity import _forward_rows, _input_device, _window_nll
from .windows import Window, plan_windows

ALPHA = 2.0
BETA = -2.0
#: The short context as a fraction of the long one.
SHORT_FRACTION = 8


def is_key(nll_long: torch.Tensor, nll_short: torch.Tensor, *, alpha: float = ALPHA, beta: float = BETA) -> torch.Tensor:
    """The paper's rule, elementwise: (nll_short - nll_long > alpha) and (-nll_long > beta); NaN (unscored) is never
    key."""
    return ((nll_short - nll_long) > alpha) & ((-nll_long) > beta)


def _windows_over(n: int, length: int, stride: int, ranges: Sequence[tuple[int, int]]) -> list[Window]:
    """Sliding windows of ``length`` (the whole document if shorter) whose targets meet one of ``ranges``."""
    if n < 2:
        return []
    if n < length:
        windows = [Window(0, 1, n)]
    else:
        windows = plan_windows(n, length, "sliding", min(stride, length - 1))
        # the first window scores only its last `stride` targets; targets before it are read from position 0 on
        first = windows[0]
        if first.first_target > 1:
            windows = [Window(0, 1, first.first_target)] + windows
    return [w for w in windows if any(w.first_target < hi and lo < w.end for lo, hi in ranges)]


def key_contexts(context: int | None, short: int | None, spelling: Spelling = FLAGS) -> tuple[int, int]:
    """The (long, short) contexts key tokens are found with: ``short`` defaults to ``context // 8``. A long context
    with no shorter one below it, or a short one not below the long, is refused with what to give instead, the
    arguments named as ``spelling`` says."""
    s = spelling
    if not context:
        raise ValueError(f"the key-token evaluator advertises no context length; give {s.name('key_context')}")
    if context < 2:
        raise ValueError(f"a key-token long context of {context} token leaves no shorter context to compare with; "
                         f"give {s.name('key_context')} of at least 2")
    short = short or max(1, context // SHORT_FRACTION)
    if not 1 <= short < context:
        raise ValueError(f"the key-token short context ({s.given('key_short', short)}) must be shorter than the long "
                         f"context {context} ({s.name('key_context')}, default: the evaluator's trained length)")
    return context, short


@torch.no_grad()
def token_nll(model, items: Sequence[tuple[int, torch.Tensor, Window]], sizes: Sequence[int], *, state=None,
              progress: bool = True, desc: str = "key tokens") -> list[torch.Tensor]:
    """Per document (``sizes`` = their token counts), every scored target's NLL (NaN where no window scored it).

    ``items``: (document number, ids, window). With several processes the windows are split and gathered."""
    device = _input_device(model)

    def work(batch):
        (number, ids, w), = batch
        rows = _forward_rows(model, ids[w.begin : w.end].unsqueeze(0).to(device), w.n_targets + 1)
        each = torch.empty(w.n_targets, dtype=torch.float64)
        _window_nll(rows, 0, ids, w, each=each)
        return [(number, w.first_target, each)]

    found = map_over_processes(items, work, state=state, progress=progress, desc=desc, unit="win")
    out = [torch.full((n,), float("nan"), dtype=torch.float64) for n in sizes]
    for number, start, values in found:
        out[number][start : start + values.numel()] = values
    return out


def key_masks(evaluator, documents: Sequence[torch.Tensor], needed: Sequence[Sequence[tuple[int, int]]], *,
              context: int, short: int | None = None, alpha: float = ALPHA, beta: float = BETA, state=None,
              progress: bool = True, spelling: Spelling = FLAGS) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """One bool mask per document: its key tokens among the positions in ``needed`` (ranges [lo, hi) per document),
    as ``evaluator`` finds them with a long context of ``context`` tokens and a short one of ``short`` (default
    ``context // 8``). Returns the masks and what was done (for the results JSON); ``spelling``: how messages name
    the arguments."""
    context, short = key_contexts(context, short, spelling)
    step = max(1, short // 4)
    sizes = [int(d.numel()) for d in documents]
    long_items, short_items = [], []
    for number, (ids, ranges) in enumerate(zip(documents, needed)):
        if not ranges:
            continue
        long_items += [(number, ids, w) for w in _windows_over(sizes[number], context, max(1, context // 2), ranges)]
        short_items += [(number, ids, w) for w in _windows_over(sizes[number], short + step, step, ranges)]
    long_nll = token_nll(evaluator, long_items, sizes, state=state, progress=progress, desc="key tokens: long")
    short_nll = token_nll(evaluator, short_items, sizes, state=state, progress=progress, desc="key tokens: short")
    masks = []
    for number, ranges in enumerate(needed):
        inside = torch.zeros(sizes[number], dtype=torch.bool)
        for lo, hi in ranges:
            inside[lo:hi] = True
        masks.append(is_key(long_nll[number], short_nll[number], alpha=alpha, beta=beta) & inside)
    info = {"definition": "Fang et al. 2024 (LongPPL): nll_short - nll_long > alpha and -nll_long > beta",
            "alpha": alpha, "beta": beta, "context": context, "short": short,
            "key_tokens": int(sum(int(m.sum()) for m in masks)),
            "positions": int(sum(hi - lo for ranges in needed for lo, hi in ranges))}
    return masks, info


def needed_ranges(plans: Sequence[Sequence[tuple[int, torch.Tensor, Window]]], n_documents: int) -> list[list[tuple[int, int]]]:
    """Per document, the merged target ranges of every window in ``plans`` (from ``perplexity.plan_documents``)."""
    spans: list[list[tuple[int, int]]] = [[] for _ in range(n_documents)]
    for plan in plans:
        for number, _, w in plan:
            spans[number].append((w.first_target, w.end))
    merged = []
    for ranges in spans:
        out: list[tuple[int, int]] = []
        for lo, hi in sorted(ranges):
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        merged.append(out)
    return merged
