"""One evaluation as asked for: :class:`EvalRequest`, frozen and validated once, whoever builds it.

``ctxext.evaluate(...)`` builds it from its keyword arguments, ``ctxext eval`` from its command line. Building it
checks every value on its own (types, ranges, method names and options, task names); :func:`~.plan.plan_eval` then
checks what needs the files and the model's structure, before anything loads. Nothing downstream edits the request.

(:mod:`.requests` holds the single patches of a request's ``methods``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .passkey import DEFAULT_DEPTHS
from .requests import MethodChoice, parse_factor
from .tasks import PASSKEY, PPL, parse_tasks
from .windows import PROTOCOLS

#: The most task samples (per task, method and length) and passkey trials (per length and depth) a run takes: each
#: is a greedy generation at the full length, and the list of samples is built whole before the first one runs
#: (RULER's own default is 500 samples per task).
MAX_TASK_SAMPLES = 10_000
MAX_PASSKEY_TRIALS = 10_000


# -- values of single arguments (the command turns their ValueError into a usage error) ---------------------------
def parse_lengths(text: str) -> list[int]:
    """``512,1024,2k`` -> [512, 1024, 2048], sorted, each once."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1024 if part.endswith("k") else 1
        try:
            number = float(part.rstrip("k")) * scale
        except ValueError:
            raise ValueError(f"not a length: {part!r} (e.g. 512,1024,2k)") from None
        if not number.is_integer() or number < 2:
            raise ValueError(f"a length must be a whole number of tokens >= 2, got {part!r}")
        out.append(int(number))
    if not out:
        raise ValueError("no lengths given (e.g. 512,1024,2k)")
    return sorted(set(out))


def parse_depths(text: str) -> tuple[float, ...]:
    """``0,.5,1`` -> needle depths, fractions of the context."""
    try:
        depths = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected numbers between 0 and 1, got {text!r}") from None
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths are fractions of the context, between 0 and 1; got {text!r}")
    return depths


def parse_count(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def parse_task_samples(text: str) -> int:
    """``--task-samples``: a whole number from 1 to ``MAX_TASK_SAMPLES``."""
    return _bounded_count(text, MAX_TASK_SAMPLES, "samples per task, method and length")


def parse_passkey_trials(text: str) -> int:
    """``--passkey-trials``: a whole number from 1 to ``MAX_PASSKEY_TRIALS``."""
    return _bounded_count(text, MAX_PASSKEY_TRIALS, "trials per length and depth")


def _bounded_count(text: str, maximum: int, what: str) -> int:
    value = parse_count(text)
    if value > maximum:
        raise ValueError(f"at most {maximum:,} {what} (each is a generation at the full length), got {value:,}")
    return value


def parse_factor_argument(text: str) -> float:
    """``--factor``: a number between 1 and the cap."""
    try:
        return parse_factor(text, "--factor")
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix("--factor: ")) from None


def parse_measures(tasks: str | None, *, passkey: bool) -> list[str]:
    """What the run measures: ``tasks`` (ppl, passkey, task names; default ppl), ``passkey`` adding passkey."""
    measures = parse_tasks(tasks) if tasks is not None else [PPL]
    if passkey and PASSKEY not in measures:
        measures.append(PASSKEY)
    return measures


# -- the request ---------------------------------------------------------------------------------------------------
def is_model_object(model: Any) -> bool:
    """Whether ``model`` is a loaded model (a torch module with a config), not a name to load."""
    return hasattr(model, "config") and callable(getattr(model, "forward", None))


