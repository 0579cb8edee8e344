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

from .device import map_over_processes
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


class _Rows:
    """Logits of one forward pass, by window position, made float32 a chunk at a time.

    Either the model's logits, or (when ``head`` is set) the final hidden states with the output
    layer still to apply: then the (positions x vocabulary) logits never exist all at once.
    """

    def __init__(self, values: torch.Tensor, first_row: int, head=None):
        self.values, self.first_row, self.head = values, first_row, head

    @property
    def device(self) -> torch.device:
        return self.values.device

    def get(self, item: int, lo: int, hi: int) -> torch.Tensor:
        rows = self.values[item, lo - self.first_row : hi - self.first_row]
        return (self.head(rows) if self.head is not None else rows).float()


def _call(model, input_ids: torch.Tensor, keep: int):
    mask = torch.ones_like(input_ids)
    try:
        return model(input_ids=input_ids, attention_mask=mask, use_cache=False, logits_to_keep=keep)
    except (TypeError, ValueError) as exc:  # a forward without logits_to_keep (4.57's BLOOM: ValueError)
        if "logits_to_keep" not in str(exc):
            raise
        return model(input_ids=input_ids, attention_mask=mask, use_cache=False)


class _CaptureHead:
    """Swap the output layer for one that keeps its input (the final hidden states) and returns a stub."""

    def __init__(self, head: torch.nn.Module):
        self.head = head
        self.forward = head.forward  # accelerate's device hooks included, if any
        self.hidden: torch.Tensor | None = None

    def __enter__(self):
        def capture(hidden, *args, **kwargs):
            self.hidden = hidden
            return hidden.new_zeros(hidden.shape[:-1] + (1,))

        self.had_own = "forward" in vars(self.head)
        self.head.forward = capture
        return self

    def __exit__(self, *exc):
        if self.had_own:
            self.head.forward = self.forward
        else:
            del self.head.forward


_HEAD_OK: "weakref.WeakKeyDictionary" = None  # model -> whether the hidden-state path reproduces its logits


def _head_path_ok(model, input_ids: torch.Tensor) -> bool:
    """Whether logits = output layer(final hidden states) for this model (no soft-capping or scaling
    after the output layer): checked once per model on a few tokens."""
    import weakref

    global _HEAD_OK
    if _HEAD_OK is None:
        _HEAD_OK = weakref.WeakKeyDictionary()
    try:
        return _HEAD_OK[model]
    except (KeyError, TypeError):
        pass
    ok = False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        probe = input_ids[:1, : min(16, input_ids.shape[1])]
        reference = _call(model, probe, probe.shape[1]).logits[0].float()
        with _CaptureHead(head) as cap:
            _call(model, probe, probe.shape[1])
        if cap.hidden is not None and cap.hidden.shape[1] == probe.shape[1]:
            mine = cap.forward(cap.hidden[0]).float()
            ok = mine.shape == reference.shape and torch.allclose(mine, reference, rtol=1e-4, atol=1e-4)
    try:
        _HEAD_OK[model] = ok
    except TypeError:
        pass
    return ok


def _forward_rows(model, input_ids: torch.Tensor, keep: int) -> _Rows:
    """The scores of the last ``keep`` positions of ``input_ids`` (all positions if the model cannot limit them)."""
    if _head_path_ok(model, input_ids):
        head = model.get_output_embeddings()
        with _CaptureHead(head) as cap:
            _call(model, input_ids, keep)
        return _Rows(cap.hidden, input_ids.shape[1] - cap.hidden.shape[1], cap.forward)
    logits = _call(model, input_ids, keep).logits
    return _Rows(logits, input_ids.shape[1] - logits.shape[1])


def _window_nll(rows: _Rows, item: int, ids: torch.Tensor, window: Window, key: torch.Tensor | None = None,
                each: torch.Tensor | None = None) -> tuple:
    """(nll_sum, tokens, nll_sum_last_quarter, tokens_last_quarter) of one window's scored targets; with ``key`` (a
    bool mask over the document's positions) also (nll_sum_key, tokens_key) of the targets it marks. ``each``, a
    float tensor of ``window.n_targets``, receives every target's NLL in order."""
    rel_first = window.first_target - window.begin  # in-window position of the first target
    targets = ids[window.first_target : window.end].to(rows.device)
    q_start = last_quarter_start(window.length)
    nll_sum = 0.0
    nll_q = 0.0
    nll_key = 0.0
    for lo in range(0, targets.numel(), _CE_CHUNK):
        hi = min(lo + _CE_CHUNK, targets.numel())
        scores = rows.get(item, rel_first - 1 + lo, rel_first - 1 + hi)
        nll = F.cross_entropy(scores, targets[lo:hi].to(scores.device), reduction="none").double()
        nll_sum += nll.sum().item()
        q_lo = max(0, q_start - (rel_first + lo))  # index into this piece where the last quarter begins
        if q_lo < nll.numel():
            nll_q += nll[q_lo:].sum().item()
        if key is not None:
            marks = key[window.first_target + lo : window.first_target + hi].to(nll.device)
            nll_key += nll[marks].sum().item()
        if each is not None:
            each[lo:hi] = nll.cpu()
    n_q = window.end - max(window.first_target, window.begin + q_start)
    out = (nll_sum, int(targets.numel()), nll_q, max(0, n_q))
    if key is not None:
        out += (nll_key, int(key[window.first_target : window.end].sum()))
    return out


