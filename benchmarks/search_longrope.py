"""LongRoPE's factor search on SmolLM2-135M (trained to 8192 tokens), against YaRN at the same factor (issue 27).

    python benchmarks/search_longrope.py [--factor 2] [--budget 12] [--max-windows 1] [--eval-windows 2]
                                         [--threads 2] [--gguf PATH] [--out benchmarks/results/longrope_search.json]

The checkpoint is the GGUF printed by ``../shared/tools/smollm2.sh`` (or ``--gguf PATH``), de-quantized to float32.
The bundled held-out book (*Emma*) is cut in two: the search scores its candidates on the first half
(``ctxext.search.longrope_search``, ``--max-windows`` windows of the target length each), and every variant is then
measured on the second half (``--eval-windows`` windows): perplexity over all targets and over the last quarter of
each window (the positions past the trained length at 2x and beyond), with the forward time. Variants: unpatched; YaRN
x F (``ctxext.patch``, its own attention factor); the search's YaRN start point (YaRN's per-dimension factors under
LongRoPE's attention factor); the search's best. The found checkpoint is written to a temporary folder and deleted:
its numbers are kept, not its weights. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common import smollm2_gguf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--budget", type=int, default=12)
    p.add_argument("--population", type=int, default=6)
    p.add_argument("--parents", type=int, default=3)
    p.add_argument("--max-windows", type=int, default=1)
    p.add_argument("--eval-windows", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gguf", type=Path, help="SmolLM2 GGUF file (default: ../shared/tools/smollm2.sh)")
    p.add_argument("--model", help="another model instead of SmolLM2: a local folder or reference:NAME (e.g. "
                   "reference:llama, the shipped LLaMA reference trained at 128 tokens)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "longrope_search.json")
    args = p.parse_args(argv)

    import torch

    import ctxext
    from ctxext.evaluation.models import load_tokenizer
    from ctxext.evaluation.perplexity import perplexity
    from ctxext.reference import reference_text
    from ctxext.search import SearchSettings, longrope_search, rescaled, start_points
    from ctxext.search.longrope_factors import plain_rope_inputs

    torch.set_num_threads(args.threads)
    if args.model:
        from ctxext.commands.export import _source

        source, kwargs, name = _source(args.model), {}, args.model
    else:
        gguf = args.gguf or smollm2_gguf()
        source, kwargs, name = str(gguf.parent), {"gguf_file": gguf.name}, gguf.name
    model = ctxext.from_pretrained(source, dtype=torch.float32, **kwargs).eval()
    tokenizer = load_tokenizer(source, **kwargs)
    tokens = torch.tensor(tokenizer(reference_text(), add_special_tokens=False)["input_ids"])
    half = tokens.numel() // 2
    calibration, held_out = tokens[:half], tokens[half:]
    trained = int(model.config.max_position_embeddings)
    target = int(round(args.factor * trained))
    settings = SearchSettings(factor=args.factor, budget=args.budget, population=args.population,
                              parents=args.parents)
    work = Path(tempfile.mkdtemp(prefix="longrope-search-"))
    started = time.perf_counter()
    try:
        result = longrope_search(model, calibration, settings, work / "out", max_windows=args.max_windows,
                                 progress=True, describe={"model": name})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    search_seconds = time.perf_counter() - started
    inputs = plain_rope_inputs(model, trained)

    def measure(label, context):
        with torch.no_grad(), context:
            tic = time.perf_counter()
            r = perplexity(model, held_out, target, max_windows=args.eval_windows, progress=False)
            seconds = time.perf_counter() - tic
        return {"variant": label, "ppl": r["ppl"], "ppl_last_quarter": r["ppl_last_quarter"], "windows": r["windows"],
                "seconds_per_window": round(seconds / max(1, r["windows"]), 2)}

    rows = [measure("unpatched", contextlib.nullcontext())]
    rows.append(measure(f"yarn x{args.factor:g} (ctxext.patch)", ctxext.patched(model, "yarn", args.factor)))
    yarn_start = start_points(inputs, args.factor)["yarn"]
    rows.append(measure("yarn factors, LongRoPE attention factor", rescaled(model, inputs, yarn_start, args.factor)))
    rows.append(measure("longrope search best", rescaled(model, inputs, result["best"], args.factor)))
    report = {
        "benchmark": "longrope_search",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": args.threads,
                    "torch": torch.__version__},
        "model": name, "trained_length": trained, "target_length": target,
        "data": "bundled Emma: first half for the search, second half held out",
        "settings": vars(args) | {"gguf": None if args.model else str(kwargs["gguf_file"]), "out": str(args.out)},
        "search": {k: result[k] for k in ("best", "best_score", "starts", "scored", "fresh", "stage")}
        | {"seconds": round(search_seconds, 1)},
        "held_out": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{name}, {trained} -> {target} tokens (x{args.factor:g}); search: {result['scored']} candidates, "
          f"{search_seconds / 60:.1f} min, calibration ppl {result['best_score']:.3f} (starts: "
          + ", ".join(f"{k} {v:.3f}" for k, v in result["starts"].items()) + ")")
    print(f"| variant | ppl (held out) | last quarter | s / window |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['ppl']:.3f} | {r['ppl_last_quarter']:.3f} | {r['seconds_per_window']} |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
