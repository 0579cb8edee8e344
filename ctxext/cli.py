"""`ctxext` command line. Each subcommand lives in its own module under ``ctxext.commands`` and provides
``register(subparsers)``, which adds a parser whose ``func(args) -> int`` runs it."""

from __future__ import annotations

import argparse
import importlib
import os
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


#: the process whose SIGTERM is handled as Ctrl-C; a child forked from it (lm-eval's bootstrap Pool workers) inherits
#: the handler, and a pool ends its workers with SIGTERM: there it ends the process as Python's default does
_HANDLER_PID: int | None = None


def _raise_terminated(signum, frame):
    if os.getpid() != _HANDLER_PID:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise Terminated()


def _quiet_libraries() -> None:
    """``--no-progress``: the libraries' bars too (transformers' "Loading weights", the hub's downloads)."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Python's default for SIGTERM ends the process without running any cleanup; a handler someone else set is kept
    own_sigterm = (threading.current_thread() is threading.main_thread()
                   and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    if own_sigterm:
        global _HANDLER_PID
        _HANDLER_PID = os.getpid()
        signal.signal(signal.SIGTERM, _raise_terminated)
    if getattr(args, "no_progress", False):
        _quiet_libraries()
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
