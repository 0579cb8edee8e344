"""`ctxext eval` and `ctxext demo`: perplexity, passkey and RULER-style tasks of several patches at several lengths.

`ctxext eval --model ID_OR_DIR ...` evaluates one model; with no `--model` (or as `ctxext demo`) it
runs the default offline evaluation of the shipped reference models. Multi-process runs:
`torchrun --nproc_per_node N -m ctxext eval ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import sys
from pathlib import Path

from ..evaluation.passkey import DEFAULT_DEPTHS
from ..evaluation.windows import PROTOCOLS

DEMO_OUTPUT = "results/demo.json"
DEMO_PLOT = "results/demo.png"
EVAL_OUTPUT = "results/eval.json"


def _lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1024 if part.endswith("k") else 1
        try:
            number = float(part.rstrip("k")) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a length: {part!r} (e.g. 512,1024,2k)") from None
        if not number.is_integer() or number < 2:
            raise argparse.ArgumentTypeError(f"a length must be a whole number of tokens >= 2, got {part!r}")
        out.append(int(number))
    if not out:
        raise argparse.ArgumentTypeError("no lengths given (e.g. 512,1024,2k)")
    return sorted(set(out))


def _depths(text: str) -> tuple[float, ...]:
    try:
        depths = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers between 0 and 1, got {text!r}") from None
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise argparse.ArgumentTypeError(f"depths are fractions of the context, between 0 and 1; got {text!r}")
    return depths


def _factor(text: str) -> float:
    from ..evaluation.requests import parse_factor

    try:
        return parse_factor(text, "--factor")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--factor: ")) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_eval_arguments(p, *, demo: bool) -> None:
    from ..evaluation.demo import DEMO_MAX_TOKENS

    g = p.add_argument_group("model")
    if not demo:
        g.add_argument("--model", help="hub id, local directory, or directory holding --gguf-file "
                       "(default: the shipped reference models, as `ctxext demo`)")
        g.add_argument("--gguf-file", help="GGUF file name inside --model")
        g.add_argument("--adapter", help="LoRA adapter directory saved by a ctxext fine-tune")
    g.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or auto")
    g.add_argument("--device", default=None, help="cpu, cuda or auto (device_map='auto'); default: cuda if available")
    g = p.add_argument_group("patches")
    g.add_argument("--methods", help="comma-separated: none (unpatched), pi, ntk, yarn:8, ... "
                   "(default: none + every method that fits the model)")
    g.add_argument("--factor", type=_factor, help="factor for every method that takes one "
                   "(default: longest length / the model's original length)")
    g.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="method option, for every method that accepts KEY, or METHOD.KEY=VALUE; repeatable")
    g = p.add_argument_group("data and protocol")
    g.add_argument("--lengths", type=_lengths, help="comma-separated window lengths, e.g. 512,1024,2k "
                   "(default: 1x,2x,4x,8x the original length)")
    g.add_argument("--data", help="text file, folder of .txt files, JSONL with a text field, or a datasets "
                   "name / local dataset folder (default: the bundled held-out book)")
    g.add_argument("--data-split", default="test", help="split of a datasets dataset (default: test)")
    g.add_argument("--text-field", default="text", help="text field of JSONL rows / dataset column (default: text)")
    g.add_argument("--protocol", choices=PROTOCOLS, default="sliding",
                   help="sliding (windows moved by --stride, each token scored once with >= L-stride context) "
                   "or chunks (consecutive windows, every token scored)")
    g.add_argument("--stride", type=_positive, help="sliding stride (default: half the length)")
    g.add_argument("--max-windows", type=_positive,
                   help="at most N windows per (method, length), spread evenly over the text")
    g.add_argument("--max-tokens", type=_positive,
                   help="at most N tokens fed per (method, length), i.e. N // length windows (at least 1), spread "
                   "evenly over the text" + (f" (default without --max-windows: {DEMO_MAX_TOKENS})" if demo else
                   f" (default: no cap; {DEMO_MAX_TOKENS} without --model)"))
    g.add_argument("--batch-size", type=_positive,
                   help="windows per forward pass (default: about 2048 tokens' worth, at most 16, at least 1)")
    g = p.add_argument_group("long-context tasks")
    g.add_argument("--tasks", help="comma-separated: ppl (perplexity), passkey, and RULER-style tasks "
                   "(niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe) or the "
                   "aliases ruler (all 11), niah (the 8 needle tasks), quick (niah_single_1, niah_single_2, "
                   "niah_multikey_1, vt) (default: ppl, plus passkey with --passkey)")
    g.add_argument("--task-samples", type=_positive, default=10,
                   help="samples per (task, method, length) (default: 10)")
    g.add_argument("--task-depths", type=_depths, default=DEFAULT_DEPTHS,
                   help="needle depths of the needle tasks, taken in turn by the samples (default: 0,.25,.5,.75,1)")
    g.add_argument("--no-chat-template", action="store_true",
                   help="plain prompts even where the tokenizer has a chat template (default: the task inside the "
                   "template's user turn, the answer prefix after its assistant start, as RULER does)")
    g.add_argument("--heatmap", help="PNG of needle-task accuracy by depth x length, one panel per method"
                   + (" (default: beside --plot, *_needles.png, when needle tasks ran)" if demo else
                      " (default: beside --plot when needle tasks ran)"))
    g.add_argument("--passkey", action="store_true", help="also run synthetic passkey retrieval (as --tasks ...,passkey)")
    g = p.add_argument_group("key-token perplexity (LongPPL)")
    g.add_argument("--key-tokens", action="store_true",
                   help="also report perplexity over the key tokens alone: those an evaluator predicts much better "
                   "with long context than with short (Fang et al. 2024: log-prob gain > 2 and log-prob > -2)")
    if not demo:
        g.add_argument("--evaluator", help="hub id or local directory of the key-token evaluator; it must share the "
                       "model's tokenizer (default: the model itself, unpatched)")
    g.add_argument("--key-context", type=_positive,
                   help="the evaluator's long context in tokens (default: its trained length)")
    g.add_argument("--key-short", type=_positive, help="the short context in tokens (default: an eighth of the long)")
    g.add_argument("--passkey-depths", type=_depths, default=DEFAULT_DEPTHS, help="needle depths (default: 0,.25,.5,.75,1)")
    g.add_argument("--passkey-trials", type=_positive, default=2, help="trials per (length, depth) (default: 2)")
    g.add_argument("--seed", type=int, default=0, help="seed of the passkey and task samples (default: 0)")
    g = p.add_argument_group("output")
    g.add_argument("--output", help=f"results JSON; rows also go to a .jsonl beside it as they finish "
                   f"(default: {DEMO_OUTPUT if demo else EVAL_OUTPUT})")
    g.add_argument("--resume", action="store_true", help="keep the finished rows of an interrupted run and skip them")
    g.add_argument("--overwrite", action="store_true",
                   help="replace a finished run at --output (without it, or --resume, such a run is refused); the old "
                   "files stay until the new run has its first row")
    g.add_argument("--plot", help="PNG of perplexity vs length" + (f" (default: {DEMO_PLOT})" if demo else ""))
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity / passkey of patched models at several lengths",
                       description="Evaluate one model under several patches and lengths; without --model, "
                       "run the default offline evaluation of the reference models (as `ctxext demo`).")
    add_eval_arguments(p, demo=False)
    p.set_defaults(func=run_eval)
    d = sub.add_parser("demo", help="the default offline run: reference models at 1x-8x their training length",
                       description="Evaluate the shipped reference models (LLaMA / GPT-2 / BLOOM families, trained "
                       "at a short context) on the held-out book at 1x, 2x, 4x and 8x their training length, "
                       "for every method that fits each; prints the table and writes JSON and a plot.")
    add_eval_arguments(d, demo=True)
    d.set_defaults(func=run_eval, model=None, gguf_file=None, adapter=None, evaluator=None)


def _machine(device: str) -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "device": device}
    if device != "cpu" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_eval(args) -> int:
    from ..evaluation.device import make_state
    from ..evaluation.results import ResultStore
    from ..evaluation.runner import Runner, Settings

    demo = args.model is None
    device, output, jobs, texts, lengths = _prepare(args, demo)  # every check: nothing loaded or written yet
    state = make_state("cpu" if device == "cpu" else device)
    with contextlib.ExitStack() as stack:
        if state.is_main_process:  # one writer per output, from before the first model loads to the last write
            from ..evaluation.results import check_output
            from ..core.outputs import OutputLock

            stack.enter_context(OutputLock(output, "--output"))
            check_output(output, resume=args.resume, overwrite=args.overwrite)  # again: another run may have ended
        return _run(args, demo, device, output, jobs, texts, lengths, state)


def _run(args, demo, device, output, jobs, texts, lengths, state) -> int:
    from ..evaluation.fingerprint import data_fingerprint, model_fingerprint, tokenizer_fingerprint
    from ..evaluation.results import ResultStore
    from ..evaluation.runner import Runner, Settings

    max_windows, max_tokens = _caps(args, demo)
    measures = _measures(args)
    tasks = [m for m in measures if m not in ("ppl", "passkey")]
    settings = Settings(
        lengths=lengths, protocol=args.protocol, stride=args.stride, max_windows=max_windows, max_tokens=max_tokens,
        batch_size=args.batch_size, perplexity="ppl" in measures, passkey="passkey" in measures,
        passkey_depths=tuple(args.passkey_depths), passkey_trials=args.passkey_trials, seed=args.seed,
        progress=not args.no_progress, tasks=tasks, task_samples=args.task_samples,
        task_depths=tuple(args.task_depths), chat_template=not args.no_chat_template,
        key_tokens=args.key_tokens, key_context=args.key_context, key_short=args.key_short,
    )
    fingerprint = {  # what must match for --resume to reuse rows (see ctxext.evaluation.fingerprint)
        "models": [dict(j.info, label=j.label, files=model_fingerprint(j.info)) for j in jobs],
        "data": dict(texts.info, content=data_fingerprint(texts.texts)), "dtype": args.dtype,
        "plan": {"methods": args.methods, "factor": args.factor, "options": sorted(args.option or []),
                 "lengths": args.lengths},
        "protocol": args.protocol, "stride": args.stride, "max_windows": max_windows, "max_tokens": max_tokens,
        "passkey": [True, list(args.passkey_depths), args.passkey_trials, args.seed] if settings.passkey else None,
    }
    if tasks:  # absent without tasks: runs from before tasks existed still resume
        fingerprint["tasks"] = [tasks, args.task_samples, list(args.task_depths), args.seed, not args.no_chat_template,
                                [tokenizer_fingerprint(j.info) for j in jobs]]
    if not settings.perplexity:
        fingerprint["perplexity"] = False
    if args.key_tokens:  # ppl rows then carry key-token perplexity: only such rows resume
        fingerprint["key_tokens"] = [args.evaluator, args.key_context, args.key_short,
                                     model_fingerprint({"model": args.evaluator}) if args.evaluator else None]
    store = ResultStore(output, fingerprint, resume=args.resume, enabled=state.is_main_process)
    runner = Runner(settings, store, state, command=args.command)
    for problem in store.rejected:
        runner.log(f"resume: {problem}; not kept, recomputed")
    if store.resumed:
        runner.log(f"resuming: {store.resumed} finished row(s) in {store.jsonl}"
                   + (f"; {store.dropped} unreadable line(s) (a write cut by a kill) will be recomputed" if store.dropped else ""))
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        runner.run(jobs)
    finally:  # also on Ctrl-C and errors: the final JSON holds every finished row (none: an earlier result stays)
        outcome = runner.outcome
        rows = store.ordered(outcome.planned)
        document = _document(args, started, device, state, outcome, texts, rows, max_windows, max_tokens, settings)
        written = store.write_final(document)
    if state.is_main_process:
        _show(args, demo, store, rows, outcome, document, written)
    state.wait_for_everyone()  # no process exits (and makes torchrun stop the others) before the files are written
    if not rows and not outcome.errors:
        raise ValueError("nothing was evaluated")
    return 2 if outcome.errors else 0


def _caps(args, demo: bool) -> tuple[int | None, int | None]:
    from ..evaluation.demo import DEMO_MAX_TOKENS

    if demo and args.max_windows is None and args.max_tokens is None:
        return None, DEMO_MAX_TOKENS
    return args.max_windows, args.max_tokens


def _measures(args) -> list[str]:
    """What the run measures: --tasks (ppl, passkey, task names), with --passkey adding passkey."""
    from ..evaluation.tasks import parse_tasks

    measures = parse_tasks(args.tasks) if args.tasks else ["ppl"]
    if args.passkey and "passkey" not in measures:
        measures.append("passkey")
    return measures


def _prepare(args, demo: bool):
    """Check every argument, the files they name, the output and the methods x model family; load no model and
    write nothing. Returns (device, output, jobs, texts, lengths)."""
    from ..evaluation.data import load_texts
    from ..evaluation.device import resolve_device, resolve_dtype
    from ..evaluation.requests import parse_methods, parse_options
    from ..evaluation.results import check_output, jsonl_path
    from ..evaluation.windows import check_protocol

    if demo and (args.gguf_file or args.adapter or args.evaluator):
        raise ValueError("--gguf-file, --adapter and --evaluator need --model")
    if args.key_tokens and "ppl" not in _measures(args):
        raise ValueError("--key-tokens is a perplexity: add ppl to --tasks")
    if not args.key_tokens and (args.evaluator or args.key_context or args.key_short):
        raise ValueError("--evaluator, --key-context and --key-short need --key-tokens")
    if args.key_context and args.key_short and args.key_short >= args.key_context:
        raise ValueError(f"--key-short {args.key_short} must be shorter than --key-context {args.key_context}")
    device = resolve_device(args.device)
    resolve_dtype(args.dtype)
    if any(m not in ("ppl", "passkey") for m in _measures(args)):  # unknown task names are refused here too
        from ..evaluation.tasks import words

        try:
            words.check_available()
        except ImportError as exc:
            raise ValueError(f"--tasks: {exc}") from None
    if args.methods:  # unknown names, bad factors and stray options
        parse_methods(args.methods, factor=args.factor, options=args.option)
    else:
        parse_options(args.option)  # the form of each --option; which methods take them is checked per model
    for length in args.lengths or []:
        check_protocol(args.protocol, length, args.stride)  # a stride too long for a length
    output = args.output or (DEMO_OUTPUT if demo else EVAL_OUTPUT)
    if args.data and Path(args.data).resolve() in (Path(output).resolve(), jsonl_path(output).resolve()):
        raise ValueError(f"--output {output} would overwrite the data {args.data}; choose another --output")
    check_output(output, resume=args.resume, overwrite=args.overwrite)
    plot = args.plot or (DEMO_PLOT if demo else None)
    if plot:
        _check_plot(plot, data=args.data)
    heatmap = _heatmap_path(args, demo)
    if heatmap and plot and Path(heatmap).resolve() == Path(plot).resolve():
        raise ValueError(f"--heatmap {heatmap} is the --plot file; choose another")
    if heatmap and heatmap != _derived_heatmap(plot):
        _check_plot(heatmap, data=args.data, flag="--heatmap")
    if not demo:
        from ..data.sources import check_source

        check_source(args.model, gguf_file=args.gguf_file, what="--model")
        if args.evaluator:
            check_source(args.evaluator, what="--evaluator")
        if args.adapter is not None and not (Path(args.adapter) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"--adapter {args.adapter}: not a LoRA adapter folder (no adapter_config.json)")
    texts = load_texts(args.data, split=args.data_split, text_field=args.text_field) if args.data else None
    jobs, texts, lengths = _jobs(args, demo, device, texts)
    _check_fit(args, jobs, lengths)
    return device, output, jobs, texts, lengths


def _check_plot(plot: str, *, data: str | None, flag: str = "--plot") -> None:
    from ..evaluation.results import check_file_target

    path = check_file_target(plot, flag, "ppl.png")
    if data and path.resolve() == Path(data).resolve():
        raise ValueError(f"{flag} {plot} would overwrite the data {data}; choose another {flag}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} needs matplotlib: pip install 'ctxext[eval]'") from None


def _derived_heatmap(plot: str | None) -> str | None:
    if not plot:
        return None
    path = Path(plot)
    return str(path.with_name(f"{path.stem}_needles{path.suffix or '.png'}"))


def _heatmap_path(args, demo: bool) -> str | None:
    """--heatmap, or beside the perplexity plot when there is one."""
    return args.heatmap or _derived_heatmap(args.plot or (DEMO_PLOT if demo else None))


def _check_fit(args, jobs, lengths) -> None:
    """Methods x factors x model family, on each model's skeleton (no weights): a requested method that fits no
    model, or a derived factor past the cap, is refused before anything loads. In the demo, a method that fits
    some reference models runs on those and is reported for the others."""
    from ..adapters import find_adapter
    from ..core.errors import PatchError
    from ..evaluation.preflight import unfit_requests
    from ..evaluation.requests import NONE, parse_methods, parse_factor
    from ..evaluation.runner import default_factor, default_lengths
    from ..methods.registry import METHODS

    unfit: dict[str, list[str]] = {}
    for job in jobs:
        if job.load_skeleton is None:
            continue
        try:
            skeleton = job.load_skeleton()
        except (OSError, ValueError):
            if len(jobs) == 1:
                raise
            continue  # the runner reports this model and runs the others
        try:
            adapter = find_adapter(skeleton)
        except PatchError as exc:
            if args.methods and any(m.strip().split(":")[0].lower() != NONE for m in args.methods.split(",")):
                raise PatchError(f"{job.label}: {exc}") from None
            continue  # unpatched only: fine for any model
        original = adapter.original_length(skeleton)
        if args.methods:
            requests = parse_methods(args.methods, factor=job.factor, options=args.option)
        else:  # the default set: every method that fits; its --option must apply to one of them
            from ..api import available_methods

            requests = parse_methods(None, factor=job.factor, options=args.option,
                                     default=[NONE] + list(available_methods(skeleton)))
        factor = job.factor
        if factor is None and original and any(r.factor is None and _takes_factor(METHODS[r.method])
                                               for r in requests if r.method != NONE):
            job_lengths = lengths or default_lengths(original)
            factor = default_factor(job_lengths, original)
            parse_factor(factor, f"{job.label}: the default factor (longest length {max(job_lengths)} / the "
                         f"model's original length {original})")
        if args.methods:  # the default set keeps only what fits (the runner notes the rest)
            for problem in unfit_requests(skeleton, requests, default_factor=factor):
                unfit.setdefault(job.label, []).append(problem)
    if unfit and (len(jobs) == 1 or len(unfit) == len(jobs)):
        raise PatchError("; ".join(f"{label}: {p}" for label, problems in unfit.items() for p in problems))


def _takes_factor(method) -> bool:
    return method.needs_factor or method.scales_with_factor


def _jobs(args, demo: bool, device: str, texts):
    """The models to evaluate (one, or the reference models), the texts, and the lengths (None: per model).
    Nothing is loaded: each job holds loaders."""
    from ..evaluation.demo import demo_jobs, reference_texts
    from ..evaluation.models import load_model, load_tokenizer
    from ..loading import model_skeleton
    from ..evaluation.runner import ModelJob

    if demo:
        jobs = demo_jobs(texts, methods=args.methods, factor=args.factor, options=args.option,
                         dtype=args.dtype, device=device)
        return jobs, jobs[0].texts, args.lengths  # None: each reference model at 1x..8x its own training length
    model_id = args.model
    texts = texts or reference_texts()
    job = ModelJob(
        label=_model_label(model_id, args.gguf_file),
        load_tokenizer=lambda: load_tokenizer(model_id, gguf_file=args.gguf_file),
        load_model=lambda state: load_model(model_id, gguf_file=args.gguf_file, adapter=args.adapter,
                                            dtype=args.dtype, device=device, state=state),
        load_skeleton=lambda: model_skeleton(model_id, gguf_file=args.gguf_file),
        texts=texts, methods=args.methods, factor=args.factor, options=args.option,
        info={"model": model_id, "gguf_file": args.gguf_file, "adapter": args.adapter},
        load_evaluator=_evaluator_loader(args, device) if args.evaluator else None,
    )
    return [job], texts, args.lengths


def _evaluator_loader(args, device: str):
    from ..evaluation.models import load_model, load_tokenizer

    def load(state):
        model = load_model(args.evaluator, dtype=args.dtype, device=device, state=state)
        return model, load_tokenizer(args.evaluator), args.evaluator

    return load


def _document(args, started, device, state, outcome, texts, rows, max_windows, max_tokens, settings) -> dict:
    """The final results JSON."""
    from .. import __version__

    sliding = args.protocol == "sliding"
    return {
        "ctxext_version": __version__,
        "created": started.isoformat(timespec="seconds"),
        "command": ["ctxext"] + sys.argv[1:] if sys.argv and "ctxext" in sys.argv[0] else sys.argv,
        "machine": _machine(device),
        "processes": state.num_processes,
        "model": outcome.models[0] if len(outcome.models) == 1 else None,
        "models": outcome.models,
        "data": texts.info,
        "protocol": {"name": args.protocol, "stride": args.stride if sliding else None,
                     "default_stride": "half the length" if sliding and args.stride is None else None,
                     "max_windows": max_windows, "max_tokens": max_tokens, "batch_size": args.batch_size,
                     "last_quarter": "targets in the last quarter of their window"},
        "passkey": {"depths": list(args.passkey_depths), "trials": args.passkey_trials, "seed": args.seed}
        if settings.passkey else None,
        "tasks": {"names": settings.tasks, "samples": settings.task_samples, "depths": list(settings.task_depths),
                  "seed": args.seed, "chat_template": settings.chat_template,
                  "source": "RULER (Hsieh et al. 2024; NVIDIA/RULER), generated offline: ctxext.evaluation.tasks"}
        if settings.tasks else None,
        "results": rows,
        "errors": outcome.errors,
        "interrupted": outcome.interrupted,
    }


def _show(args, demo: bool, store, rows, outcome, document, written) -> None:
    """Tables on stdout, file names on stderr, and the plot (only beside results this run wrote)."""
    from ..evaluation import report

    from ..evaluation.verdict import format_verdicts

    table = report.format_report(rows, outcome.models, document["protocol"])
    if table:
        print(table)
    verdict = format_verdicts(rows, outcome.models)
    if verdict:
        print("\n" + verdict)
    if written is None:
        print("\nno results written: nothing finished in this run", file=sys.stderr)
        return
    print(f"\nresults: {store.output} (rows: {store.jsonl})", file=sys.stderr)
    plot_path = args.plot or (DEMO_PLOT if demo else None)
    if plot_path and any(r.get("kind", "ppl") == "ppl" and r.get("ppl") for r in rows):
        path = Path(plot_path)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # the suffix tells the format
        try:
            report.plot(rows, outcome.models, tmp, title=_plot_title(document))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        print(f"plot: {plot_path}", file=sys.stderr)
    heatmap = _heatmap_path(args, demo)
    if heatmap and any(r.get("depths") and r.get("kind") not in ("ppl", "passkey") for r in rows):
        path = Path(heatmap)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
        try:
            report.needle_heatmap(rows, outcome.models, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        print(f"needle heatmap: {heatmap}", file=sys.stderr)


def _model_label(model_id: str, gguf_file: str | None) -> str:
    if gguf_file:
        return Path(gguf_file).name.removesuffix(".gguf")
    path = Path(model_id)
    return path.resolve().name if path.exists() else model_id


def _plot_title(document: dict) -> str:
    proto = document["protocol"]
    what = "sliding window" if proto["name"] == "sliding" else "chunks"
    return f"Perplexity vs context length ({what}) on {document['data'].get('data', 'data')}"
