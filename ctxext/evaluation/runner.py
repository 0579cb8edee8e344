"""The evaluation loop: for each model, each requested patch and each length, score and record a row.

Rows are written as they finish (see :mod:`.results`); rows already present (``--resume``) are skipped;
a method that does not fit the model is reported and skipped while the others run.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..api import describe, patch, unpatch
from ..core.errors import PatchError
from .data import Texts, tokenize_texts
from .models import model_info
from .passkey import DEFAULT_DEPTHS, passkey_accuracy, passkey_prompt_check
from .keytokens import key_masks, needed_ranges
from .perplexity import plan_documents, score_documents
from .progress import RowProgress, progress_line
from .request import spelling_for
from .requests import ADAPTER_SUFFIX, MethodChoice, MethodRequest, check_request
from .results import ResultStore, row_key
from .tasks import Encoder, check_length, task_accuracy
from .tasks import sources as task_sources

#: Default lengths, as multiples of the model's original context length.
DEFAULT_MULTIPLES = (1, 2, 4, 8)


@dataclass
class Settings:
    """What to run on every model (see :mod:`.plan`, which builds them from the command line)."""

    #: The patches (``--methods``, parsed once); the default: every method that fits each model.
    methods: MethodChoice = field(default_factory=MethodChoice)
    lengths: list[int] | None = None
    protocol: str = "sliding"
    stride: int | None = None
    max_windows: int | None = None
    #: At most this many tokens fed per (method, length): ``max_tokens // length`` windows (at least 1).
    max_tokens: int | None = None
    #: Windows per forward pass; None: as many as make about 2048 tokens (at most 16).
    batch_size: int | None = None
    perplexity: bool = True
    passkey: bool = False
    passkey_depths: tuple[float, ...] = DEFAULT_DEPTHS
    passkey_trials: int = 2
    seed: int = 0
    progress: bool = True
    #: RULER-style tasks (``ctxext.evaluation.tasks``), run for every method x length beside perplexity.
    tasks: list[str] = field(default_factory=list)
    task_samples: int = 10
    task_depths: tuple[float, ...] = DEFAULT_DEPTHS
    chat_template: bool = True
    #: Key-token perplexity (``ctxext.evaluation.keytokens``) beside perplexity; the evaluator's long and short
    #: contexts (None: its trained length, and an eighth of that).
    key_tokens: bool = False
    key_context: int | None = None
    key_short: int | None = None

    def windows_for(self, length: int) -> int | None:
        caps = [c for c in (self.max_windows, None if self.max_tokens is None else max(1, self.max_tokens // length))
                if c is not None]
        return min(caps) if caps else None

    def batch_for(self, length: int) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return max(1, min(16, 2048 // length))

    def stride_for(self, length: int) -> int | None:
        if self.protocol != "sliding":
            return None
        return self.stride if self.stride is not None else max(1, length // 2)


#: What ``ModelJob.passkey`` may say.
PASSKEY_ASKED, PASSKEY_WHERE_IT_FITS, PASSKEY_NOT = "asked", "where it fits", "not"


@dataclass
class ModelJob:
    """One model to evaluate, and what to evaluate it with."""

    label: str
    load_tokenizer: Callable[[], Any]
    load_model: Callable[[Any], Any]  # called with the accelerate state (device placement)
    texts: Texts
    #: The factor of requests that name none; None: the longest length over the model's original length.
    factor: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: The model without weights (see :mod:`.preflight`), for checks before anything loads; None: no such checks.
    load_skeleton: Callable[[], Any] | None = None
    #: The key-token evaluator: (model, tokenizer, label) from the accelerate state; None: the model itself, unpatched.
    load_evaluator: Callable[[Any], tuple] | None = None
    #: Passkey for this model where the run measures it: PASSKEY_ASKED (every length; one its prompt does not fit is
    #: an error), PASSKEY_WHERE_IT_FITS (the demo's default: such a length is skipped with a note) or PASSKEY_NOT
    #: (none: the demo's reference models that were not trained to retrieve).
    passkey: str = PASSKEY_ASKED
    #: Gives the model back when the job is done, also after an error or Ctrl-C: None drops the model's patch (it
    #: was loaded for this run); a model object the caller holds is restored as it came (see :mod:`.held`).
    release: Callable[[Any], None] | None = None


def default_lengths(original: int) -> list[int]:
    return [int(original * m) for m in DEFAULT_MULTIPLES]


def default_factor(lengths: list[int], original: int | None) -> float | None:
    """The factor of requests that give none: the longest length over the model's original length (at least 1)."""
    return max(1.0, max(lengths) / original) if original else None


