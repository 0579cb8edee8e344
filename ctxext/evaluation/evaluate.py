"""``ctxext.evaluate``: long-context perplexity, passkey and RULER-style tasks of several patches, from Python.

    results = ctxext.evaluate(model, tokenizer=tok, methods="none,yarn,ntk", lengths=[2048, 4096], tasks="ppl,passkey")
    print(results.table())

``ctxext eval`` is this function behind a command line: both build one :class:`~.request.EvalRequest`, plan it
(every check, before anything loads) and run it.
"""

from __future__ import annotations

from typing import Any, Callable

from .request import PYTHON, EvalRequest
from .result_set import EvalResults


def evaluate(model: Any = None, tokenizer: Any = None, **settings: Any) -> EvalResults:
    """Evaluate ``model`` under several patches at several lengths; returns an :class:`EvalResults`.

    ``model``: a model object (with ``tokenizer``), a hub id, a local folder, ``reference:NAME``; None runs the
    default offline evaluation of the shipped reference models (``ctxext demo``). A model object is patched and
    unpatched in place and comes back as it was (the same logits and config), also when a method fails or the run
    is interrupted; one that is already patched is evaluated as it is.

    ``settings`` are the keyword forms of ``ctxext eval``'s flags (``help(ctxext.evaluation.EvalRequest)``), e.g.
    ``methods`` ("none,pi,yarn:8" or a list with ``(method, factor, options)`` tuples), ``factor``, ``options``
    (a dict), ``lengths`` (ints, or "2k,4k"), ``tasks`` ("ppl,passkey,niah_single_1", "ruler", ...), ``data`` (a
    path, dataset name, list of strings or ``datasets.Dataset``), ``key_tokens``, ``max_tokens``, ``seed``,
    ``progress``. With ``output=PATH`` rows are written as they finish and ``resume=True`` continues an
    interrupted run, as the command does; without it nothing is written. Under ``torchrun`` / ``accelerate
    launch`` the work is split between the processes and every process returns the same results.

    Bad arguments raise ``ValueError`` or ``ctxext.PatchError`` naming the argument before anything loads.
    """
    unknown = sorted(set(settings) - set(EvalRequest.names()) | ({"model", "tokenizer", "command"} & set(settings)))
    if unknown:
        known = ", ".join(n for n in EvalRequest.names() if n not in ("model", "tokenizer", "command"))
        raise TypeError(f"evaluate() got unknown argument(s) {', '.join(unknown)}; known: {known}")
    from .held import held_alone

    request = EvalRequest(model=model, tokenizer=tokenizer, command=PYTHON, **settings)
    with held_alone(request.model if request.holds_model else None):  # one call at a time patches a model object
        return run_request(request)


def run_request(request: EvalRequest, *, on_finished: Callable[[EvalResults], None] | None = None,
                on_picture: Callable[[str, str, str | None], None] | None = None) -> EvalResults:
    """Plan and run ``request``. On the main process, ``on_finished`` sees the results before the pictures are
    drawn, and ``on_picture(what, file, problem)`` each picture (``problem`` None where it was written)."""
    from .plan import plan_eval
    from .report import write_pictures
    from .session import open_run, run_plan

    plan = plan_eval(request)  # every check: nothing loaded or written yet
    with open_run(plan) as state:
        finished = run_plan(plan, state)
        outcome = finished.outcome
        results = EvalResults(rows=finished.rows, models=outcome.models, document=finished.document,
                              output=finished.written, errors=list(outcome.errors), interrupted=outcome.interrupted)
        if state.is_main_process:
            if on_finished is not None:
                on_finished(results)
            if finished.written is not None:
                for what, path, problem in write_pictures(plan, finished.rows, outcome.models, finished.document):
                    if problem is not None:
                        results.errors.append(problem)
                    if on_picture is not None:
                        on_picture(what, path, problem)
        state.wait_for_everyone()  # no process exits (and makes torchrun stop the others) before the files are written
    return results
