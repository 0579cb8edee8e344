"""`ctxext lm-eval ...`: lm-evaluation-harness with the `ctxext` model type registered.

Every remaining argument goes to lm-eval's own command line (:func:`ctxext.integrations.lm_eval_run.run_lm_eval`
does the job: it registers the model type and runs lm-eval):

    ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 --tasks TASKS
    python -m ctxext lm-eval ...        (same, without the console script)

Bad input is refused before lm-eval loads any model or task, as `ctxext eval` refuses its own: one
``ctxext lm-eval: error: ...`` line, exit code 2 (the checks: :mod:`ctxext.integrations.lm_eval_checks`).
With no arguments it prints its usage and exits 2. This module holds the arguments and the printing only.
"""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "lm-eval", help="run lm-evaluation-harness with the `ctxext` model type (patched models)",
        description="lm-evaluation-harness with `--model ctxext` registered; every argument after `lm-eval` "
        "goes to lm-eval, e.g. `ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 "
        "--tasks hellaswag`. ctxext model_args: pretrained, gguf_file, adapter, method, factor, and the method's "
        "options (e.g. beta_fast=32); the rest are lm-eval's `hf` model_args.",
        add_help=False,
        prefix_chars="+",  # every argument, `--model` included, is lm-eval's
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


USAGE = (
    "usage: ctxext lm-eval --model ctxext --model_args pretrained=DIR[,method=METHOD,factor=F,OPTION=V,...]\n"
    "                      --tasks TASK[,TASK...] [lm-eval options]   (ctxext lm-eval --help: lm-eval's help)"
)


HELP = (
    "ctxext lm-eval: lm-evaluation-harness with `--model ctxext` registered; every argument goes to lm-eval.\n"
    "  ctxext lm-eval --model ctxext --model_args pretrained=DIR[,method=METHOD,factor=F,OPTION=V,...] --tasks TASKS\n"
    "ctxext model_args: pretrained, gguf_file, adapter, method, factor, the method's options (e.g. beta_fast=32);\n"
    "the rest are lm-eval's `hf` model_args. They are checked before any task loads. lm-eval's own help follows.\n"
)


def run(args) -> int:
    from ..integrations.lm_eval_run import HELP_FLAGS, require_lm_eval, run_lm_eval

    argv = list(args.lm_eval_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        raise ValueError("nothing to run: give --model ctxext --model_args pretrained=DIR,... --tasks TASKS")
    require_lm_eval()
    if argv[0] in HELP_FLAGS:
        print(HELP)  # lm-eval's own help follows
    return run_lm_eval(argv)
