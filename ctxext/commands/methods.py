"""`ctxext methods`: which patching method fits which architecture family, from the registry.

The default output fits a 120-column terminal: a yes / no matrix (methods x families), the family names, and the
method summaries. ``--why`` prints the reason behind every cell, ``--family NAME`` those of one family.
``--markdown`` prints the table of docs/methods.md, ``--json`` the table and each method's options, ``--census`` the
model x method census (``ctxext.census``).
"""

from __future__ import annotations

import json
import textwrap

from ..adapters.table import format_method_table, method_table
from ..methods.registry import METHODS

#: Width of the text output: a terminal's, so that no line wraps.
WIDTH = 120


def register(sub) -> None:
    p = sub.add_parser("methods", help="list patching methods and the architectures each applies to")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (as in docs/methods.md)")
    p.add_argument("--json", action="store_true", help="print the table and each method's options as JSON")
    p.add_argument("--why", action="store_true",
                   help="the reason behind every cell: what each method does on each family, or why it does not fit")
    p.add_argument("--family", default=None, metavar="NAME",
                   help="the reasons behind one family's cells (a column of the matrix, e.g. rotary, gpt2)")
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


# -- the text views --------------------------------------------------------------------------------------------------


def families() -> list[tuple[str, str]]:
    """(key, title) of every architecture family, in the table's column order."""
    from ..adapters import ADAPTERS

    return [(a.family, a.title) for a in ADAPTERS]


def fits(cell: str) -> bool:
    """Whether a table cell says the method applies: a cell that says why not starts with ``error``."""
    return not cell.startswith("error")


def _wrap(text: str, first: str, rest: str) -> str:
    # break between words only: method names and identifiers stay whole
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False)


def format_matrix(rows: list[dict[str, str]], columns: list[tuple[str, str]]) -> str:
    """Methods as rows, families as columns, ``yes`` / ``no`` in the cells."""
    header = ["method"] + [key for key, _ in columns]
    body = [[row["method"]] + ["yes" if fits(row[key]) else "no" for key, _ in columns] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(header, *body)]
    lines = [header, ["-" * w for w in widths], *body]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def format_overview(rows: list[dict[str, str]], columns: list[tuple[str, str]]) -> str:
    """The default view: the matrix, what each column is, each method's summary and options, where the reasons are."""
    width = max(len(key) for key, _ in columns)
    lines = [format_matrix(rows, columns), "", "Families:"]
    lines += [_wrap(title, f"  {key:<{width}}  ", " " * (width + 4)) for key, title in columns]
    lines.append("")
    for m in METHODS.values():
        opts = ", ".join(f"{k}={o.default}" for k, o in m.options.items())
        alias = f" (alias {', '.join(m.aliases)})" if m.aliases else ""
        lines.append(_wrap(f"{m.name}{alias}: {m.summary}" + (f"; options: {opts}" if opts else ""), "", "  "))
    lines += ["", "Why a cell is yes or no: ctxext methods --why (every family), or --family NAME (one family)."]
    return "\n".join(lines)


def format_reasons(rows: list[dict[str, str]], columns: list[tuple[str, str]]) -> str:
    """For each family: what each method does on it, or why it does not fit (the table's full cell text)."""
    width = max(len(row["method"]) for row in rows)
    blocks = []
    for key, title in columns:
        lines = [f"{key}: {title}"]
        lines += [_wrap(row[key], f"  {row['method']:<{width}}  ", " " * (width + 4)) for row in rows]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def pick_family(columns: list[tuple[str, str]], name: str) -> tuple[str, str]:
    """The family whose key is ``name`` (any case); ValueError naming the keys otherwise."""
    key = name.strip().lower()
    for column in columns:
        if column[0] == key:
            return column
    raise ValueError(f"unknown family {name!r}; choose one of {', '.join(k for k, _ in columns)}")


def run(args) -> int:
    reasons = args.why or args.family is not None
    if reasons and (args.census or args.markdown or args.json):
        raise ValueError("--why and --family print the reasons as text; leave out --census, --markdown and --json")
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
    if args.markdown:
        print(format_method_table(markdown=True))
        return 0
    columns = families()
    if args.family is not None:
        print(format_reasons(method_table(), [pick_family(columns, args.family)]))
    elif args.why:
        print(format_reasons(method_table(), columns))
    else:
        print(format_overview(method_table(), columns))
    return 0
