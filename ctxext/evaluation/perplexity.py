"""Long-context perplexity of a causal LM over one or several tokenized documents.

    from ctxext.evaluation.perplexity import perplexity
    perplexity(model, ids, 1024, protocol="sliding", stride=512)["ppl"]

Windows come from :mod:`ctxext.evaluation.windows` (all exactly ``length`` tokens). Each window's
negative log-likelihood is summed in float64; with an accelerate ``PartialState`` of several processes
the windows are split between them and gathered, and totals are summed in window order, so the
numbers do not depend on the process count.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .windows import Window, check_protocol, plan_windows

#: Positions whose cross-entropy is computed at once (bounds the float32 copy of the logits).
_CE_CHUNK = 2048


def last_quarter_start(length: int) -> int:
    """First in-window position of the last quarter of a window of ``length`` tokens."""
    return length - max(1, length // 4)


def _input_device(model) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _forward_logits(model, input_ids: torch.Tensor, keep: int) -> tuple[torch.Tensor, int]:
    """Logits of the last ``keep`` positions when the model supports ``logits_to_keep``, else all.
    Returns the logits and the window position of their first row."""
    mask = torch.ones_like(input_ids)
    try:
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=False, logits_to_keep=keep)
    except TypeError as exc:
        if "logits_to_keep" not in str(exc):
            raise
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    logits = out.logits
    return logits, input_ids.shape[1] - logits.shape[1]


def _window_nll(logits: torch.Tensor, first_row: int, ids: torch.Tensor, window: Window) -> tuple[float, int, float, int]:
    """(nll_sum, tokens, nll_sum_last_quarter, tokens_last_quarter) of one window's scored targets."""
    rel_first = window.first_target - window.begin  # in-window position of the first target
    targets = ids[window.first_target : window.end].to(logits.device)
    q_start = last_quarter_start(window.length)
    nll_sum = 0.0
    nll_q = 0.0
    for lo in range(0, targets.numel(), _CE_CHUNK):
        hi = min(lo + _CE_CHUNK, targets.numel())
        rows = logits[rel_first - 1 + lo - first_row : rel_first - 1 + hi - first_row].float()
        nll = F.cross_entropy(rows, targets[lo:hi], reduction="none").double()
        nll_sum += nll.sum().item()
        q_lo = max(0, q_start - (rel_first + lo))  # index into this piece where the last quarter begins
        if q_lo < nll.numel():
            nll_q += nll[q_lo:].sum().item()
    n_q = window.end - max(window.first_target, window.begin + q_start)
    return nll_sum, int(targets.numel()), nll_q, max(0, n_q)


@torch.no_grad()
def score_windows(
    model,
    items: Sequence[tuple[torch.Tensor, Window]],
    *,
    batch_size: int = 1,
    progress: bool = True,
    state=None,
    desc: str = "perplexity",
) -> list[tuple[float, int, float, int]]:
    """Score (document ids, window) pairs; returns one (nll, tokens, nll_lq, tokens_lq) per item, in order.

    With ``state`` (an accelerate ``PartialState``) of several processes, each process scores a
    contiguous share and the shares are gathered on every process.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    indexed = list(enumerate(items))
    distributed = state is not None and state.num_processes > 1
    if distributed:
        with state.split_between_processes(indexed) as mine:
            mine = list(mine)
    else:
        mine = indexed
    is_main = state is None or state.is_main_process
    device = _input_device(model)
    scores: list[tuple[int, tuple[float, int, float, int]]] = []
    bar = tqdm(total=len(indexed), desc=desc, unit="win", disable=not (progress and is_main), leave=False)
    for lo in range(0, len(mine), batch_size):
        batch = mine[lo : lo + batch_size]
        input_ids = torch.stack([ids[w.begin : w.end] for _, (ids, w) in batch]).to(device)
        keep = max(w.n_targets for _, (_, w) in batch) + 1
        logits, first_row = _forward_logits(model, input_ids, keep)
        for row, (index, (ids, w)) in enumerate(batch):
            scores.append((index, _window_nll(logits[row], first_row, ids, w)))
        del logits
        bar.update(len(batch) * (state.num_processes if distributed else 1))
    bar.close()
    if distributed:
        from accelerate.utils import gather_object

        scores = gather_object(scores)
    scores.sort(key=lambda s: s[0])
    return [s for _, s in scores]


def summarize(scores: Sequence[tuple[float, int, float, int]]) -> dict[str, Any]:
    """Totals and perplexities from per-window scores (summed in order, float64)."""
    nll = math.fsum(s[0] for s in scores)
    tokens = sum(s[1] for s in scores)
    nll_q = math.fsum(s[2] for s in scores)
    tokens_q = sum(s[3] for s in scores)
    return {
        "ppl": math.exp(nll / tokens) if tokens else None,
        "nll_sum": nll,
        "tokens": tokens,
        "windows": len(scores),
        "ppl_last_quarter": math.exp(nll_q / tokens_q) if tokens_q else None,
        "nll_sum_last_quarter": nll_q,
        "tokens_last_quarter": tokens_q,
    }


def _as_ids(token_ids) -> torch.Tensor:
    ids = torch.as_tensor(token_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"token_ids must be a 1-D sequence of one document, got shape {tuple(ids.shape)}")
    return ids.long().cpu()


def perplexity(
    model,
    token_ids: torch.Tensor,
    length: int,
    *,
    protocol: str = "chunks",
    stride: int | None = None,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
    state=None,
) -> dict[str, Any]:
    """Perplexity of ``model`` on one document at window ``length``.

    Returns ``ppl``, ``nll_sum``, ``tokens``, ``windows``, ``ppl_last_quarter`` (targets in the last
    quarter of their window), ``nll_sum_last_quarter``, ``tokens_last_quarter``, and the settings used.
    A document shorter than ``length`` scores nothing (``ppl`` is None, ``windows`` 0).
    """
    return score_documents(
        model, [token_ids], length, protocol=protocol, stride=stride, max_windows=max_windows,
        batch_size=batch_size, progress=progress, state=state,
    )


def score_documents(
    model,
    documents: Sequence[torch.Tensor],
    length: int,
    *,
    protocol: str = "chunks",
    stride: int | None = None,
    max_windows: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
    state=None,
    desc: str | None = None,
) -> dict[str, Any]:
    """Perplexity over several documents at window ``length``: all their windows pooled.

    Documents shorter than ``length`` are skipped and counted (``documents_skipped``);
    ``max_windows`` caps the windows in total, taken in document order (long-enough documents left
    out by the cap are counted in ``documents_unused``).
    """
    stride = check_protocol(protocol, length, stride)
    items: list[tuple[torch.Tensor, Window]] = []
    scored_docs = skipped = unused = 0
    for doc in documents:
        ids = _as_ids(doc)
        if ids.numel() < length:
            skipped += 1
            continue
        room = None if max_windows is None else max_windows - len(items)
        if room is not None and room <= 0:
            unused += 1  # long enough, but the window cap was reached before it
            continue
        windows = plan_windows(ids.numel(), length, protocol, stride, room)
        items.extend((ids, w) for w in windows)
        scored_docs += 1
    scores = score_windows(
        model, items, batch_size=batch_size, progress=progress, state=state,
        desc=desc or f"{protocol} L={length}",
    )
    result = summarize(scores)
    result.update(
        length=length, protocol=protocol, stride=stride, max_windows=max_windows,
        documents_scored=scored_docs, documents_skipped=skipped, documents_unused=unused,
    )
    return result