@torch.no_grad()
def score_windows(
    model,
    items: Sequence[tuple[torch.Tensor, Window]],
    *,
    batch_size: int = 1,
    progress: bool = True,
    state=None,
    desc: str = "perplexity",
    keys: Sequence[torch.Tensor | None] | None = None,
) -> list[tuple]:
    """Score (document ids, window) pairs; returns one (nll, tokens, nll_lq, tokens_lq) per item, in order, and
    with ``keys`` (one bool mask over each item's document positions) also (nll_key, tokens_key).

    With ``state`` (an accelerate ``PartialState``) of several processes, each process scores a
    contiguous share and the shares are gathered on every process.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = _input_device(model)

    def work(batch):
        input_ids = torch.stack([ids[w.begin : w.end] for (ids, w), _ in batch]).to(device)
        rows = _forward_rows(model, input_ids, max(w.n_targets for (_, w), _ in batch) + 1)
        return [_window_nll(rows, item, ids, w, key) for item, ((ids, w), key) in enumerate(batch)]

    with_keys = list(zip(items, keys if keys is not None else [None] * len(items), strict=True))
    return map_over_processes(with_keys, work, state=state, batch_size=batch_size, progress=progress, desc=desc,
                              unit="win")


def summarize(scores: Sequence[tuple[float, int, float, int]]) -> dict[str, Any]:
    """Totals and perplexities from per-window scores (summed in order, float64)."""
    nll = math.fsum(s[0] for s in scores)
    tokens = sum(s[1] for s in scores)
    nll_q = math.fsum(s[2] for s in scores)
    tokens_q = sum(s[3] for s in scores)
    keyed = {}
    if scores and len(scores[0]) > 4:  # key-token perplexity (ctxext.evaluation.keytokens)
        nll_k = math.fsum(s[4] for s in scores)
        tokens_k = sum(s[5] for s in scores)
        keyed = {"ppl_key": math.exp(nll_k / tokens_k) if tokens_k else None, "nll_sum_key": nll_k,
                 "key_tokens": tokens_k}
    return {**keyed,
        "ppl": math.exp(nll / tokens) if tokens else None,
        "nll_sum": nll,
        "tokens": tokens,
        "windows": len(scores),
        "ppl_last_quarter": math.exp(nll_q / tokens_q) if tokens_q else None,
        "nll_sum_last_quarter": nll_q,
        "tokens_last_quarter": tokens_q,
    }


def spread(total: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(total)`` (all of them if ``count >= total``)."""
    if count >= total:
        return list(range(total))
    return [int((i + 0.5) * total / count) for i in range(count)]


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


def plan_documents(documents: Sequence[torch.Tensor], length: int, *, protocol: str = "chunks",
                   stride: int | None = None, max_windows: int | None = None):
    """The windows that score ``documents`` at ``length``: ([(document number, ids, window)], documents too short,
    numbers of the documents long enough), ``max_windows`` of them spread evenly over the full plan."""
    stride = check_protocol(protocol, length, stride)
    plan: list[tuple[int, torch.Tensor, Window]] = []
    skipped = 0
    long_enough = set()
    for number, doc in enumerate(documents):
        ids = _as_ids(doc)
        if ids.numel() < length:
            skipped += 1
            continue
        long_enough.add(number)
        plan.extend((number, ids, w) for w in plan_windows(ids.numel(), length, protocol, stride))
    if max_windows is not None:
        if max_windows < 1:
            raise ValueError(f"max_windows must be >= 1, got {max_windows}")
        plan = [plan[i] for i in spread(len(plan), max_windows)]
    return plan, skipped, long_enough


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
    key_masks: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Perplexity over several documents at window ``length``: all their windows pooled.

    With ``key_masks`` (one bool mask per document over its positions, see :mod:`.keytokens`) the result also holds
    the perplexity of the marked targets alone (``ppl_key``, ``key_tokens``).

    Documents shorter than ``length`` are skipped and counted (``documents_skipped``). ``max_windows``
    caps the windows in total: they are spread evenly over all documents' windows (every k-th window of
    the full plan), so a capped run samples the whole text, not its beginning; long-enough documents
    that get no window are counted in ``documents_unused``.
    """
    stride = check_protocol(protocol, length, stride)
    plan, skipped, long_enough = plan_documents(documents, length, protocol=protocol, stride=stride,
                                                max_windows=max_windows)
    items = [(ids, w) for _, ids, w in plan]
    scored_docs = len({number for number, _, _ in plan})
    unused = len(long_enough) - scored_docs
    scores = score_windows(
        model, items, batch_size=batch_size, progress=progress, state=state,
        desc=desc or f"{protocol} L={length}", keys=None if key_masks is None else [key_masks[n] for n, _, _ in plan],
    )
    result = summarize(scores)
    result.update(
        length=length, protocol=protocol, stride=stride, max_windows=max_windows,
        documents_scored=scored_docs, documents_skipped=skipped, documents_unused=unused,
    )
    return result
