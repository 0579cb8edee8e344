"""What one evaluation will do, checked once, before anything loads.

:func:`plan_eval` takes an :class:`~.request.EvalRequest` (whose values are checked already), checks the files it
names, the output and the methods x model family (on each model's skeleton), and returns an :class:`EvalPlan`: the
runner's settings, the models as loaders, the texts, and where the results go. Nothing is loaded and nothing is
written here, and the request is not changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.textfiles import check_data_path
from .data import Texts, load_texts
from .demo import DEMO_MAX_TOKENS, demo_jobs, reference_texts
from .device import resolve_device, resolve_dtype
from .held import check_held_model, given_texts, held_dtype, held_device, held_model_job
from .models import load_model, load_tokenizer
from .passkey import DEFAULT_DEPTHS
from .preflight import check_evaluator_tokenizer, check_fit, check_key_tokens
from .request import EvalRequest, parse_measures
from .requests import FLAGS, NONE, MethodChoice, Spelling
from .results import check_file_target, check_output, jsonl_path, recorded_pictures
from .runner import PASSKEY_ASKED, PASSKEY_NOT, ModelJob, Settings, default_lengths
from ..export import ADAPTER_RECORD
from ..reference import model_source, reference_name
from .tasks import PASSKEY, PPL, parse_tasks
from .windows import PROTOCOLS, check_protocol

DEMO_OUTPUT = "results/demo.json"
DEMO_PLOT = "results/demo.png"
EVAL_OUTPUT = "results/eval.json"


# -- the plan -----------------------------------------------------------------------------------------------------
@dataclass
class EvalPlan:
    """One run, checked: what the runner does (``settings``, ``jobs``) and where its results go."""

    demo: bool
    device: str
    dtype: str
    settings: Settings
    jobs: list[ModelJob]
    texts: Texts
    #: The results JSON; None: nothing is written (``ctxext.evaluate`` without ``output=``).
    output: str | None
    resume: bool = False
    overwrite: bool = False
    plot: str | None = None
    heatmap: str | None = None
    #: The picture files (resolved) this run draws and earlier runs at ``output`` drew: the files a --resume may replace.
    pictures: list[str] = field(default_factory=list)
    evaluator: str | None = None
    #: --methods, --factor, --option and --lengths as the user gave them (part of what --resume must match).
    as_given: dict[str, Any] = field(default_factory=dict)
    #: What messages call the run (``ctxext eval: error: ...``).
    command: str = "eval"

    def fingerprint(self) -> dict[str, Any]:
        """What must match for --resume to reuse rows (see :mod:`ctxext.evaluation.fingerprint`); reads the
        model, data and tokenizer files."""
        from .fingerprint import data_fingerprint, model_fingerprint, tokenizer_fingerprint

        s = self.settings
        found: dict[str, Any] = {
            "models": [dict(j.info, label=j.label, files=model_fingerprint(j.info)) for j in self.jobs],
            "data": dict(self.texts.info, content=data_fingerprint(self.texts.texts)), "dtype": self.dtype,
            "plan": self.as_given,
            "protocol": s.protocol, "stride": s.stride, "max_windows": s.max_windows, "max_tokens": s.max_tokens,
            "passkey": [True, list(s.passkey_depths), s.passkey_trials, s.seed] if s.passkey else None,
        }
        if s.passkey and any(j.passkey != PASSKEY_ASKED for j in self.jobs):  # the demo's default: on some models only
            found["passkey"].append([j.label for j in self.jobs if j.passkey != PASSKEY_NOT])
        # the tokenizer decides every row's tokens (perplexity windows, passkey prompts): a retrained one in place
        # must not resume (runs from before this key still do: ResultStore compares it only where recorded)
        found["tokenizers"] = [tokenizer_fingerprint(j.info) for j in self.jobs]
        if s.tasks:  # absent without tasks: runs from before tasks existed still resume
            found["tasks"] = [s.tasks, s.task_samples, list(s.task_depths), s.seed, s.chat_template,
                              [tokenizer_fingerprint(j.info) for j in self.jobs]]
        if not s.perplexity:
            found["perplexity"] = False
        if s.key_tokens:  # ppl rows then carry key-token perplexity: only such rows resume
            found["key_tokens"] = [self.evaluator, s.key_context, s.key_short,
                                   model_fingerprint({"model": self.evaluator}) if self.evaluator else None]
        return found


def plan_eval(request: EvalRequest) -> EvalPlan:
    """Check the files ``request`` names, the output and the methods x model family; load no model and write
    nothing. ``request.model`` None: the demo, the shipped reference models."""
    r, s = request, request.spelling  # s: flags from the command, keywords from ctxext.evaluate
    model_id, evaluator = r.model, r.evaluator
    # a shipped checkpoint named as export, search and recipes name it
    if not r.holds_model and reference_name(model_id) is not None:
        model_id = _reference_source("model", model_id, s)
    if reference_name(evaluator) is not None:
        evaluator = _reference_source("evaluator", evaluator, s)
    demo = r.demo  # the request refused a gguf_file, adapter or evaluator without a model
    # the demo measures perplexity and, on the reference trained to retrieve, passkey (issue 24): the verdict then
    # says which method still finds the key at 4x, not only which holds perplexity
    demo_passkey = demo and r.tasks is None and not r.passkey
    measures = parse_measures(r.tasks, passkey=r.passkey or demo_passkey)  # key-token settings: checked by the request
    device = held_device(r.model) if r.holds_model else resolve_device(r.device, s)
    dtype = held_dtype(r.model) if r.holds_model else (r.dtype or "float32")
    resolve_dtype(dtype if not r.holds_model else None)
    tasks = [m for m in measures if m not in (PPL, PASSKEY)]
    if tasks:
        from .tasks import words

        try:
            words.check_available()
        except ImportError as exc:
            raise ValueError(f"{s.name('tasks')}: {exc}") from None
    methods = r.choice  # unknown names, bad factors, stray options: refused when the request was built
    if r.data:
        check_data_path(r.data, s.name("data"))  # a link loop, a path that cannot be read: one line, as search says it
    for length in r.lengths or []:
        check_protocol(r.protocol, length, r.stride)  # a stride too long for a length
    output, plot, heatmap, pictures = _check_outputs(r, demo=demo, measures=measures, tasks=tasks)
    adapter_patch, trained_modules = None, []
    if not demo and not r.holds_model:
        _check_sources(model_id, r.gguf_file, evaluator, r.adapter, s)
        if r.adapter is not None:
            adapter_patch, trained_modules = adapter_record(r.adapter, s)
            if adapter_patch is not None:
                _check_adapter_methods(r, methods, adapter_patch, trained_modules)
    elif r.holds_model:
        if evaluator:
            _check_sources(None, None, evaluator, None, s)
        check_held_model(r, methods)
    if r.texts is not None:
        texts = given_texts(r.texts)
    else:
        texts = load_texts(r.data, split=r.data_split, text_field=r.text_field, spelling=s) if r.data else None
    if demo:
        jobs = demo_jobs(texts, factor=r.factor, dtype=dtype, device=device, passkey_where_trained=demo_passkey)
        texts = jobs[0].texts
    else:
        texts = texts or reference_texts()
        if r.holds_model:
            jobs = [held_model_job(r.model, r.tokenizer, texts, factor=r.factor)]
        else:
            jobs = [_model_job(r, model_id, device, dtype, texts, adapter_patch)]
        if evaluator:
            jobs[0].load_evaluator = _evaluator_loader(evaluator, dtype, device)
    limits: dict[str, tuple[int, str]] = {}
    # lengths None: each model at 1x..8x its own original length
    originals = check_fit(jobs, methods, r.lengths, limits=limits if r.key_tokens else None)
    if not r.lengths:  # the default lengths are known only now: a --stride too long for one of them
        for label, original in originals.items():
            for length in default_lengths(original) if original else ():
                try:
                    check_protocol(r.protocol, length, r.stride)
                except ValueError as exc:
                    raise ValueError(f"{s.name('stride')}: {exc} ({label}'s default lengths: "
                                     f"{', '.join(map(str, default_lengths(original)))}; give {s.name('lengths')})"
                                     ) from None
    if r.key_tokens:
        check_key_tokens(originals, context=r.key_context, short=r.key_short, evaluator=evaluator, limits=limits,
                         spelling=s)
        if evaluator and not demo:
            check_evaluator_tokenizer(jobs[0].load_tokenizer(), evaluator, texts.texts, spelling=s)
    max_windows, max_tokens = r.max_windows, r.max_tokens
    if demo and max_windows is None and max_tokens is None:
        max_tokens = DEMO_MAX_TOKENS
    settings = Settings(
        methods=methods, lengths=r.lengths, protocol=r.protocol, stride=r.stride, max_windows=max_windows,
        max_tokens=max_tokens, batch_size=r.batch_size, perplexity=PPL in measures, passkey=PASSKEY in measures,
        passkey_depths=tuple(r.passkey_depths), passkey_trials=r.passkey_trials, seed=r.seed,
        progress=r.progress, tasks=tasks, task_samples=r.task_samples,
        task_depths=tuple(r.task_depths), chat_template=r.chat_template,
        key_tokens=r.key_tokens, key_context=r.key_context, key_short=r.key_short,
    )
    return EvalPlan(
        demo=demo, device=device, dtype=dtype, settings=settings, jobs=jobs, texts=texts, output=output,
        resume=r.resume, overwrite=r.overwrite, plot=plot, heatmap=heatmap, evaluator=evaluator,
        pictures=pictures, as_given=r.as_given(), command=r.command,
    )


def _reference_source(name: str, value: str, spelling: Spelling = FLAGS) -> str:
    try:
        return model_source(value)
    except ValueError as exc:
        raise ValueError(f"{spelling.given(name, value)}: {exc}") from None


def _check_outputs(r: EvalRequest, *, demo: bool, measures: list[str], tasks: list[str]):
    """The results file and the pictures: (output, plot, heatmap, the picture files a resume may replace). Without
    ``output`` nothing is written, so no picture is either (a results object draws them on request)."""
    output = r.output
    if output is None:
        if r.plot or r.heatmap:
            raise ValueError("plot and heatmap are drawn beside the results: give output= too, or draw them from "
                             "the returned results (results.plot(path))")
        return None, None, None, []
    s = r.spelling  # flags from the command, keywords from ctxext.evaluate
    given = s.given("output", output)
    if r.data and _resolved(r.data) in (_resolved(output), _resolved(jsonl_path(output))):
        raise ValueError(f"{given} would overwrite the data {r.data}; choose another {s.name('output')}")
    if r.data and Path(r.data).is_dir() and _resolved(r.data) in _resolved(output).parents:
        raise ValueError(f"{given} is inside the {s.name('data')} folder {r.data}: its rows file would be read "
                         f"as data by the next run ({s.on('resume')}, {s.on('overwrite')}); choose an "
                         f"{s.name('output')} outside it")
    check_output(output, resume=r.resume, overwrite=r.overwrite, spelling=s)
    # the demo's picture goes beside its results (results/demo.png by default), not into one shared place
    plot = r.plot or (str(Path(output).with_suffix(".png")) if demo else None)
    # a picture is replaced with --overwrite, or with --resume where an earlier run at this --output drew it (runs
    # record their pictures; one from before they did may have drawn any): a resume would otherwise replace a file
    # of the user's
    earlier = jsonl_path(output).is_file() or Path(output).is_file()
    drawn = recorded_pictures(output) if earlier else None
    heatmap = r.heatmap or (_beside(plot) if tasks or PASSKEY in measures else None)  # needles by depth; ppl: none
    pictures = []
    for arg, path in (("plot", plot), ("heatmap", heatmap)):
        if not path:
            continue
        written = str(_resolved(picture_file(Path(path))))
        if r.overwrite or not r.resume:
            why = None
        elif not earlier:
            why = f"{s.on('resume')} finds no earlier run at {given} that drew it"
        elif drawn is not None and written not in drawn:
            why = f"the earlier run at {given} did not draw it"
        else:
            why = None
        _check_picture(path, data=r.data, output=output, arg=arg,
                       replace=r.overwrite or (r.resume and why is None), why=why, spelling=s)
        if written in pictures:
            raise ValueError(f"{s.given('heatmap', heatmap)} is the {s.name('plot')} file; choose another")
        pictures.append(written)
    return output, plot, heatmap, sorted(set(pictures) | ((drawn or set()) if r.resume else set()))


def _resolved(path) -> Path:
    """``path`` made absolute with its links followed; a link loop (which ``Path.resolve`` raises on) as written."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))


