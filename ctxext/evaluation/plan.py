"""What one `ctxext eval` / `ctxext demo` run will do, parsed and checked once, before anything loads.

:func:`plan_eval` takes the command's arguments, parses the methods, lengths and tasks, checks every argument,
the files they name, the output and the methods x model family (on each model's skeleton), and returns an
:class:`EvalPlan`: the runner's settings, the models as loaders, the texts, and where the results go. Nothing is
loaded and nothing is written here.
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
from .models import load_model, load_tokenizer
from .passkey import DEFAULT_DEPTHS
from .preflight import check_evaluator_tokenizer, check_fit, check_key_tokens
from .requests import NONE, MethodChoice, parse_factor
from .results import check_file_target, check_output, jsonl_path, recorded_pictures
from .runner import PASSKEY_ASKED, PASSKEY_NOT, ModelJob, Settings, default_lengths
from ..export import ADAPTER_RECORD
from ..reference import model_source, reference_name
from .tasks import PASSKEY, PPL, parse_tasks
from .windows import PROTOCOLS, check_protocol

#: What the command line offers and shows as defaults (the command imports them from here).
__all__ = ["DEFAULT_DEPTHS", "DEMO_MAX_TOKENS", "DEMO_OUTPUT", "DEMO_PLOT", "EVAL_OUTPUT", "PROTOCOLS", "EvalPlan",
           "MAX_PASSKEY_TRIALS", "MAX_TASK_SAMPLES", "parse_count", "parse_depths", "parse_factor_argument",
           "parse_lengths", "parse_measures", "parse_passkey_trials", "parse_task_samples", "plan_eval"]

DEMO_OUTPUT = "results/demo.json"
DEMO_PLOT = "results/demo.png"
EVAL_OUTPUT = "results/eval.json"


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


#: The most --task-samples (per task, method and length) and --passkey-trials (per length and depth) a run takes:
#: each is a greedy generation at the full length, so more would run for weeks, and the list of samples is built
#: whole before the first one runs (RULER's own default is 500 samples per task).
MAX_TASK_SAMPLES = 10_000
MAX_PASSKEY_TRIALS = 10_000


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
    """What the run measures: ``--tasks`` (ppl, passkey, task names; default ppl), ``--passkey`` adding passkey."""
    measures = parse_tasks(tasks) if tasks is not None else [PPL]
    if passkey and PASSKEY not in measures:
        measures.append(PASSKEY)
    return measures


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
    output: str
    resume: bool = False
    overwrite: bool = False
    plot: str | None = None
    heatmap: str | None = None
    #: The picture files (resolved) this run draws and earlier runs at ``output`` drew: the files a --resume may replace.
    pictures: list[str] = field(default_factory=list)
    evaluator: str | None = None
    #: --methods, --factor, --option and --lengths as the user gave them (part of what --resume must match).
    as_given: dict[str, Any] = field(default_factory=dict)

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


def plan_eval(args) -> EvalPlan:
    """Check every argument, the files they name, the output and the methods x model family; load no model and
    write nothing. ``args`` are the parsed arguments of `ctxext eval` / `ctxext demo` (no ``model``: the demo)."""
    # a shipped checkpoint named as export, search and recipes name it
    for flag in ("model", "evaluator"):
        if reference_name(getattr(args, flag)) is not None:
            try:
                setattr(args, flag, model_source(getattr(args, flag)))
            except ValueError as exc:
                raise ValueError(f"--{flag} {getattr(args, flag)}: {exc}") from None
    demo = args.model is None
    if demo and (args.gguf_file or args.adapter or args.evaluator):
        raise ValueError("--gguf-file, --adapter and --evaluator need --model")
    # the demo measures perplexity and, on the reference trained to retrieve, passkey (issue 24): the verdict then
    # says which method still finds the key at 4x, not only which holds perplexity
    demo_passkey = demo and args.tasks is None and not args.passkey
    measures = None  # parsed here only with --key-tokens, so that errors come in the order they always did
    if args.key_tokens:
        measures = parse_measures(args.tasks, passkey=args.passkey or demo_passkey)
        if PPL not in measures:
            raise ValueError("--key-tokens is a perplexity: add ppl to --tasks")
    if not args.key_tokens and (args.evaluator or args.key_context or args.key_short):
        raise ValueError("--evaluator, --key-context and --key-short need --key-tokens")
    if args.key_context and args.key_short and args.key_short >= args.key_context:
        raise ValueError(f"--key-short {args.key_short} must be shorter than --key-context {args.key_context}")
    _check_counts(args)
    device = resolve_device(args.device)
    resolve_dtype(args.dtype)
    if measures is None:
        measures = parse_measures(args.tasks, passkey=args.passkey or demo_passkey)
    tasks = [m for m in measures if m not in (PPL, PASSKEY)]
    if tasks:
        from .tasks import words

        try:
            words.check_available()
        except ImportError as exc:
            raise ValueError(f"--tasks: {exc}") from None
    methods = MethodChoice.parse(args.methods, options=args.option)  # unknown names, bad factors, stray options
    if args.data:
        check_data_path(args.data, "--data")  # a link loop, a path that cannot be read: one line, as search says it
    for length in args.lengths or []:
        check_protocol(args.protocol, length, args.stride)  # a stride too long for a length
    output = args.output or (DEMO_OUTPUT if demo else EVAL_OUTPUT)
    if args.data and _resolved(args.data) in (_resolved(output), _resolved(jsonl_path(output))):
        raise ValueError(f"--output {output} would overwrite the data {args.data}; choose another --output")
    if args.data and Path(args.data).is_dir() and _resolved(args.data) in _resolved(output).parents:
        raise ValueError(f"--output {output} is inside the --data folder {args.data}: its rows file would be read "
                         "as data by the next run (--resume, --overwrite); choose an --output outside it")
    check_output(output, resume=args.resume, overwrite=args.overwrite)
    # the demo's picture goes beside its results (results/demo.png by default), not into one shared place
    plot = args.plot or (str(Path(output).with_suffix(".png")) if demo else None)
    # a picture is replaced with --overwrite, or with --resume where an earlier run at this --output drew it (runs
    # record their pictures; one from before they did may have drawn any): a resume would otherwise replace a file
    # of the user's
    earlier = jsonl_path(output).is_file() or Path(output).is_file()
    drawn = recorded_pictures(output) if earlier else None
    heatmap = args.heatmap or (_beside(plot) if tasks or PASSKEY in measures else None)  # needles by depth; ppl: none
    pictures = []
    for flag, path in (("--plot", plot), ("--heatmap", heatmap)):
        if not path:
            continue
        written = str(_resolved(picture_file(Path(path))))
        if args.overwrite or not args.resume:
            why = None
        elif not earlier:
            why = f"--resume finds no earlier run at --output {output} that drew it"
        elif drawn is not None and written not in drawn:
            why = f"the earlier run at --output {output} did not draw it"
        else:
            why = None
        _check_picture(path, data=args.data, output=output, flag=flag,
                       replace=args.overwrite or (args.resume and why is None), why=why)
        if written in pictures:
            raise ValueError(f"--heatmap {heatmap} is the --plot file; choose another")
        pictures.append(written)
    adapter_patch, trained_modules = None, []
    if not demo:
        _check_sources(args)
        if args.adapter is not None:
            adapter_patch, trained_modules = adapter_record(args.adapter)
            if adapter_patch is not None:
                _check_adapter_methods(args, methods, adapter_patch, trained_modules)
    texts = load_texts(args.data, split=args.data_split, text_field=args.text_field) if args.data else None
    if demo:
        jobs = demo_jobs(texts, factor=args.factor, dtype=args.dtype, device=device, passkey_where_trained=demo_passkey)
        texts = jobs[0].texts
    else:
        texts = texts or reference_texts()
        jobs = [_model_job(args, device, texts, adapter_patch)]
    limits: dict[str, tuple[int, str]] = {}
    # lengths None: each model at 1x..8x its own original length
    originals = check_fit(jobs, methods, args.lengths, limits=limits if args.key_tokens else None)
    if not args.lengths:  # the default lengths are known only now: a --stride too long for one of them
        for label, original in originals.items():
            for length in default_lengths(original) if original else ():
                try:
                    check_protocol(args.protocol, length, args.stride)
                except ValueError as exc:
                    raise ValueError(f"--stride: {exc} ({label}'s default lengths: "
                                     f"{', '.join(map(str, default_lengths(original)))}; give --lengths)") from None
    if args.key_tokens:
        check_key_tokens(originals, context=args.key_context, short=args.key_short, evaluator=args.evaluator,
                         limits=limits)
        if args.evaluator and not demo:
            check_evaluator_tokenizer(jobs[0].load_tokenizer(), args.evaluator, texts.texts)
    max_windows, max_tokens = args.max_windows, args.max_tokens
    if demo and max_windows is None and max_tokens is None:
        max_tokens = DEMO_MAX_TOKENS
    settings = Settings(
        methods=methods, lengths=args.lengths, protocol=args.protocol, stride=args.stride, max_windows=max_windows,
        max_tokens=max_tokens, batch_size=args.batch_size, perplexity=PPL in measures, passkey=PASSKEY in measures,
        passkey_depths=tuple(args.passkey_depths), passkey_trials=args.passkey_trials, seed=args.seed,
        progress=not args.no_progress, tasks=tasks, task_samples=args.task_samples,
        task_depths=tuple(args.task_depths), chat_template=not args.no_chat_template,
        key_tokens=args.key_tokens, key_context=args.key_context, key_short=args.key_short,
    )
    return EvalPlan(
        demo=demo, device=device, dtype=args.dtype, settings=settings, jobs=jobs, texts=texts, output=output,
        resume=args.resume, overwrite=args.overwrite, plot=plot, heatmap=heatmap, evaluator=args.evaluator,
        pictures=sorted(set(pictures) | ((drawn or set()) if args.resume else set())),
        as_given={"methods": args.methods, "factor": args.factor, "options": sorted(args.option or []),
                  "lengths": args.lengths},
    )


def _resolved(path) -> Path:
    """``path`` made absolute with its links followed; a link loop (which ``Path.resolve`` raises on) as written."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))


