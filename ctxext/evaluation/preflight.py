"""Checks that need the model's structure but not its weights, run before anything loads.

They run on :func:`ctxext.loading.model_skeleton` (the model with its buffers but no weights), so ``build_spec``
says whether a patch fits the model exactly as it will after loading.
"""

from __future__ import annotations

from ..adapters import find_adapter
from ..core.errors import PatchError
from .models import model_info
from .requests import (FLAGS, NONE, MethodChoice, MethodRequest, Spelling, check_request, parse_factor,
                       takes_factor)
from .runner import ModelJob, default_factor, default_lengths


def unfit_requests(skeleton, requests: list[MethodRequest], *, default_factor: float | None,
                   spelling: Spelling = FLAGS) -> list[str]:
    """One message per request that cannot be applied to the model (``default_factor`` stands in for requests
    whose factor the evaluator derives from the lengths), the arguments named as ``spelling`` says."""
    problems = []
    for req in requests:
        if req.patch_call() is None:
            continue
        if req.method != NONE and req.factor is None and default_factor is not None:
            req = MethodRequest(req.method, default_factor, req.options)
        try:
            check_request(skeleton, req, spelling)
        except PatchError as exc:
            problems.append(str(exc))
    return problems


def check_fit(jobs: list[ModelJob], methods: MethodChoice, lengths: list[int] | None, *,
              limits: dict[str, tuple[int, str]] | None = None) -> dict[str, int | None]:
    """Methods x factors x model family, on each model's skeleton: a requested method that fits no model, or a
    derived factor past the cap, is refused before anything loads. Where several models run (the demo), a method
    that fits some of them runs on those and is reported for the others. ``lengths`` None: each model's default.
    Returns each checked model's original (trained) length, as the results will state it; ``limits`` (a dict) gets
    each model's :func:`context_limit`, unpatched (for the key-token evaluator)."""
    unfit: dict[str, list[str]] = {}
    originals: dict[str, int | None] = {}
    for job in jobs:
        if job.load_skeleton is None:
            continue
        try:
            skeleton = job.load_skeleton()
        except (OSError, ValueError):
            if len(jobs) == 1:
                raise
            continue  # the runner reports this model and runs the others
        originals[job.label] = model_info(skeleton, job.label)["original_length"]
        if limits is not None:
            found = context_limit(skeleton, originals[job.label])
            if found is not None:
                limits[job.label] = found
        try:
            adapter = find_adapter(skeleton)
        except PatchError as exc:
            if methods.patches:
                raise PatchError(f"{job.label}: {exc}") from None
            continue  # unpatched only: fine for any model
        original = adapter.original_length(skeleton)
        requests = methods.for_model(skeleton, job.factor)  # the default set: every method that fits
        factor = job.factor
        if factor is None and original and any(r.factor is None and takes_factor(r.method)
                                               for r in requests if r.method != NONE):
            job_lengths = lengths or default_lengths(original)
            factor = default_factor(job_lengths, original)
            parse_factor(factor, f"{job.label}: the default factor (longest length {max(job_lengths)} / the "
                         f"model's original length {original})")
        if methods.given is not None:  # the default set keeps only what fits (the runner notes the rest)
            for problem in unfit_requests(skeleton, requests, default_factor=factor, spelling=methods.spelling):
                unfit.setdefault(job.label, []).append(problem)
    if unfit and (len(jobs) == 1 or len(unfit) == len(jobs)):
        raise PatchError("; ".join(f"{label}: {p}" for label, problems in unfit.items() for p in problems))
    return originals


def check_key_tokens(originals: dict[str, int | None], *, context: int | None, short: int | None,
                     evaluator: str | None, limits: dict[str, tuple[int, str]] | None = None,
                     spelling: Spelling = FLAGS) -> None:
    """--key-context / --key-short against the evaluator's trained length (the model's own, unpatched, or
    ``evaluator``'s read from its skeleton), so that a short context that is not shorter, or a long one past what the
    evaluator can read (``limits``: :func:`context_limit` of each model, from :func:`check_fit`), is refused before
    any weights load. ``spelling``: how messages name the arguments."""
    from ..loading import model_skeleton
    from .keytokens import key_contexts

    limits = dict(limits or {})
    if evaluator is not None:
        skeleton = model_skeleton(evaluator)
        original = model_info(skeleton, evaluator)["original_length"]
        originals = {evaluator: original}
        found = context_limit(skeleton, original, saved=_saved_length(evaluator))
        limits = {evaluator: found} if found is not None else {}
    s = spelling
    for label, original in originals.items():
        try:
            key_contexts(context or original, short, s)
        except ValueError as exc:
            raise ValueError(f"{s.name('key_tokens')}: {label}: {exc}") from None
        limit, why = limits.get(label, (None, ""))
        if context and limit is not None and context > limit:
            who = f"the evaluator {label}" if evaluator is not None else f"the evaluator (the model itself, {label})"
            raise ValueError(f"{s.given('key_context', context)} is longer than {who} learned to read: {why}. Past "
                             f"that its long-context predictions are not ones it learned, so the key tokens it would "
                             f"find mean nothing; give {s.given('key_context', limit)} or less, or an "
                             f"{s.name('evaluator')} trained to {context} tokens")


def context_limit(skeleton, original: int | None, *, saved: int | None = None) -> tuple[int, str] | None:
    """The longest context a key-token evaluator reads as it learned to, and why: a learned position table's rows
    (a hard limit: past them there are no positions), else its trained length (``original``), or the length a patch
    saved with it extends that to (``saved``); None where the model states none."""
    from .runner import position_limit

    table = position_limit(skeleton)
    if saved:
        return saved, f"it is saved patched to {saved} tokens"
    if table is not None and (not original or table <= original):
        return table, f"its position table has {table} rows"
    if original:
        return original, f"it was trained to {original} tokens"
    return None


def _saved_length(source: str) -> int | None:
    """The length a ctxext patch saved in ``source``'s config extends it to (``patched_length``), or None."""
    from ..core.spec import CONFIG_KEY
    from ..loading import load_config

    try:
        saved = getattr(load_config(source), CONFIG_KEY, None)
    except (OSError, ValueError):
        return None
    length = saved.get("patched_length") if isinstance(saved, dict) else None
    return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None


def check_evaluator_tokenizer(model_tokenizer, evaluator: str, texts: list[str], spelling: Spelling = FLAGS) -> None:
    """Key tokens are compared token by token, so ``--evaluator`` must split the text as the model does: checked on
    the start of each text before any weights load (the runner checks every token once they are loaded)."""
    from .models import load_tokenizer

    sample = [t[:SAMPLE_CHARS] for t in texts[:SAMPLE_TEXTS]]
    ours, theirs = model_tokenizer, load_tokenizer(evaluator)
    if [ours(t, add_special_tokens=False)["input_ids"] for t in sample] != \
            [theirs(t, add_special_tokens=False)["input_ids"] for t in sample]:
        raise ValueError(f"{spelling.given('evaluator', evaluator)}: its tokenizer splits the text differently from "
                         "the model's; key tokens are compared token by token, so the evaluator must share the "
                         "tokenizer")


#: How much of the data the evaluator's tokenizer is compared on before the weights load.
SAMPLE_TEXTS, SAMPLE_CHARS = 4, 20_000
