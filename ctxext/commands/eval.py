"""`ctxext eval` and `ctxext demo`: perplexity (and passkey) of several patches at several lengths.

`ctxext eval --model ID_OR_DIR ...` evaluates one model; with no `--model` (or as `ctxext demo`) it
runs the default offline evaluation of the shipped reference models. Multi-process runs:
`torchrun --nproc_per_node N -m ctxext eval ...`.
"""

from __future__ import annotations

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
            value = int(float(part.rstrip("k")) * scale)
        except ValueError:
            raise ValueError(f"--lengths: not a length: {part!r} (e.g. 512,1024,2k)") from None
        if value < 2:
            raise ValueError(f"--lengths: a length must be >= 2, got {part!r}")
        out.append(value)
    if not out:
        raise ValueError("--lengths is empty")
    return sorted(set(out))


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--passkey-depths: expected numbers between 0 and 1, got {text!r}") from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        import argparse

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
    g.add_argument("--factor", type=float, help="factor for every method that takes one "
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
    g = p.add_argument_group("passkey retrieval")
    g.add_argument("--passkey", action="store_true", help="also run synthetic passkey retrieval")
    g.add_argument("--passkey-depths", type=_floats, default=DEFAULT_DEPTHS, help="needle depths (default: 0,.25,.5,.75,1)")
    g.add_argument("--passkey-trials", type=_positive, default=2, help="trials per (length, depth) (default: 2)")
    g.add_argument("--seed", type=int, default=0, help="passkey seed (default: 0)")
    g = p.add_argument_group("output")
    g.add_argument("--output", help=f"results JSON; rows also go to a .jsonl beside it as they finish "
                   f"(default: {DEMO_OUTPUT if demo else EVAL_OUTPUT})")
    g.add_argument("--resume", action="store_true", help="keep the finished rows of an interrupted run and skip them")
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
    d.set_defaults(func=run_eval, model=None, gguf_file=None, adapter=None)


def _machine(device: str) -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "device": device}
    if device != "cpu" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_eval(args) -> int:
    from ..evaluation.demo import DEMO_MAX_TOKENS
    from ..evaluation.device import make_state, resolve_device
    from ..evaluation.results import ResultStore, jsonl_path
    from ..evaluation.runner import Runner, Settings
    from ..evaluation.windows import check_protocol

    demo = args.model is None
    if demo and (args.gguf_file or args.adapter):
        raise ValueError("--gguf-file and --adapter need --model")
    device = resolve_device(args.device)
    state = make_state("cpu" if device == "cpu" else device)
    max_windows, max_tokens = args.max_windows, args.max_tokens
    if demo and max_windows is None and max_tokens is None:
        max_tokens = DEMO_MAX_TOKENS
    if args.methods:  # unknown names, bad factors and stray options fail before anything loads
        from ..evaluation.requests import parse_methods

        parse_methods(args.methods, factor=args.factor, options=args.option)
    jobs, texts, lengths = _jobs(args, demo, device, state)
    for length in lengths or []:
        check_protocol(args.protocol, length, args.stride)  # bad stride: fail before loading anything
    output = args.output or (DEMO_OUTPUT if demo else EVAL_OUTPUT)
    if args.data and Path(args.data).resolve() in (Path(output).resolve(), jsonl_path(output).resolve()):
        raise ValueError(f"--output {output} would overwrite the data {args.data}; choose another --output")
    settings = Settings(
        lengths=lengths, protocol=args.protocol, stride=args.stride, max_windows=max_windows, max_tokens=max_tokens,
        batch_size=args.batch_size, passkey=args.passkey, passkey_depths=tuple(args.passkey_depths),
        passkey_trials=args.passkey_trials, seed=args.seed, progress=not args.no_progress,
    )
    fingerprint = {  # what must match for --resume to reuse rows
        "models": [dict(j.info, label=j.label) for j in jobs], "data": texts.info, "dtype": args.dtype,
        "protocol": args.protocol, "stride": args.stride, "max_windows": max_windows, "max_tokens": max_tokens,
        "passkey": [args.passkey, list(args.passkey_depths), args.passkey_trials, args.seed] if args.passkey else None,
    }
    store = ResultStore(output, fingerprint, resume=args.resume, enabled=state.is_main_process)
    runner = Runner(settings, store, state, command=args.command)
    if store.resumed:
        runner.log(f"resuming: {store.resumed} finished row(s) in {store.jsonl}")
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        runner.run(jobs)
    finally:  # also on Ctrl-C and errors: the final JSON holds every finished row
        outcome = runner.outcome
        rows = store.ordered(outcome.planned)
        document = _document(args, started, device, state, outcome, texts, rows, max_windows, max_tokens)
        store.write_final(document)
    if state.is_main_process:
        _show(args, demo, store, rows, outcome, document)
    state.wait_for_everyone()  # no process exits (and makes torchrun stop the others) before the files are written
    if not rows and not outcome.errors:
        raise ValueError("nothing was evaluated")
    return 2 if outcome.errors else 0


