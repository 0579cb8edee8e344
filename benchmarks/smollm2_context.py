"""Training-free context extension on a real checkpoint: SmolLM2-135M (LLaMA architecture, trained to 8192 tokens)
at 8k and 16k tokens, unpatched and with pi / ntk / dynamic-ntk / yarn at factor 2, on held-out Austen (*Emma*).

    python benchmarks/smollm2_context.py [--max-tokens 32768] [--out benchmarks/results/smollm2_context]

The checkpoint is the GGUF printed by ``../shared/tools/smollm2.sh`` (or ``--gguf PATH``), de-quantized to float32
by transformers. This is ``ctxext eval`` with fixed arguments: non-overlapping windows (``--protocol chunks``) of
each length, ``--max-tokens`` tokens per (method, length) spread evenly over the book, float32 on CPU; it writes
``OUT.json`` (+ ``OUT.jsonl`` rows as they finish, so ``--resume`` continues an interrupted run) and ``OUT.png``
(two panels: perplexity of all targets, and of the last quarter of each window), and prints the tables. ``ppl_last_quarter`` scores only targets in the last quarter of each window (positions
6144-8191 at 8k, 12288-16383 at 16k): at 16k, tokens that sit past the training length.

About 30 s per 8k window and 100 s per 16k window on an idle 2-core CPU, so the default (4 + 2 windows for each
of 5 methods) takes about 30 minutes (29 measured). The report is ``benchmarks/smollm2_context.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import smollm2_gguf

HERE = Path(__file__).resolve().parent
METHODS = "none,pi,ntk,dynamic-ntk,yarn"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, help="SmolLM2 GGUF file (default: ../shared/tools/smollm2.sh)")
    p.add_argument("--max-tokens", type=int, default=32768, help="tokens per (method, length)")
    p.add_argument("--lengths", default="8192,16384")
    p.add_argument("--factor", default="2")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--out", type=Path, default=HERE / "results" / "smollm2_context", help="path without suffix")
    p.add_argument("--resume", action="store_true", help="keep finished rows of an interrupted run")
    p.add_argument("--plot-only", action="store_true", help="redraw OUT.png from OUT.json")
    args = p.parse_args(argv)
    if args.plot_only:
        print(f"plot: {plot(args.out.with_suffix('.json'), args.out.with_suffix('.png'))}")
        return 0

    gguf = args.gguf or smollm2_gguf()
    if not gguf.is_file():
        raise SystemExit(f"no GGUF file at {gguf}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from ctxext.cli import main as ctxext_main

    eval_args = [
        "eval", "--model", str(gguf.parent), "--gguf-file", gguf.name, "--device", "cpu", "--dtype", "float32",
        "--methods", args.methods, "--factor", args.factor, "--lengths", args.lengths, "--protocol", "chunks",
        "--max-tokens", str(args.max_tokens), "--output", str(args.out.with_suffix(".json")), "--no-progress",
    ] + (["--resume"] if args.resume else [])
    print("ctxext " + " ".join(eval_args), file=sys.stderr, flush=True)
    code = ctxext_main(eval_args)
    if args.out.with_suffix(".json").exists():
        print(f"plot: {plot(args.out.with_suffix('.json'), args.out.with_suffix('.png'))}", file=sys.stderr)
    return code


def plot(results: Path, png: Path) -> Path:
    """One panel for all targets, one for the last quarter of each window (where extrapolation fails first)."""
    import json

    from ctxext.evaluation.report import plot as plot_rows

    doc = json.loads(results.read_text())
    model = doc["models"][0]
    panels = {"all": "all targets", "last quarter": "last quarter of each window"}
    models = [dict(model, label=key, title=f"{model['label']}: {what}") for key, what in panels.items()]
    rows = []
    for r in doc["results"]:
        if r.get("kind", "ppl") == "ppl":
            rows.append(dict(r, model="all"))
            rows.append(dict(r, model="last quarter", ppl=r["ppl_last_quarter"]))
    title = (f"SmolLM2-135M (trained to {model['original_length']}) on held-out Emma, non-overlapping windows, "
             f"{doc['protocol']['max_tokens']} tokens per point, {doc['created'][:10]}")
    return plot_rows(rows, models, png, title=title)


if __name__ == "__main__":
    sys.exit(main())