def adapter_record(adapter: str, spelling: Spelling = FLAGS) -> tuple[dict[str, Any] | None, list[str]]:
    """The patch an --adapter folder records (its ``ctxext_patch.json``; method, factor, options with their defaults
    filled in, original length), or None where it records none; and the modules it trained in full
    (``adapter_config.json``'s ``modules_to_save``, e.g. GPT-2's interpolated position table). Loads nothing."""
    import json

    from ..core.errors import PatchError
    from ..export import read_adapter_record
    from ..methods.registry import resolve_method, validate_options

    trained: list[str] = []
    try:
        config = json.loads((Path(adapter) / "adapter_config.json").read_text(encoding="utf-8-sig"))
        trained = [str(m) for m in (config.get("modules_to_save") or [])]
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # peft says what is wrong with it when the adapter loads
    try:
        spec = read_adapter_record(adapter)
        if spec is None:
            from ..loading import lost_adapter_record

            lost = lost_adapter_record(adapter)  # its fine-tune's files say it was trained patched: refused now
            if lost is not None:  # "adapter DIR: ...", named as the argument is
                raise ValueError(spelling.name("adapter") + lost.removeprefix("adapter"))
            return None, trained
        info = resolve_method(spec.method)
        options = validate_options(info, dict(spec.options or {}))
    except PatchError as exc:
        raise PatchError(f"{spelling.given('adapter', adapter)}: {exc}") from None
    factor = None if spec.factor is None else float(spec.factor)
    return {"method": info.name, "factor": factor, "options": options, "original_length": spec.original_length}, trained


