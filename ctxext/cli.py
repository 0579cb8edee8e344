"""`ctxext` command line. Each subcommand lives in its own module under ``ctxext.commands`` and provides
``register(subparsers)``, which adds a parser whose ``func(args) -> int`` runs it."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from .core.errors import PatchError

#: Subcommand modules, in the order `ctxext --help` lists them.
COMMAND_MODULES = [
    "ctxext.commands.methods",
    "ctxext.commands.eval",
    "ctxext.commands.lm_eval",
    "ctxext.commands.finetune",
    "ctxext.commands.export",
    "ctxext.commands.search",
    "ctxext.commands.lab",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctxext", description="Extend and measure the context window of causal LMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, a scheduler's preemption) handled as Ctrl-C is: cleanup runs, the output lock
    goes, finished rows and checkpoints stay."""


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Python's default for SIGTERM ends the process without running any cleanup; a handler someone else set is kept
    own_sigterm = (threading.current_thread() is threading.main_thread()
                   and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    if own_sigterm:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return int(args.func(args) or 0)
    except (PatchError, FileNotFoundError, OSError, ValueError) as exc:
        # Bad input: one clear line, no traceback.
        print(f"ctxext {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"ctxext {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"ctxext {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if own_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