def _jobs(args, demo: bool, device: str, state):
    """The models to evaluate (one, or the reference models), the texts, and the lengths (None: per model)."""
    from ..evaluation.data import load_texts
    from ..evaluation.demo import demo_jobs, demo_lengths, reference_texts
    from ..evaluation.models import load_model, load_tokenizer
    from ..evaluation.runner import ModelJob

    texts = load_texts(args.data, split=args.data_split, text_field=args.text_field) if args.data else None
    if demo:
        jobs = demo_jobs(texts, methods=args.methods, factor=args.factor, options=args.option,
                         dtype=args.dtype, device=device)
        return jobs, jobs[0].texts, args.lengths or demo_lengths()
    model_id = args.model
    if model_id.startswith((".", "/", "~")) and not Path(model_id).exists():
        raise FileNotFoundError(f"model directory not found: {model_id}")
    texts = texts or reference_texts()
    job = ModelJob(
        label=_model_label(model_id, args.gguf_file),
        load_tokenizer=lambda: load_tokenizer(model_id, gguf_file=args.gguf_file),
        load_model=lambda: load_model(model_id, gguf_file=args.gguf_file, adapter=args.adapter,
                                      dtype=args.dtype, device=device, state=state),
        texts=texts, methods=args.methods, factor=args.factor, options=args.option,
        info={"model": model_id, "gguf_file": args.gguf_file, "adapter": args.adapter},
    )
    return [job], texts, args.lengths


def _document(args, started, device, state, outcome, texts, rows, max_windows, max_tokens) -> dict:
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
        if args.passkey else None,
        "results": rows,
        "errors": outcome.errors,
        "interrupted": outcome.interrupted,
    }


def _show(args, demo: bool, store, rows, outcome, document) -> None:
    """Tables on stdout, file names on stderr, and the plot."""
    from ..evaluation import report

    table = report.format_report(rows, outcome.models, document["protocol"])
    if table:
        print(table)
    print(f"\nresults: {store.output} (rows: {store.jsonl})", file=sys.stderr)
    plot_path = args.plot or (DEMO_PLOT if demo else None)
    if plot_path and any(r.get("kind", "ppl") == "ppl" and r.get("ppl") for r in rows):
        report.plot(rows, outcome.models, plot_path, title=_plot_title(document))
        print(f"plot: {plot_path}", file=sys.stderr)


def _model_label(model_id: str, gguf_file: str | None) -> str:
    if gguf_file:
        return Path(gguf_file).name.removesuffix(".gguf")
    path = Path(model_id)
    return path.resolve().name if path.exists() else model_id


def _plot_title(document: dict) -> str:
    proto = document["protocol"]
    what = "sliding window" if proto["name"] == "sliding" else "chunks"
    return f"Perplexity vs context length ({what}) on {document['data'].get('data', 'data')}"
