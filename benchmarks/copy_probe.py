#!/usr/bin/env python
"""Does a (reference-sized) LLaMA still copy by content past its trained length, per method? Issue 24, item 4.

    python benchmarks/copy_probe.py --model benchmarks/results/reference_candidates/llama_p100 \
        --out benchmarks/results/copy_probe_llama_p100.json

The probe is ``benchmarks/induction_search.py``'s ``far`` probe at 1x-8x the trained length: in each of ``--windows``
held-out windows of the book (*Emma*), 16 random tokens (ids 100-4095) are written at positions 4-19 and again just
before the window's end, so the second copy lies L - 21 tokens after the first. The score is the top-1 accuracy of
the second copy's tokens after its first (teacher-forced): a model that looks the span up by content at that
distance scores near 1, one that cannot reach it scores near 0. Every method is applied with ``--factor``
(default 8, as ``ctxext demo``), through ``ctxext.patched``. Prints one table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import ctxext
from ctxext import reference

METHODS = "none,pi,ntk,yarn,llama3,dynamic-ntk,self-extend,dca,rerope,lm-infinite,streaming-llm"
SPAN, START = 16, 4


def probe(model, stream: torch.Tensor, length: int, windows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows, targets): held-out windows of ``length`` with one random span twice; targets = the second copy."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length - 1, (windows,), generator=gen).tolist()
    rows = torch.stack([stream[s : s + length] for s in starts])
    span = torch.randint(100, 4096, (windows, SPAN), generator=gen)
    rows[:, START : START + SPAN] = span
    rows[:, length - SPAN - 1 : length - 1] = span
    return rows, span


@torch.inference_mode()
def copy_accuracy(model, rows: torch.Tensor, span: torch.Tensor) -> float:
    length = rows.shape[1]
    pred = torch.cat([model(r).logits.argmax(-1) for r in rows.split(8)])
    # the prediction at position i is for token i + 1: the copy's tokens after its first one
    guessed = pred[:, length - SPAN - 1 : length - 2]
    return float((guessed == span[:, 1:]).float().mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="reference:llama", help="a folder, or reference:llama (default)")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--factor", type=float, default=8.0)
    p.add_argument("--multiples", default="1,2,4,8", help="lengths as multiples of the trained length")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True, help="JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = ctxext.from_pretrained(reference.model_source(args.model), dtype=torch.float32).eval()
    trained = model.config.max_position_embeddings
    tokenizer = reference.reference_tokenizer("llama")
    stream = torch.tensor(tokenizer(reference.reference_text()[:400_000])["input_ids"])
    lengths = [int(float(m) * trained) for m in args.multiples.split(",")]
    methods = args.methods.split(",")
    table: dict[str, dict[int, float]] = {m: {} for m in methods}
    started = time.time()
    for length in lengths:
        rows, span = probe(model, stream, length, args.windows, args.seed)
        for method in methods:
            with ctxext.patched(model, method, args.factor) if method != "none" else torch.no_grad():
                table[method][length] = round(copy_accuracy(model, rows, span), 3)
    head = f"{'method':<16}" + "".join(f"{n:>8}" for n in lengths)
    print(f"copy accuracy, span of {SPAN} at distance L-{SPAN + START + 1} ({args.model}, trained at {trained}, "
          f"factor {args.factor:g}, {args.windows} windows)")
    print(head)
    for method in methods:
        print(f"{method:<16}" + "".join(f"{table[method][n]:>8.3f}" for n in lengths))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": args.model, "trained_length": trained, "factor": args.factor, "windows": args.windows,
        "seed": args.seed, "span": SPAN, "lengths": lengths, "accuracy": table,
        "seconds": round(time.time() - started, 1), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
