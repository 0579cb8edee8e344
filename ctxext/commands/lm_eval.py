"""`ctxext lm-eval ...`: lm-evaluation-harness with the `ctxext` model type registered.

lm-eval 0.4.13 finds models only in its own registry (no plugin entry points), so `lm_eval --model
ctxext` works only once :mod:`ctxext.lm_eval_model` is imported. This command imports it and hands
every remaining argument to lm-eval's own command line:

    ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 --tasks TASKS
    python -m ctxext lm-eval ...        (same, without the console script)

Bad input is refused before lm-eval loads any task (which alone takes from seconds to minutes): lm-eval's own
argument parser runs first, then :func:`precheck` (``--tasks``, ``--include_path``, and for ``--model ctxext``
the model_args, the model's source and whether the method fits the model's family, on a weightless skeleton).
With no arguments it prints its usage and exits 2.
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
    argv = list(args.lm_eval_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        raise ValueError("nothing to run: give --model ctxext --model_args pretrained=DIR,... --tasks TASKS")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise OSError("`ctxext lm-eval` needs lm-eval: pip install 'ctxext[eval]'") from None
    from .. import lm_eval_model  # noqa: F401  registers --model ctxext

    if argv[0] in ("-h", "--help"):
        print(HELP)
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
    parser = HarnessCLI()
    parsed = parser.parse_args()  # lm-eval's own usage errors (exit 2) and --help (exit 0) come first
    if getattr(parsed, "command", None) == "run":
        precheck(parsed)  # then ours, before any task loads
    setup_logging()
    parser.execute(parsed)


def precheck(parsed) -> None:
    """Refuse bad input to `lm-eval run` before any task loads (task indexing alone takes a minute or more):
    the settings as lm-eval itself merges them (``--config`` YAML, then the command line), ``--tasks`` and
    ``--include_path``, and for ``--model ctxext`` its model_args (see
    :func:`ctxext.lm_eval_model.check_model_args`), the model's source, and whether the method fits its family."""
    import argparse
    import contextlib
    import io
    import logging
    from pathlib import Path

    from ..lm_eval_model import check_model_args

    if not getattr(parsed, "tasks", None) and not getattr(parsed, "config", None):
        raise ValueError("--tasks is required, e.g. --tasks hellaswag (`ctxext lm-eval ls tasks` lists them)")
    include = getattr(parsed, "include_path", None)
    if include and not Path(include).expanduser().exists():
        raise FileNotFoundError(f"--include_path: not found: {include}")
    try:
        from lm_eval.config.evaluate_config import EvaluatorConfig
    except ImportError:  # pragma: no cover - lm-eval < 0.4.9 has no config object; check what the CLI gave
        model, model_args = getattr(parsed, "model", None), getattr(parsed, "model_args", None) or {}
    else:
        copy = argparse.Namespace(**{k: dict(v) if isinstance(v, dict) else v for k, v in vars(parsed).items()})
        quiet = io.StringIO()
        disabled = logging.root.manager.disable
        logging.disable(logging.WARNING)  # lm-eval warns (e.g. about --limit) again when it really runs
        try:
            with contextlib.redirect_stdout(quiet):  # it prints a --config's merged settings, likewise
                cfg = EvaluatorConfig.from_cli(copy)
        except TypeError as exc:  # a --config YAML whose root is not a mapping
            raise ValueError(str(exc)) from None
        finally:
            logging.disable(disabled)
        model, model_args = cfg.model, cfg.model_args or {}
    if model != "ctxext":
        return
    if isinstance(model_args, str):
        from lm_eval.utils import simple_parse_args_string

        model_args = simple_parse_args_string(model_args)
    checked = check_model_args(model_args)
    if checked["method"] is not None:
        check_fits(model_args, checked)


def check_fits(model_args: dict, checked: dict) -> None:
    """Build the model without weights from its config and check that the method fits its family."""
    from ..api import build_spec
    from ..loading import model_skeleton

    kwargs = {k: model_args[k] for k in ("revision", "trust_remote_code") if model_args.get(k) is not None}
    skeleton = model_skeleton(str(model_args["pretrained"]), gguf_file=model_args.get("gguf_file") or None, **kwargs)
    build_spec(skeleton, checked["method"], checked["factor"], **checked["options"])
