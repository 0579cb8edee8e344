"""`ctxext` command line. Each subcommand lives in its own module under ``ctxext.commands`` and provides
``register(subparsers)``, which adds a parser whose ``func(args) -> int`` runs it."""

from __future__ import annotations

import argparse
import importlib
import sys

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (PatchError, FileNotFoundError, OSError, ValueError) as exc:
        # Bad input: one clear line, no traceback.
        print(f"ctxext {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ctxext {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