def _check_adapter_methods(r: EvalRequest, methods: MethodChoice, recorded: dict[str, Any], trained: list[str]) -> None:
    """What --methods, --factor and --option may ask of an --adapter trained under the patch ``recorded``: never
    its LoRA weights without that patch (``none``), no other patch where it trained patched modules in full (their
    trained values would be replaced), and no --factor / --option that nothing would use."""
    from .requests import MethodRequest, with_factor

    s = r.spelling
    own = MethodRequest(recorded["method"], recorded["factor"], recorded["options"])
    name = f"{own.method}:{own.factor:g}" if own.factor is not None else own.method
    where = f"{s.given('adapter', r.adapter)} was trained with {own.label} (its {ADAPTER_RECORD})"
    methods_ = s.name("methods")
    if r.key_tokens and not r.evaluator and trained:
        raise ValueError(f"{s.name('key_tokens')}: the default evaluator is the model itself without its patch, and "
                         f"{where} and trained {', '.join(trained)} in full under it, which taking the patch off "
                         f"drops; give {s.name('evaluator')} (e.g. the base model, as given to {s.name('model')})")
    if methods.given is None:
        stray = [s.name(arg) for arg, given in (("factor", r.factor is not None), ("options", bool(r.options)))
                 if given]
        if stray:
            other = f"{own.method}:{r.factor:g}" if r.factor is not None else own.method
            raise ValueError(f"{' and '.join(stray)} without {methods_}: {where}, and without {methods_} it is "
                             f"evaluated with that patch as recorded; name the patches to evaluate with {methods_} "
                             f"(e.g. {s.given('methods', f'{name},{other}')})")
        return
    asked = s.given("methods", r.methods)
    if any(q.method == NONE for q in methods.given):
        raise ValueError(f"{asked}: 'none' would evaluate the adapter's LoRA weights without the patch they were "
                         f"trained with: {where}. Drop 'none': leave {methods_} out to evaluate the adapter as "
                         f"trained, or list patches only (e.g. {name}); for the unpatched baseline, evaluate the base "
                         f"model without {s.name('adapter')}")
    factor = r.factor if r.factor is not None else recorded["factor"]
    others = [q for q in with_factor(list(methods.given), factor) if not q.matches(recorded)]
    if others and trained:
        raise ValueError(f"{asked}: {where} and trained {', '.join(trained)} in full under it; "
                         f"{', '.join(q.label for q in others)} would put untrained {', '.join(trained)} in place "
                         f"of the trained. Evaluate it with its own patch: leave {methods_} out (or give {name})")


