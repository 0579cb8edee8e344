"""One evaluation as asked for: :class:`EvalRequest`, frozen and validated once, whoever builds it.

``ctxext.evaluate(...)`` builds it from its keyword arguments, ``ctxext eval`` from its command line. Building it
checks every value on its own (types, ranges, method names and options, task names); :func:`~.plan.plan_eval` then
checks what needs the files and the model's structure, before anything loads. Nothing downstream edits the request.

(:mod:`.requests` holds the single patches of a request's ``methods``.)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from itertools import chain
from pathlib import Path
from typing import Any

from .device import DEVICES, DTYPES
from .passkey import DEFAULT_DEPTHS
from .requests import FLAGS, KEYWORDS, MethodChoice, Spelling, method_names, no_methods, parse_factor
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


#: What ``command`` is when ``ctxext.evaluate`` built the request (its messages name keywords, not flags).
PYTHON = "evaluate"


def spelling_for(command: str) -> Spelling:
    """How the messages of a run started by ``command`` name its arguments: ``ctxext.evaluate``'s keywords, or the
    command line's flags."""
    return KEYWORDS if command == PYTHON else FLAGS


#: The arguments that are True or False.
SWITCHES = ("chat_template", "passkey", "key_tokens", "resume", "overwrite", "progress", "demo")


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
        s = self.spelling
        for name in SWITCHES:  # a string is truthy: overwrite="False" would replace a finished run
            put(self, name, _switch(s.name(name), getattr(self, name)))
        if self.model is None:
            put(self, "demo", True)
        held = is_model_object(self.model)
        if held:
            _check_held(self.model, self.tokenizer)
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
            put(self, name, _count(name, getattr(self, name), optional=True))
        for name, maximum in (("task_samples", MAX_TASK_SAMPLES), ("passkey_trials", MAX_PASSKEY_TRIALS)):
            put(self, name, _count(name, getattr(self, name), maximum=maximum))
        if not _whole(self.seed):
            raise ValueError(f"seed: expected a whole number, got {self.seed!r}")
        put(self, "seed", int(self.seed))
        for name in ("data_split", "text_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{s.name(name)}: expected a name, got {getattr(self, name)!r}")
        for name, choices in (("protocol", PROTOCOLS), ("dtype", DTYPES), ("device", DEVICES)):
            value = getattr(self, name)
            if (value is not None or name == "protocol") and (not isinstance(value, str) or value not in choices):
                raise ValueError(f"{s.name(name)} must be one of {', '.join(choices)}, got {value!r}")
        if self.factor is not None:
            put(self, "factor", parse_factor(self.factor, s.name("factor")))
        put(self, "lengths", _lengths(self.lengths))
        put(self, "task_depths", _depths("task_depths", self.task_depths))
        put(self, "passkey_depths", _depths("passkey_depths", self.passkey_depths))
        put(self, "tasks", _tasks(self.tasks))
        self._check_measures(s)  # unknown task names: before anything else is looked at
        put(self, "options", _options(self.options))
        put(self, "choice", _choice(self.methods, self.options, s))
        if self.methods is not None and not isinstance(self.methods, str):
            put(self, "methods", _methods_as_given(self.methods))
        put(self, "texts", _texts(self.data, self.text_field))
        if self.texts is not None:
            put(self, "data", None)
        for name, what in (("resume", "the results to continue"), ("overwrite", "the results to replace")):
            if getattr(self, name) and self.output is None:
                raise ValueError(f"{s.name(name)}: needs {s.name('output')} ({what})")
        if self.resume and self.overwrite:
            raise ValueError(f"{s.on('resume')} keeps the finished rows and {s.on('overwrite')} discards them: "
                             "give one of them")

    def _check_measures(self, s: Spelling) -> None:
        """The task names, and the key-token settings against them and each other."""
        try:
            measures = parse_measures(self.tasks, passkey=self.passkey)
        except ValueError as exc:  # the task catalogue names the flag: said as this request names it
            raise ValueError(s.name("tasks") + str(exc).removeprefix("--tasks")) from None
        if self.key_tokens and PPL not in measures:
            raise ValueError(f"{s.name('key_tokens')} is a perplexity: add ppl to {s.name('tasks')}")
        if not self.key_tokens and (self.evaluator or self.key_context or self.key_short):
            raise ValueError(f"{s.name('evaluator')}, {s.name('key_context')} and {s.name('key_short')} need "
                             f"{s.on('key_tokens')}")
        if self.key_context and self.key_short and self.key_short >= self.key_context:
            raise ValueError(f"{s.given('key_short', self.key_short)} must be shorter than "
                             f"{s.given('key_context', self.key_context)}")
        if self.demo and (self.gguf_file or self.adapter or self.evaluator):
            raise ValueError(f"{s.name('gguf_file')}, {s.name('adapter')} and {s.name('evaluator')} need "
                             f"{s.name('model')}")

    @property
    def spelling(self) -> Spelling:
        """How messages name this request's arguments: keywords from ``ctxext.evaluate``, flags from the command."""
        return spelling_for(self.command)

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


