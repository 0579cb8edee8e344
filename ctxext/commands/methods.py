"""`ctxext methods`: the method x architecture table from the registry."""

from __future__ import annotations

import json

from ..registry import METHODS, format_method_table, method_table


def register(sub) -> None:
    p = sub.add_parser("methods", help="list patching methods and the architectures each applies to")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (as in the README)")
    p.add_argument("--json", action="store_true", help="print the table and each method's options as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
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