def _beside(plot: str | None) -> str | None:
    """The needle heatmap's default file: beside the perplexity plot, when there is one."""
    if not plot:
        return None
    path = Path(plot)
    return str(path.with_name(f"{path.stem}_needles{path.suffix or '.png'}"))


def picture_file(path: Path) -> Path:
    """The file matplotlib writes for ``path``: a name without a suffix gets ``.png`` (its savefig.format)."""
    return path if path.suffix else path.with_name(path.name + ".png")


def _check_picture(path: str, *, data: str | None, output: str, arg: str = "plot", replace: bool = True,
                   why: str | None = None, spelling: Spelling = FLAGS) -> Path:
    """A picture matplotlib can write at ``path`` that replaces neither the data nor this run's results, nor (unless
    ``replace``: --overwrite, or --resume of the run that drew it) a file already there, a default name beside the
    results included (it may be the user's picture); ``why``: why a --resume may not replace it. ``arg``: the
    argument that gave ``path`` (``plot``, ``heatmap``), named as ``spelling`` says. Returns the file written."""
    s = spelling
    flag, given = s.name(arg), s.given(arg, path)
    target = check_file_target(path, arg, "ppl.png", s)
    if not replace and picture_file(target).exists():
        because = f", and {why} (it may be yours)" if why else ""
        raise ValueError(f"{given}: {picture_file(target)} exists{because}; pass {s.on('overwrite')} to replace it, "
                         f"or choose another {flag}")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError(f"{flag} needs matplotlib: pip install 'ctxext[eval]'") from None
    written = picture_file(target)
    for other, what in ((data, "the data"), (output, f"the {s.name('output')} results"),
                        (jsonl_path(output), f"the {s.name('output')} rows file")):
        if other and written.resolve() == Path(other).resolve():
            raise ValueError(f"{given} would overwrite {what} {other}; choose another {flag}")
    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = target.suffix.lower().lstrip(".")
    if suffix and suffix not in kinds:
        raise ValueError(f"{given}: matplotlib cannot write .{suffix} pictures; end the name in .png, .pdf or "
                         f".svg (or one of {', '.join('.' + k for k in sorted(kinds))})")
    return written