def _whole(value: Any) -> bool:
    """An int or a numpy integer; not a bool (True is not a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and not _is_bool(value)


def _is_bool(value: Any) -> bool:
    """True or False, also as numpy.bool_ (``array.all()`` gives one)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def _switch(name: str, value: Any) -> bool:
    if not _is_bool(value):
        raise ValueError(f"{name}: expected True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def _count(name: str, value: Any, *, optional: bool = False, maximum: int | None = None) -> int | None:
    """``value`` as an int from 1 to ``maximum``; None where ``optional`` and not given."""
    if value is None and optional:
        return None
    if not _whole(value) or value < 1 or (maximum and value > maximum):
        bound = f"from 1 to {maximum:,}" if maximum else ">= 1"
        raise ValueError(f"{name}={value!r}: expected a whole number {bound}")
    return int(value)


def _check_held(model: Any, tokenizer: Any) -> None:
    """A model object with weights to compute with, and a tokenizer object (a name is not loaded for it)."""
    if tokenizer is None:
        raise ValueError("tokenizer: a model object needs its tokenizer (evaluate(model, tokenizer=...))")
    if isinstance(tokenizer, (str, Path)):
        raise ValueError(f"tokenizer: expected the model's tokenizer object, got the name {str(tokenizer)!r}; load "
                         "it (AutoTokenizer.from_pretrained(NAME)) and pass it, or pass the model by name too")
    if not callable(tokenizer):
        raise ValueError(f"tokenizer: expected the model's tokenizer object (e.g. from AutoTokenizer.from_pretrained), "
                         f"got {type(tokenizer).__name__}")
    tensors = chain(getattr(model, "parameters", tuple)(), getattr(model, "buffers", tuple)())
    if any(getattr(getattr(t, "device", None), "type", None) == "meta" for t in tensors):
        raise ValueError("model: its weights are on the meta device (a skeleton without values); load them first "
                         "(from_pretrained without init_empty_weights / device_map='meta', or load_state_dict with "
                         "assign=True), or pass the model's name")


def _lengths(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_lengths(value)
        except ValueError as exc:
            raise ValueError(f"lengths: {exc}") from None
    if _whole(value):
        value = [value]
    if not _iterable(value):
        raise ValueError(f"lengths: expected whole numbers of tokens (e.g. [512, 1024]) or a string such as "
                         f"'512,1k', got {value!r}")
    try:
        return parse_lengths(",".join(str(int(v)) if _whole(v) else repr(v) for v in value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"lengths: {exc}") from None


def _depths(name: str, value: Any) -> tuple[float, ...]:
    if _real(value):
        value = [value]
    if not isinstance(value, str) and not _iterable(value):
        raise ValueError(f"{name}: expected fractions of the context between 0 and 1 (e.g. [0, 0.5, 1]), "
                         f"got {value!r}")
    text = value if isinstance(value, str) else ",".join(repr(float(v)) if _real(v) else repr(v) for v in value)
    try:
        return parse_depths(text)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value) and math.isfinite(value)


def _iterable(value: Any) -> bool:
    """A list-like of items (not a string, bytes or mapping, which iterate as something else)."""
    if isinstance(value, (str, bytes, dict)) or hasattr(value, "keys"):
        return False
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _tasks(value: Any) -> str | None:
    """Task names as ``--tasks`` spells them; a list of names joined."""
    if value is None or isinstance(value, str):
        return value
    if not _iterable(value) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"tasks: expected task names, as a string ('ppl,passkey') or a list of strings, got {value!r}")
    return ",".join(value)


def _options(value: Any) -> tuple[str, ...]:
    """Method options as ``KEY=VALUE`` strings (the command line's form; a dict's values written with ``str``)."""
    if value is None:
        return ()
    if isinstance(value, dict):
        return tuple(f"{k}={v}" for k, v in value.items())
    if isinstance(value, str):
        value = [value]
    if not _iterable(value) or not all(isinstance(o, str) for o in value):
        raise ValueError(f"options: expected KEY=VALUE strings or a dict, got {value!r}")
    return tuple(value)


def _method_items(methods: Any) -> list:
    """A list of methods; one ``(method, factor, options)`` tuple given alone is a list of one."""
    if isinstance(methods, tuple) and methods and isinstance(methods[0], str) and len(methods) <= 3 and (
            len(methods) == 1 or not isinstance(methods[1], str)):
        return [methods]
    return list(methods)


def _choice(methods: Any, options: tuple[str, ...], spelling: Spelling) -> MethodChoice:
    """``methods`` parsed once: a spec string as ``--methods``; a list of names and ``(method, factor[, options])``.
    None is the default set; a string or list that names no method is refused (not taken as the default: that set
    runs every method that fits, hours on a real model)."""
    if isinstance(methods, str) and not method_names(methods):
        raise ValueError(no_methods(spelling))
    if methods is None or isinstance(methods, str):
        return MethodChoice.parse(methods, options=list(options), spelling=spelling)
    if not isinstance(methods, (list, tuple)):
        raise ValueError(f"{spelling.name('methods')}: expected a string such as 'none,pi,yarn:8', or a list of names "
                         f"and (method, factor, options) tuples, got {type(methods).__name__}")
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
    if not [n for name in names for n in method_names(name)]:
        raise ValueError(no_methods(spelling))
    return MethodChoice.parse(",".join(names), options=list(options) + own, spelling=spelling)


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
    takes = "a path, a dataset name, a list of strings or a datasets.Dataset"
    columns = getattr(data, "column_names", None)
    if columns is not None and not isinstance(columns, dict):  # a datasets.Dataset
        if text_field not in columns:
            raise ValueError(f"data: the dataset has no {text_field!r} column (columns: {', '.join(columns)}); "
                             "give text_field=")
        data = data[text_field]
    elif type(data).__name__.endswith("DatasetDict"):
        raise ValueError("data: a DatasetDict holds several splits; pass one (e.g. data=ds['test'])")
    if not _iterable(data):
        raise ValueError(f"data: expected {takes}, got {type(data).__name__}")
    texts = tuple(data)
    if not all(isinstance(t, str) for t in texts):
        raise ValueError(f"data: expected {takes}; got a {type(data).__name__} holding "
                         f"{type(next(t for t in texts if not isinstance(t, str))).__name__}")
    texts = tuple(t for t in texts if t.strip())
    if not texts:
        raise ValueError("data: no text found")
    return texts
