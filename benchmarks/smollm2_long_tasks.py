"""Does a patched SmolLM2 still read its context? RULER-style tasks, key-token and plain perplexity for every
method that fits, at 4k-32k (SmolLM2-135M-Instruct, LLaMA architecture, trained to 8192 tokens).

    python benchmarks/smollm2_long_tasks.py                       # CPU subset: 4k, 8k (and 16k with --lengths)
    python benchmarks/smollm2_long_tasks.py --lengths 4k,8k,16k,32k --device cuda --dtype bfloat16 --samples 20

This is ``ctxext eval`` with fixed arguments (issue 24's evidence): ``--tasks ppl,niah_single_1,niah_single_2,
niah_single_3,niah_multikey_1,vt,cwe --key-tokens`` on the bundled held-out book, the model's chat template, every
method that fits the model unless ``--methods`` names some, factor = longest length / 8192. It writes ``OUT.json``
(+ ``OUT.jsonl`` rows as they finish: ``--resume`` continues), ``OUT.png`` (perplexity) and ``OUT_needles.png``
(needle accuracy by depth x length per method), prints the tables and the verdict, and writes ``OUT.md`` with one
table of task averages and key-token perplexity per length, which docs/performance.md's "which method, where" quotes.

Cost: every task sample is one forward pass of the full length plus a few dozen decoding steps. Measured on this
project's 2-core CPU (2026-11-24, ``--lengths 8k,16k --methods none,yarn,self-extend,streaming-llm --tasks
ppl,niah_single_1,niah_single_2 --samples 2``): finding the key tokens for 16,384 scored positions took 14 minutes
(the evaluator reads each with 4k-8k tokens of context and again with 1k), perplexity at 8k 84 s per window, and a
task sample at 8k 79 s; the 16k half would have taken about 25 minutes per method, so the run was stopped after
the unpatched model at 8k (niah_single_1 and niah_single_2: 1 of 2 each; the needle at depth 0 was missed, at 0.25
found; 51 key tokens, 0.3% of the positions). On CPU keep to ``--lengths 8k,16k`` with two or three methods, or run
it on a GPU (``--device cuda --dtype bfloat16``), where the whole table at 4k-32k is minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import smollm2_gguf

HERE = Path(__file__).resolve().parent
TASKS = "ppl,niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt,cwe"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, help="SmolLM2 GGUF file (default: ../shared/tools/smollm2.sh)")
    p.add_argument("--model", help="a hub id or local folder instead of the GGUF file")
    p.add_argument("--lengths", default="4k,8k")
    p.add_argument("--methods", help="default: every method that fits the model")
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--samples", type=int, default=4, help="samples per (task, method, length)")
    p.add_argument("--max-tokens", type=int, default=16384, help="perplexity tokens per (method, length)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=HERE / "results" / "smollm2_long_tasks", help="path without suffix")
    p.add_argument("--resume", action="store_true", help="keep finished rows of an interrupted run")
    p.add_argument("--overwrite", action="store_true", help="replace a finished run at --out")
    args = p.parse_args(argv)

    if args.model:
        source = ["--model", args.model]
    else:
        gguf = args.gguf or smollm2_gguf()
        if not gguf.is_file():
            raise SystemExit(f"no GGUF file at {gguf}")
        source = ["--model", str(gguf.parent), "--gguf-file", gguf.name]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from ctxext.cli import main as ctxext_main

    eval_args = ["eval", *source, "--device", args.device, "--dtype", args.dtype, "--lengths", args.lengths,
                 "--tasks", args.tasks, "--task-samples", str(args.samples),
                 "--max-tokens", str(args.max_tokens), "--output", str(args.out.with_suffix(".json")),
                 "--plot", str(args.out.with_suffix(".png")), "--no-progress"]
    eval_args += ["--key-tokens"] if "ppl" in args.tasks.split(",") else []  # key tokens are a perplexity
    eval_args += ["--methods", args.methods] if args.methods else []
    eval_args += ["--resume"] if args.resume else []
    eval_args += ["--overwrite"] if args.overwrite else []
    print("ctxext " + " ".join(eval_args), file=sys.stderr, flush=True)
    code = ctxext_main(eval_args)
    results = args.out.with_suffix(".json")
    if results.exists():
        md = args.out.with_suffix(".md")
        md.write_text(summary(json.loads(results.read_text())))
        print(f"summary: {md}", file=sys.stderr)
    return code


def summary(doc: dict) -> str:
    """Markdown: per method and length, the task average (and each task), key-token and plain perplexity."""
    from ctxext.evaluation.report import task_average, task_names

    rows = doc["results"]
    tasks = task_names(rows)
    avg = {(r["label"], r["length"]): r["accuracy"] for r in task_average(rows)}
    ppl = {(r["label"], r["length"]): r for r in rows if r.get("kind") == "ppl"}
    lengths = sorted({r["length"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    model = doc["models"][0] if doc.get("models") else {}
    out = [f"# {model.get('label', 'model')} (trained to {model.get('original_length')}): tasks, key-token and "
           f"plain perplexity", "",
           f"Machine: {doc['machine'].get('platform')}, {doc['machine'].get('device')}; created {doc['created']}; "
           f"tasks: {', '.join(tasks)} ({doc['tasks']['samples'] if doc.get('tasks') else 0} samples each).", "",
           "| method | " + " | ".join(f"{n}: tasks avg / key ppl / ppl" for n in lengths) + " |",
           "|---|" + "---|" * len(lengths)]
    for label in labels:
        cells = []
        for n in lengths:
            a = avg.get((label, n))
            r = ppl.get((label, n), {})
            key, plain = r.get("ppl_key"), r.get("ppl")
            cells.append(" / ".join(["-" if a is None else f"{100 * a:.0f}%", "-" if key is None else f"{key:.2f}",
                                     "-" if plain is None else f"{plain:.2f}"]))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
