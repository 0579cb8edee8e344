"""Run-time cost of a ctxext patch: forward time of a ctxext-patched model vs the same weights configured with
transformers' own rope type, at 2k and 8k tokens. Target: speed ratio (transformers time / ctxext time) >= 0.98.

    python benchmarks/bench_patch_overhead.py [--lengths 2048,8192] [--repeats 7] [--out benchmarks/results/patch_overhead.json]

Runs alternate between the two models in one process; medians are reported. Also checks that both run the
sdpa kernel (aten::scaled_dot_product_attention in the profiler).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ctxext
from common import small_llama_config

L0 = 1024
PAIRS = {
    # ctxext method, options -> transformers rope_parameters with the same meaning
    "pi": ({}, {"rope_type": "linear"}),
    "yarn": ({}, {"rope_type": "yarn", "original_max_position_embeddings": L0}),
    "dynamic-ntk": ({}, {"rope_type": "dynamic"}),
}


def build(rope_parameters: dict, max_positions: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**small_llama_config(max_positions, rope_parameters=rope_parameters))).eval()


def uses_sdpa(model, ids) -> bool:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(ids[:, :256])
    return any(e.key == "aten::scaled_dot_product_attention" for e in prof.key_averages())


def timed(model, ids) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one forward pass."""
    wall, cpu = time.perf_counter(), time.process_time()
    model(ids)
    return time.perf_counter() - wall, time.process_time() - cpu


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--factor", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--methods", default=",".join(PAIRS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is steadier on a busy machine)")
    parser.add_argument("--out", default="benchmarks/results/patch_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    base = build({"rope_type": "default"}, L0)
    rows = []
    for method in args.methods.split(","):
        options, rope = PAIRS[method]
        patched = copy.deepcopy(base)
        ctxext.patch(patched, method, args.factor, **options)
        reference = build({**rope, "factor": args.factor}, int(L0 * args.factor) if method != "dynamic-ntk" else L0)
        reference.load_state_dict(base.state_dict())
        for length in map(int, args.lengths.split(",")):
            ids = torch.randint(0, 4096, (1, length), generator=torch.Generator().manual_seed(length))
            torch.testing.assert_close(patched(ids[:, :512]).logits, reference(ids[:, :512]).logits, atol=1e-4, rtol=0)
            timed(patched, ids), timed(reference, ids)  # warm-up
            t_ctxext, t_ref = [], []
            for i in range(args.repeats):  # alternate so drift hits both alike
                order = [(patched, t_ctxext), (reference, t_ref)]
                for model, sink in order if i % 2 == 0 else order[::-1]:
                    sink.append(timed(model, ids))
            row = {
                "method": method,
                "length": length,
                "ctxext_s": statistics.median(t[0] for t in t_ctxext),
                "transformers_s": statistics.median(t[0] for t in t_ref),
                "ctxext_cpu_s": statistics.median(t[1] for t in t_ctxext),
                "transformers_cpu_s": statistics.median(t[1] for t in t_ref),
                "ctxext_sdpa": uses_sdpa(patched, ids),
                "transformers_sdpa": uses_sdpa(reference, ids),
            }
            row["speed_ratio"] = row["transformers_s"] / row["ctxext_s"]
            row["cpu_speed_ratio"] = row["transformers_cpu_s"] / row["ctxext_cpu_s"]
            rows.append(row)
            print(
                f"{method:12s} {length:6d}  ctxext {row['ctxext_s']:.3f}s  transformers {row['transformers_s']:.3f}s"
                f"  ratio {row['speed_ratio']:.3f} (cpu {row['cpu_speed_ratio']:.3f})  sdpa {row['ctxext_sdpa']}/{row['transformers_sdpa']}",
                flush=True,
            )

    print("\nmethod        length  ctxext(s)  transformers(s)  speed ratio (>= 0.98)  CPU-time ratio  sdpa")
    for r in rows:
        print(
            f"{r['method']:12s}  {r['length']:6d}  {r['ctxext_s']:9.3f}  {r['transformers_s']:15.3f}"
            f"  {r['speed_ratio']:21.3f}  {r['cpu_speed_ratio']:14.3f}  {r['ctxext_sdpa']}"
        )
    result = {
        "benchmark": "patch_overhead",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "note": "speed ratio = transformers time / ctxext time (wall and CPU medians); >= 0.98 means no overhead",
        "model": "LLaMA 4 layers, hidden 256, 8 heads (4 KV), random weights",
        "factor": args.factor,
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
