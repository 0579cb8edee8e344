"""`ctxext lm-eval ...`: lm-evaluation-harness with the `ctxext` model type registered.

lm-eval 0.4.13 finds models only in its own registry (no plugin entry points), so `lm_eval --model
ctxext` works only once :mod:`ctxext.lm_eval_model` is imported. This command imports it and hands
every remaining argument to lm-eval's own command line:

    ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 --tasks TASKS
    python -m ctxext lm-eval ...        (same, without the console script)
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


def run(args) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise OSError("`ctxext lm-eval` needs lm-eval: pip install 'ctxext[eval]'") from None
    from .. import lm_eval_model  # noqa: F401  registers --model ctxext

    argv = list(args.lm_eval_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    saved = sys.argv
    sys.argv = ["lm-eval"] + argv  # lm-eval's parser reads sys.argv
    try:
        _lm_eval_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        sys.argv = saved
    return 0


def _lm_eval_main() -> None:
    try:  # lm-eval >= 0.4.9: subcommands (run / ls / validate); `run` is inserted when none is given
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError:  # older lm-eval: one flat command
        from lm_eval.__main__ import cli_evaluate

        cli_evaluate()
        return
    setup_logging()
    parser = HarnessCLI()
    parser.execute(parser.parse_args())
