"""`ctxext methods`: the method x architecture table from the registry."""

from __future__ import annotations

import json

from ..adapters.table import format_method_table, method_table
from ..methods.registry import METHODS


def register(sub) -> None:
    p = sub.add_parser("methods", help="list patching methods and the architectures each applies to")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (as in the README)")
    p.add_argument("--json", action="store_true", help="print the table and each method's options as JSON")
    p.add_argument(
        "--census",
        action="store_true",
        help="build every causal LM of the installed transformers tiny and patch it with every method: a model x "
        "method table of ok / refused (why) / FAILED (see ctxext.census)",
    )
    p.add_argument("--models", default=None, help="with --census: comma-separated model types (e.g. llama,gpt2,falcon+alibi)")
    p.add_argument("--only", default=None, metavar="METHODS", help="with --census: comma-separated methods")
    p.add_argument(
        "--slow-models", action="store_true", help="with --census: also walk models whose tiny forward pass is slow"
    )
    p.add_argument("--progress", action="store_true", help="with --census: print each row as it is checked")
    p.set_defaults(func=run)


def _split(text, flag: str):
    """A comma-separated list; None when the flag was not given, ValueError when it was given empty."""
    if text is None:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{flag} {text!r} names nothing; give comma-separated names (e.g. llama,gpt2) or leave it out")
    return items


def run_census(args) -> int:
    import dataclasses
    import sys

    from ..census import format_census, run_census as census

    def progress(row):
        print(f"{row.model} {row.method}: {row.cell} ({row.seconds:.1f}s)", file=sys.stderr, flush=True)

    rows = census(_split(args.models, "--models"), _split(args.only, "--only"),
                  progress=progress if args.progress else None, slow_models=args.slow_models)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print(format_census(rows, markdown=args.markdown))
    return 1 if any(r.status == "FAILED" for r in rows) else 0


def run(args) -> int:
    if args.census:
        return run_census(args)
    if args.models is not None or args.only is not None or args.slow_models or args.progress:
        raise ValueError("--models, --only, --slow-models and --progress go with --census")
    if args.json:
        rows = method_table()
        for row in rows:
            m = METHODS[row["method"]]
            row["aliases"] = list(m.aliases)
            row["needs_factor"] = m.needs_factor
            row["scales_with_factor"] = m.scales_with_factor
            row["options"] = {k: o.default for k, o in m.options.items()}
        print(json.dumps(rows, indent=2))
        return 0
    print(format_method_table(markdown=args.markdown))
    if not args.markdown:
        print()
        for m in METHODS.values():
            opts = ", ".join(f"{k}={o.default}" for k, o in m.options.items())
            alias = f" (alias {', '.join(m.aliases)})" if m.aliases else ""
            print(f"{m.name}{alias}: {m.summary}" + (f"; options: {opts}" if opts else ""))
    return 0
