"""One evaluation run from its plan (:class:`~.plan.EvalPlan`): the processes' state, the output held against other
runs, the result store (``--resume``), the runner over the models, and the final document, written also after
Ctrl-C or an error."""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..core.outputs import OutputLock
from .device import make_state
from .report import results_document
from .request import spelling_for
from .results import ResultStore, check_output, jsonl_path
from .runner import Outcome, Runner


@dataclass
class Finished:
    """What a run left: its rows in plan order, the runner's outcome, the final document and whether it was
    written (None: nothing finished in this run, an earlier result stays)."""

    store: ResultStore
    rows: list[dict[str, Any]]
    outcome: Outcome
    document: dict[str, Any]
    written: Path | None


@contextlib.contextmanager
def open_run(plan) -> Iterator[Any]:
    """The accelerate state of this process; the main process holds the output from before the first model loads
    to the last write (one writer per output)."""
    state = make_state(plan.device)
    s = spelling_for(getattr(plan, "command", "eval"))  # a plan-like object without one: the command's flags
    with contextlib.ExitStack() as stack:
        if state.is_main_process and plan.output is not None:
            flag, given = s.name("output"), s.given("output", plan.output)
            stack.enter_context(OutputLock(plan.output, flag, subject=given))
            # X.json and X.txt keep their rows in one X.jsonl: a run on the other name must wait for this one too
            rows = jsonl_path(plan.output)
            stack.enter_context(OutputLock(rows, flag, subject=f"{given}: its rows file {rows}"))
            # again: another run may have ended
            check_output(plan.output, resume=plan.resume, overwrite=plan.overwrite, spelling=s)
        yield state


def _planned_only(rows: list[dict], plan, outcome, runner) -> list[dict]:
    """A finished run's rows without resumed ones its plan does not hold (a rows file edited by hand: another model,
    method or length would reach the tables and the verdict). Rows of a model whose job did not run are kept."""
    from .results import row_key

    planned = set(outcome.planned)
    ran = {key[1] for key in planned}
    labels = {job.label for job in plan.jobs}
    stray = [r for r in rows if row_key(r) not in planned and (r.get("model") not in labels or r.get("model") in ran)]
    if stray:
        runner.log(f"resume: {len(stray)} row(s) of the rows file are not part of this run's plan (e.g. "
                   f"{stray[0].get('model')} {stray[0].get('label')} at {stray[0].get('length')}); left out of "
                   "the results")
    dropped = {id(r) for r in stray}
    return [r for r in rows if id(r) not in dropped]


def run_plan(plan, state) -> Finished:
    """Run every job of ``plan``; the final document holds every finished row, also when the run is cut short."""
    store = ResultStore(plan.output, plan.fingerprint(), resume=plan.resume, enabled=state.is_main_process,
                        pictures=plan.pictures, spelling=spelling_for(plan.command))
    runner = Runner(plan.settings, store, state, command=plan.command)
    for problem in store.rejected:
        runner.log(f"resume: {problem}; not kept, recomputed")
    if store.resumed:
        runner.log(f"resuming: {store.resumed} finished row(s) in {store.jsonl}"
                   + (f"; {store.dropped} unreadable line(s) (a write cut by a kill) will be recomputed"
                      if store.dropped else ""))
    started = datetime.datetime.now(datetime.timezone.utc)
    completed = False
    try:
        runner.run(plan.jobs)
        completed = True
    finally:  # also on Ctrl-C and errors: the final JSON holds every finished row (none: an earlier result stays)
        outcome = runner.outcome
        rows = store.ordered(outcome.planned)
        if completed:
            rows = _planned_only(rows, plan, outcome, runner)
        document = results_document(plan, started, state, outcome, rows)
        written = store.write_final(document)
    return Finished(store, rows, outcome, document, written)