@dataclass(frozen=True)
class EvalRequest:
    """Everything one evaluation needs to know, checked on construction (``ValueError`` / ``PatchError`` naming the
    argument). Field names follow ``ctxext.evaluate``'s keyword arguments; the command line's flags map onto them
    (``--option`` -> ``options``, ``--no-chat-template`` -> ``chat_template=False``, ``--no-progress`` ->
    ``progress=False``)."""

    #: A hub id, a local folder, ``reference:NAME``, or a loaded model object; None: the shipped reference models.
    model: Any = None
    #: The tokenizer of a model object (required with one); loaded from ``model`` otherwise.
    tokenizer: Any = None
    gguf_file: str | None = None
    adapter: str | None = None
    dtype: str | None = None
    device: str | None = None
    #: ``"none,pi,yarn:8"``, or a list of such names and ``(method, factor[, options])`` tuples; None: the default set.
    methods: Any = None
    factor: float | None = None
    #: Method options: ``KEY=VALUE`` / ``METHOD.KEY=VALUE`` strings, or a dict of them.
    options: Any = ()
    lengths: Any = None
    #: A text file, folder, JSONL, dataset name or folder; or a list of strings, or a ``datasets.Dataset``.
    data: Any = None
    data_split: str = "test"
    text_field: str = "text"
    protocol: str = "sliding"
    stride: int | None = None
    max_windows: int | None = None
    max_tokens: int | None = None
    batch_size: int | None = None
    #: ``"ppl,passkey,niah_single_1"`` or a list of names; None: ppl (plus passkey with ``passkey=True``).
    tasks: Any = None
    task_samples: int = 10
    task_depths: Any = DEFAULT_DEPTHS
    chat_template: bool = True
    passkey: bool = False
    passkey_depths: Any = DEFAULT_DEPTHS
    passkey_trials: int = 2
    seed: int = 0
    key_tokens: bool = False
    evaluator: str | None = None
    key_context: int | None = None
    key_short: int | None = None
    #: The results JSON (rows also go to a .jsonl beside it as they finish); None: nothing is written.
    output: str | None = None
    resume: bool = False
    overwrite: bool = False
    plot: str | None = None
    heatmap: str | None = None
    progress: bool = True
    #: The default offline run of the reference models (``ctxext demo``, or no ``model``).
    demo: bool = False
    #: What messages call the run (``ctxext eval: error: ...``).
    command: str = "eval"
    #: Set on construction: the methods parsed once, and the texts of ``data`` given as strings or a dataset.
    choice: MethodChoice = field(init=False, repr=False, compare=False)
    texts: tuple[str, ...] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: each normalised value is set once, here
        if self.model is None:
            put(self, "demo", True)
        held = is_model_object(self.model)
        if held:
            if self.tokenizer is None:
                raise ValueError("tokenizer: a model object needs its tokenizer (evaluate(model, tokenizer=...))")
            given = [n for n in ("gguf_file", "adapter", "dtype", "device") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: applies to a model that ctxext loads; a model object is "
                                 "evaluated as it is (load it with these settings, or pass its name)")
        elif self.model is not None:
            if not isinstance(self.model, (str, Path)):
                raise ValueError(f"model: expected a hub id, a local folder or a model object, got "
                                 f"{type(self.model).__name__}")
            put(self, "model", str(self.model))
            if self.tokenizer is not None:
                raise ValueError("tokenizer: given with a model name; the tokenizer is loaded from the model's files")
        for name in ("gguf_file", "adapter", "evaluator", "output", "plot", "heatmap"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, Path)) or not str(value):
                    raise ValueError(f"{name}: expected a path, got {value!r}")
                put(self, name, str(value))
        for name in ("stride", "max_windows", "max_tokens", "batch_size", "key_context", "key_short"):
            _check_count(name, getattr(self, name), optional=True)
        for name, maximum in (("task_samples", MAX_TASK_SAMPLES), ("passkey_trials", MAX_PASSKEY_TRIALS)):
            _check_count(name, getattr(self, name), maximum=maximum)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: expected a whole number, got {self.seed!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: choose one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.factor is not None:
            put(self, "factor", parse_factor(self.factor, "factor"))
        put(self, "lengths", _lengths(self.lengths))
        put(self, "task_depths", _depths("task_depths", self.task_depths))
        put(self, "passkey_depths", _depths("passkey_depths", self.passkey_depths))
        if self.tasks is not None and not isinstance(self.tasks, str):
            put(self, "tasks", ",".join(map(str, self.tasks)))
        if self.tasks is not None:
            parse_measures(self.tasks, passkey=False)  # unknown names: before anything else is looked at
        put(self, "options", _options(self.options))
        put(self, "choice", _choice(self.methods, self.options))
        if self.methods is not None and not isinstance(self.methods, str):
            put(self, "methods", _methods_as_given(self.methods))
        put(self, "texts", _texts(self.data, self.text_field))
        if self.texts is not None:
            put(self, "data", None)
        if self.resume and self.output is None:
            raise ValueError("resume: needs output= (the results to continue)")
        if self.overwrite and self.output is None:
            raise ValueError("overwrite: needs output= (the results to replace)")

    @property
    def holds_model(self) -> bool:
        """Whether the model is an object the caller holds (evaluated in place, and given back as it was)."""
        return is_model_object(self.model)

    def as_given(self) -> dict[str, Any]:
        """The methods, factor, options and lengths as given: part of what a resume must match."""
        return {"methods": self.methods, "factor": self.factor, "options": sorted(self.choice.options),
                "lengths": self.lengths}

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]