def _check_counts(args) -> None:
    """--task-samples and --passkey-trials within their bounds (the command line's parsers say it first; this holds
    for arguments made in Python too): the samples are listed whole before the first one runs."""
    for flag, value, maximum in (("--task-samples", args.task_samples, MAX_TASK_SAMPLES),
                                 ("--passkey-trials", args.passkey_trials, MAX_PASSKEY_TRIALS)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
            raise ValueError(f"{flag} {value}: expected a whole number from 1 to {maximum:,}")


def adapter_record(adapter: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The patch an --adapter folder records (its ``ctxext_patch.json``; method, factor, options with their defaults
    filled in), or None where it records none; and the modules it trained in full (``adapter_config.json``'s
    ``modules_to_save``, e.g. GPT-2's interpolated position table). Loads nothing."""
    import json

    from ..core.errors import PatchError
    from ..core.spec import PatchSpec
    from ..methods.registry import resolve_method, validate_options

    folder = Path(adapter)
    trained: list[str] = []
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8-sig"))
        trained = [str(m) for m in (config.get("modules_to_save") or [])]
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # peft says what is wrong with it when the adapter loads
    spec_file = folder / ADAPTER_RECORD
    if not spec_file.is_file():
        from ..loading import lost_adapter_record

        lost = lost_adapter_record(adapter)  # its fine-tune's files say it was trained patched: refused before loading
        if lost is not None:
            raise ValueError(f"--{lost}")
        return None, trained
    try:
        spec = PatchSpec.from_dict(json.loads(spec_file.read_text(encoding="utf-8-sig")))
        info = resolve_method(spec.method)
        options = validate_options(info, dict(spec.options or {}))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"--adapter {adapter}: {spec_file.name} cannot be read ({exc}); it records the patch the "
                         "adapter was trained with: restore it from the training run's output") from None
    except PatchError as exc:
        raise PatchError(f"--adapter {adapter}: {spec_file.name}: {exc}") from None
    factor = None if spec.factor is None else float(spec.factor)
    return {"method": info.name, "factor": factor, "options": options}, trained


def _check_adapter_methods(args, methods: MethodChoice, recorded: dict[str, Any], trained: list[str]) -> None:
    """What --methods, --factor and --option may ask of an --adapter trained under the patch ``recorded``: never
    its LoRA weights without that patch (``none``), no other patch where it trained patched modules in full (their
    trained values would be replaced), and no --factor / --option that nothing would use."""
    from .requests import MethodRequest, with_factor

    own = MethodRequest(recorded["method"], recorded["factor"], recorded["options"])
    name = f"{own.method}:{own.factor:g}" if own.factor is not None else own.method
    where = f"--adapter {args.adapter} was trained with {own.label} (its {ADAPTER_RECORD})"
    if args.key_tokens and not args.evaluator and trained:
        raise ValueError(f"--key-tokens: the default evaluator is the model itself without its patch, and {where} and "
                         f"trained {', '.join(trained)} in full under it, which taking the patch off drops; give "
                         "--evaluator (e.g. the base model, as given to --model)")
    if methods.given is None:
        stray = [flag for flag, given in (("--factor", args.factor is not None), ("--option", bool(args.option)))
                 if given]
        if stray:
            other = f"{own.method}:{args.factor:g}" if args.factor is not None else own.method
            raise ValueError(f"{' and '.join(stray)} without --methods: {where}, and without --methods it is evaluated "
                             f"with that patch as recorded; name the patches to evaluate with --methods (e.g. "
                             f"--methods {name},{other})")
        return
    if any(r.method == NONE for r in methods.given):
        raise ValueError(f"--methods {args.methods}: 'none' would evaluate the adapter's LoRA weights without the "
                         f"patch they were trained with: {where}. Drop 'none': leave --methods out to evaluate the "
                         f"adapter as trained, or list patches only (e.g. {name}); for the unpatched baseline, "
                         "evaluate the base model without --adapter")
    factor = args.factor if args.factor is not None else recorded["factor"]
    others = [r for r in with_factor(list(methods.given), factor) if not r.matches(recorded)]
    if others and trained:
        raise ValueError(f"--methods {args.methods}: {where} and trained {', '.join(trained)} in full under it; "
                         f"{', '.join(r.label for r in others)} would put untrained {', '.join(trained)} in place "
                         f"of the trained. Evaluate it with its own patch: leave --methods out (or give {name})")


def _beside(plot: str | None) -> str | None:
    """The needle heatmap's default file: beside the perplexity plot, when there is one."""
    if not plot:
        return None
    path = Path(plot)
    return str(path.with_name(f"{path.stem}_needles{path.suffix or '.png'}"))


def picture_file(path: Path) -> Path:
    """The file matplotlib writes for ``path``: a name without a suffix gets ``.png`` (its savefig.format)."""
    return path if path.suffix else path.with_name(path.name + ".png")


def _check_picture(path: str, *, data: str | None, output: str, flag: str = "--plot", replace: bool = True,
                   why: str | None = None) -> Path:
    """A picture matplotlib can write at ``path`` that replaces neither the data nor this run's results, nor (unless
    ``replace``: --overwrite, or --resume of the run that drew it) a file already there, a default name beside the
    results included (it may be the user's picture); ``why``: why a --resume may not replace it. Returns the file
    written."""
    target = check_file_target(path, flag, "ppl.png")
    if not replace and picture_file(target).exists():
        because = f", and {why} (it may be yours)" if why else ""
        raise ValueError(f"{flag} {path}: {picture_file(target)} exists{because}; pass --overwrite to replace it, or "
                         f"choose another {flag}")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError(f"{flag} needs matplotlib: pip install 'ctxext[eval]'") from None
    written = picture_file(target)
    for other, what in ((data, "the data"), (output, "the --output results"),
                        (jsonl_path(output), "the --output rows file")):
        if other and written.resolve() == Path(other).resolve():
            raise ValueError(f"{flag} {path} would overwrite {what} {other}; choose another {flag}")
    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = target.suffix.lower().lstrip(".")
    if suffix and suffix not in kinds:
        raise ValueError(f"{flag} {path}: matplotlib cannot write .{suffix} pictures; end the name in .png, .pdf or "
                         f".svg (or one of {', '.join('.' + k for k in sorted(kinds))})")
    return written


def _check_sources(args) -> None:
    """--model, --evaluator and --adapter can be loaded from here (nothing is downloaded)."""
    from ..data.sources import check_source

    check_source(args.model, gguf_file=args.gguf_file, what="--model")
    if args.evaluator:
        check_source(args.evaluator, what="--evaluator")
    from ..loading import TOKENIZER_FILES, adapter_files_missing, lacks_tokenizer

    if not args.gguf_file and lacks_tokenizer(model_source(args.model)):
        raise FileNotFoundError(f"--model {args.model} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...; "
                                "model.save_pretrained writes none): save the model's tokenizer beside it "
                                "(tokenizer.save_pretrained(DIR))")

    missing = adapter_files_missing(args.adapter) if args.adapter is not None else None
    if missing:
        raise FileNotFoundError(f"--adapter {args.adapter}: {missing}")


def _model_job(args, device: str, texts: Texts, adapter_patch: dict[str, Any] | None = None) -> ModelJob:
    """The one model of `ctxext eval --model`, as loaders: nothing is loaded here. ``adapter_patch``: the patch
    recorded beside --adapter, whose factor a method named without one gets (unless --factor gives one)."""
    from ..loading import model_skeleton

    model_id, gguf_file = args.model, args.gguf_file
    factor = args.factor if args.factor is not None or adapter_patch is None else adapter_patch["factor"]
    return ModelJob(
        label=_model_label(model_id, gguf_file),
        load_tokenizer=lambda: load_tokenizer(model_id, gguf_file=gguf_file),
        load_model=lambda state: load_model(model_id, gguf_file=gguf_file, adapter=args.adapter, dtype=args.dtype,
                                            device=device, state=state),
        load_skeleton=lambda: model_skeleton(model_id, gguf_file=gguf_file),
        texts=texts, factor=factor, info={"model": model_id, "gguf_file": gguf_file, "adapter": args.adapter},
        load_evaluator=_evaluator_loader(args.evaluator, args.dtype, device) if args.evaluator else None,
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
