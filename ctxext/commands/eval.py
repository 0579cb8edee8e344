"""`ctxext eval` and `ctxext demo`: perplexity, passkey and RULER-style tasks of several patches at several lengths.

`ctxext eval --model ID_OR_DIR ...` evaluates one model; with no `--model` (or as `ctxext demo`) it
runs the default offline evaluation of the shipped reference models. Multi-process runs:
`torchrun --nproc_per_node N -m ctxext eval ...`.

This module is the command line: its arguments, and what the run prints. The arguments become one
:class:`ctxext.evaluation.request.EvalRequest`, run as ``ctxext.evaluate`` runs it.
"""

from __future__ import annotations

import argparse
import sys

from ..evaluation.plan import DEFAULT_DEPTHS, DEMO_MAX_TOKENS, DEMO_OUTPUT, DEMO_PLOT, EVAL_OUTPUT, PROTOCOLS
from ..evaluation.request import (
    MAX_PASSKEY_TRIALS,
    MAX_TASK_SAMPLES,
    EvalRequest,
    parse_count,
    parse_depths,
    parse_factor_argument,
    parse_lengths,
    parse_passkey_trials,
    parse_task_samples,
)


def _argument(parse):
    """An argparse ``type`` from a parser of the plan: its ValueError becomes a usage error with the same text."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


_lengths = _argument(parse_lengths)
_depths = _argument(parse_depths)
_positive = _argument(parse_count)
_samples = _argument(parse_task_samples)
_trials = _argument(parse_passkey_trials)
_factor = _argument(parse_factor_argument)  # also `ctxext export --factor`


def add_eval_arguments(p, *, demo: bool) -> None:
    g = p.add_argument_group("model")
    if not demo:
        g.add_argument("--model", help="hub id, local directory, directory holding --gguf-file, or reference:NAME "
                       "(llama, gpt2, bloom: one shipped reference model) (default: the shipped reference models, as "
                       "`ctxext demo`)")
        g.add_argument("--gguf-file", help="GGUF file name inside --model")
        g.add_argument("--adapter", help="LoRA adapter directory saved by a ctxext fine-tune: evaluated as trained, "
                       "with the patch its ctxext_patch.json records (a method named without a factor gets its factor; "
                       "'none' is refused); rows are labelled +LoRA")
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
                   "niah_multikey_1, vt) (default: ppl, plus passkey with --passkey"
                   + ("; the demo adds passkey on the LLaMA reference, the one trained to retrieve)" if demo else ")"))
    g.add_argument("--task-samples", type=_samples, default=10,
                   help=f"samples per (task, method, length), at most {MAX_TASK_SAMPLES:,} (default: 10)")
    g.add_argument("--task-depths", type=_depths, default=DEFAULT_DEPTHS,
                   help="needle depths of the needle tasks, taken in turn by the samples (default: 0,.25,.5,.75,1)")
    g.add_argument("--no-chat-template", action="store_true",
                   help="plain prompts even where the tokenizer has a chat template (default: the task inside the "
                   "template's user turn, the answer prefix after its assistant start, as RULER does)")
    g.add_argument("--heatmap", help="PNG of needle-task (else passkey) accuracy by depth x length, one panel per method"
                   + (" (default: beside --plot, *_needles.png, when needle tasks or passkey ran)" if demo else
                      " (default: beside --plot when needle tasks or passkey ran)"))
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
    g.add_argument("--passkey-trials", type=_trials, default=2,
                   help=f"trials per (length, depth), at most {MAX_PASSKEY_TRIALS:,} (default: 2)")
    g.add_argument("--seed", type=int, default=0, help="seed of the passkey and task samples (default: 0)")
    g = p.add_argument_group("output")
    g.add_argument("--output", help=f"results JSON; rows also go to a .jsonl beside it as they finish "
                   f"(default: {DEMO_OUTPUT if demo else EVAL_OUTPUT})")
    g.add_argument("--resume", action="store_true", help="keep the finished rows of an interrupted run and skip them")
    g.add_argument("--overwrite", action="store_true",
                   help="replace a finished run at --output (without it, or --resume, such a run is refused); the old "
                   "files stay until the new run has its first row")
    g.add_argument("--plot", help="PNG of perplexity vs length; an existing file is replaced only with --overwrite "
                   "or --resume" + (f" (default: beside --output, {DEMO_PLOT})" if demo else ""))
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


def request_from_args(args) -> EvalRequest:
    """The request of a parsed `ctxext eval` / `ctxext demo` command line (default outputs filled in)."""
    demo = getattr(args, "command", "eval") == "demo" or args.model is None
    return EvalRequest(
        model=args.model, gguf_file=args.gguf_file, adapter=args.adapter, dtype=args.dtype, device=args.device,
        methods=args.methods, factor=args.factor, options=tuple(args.option or ()), lengths=args.lengths,
        data=args.data, data_split=args.data_split, text_field=args.text_field, protocol=args.protocol,
        stride=args.stride, max_windows=args.max_windows, max_tokens=args.max_tokens, batch_size=args.batch_size,
        tasks=args.tasks, task_samples=args.task_samples, task_depths=args.task_depths,
        chat_template=not args.no_chat_template, passkey=args.passkey, passkey_depths=args.passkey_depths,
        passkey_trials=args.passkey_trials, seed=args.seed, key_tokens=args.key_tokens, evaluator=args.evaluator,
        key_context=args.key_context, key_short=args.key_short,
        output=args.output or (DEMO_OUTPUT if demo else EVAL_OUTPUT), resume=args.resume, overwrite=args.overwrite,
        plot=args.plot, heatmap=args.heatmap, progress=not args.no_progress, demo=demo,
        command=getattr(args, "command", "eval"),
    )


def run_eval(args) -> int:
    from ..evaluation.evaluate import run_request
    from ..evaluation.results import jsonl_path

    command = getattr(args, "command", "eval")
    pictures = []

    def show(results) -> None:
        if results.table():
            print(results.table())
        if results.output is None:
            print("\nno results written: nothing finished in this run", file=sys.stderr)
        else:
            print(f"\nresults: {results.output} (rows: {jsonl_path(results.output)})", file=sys.stderr)

    def picture(what: str, path: str, problem: str | None) -> None:
        pictures.append(problem)
        print(f"{what}: {path}" if problem is None else f"ctxext {command}: error: {problem}", file=sys.stderr)

    results = run_request(request_from_args(args), on_finished=show, on_picture=picture)
    if not results.rows and not results.errors:
        raise ValueError("nothing was evaluated")
    return 2 if results.errors or any(pictures) else 0