def _check_count(name: str, value: Any, *, optional: bool = False, maximum: int | None = None) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (maximum and value > maximum):
        bound = f"from 1 to {maximum:,}" if maximum else ">= 1"
        raise ValueError(f"{name}={value!r}: expected a whole number {bound}")


def _lengths(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_lengths(value)
        except ValueError as exc:
            raise ValueError(f"lengths: {exc}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    try:
        return parse_lengths(",".join(str(int(v)) if isinstance(v, int) and not isinstance(v, bool) else repr(v)
                                      for v in value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"lengths: {exc}") from None


def _depths(name: str, value: Any) -> tuple[float, ...]:
    text = value if isinstance(value, str) else ",".join(repr(float(v)) if _real(v) else repr(v) for v in value)
    try:
        return parse_depths(text)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _options(value: Any) -> tuple[str, ...]:
    """Method options as ``KEY=VALUE`` strings (the command line's form; a dict's values written with ``str``)."""
    if value is None:
        return ()
    if isinstance(value, dict):
        return tuple(f"{k}={v}" for k, v in value.items())
    if isinstance(value, str):
        value = [value]
    out = tuple(value)
    if not all(isinstance(o, str) for o in out):
        raise ValueError(f"options: expected KEY=VALUE strings or a dict, got {value!r}")
    return out


def _method_items(methods: Any) -> list:
    """A list of methods; one ``(method, factor, options)`` tuple given alone is a list of one."""
    if isinstance(methods, tuple) and methods and isinstance(methods[0], str) and len(methods) <= 3 and (
            len(methods) == 1 or not isinstance(methods[1], str)):
        return [methods]
    return list(methods)


def _choice(methods: Any, options: tuple[str, ...]) -> MethodChoice:
    """``methods`` parsed once: a spec string as ``--methods``; a list of names and ``(method, factor[, options])``."""
    if methods is None or isinstance(methods, str):
        return MethodChoice.parse(methods or None, options=list(options))
    names, own = [], []
    for item in _method_items(methods):
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, (tuple, list)) and 1 <= len(item) <= 3 and isinstance(item[0], str):
            method, factor, opts = (*item, None, None)[:3]
            if opts is not None and not isinstance(opts, dict):
                raise ValueError(f"methods: the options of {item!r} must be a dict")
            spec = method if factor is None else f"{method}:{parse_factor(factor, f'methods: {method}')!r}"
            names.append(spec)
            own += [f"{method.strip().lower()}.{k}={v}" for k, v in (opts or {}).items()]
        else:
            raise ValueError(f"methods: expected names like 'yarn:8' or (method, factor, options) tuples, got {item!r}")
    return MethodChoice.parse(",".join(names), options=list(options) + own)


def _methods_as_given(methods: Any) -> str:
    """A list of methods in the command line's spelling (what a resume compares, as for ``--methods``)."""
    parts = []
    for item in _method_items(methods):
        if isinstance(item, str):
            parts.append(item)
        else:
            method, factor, opts = (*item, None, None)[:3]
            parts.append(method if factor is None else f"{method}:{float(factor):g}")
    return ",".join(parts)


def _texts(data: Any, text_field: str) -> tuple[str, ...] | None:
    """The documents of ``data`` given as strings or as a ``datasets.Dataset``; None for a path or name."""
    if data is None or isinstance(data, (str, Path)):
        return None
    columns = getattr(data, "column_names", None)
    if columns is not None and not isinstance(columns, dict):  # a datasets.Dataset
        if text_field not in columns:
            raise ValueError(f"data: the dataset has no {text_field!r} column (columns: {', '.join(columns)}); "
                             "give text_field=")
        data = data[text_field]
    elif hasattr(data, "keys"):
        raise ValueError("data: a DatasetDict holds several splits; pass one (e.g. data=ds['test'])")
    texts = tuple(data)
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("data: expected a path, a list of strings or a datasets.Dataset")
    texts = tuple(t for t in texts if t.strip())
    if not texts:
        raise ValueError("data: no text found")
    return texts