@dataclass
class Outcome:
    models: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    planned: list[tuple] = field(default_factory=list)
    interrupted: bool = False


class Runner:
    def __init__(self, settings: Settings, store: ResultStore, state, *, command: str = "eval"):
        self.settings = settings
        self.store = store
        self.state = state
        self.command = command
        self.spelling = spelling_for(command)  # how messages name the arguments: flags, or evaluate's keywords
        self.outcome = Outcome()
        self.main = state is None or state.is_main_process
        self._masks = None  # the current model's key tokens (one bool mask per document), when asked for
        self.progress = RowProgress()

    # -- messages (main process only) -------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.main:
            print(message, file=sys.stderr, flush=True)

    def error(self, message: str) -> None:
        self.outcome.errors.append(message)
        if self.main:
            print(f"ctxext {self.command}: error: {message}", file=sys.stderr, flush=True)

    # -- planning ---------------------------------------------------------------------------------
    def _lengths(self, info: dict[str, Any]) -> list[int]:
        if self.settings.lengths:
            return list(self.settings.lengths)
        original = info.get("original_length")
        if not original:
            raise ValueError(f"{info['label']}: the model advertises no context length; "
                             f"give {self.spelling.name('lengths')}")
        return default_lengths(original)

    def _requests(self, job: ModelJob, model, info: dict[str, Any], lengths: list[int]) -> list[MethodRequest]:
        loaded = info.get("loaded_patch")
        if self.settings.methods.given is None and loaded:
            return [MethodRequest(loaded["method"], loaded["factor"], dict(loaded.get("options") or {}))]
        factor = job.factor if job.factor is not None else default_factor(lengths, info.get("original_length"))
        return self.settings.methods.for_model(model, factor)

    # -- running ----------------------------------------------------------------------------------
    def run(self, jobs: list[ModelJob]) -> Outcome:
        try:
            for job in jobs:
                try:
                    self._run_job(job)
                except (OSError, ValueError) as exc:  # this model cannot be evaluated: say so, go on with the others
                    if len(jobs) == 1:
                        raise
                    self.error(f"{job.label}: {exc}")
        except KeyboardInterrupt:
            self.outcome.interrupted = True
            raise
        return self.outcome

    def _run_job(self, job: ModelJob) -> None:
        s = self.settings
        tokenizer = job.load_tokenizer()
        docs = tokenize_texts(tokenizer, job.texts.texts)
        sources = self._task_sources(job, tokenizer) if s.tasks else None
        task_plan = None
        if s.tasks and s.lengths:  # lengths known before the weights: a task that fits none is reported first
            task_plan = self._task_plan(job, sources, list(s.lengths))
            if not task_plan and not (s.perplexity or (s.passkey and job.passkey != PASSKEY_NOT)):
                return  # nothing to measure: the weights are not loaded
        model = job.load_model(self.state)
        try:
            self._run_model(job, model, tokenizer, docs, sources, task_plan)
        finally:
            if job.release is not None:
                job.release(model)
            elif describe(model) is not None:
                unpatch(model)
            del model

    def _unpatched(self, model) -> None:
        """Take the model's patch off (the one it loaded with, or a request's): the next request starts from the
        model without a patch."""
        if describe(model) is not None:
            unpatch(model)

    def _run_model(self, job: ModelJob, model, tokenizer, docs, sources, task_plan) -> None:
        s = self.settings
        info = model_info(model, job.info.get("model", job.label), label=job.label, **{k: v for k, v in job.info.items() if k != "model"})
        info["tokens"] = sum(int(d.numel()) for d in docs)
        info["methods"] = {}
        self.outcome.models.append(info)
        # the patch the model loaded with (saved in its config, or recorded beside its --adapter): the request that
        # names it is evaluated on the model exactly as loaded, before anything unpatches it (an adapter may have
        # trained patched modules, e.g. GPT-2's interpolated position table, that a re-applied patch would not have)
        loaded = describe(model)
        lengths = self._lengths(info)
        longest = max(int(d.numel()) for d in docs)
        usable = []
        for length in lengths:
            if length > longest and s.perplexity:
                self.error(
                    f"{job.label}: length {length} is longer than every document "
                    f"(the longest has {longest} tokens); skipped"
                )
            else:
                usable.append(length)
        requests = []
        for req in self._requests(job, model, info, lengths):
            if not req.matches(loaded):  # the loaded patch fits as it is; any other is checked on the plain model
                self._unpatched(model)
                try:
                    check_request(model, req, self.spelling)
                except PatchError as exc:
                    if s.methods.given is None:  # the default set: a method that fits the family but not these settings
                        self.log(f"{job.label}: {req.label} skipped: {exc}")
                    else:
                        self.error(f"{job.label}: {exc}")
                    continue
            requests.append(req)
        self._masks = None
        if s.key_tokens and s.perplexity and any(self.store.done(("ppl", job.label, r.method, r.factor, n)) is None
                                                 for r in requests for n in usable):  # not when every row resumed
            if job.load_evaluator is None:
                self._unpatched(model)  # the model itself, unpatched, is the evaluator
            self._masks = self._key_masks(job, model, info, docs, usable)
        plan = [("ppl", L) for L in usable] if s.perplexity else []
        if s.passkey and job.passkey != PASSKEY_NOT:
            for length in lengths:
                try:
                    passkey_prompt_check(tokenizer, length)
                except ValueError as exc:
                    (self.log if job.passkey == PASSKEY_WHERE_IT_FITS else self.error)(
                        f"{job.label}: {exc}; no passkey at this length")
                    continue
                plan.append(("passkey", length))
        if s.tasks:
            plan += task_plan if task_plan is not None else self._task_plan(job, sources, lengths)
        plan.sort(key=lambda p: (p[1], p[0] != "ppl"))
        keys = []
        for req in requests:
            keys.append([(kind, job.label, req.method, req.factor, L) for kind, L in plan])
            self.outcome.planned.extend(keys[-1])
            for key in keys[-1]:  # a row resumed from a run that labelled it otherwise (before adapter labels)
                done = self.store.done(key)
                if done is not None and done.get("label") != row_label(req, job):
                    done["label"] = row_label(req, job)
        self._announce(job, requests, keys)
        # the request that is the loaded patch first, while the model is still as loaded
        current = describe(model)
        for number in sorted(range(len(requests)), key=lambda n: not requests[n].matches(current)):
            req, label = requests[number], row_label(requests[number], job)
            todo = [k for k in keys[number] if self.store.done(k) is None]
            if not todo:
                continue
            if not (loaded is not None and req.matches(loaded) and describe(model) == loaded):
                self._unpatched(model)
                loaded = None  # the model as loaded is gone: a later request matching it is applied again
                try:
                    call = req.patch_call()
                    if call is not None:
                        method, factor, options = call
                        patch(model, method, factor, **options)
                except PatchError as exc:
                    self.error(f"{job.label}: {exc}")
                    continue
            spec = describe(model)
            info["methods"][label] = spec
            limit = position_limit(model)
            for kind, _, _, _, length in todo:
                where = f"{job.label} {label} L={length}"
                if limit is not None and length > limit:
                    # a learned position table (GPT-2's wpe) has no row for these positions
                    row = {"ppl": None, "accuracy": None,
                           "not_applicable": f"the position table has {limit} rows; length {length} needs more"}
                    self.log(f"{where}: n/a ({row['not_applicable']})")
                else:
                    try:
                        row = self._score(kind, model, tokenizer, docs, length, sources)
                    except ValueError as exc:
                        self.error(f"{where}: {exc}")
                        continue
                ident = dict(kind=kind, model=job.label, method=req.method, factor=req.factor, length=length,
                             label=label)
                row = {**ident, **{k: v for k, v in row.items() if k not in ident}, "spec": spec}
                self.store.add(row)
                self.progress.row_done(row.get("seconds"))
                if "not_applicable" not in row:
                    self.log(f"{self.progress.prefix()} {progress_line(row)}{self.progress.eta()}")
        for req in requests:  # labels of rows finished in an earlier (resumed) run
            info["methods"].setdefault(row_label(req, job),
                                       None if req.patch_call() is None else _spec_of(self.store, job.label, req))

    def _announce(self, job: ModelJob, requests: list[MethodRequest], keys: list[list[tuple]]) -> None:
        """Say what this model's part of the run holds before its first row: rows to run, rows resumed."""
        planned = sum(len(k) for k in keys)
        todo = sum(1 for k in keys for key in k if self.store.done(key) is None)
        self.progress.add(todo)
        lengths = sorted({key[4] for k in keys for key in k})
        measures = sorted({key[0] for k in keys for key in k})
        resumed = f", {planned - todo} resumed" if planned > todo else ""
        self.log(f"{job.label}: {todo} row(s) to run ({len(requests)} method(s) x {len(lengths)} length(s) x "
                 f"{', '.join(measures) or 'nothing'}{resumed})")

    def _key_masks(self, job: ModelJob, model, info: dict[str, Any], docs, usable: list[int]):
        """The key tokens among every target the perplexity windows will score, found once per model by the
        evaluator (the model itself, unpatched, unless the job names another)."""
        s = self.settings
        plans = [plan_documents(docs, n, protocol=s.protocol, stride=s.stride_for(n), max_windows=s.windows_for(n))[0]
                 for n in usable]
        if job.load_evaluator is None:
            evaluator, label, context = model, "the model itself, unpatched", info.get("original_length")
        else:
            evaluator, ev_tokenizer, label = job.load_evaluator(self.state)
            if [d.tolist() for d in tokenize_texts(ev_tokenizer, job.texts.texts)] != [d.tolist() for d in docs]:
                raise ValueError(f"{self.spelling.given('evaluator', label)}: its tokenizer splits the text "
                                 "differently from the model's; key tokens are compared token by token, so the "
                                 "evaluator must share the tokenizer")
            context = model_info(evaluator, label, label=label).get("original_length")
        context = s.key_context or context
        if not context:
            raise ValueError(f"{job.label}: the key-token evaluator advertises no context length; "
                             f"give {self.spelling.name('key_context')}")
        masks, found = key_masks(evaluator, docs, needed_ranges(plans, len(docs)), context=context, short=s.key_short,
                                 state=self.state, progress=s.progress, spelling=self.spelling)
        found["evaluator"] = label
        info["key_tokens"] = found
        share = found["key_tokens"] / found["positions"] if found["positions"] else 0.0
        self.log(f"{job.label}: key tokens: {found['key_tokens']} of {found['positions']} scored positions "
                 f"({100 * share:.1f}%), by {label} (context {found['context']}, short {found['short']})")
        if evaluator is not model:
            del evaluator
        return masks

    def _task_plan(self, job: ModelJob, sources, lengths: list[int]) -> list[tuple[str, int]]:
        """(task, length) for every task that fits a length; the others are reported and skipped."""
        plan = []
        for task in self.settings.tasks:
            for length in lengths:
                try:
                    check_length(task, sources, length, seed=self.settings.seed)
                except ValueError as exc:
                    self.error(f"{job.label}: {exc}; skipped")
                    continue
                plan.append((task, length))
        return plan

    def _task_sources(self, job: ModelJob, tokenizer):
        """The tokenizer's haystacks: prose from the job's texts, RULER's noise sentence."""
        return task_sources(Encoder(tokenizer, chat_template=self.settings.chat_template, spelling=self.spelling), job.texts.texts)

    def _score(self, kind: str, model, tokenizer, docs, length: int, sources=None) -> dict[str, Any]:
        s = self.settings
        start = time.perf_counter()
        if kind == "ppl":
            row = score_documents(
                model, docs, length, protocol=s.protocol, stride=s.stride_for(length), max_windows=s.windows_for(length),
                batch_size=s.batch_for(length), progress=s.progress, state=self.state, key_masks=self._masks,
            )
        elif kind != "passkey":
            row = task_accuracy(model, sources, kind, length, samples=s.task_samples, depths=s.task_depths,
                                seed=s.seed, state=self.state, progress=s.progress)
        else:
            row = passkey_accuracy(
                model, tokenizer, length, depths=s.passkey_depths, trials=s.passkey_trials, seed=s.seed,
                state=self.state, progress=s.progress,
            )
        seconds = time.perf_counter() - start
        row["seconds"] = round(seconds, 3)
        if kind == "ppl" and seconds > 0:
            row["tokens_per_second"] = round(row["tokens"] / seconds, 1)
        row["processes"] = 1 if self.state is None else self.state.num_processes
        if kind == "ppl":
            row["batch_size"] = s.batch_for(length)
        return row


def row_label(req: MethodRequest, job: ModelJob) -> str:
    """The label of ``req``'s rows: the method's, with ``+LoRA`` where the model was loaded with an adapter."""
    return req.label + (ADAPTER_SUFFIX if job.info.get("adapter") else "")


def position_limit(model) -> int | None:
    """How many positions the model can take at all (a learned table's rows; the model's family decides), or
    None if unbounded."""
    from ..adapters import adapter_for
    from ..api import base_model

    plain = base_model(model)
    return adapter_for(plain).position_limit(plain)


def _spec_of(store: ResultStore, label: str, req: MethodRequest):
    for row in store.rows.values():
        if row.get("model") == label and row_key(row)[2:4] == (req.method, req.factor):
            return row.get("spec")
    return None