def _check_sources(model: str | None, gguf_file: str | None, evaluator: str | None, adapter: str | None,
                   spelling: Spelling = FLAGS) -> None:
    """The model, evaluator and adapter can be loaded from here (nothing is downloaded); ``spelling``: how messages
    name them."""
    from ..data.sources import check_source
    from ..loading import TOKENIZER_FILES, adapter_files_missing, lacks_tokenizer

    if model is not None:
        check_source(model, gguf_file=gguf_file, what=spelling.name("model"))
    if evaluator:
        check_source(evaluator, what=spelling.name("evaluator"))
    if model is not None and not gguf_file and lacks_tokenizer(model_source(model)):
        raise FileNotFoundError(f"{spelling.given('model', model)} holds no tokenizer "
                                f"({', '.join(TOKENIZER_FILES[:3])}, ...; "
                                "model.save_pretrained writes none): save the model's tokenizer beside it "
                                "(tokenizer.save_pretrained(DIR))")
    missing = adapter_files_missing(adapter) if adapter is not None else None
    if missing:
        raise FileNotFoundError(f"{spelling.given('adapter', adapter)}: {missing}")


def _model_job(r: EvalRequest, model_id: str, device: str, dtype: str, texts: Texts,
               adapter_patch: dict[str, Any] | None = None) -> ModelJob:
    """The one model of `ctxext eval --model`, as loaders: nothing is loaded here. ``adapter_patch``: the patch
    recorded beside the adapter, whose factor a method named without one gets (unless ``factor`` gives one)."""
    from ..loading import model_skeleton

    gguf_file, adapter = r.gguf_file, r.adapter
    factor = r.factor if r.factor is not None or adapter_patch is None else adapter_patch["factor"]
    return ModelJob(
        label=_model_label(model_id, gguf_file),
        load_tokenizer=lambda: load_tokenizer(model_id, gguf_file=gguf_file),
        load_model=lambda state: load_model(model_id, gguf_file=gguf_file, adapter=adapter, dtype=dtype,
                                            device=device, state=state),
        load_skeleton=lambda: model_skeleton(model_id, gguf_file=gguf_file),
        texts=texts, factor=factor, info={"model": model_id, "gguf_file": gguf_file, "adapter": adapter},
    )


def _evaluator_loader(evaluator: str, dtype: str, device: str):
    def load(state):
        model = load_model(evaluator, dtype=dtype, device=device, state=state)
        return model, load_tokenizer(evaluator), evaluator

    return load


def _model_label(model_id: str, gguf_file: str | None) -> str:
    if gguf_file:
        return Path(gguf_file).name.removesuffix(".gguf")
    path = Path(model_id)
    return path.resolve().name if path.exists() else model_id
