"""Cost of attention-side position remapping: forward time and peak memory of each remap method (attention
``ctxext_remap``) and of the ALiBi swap (``alibi``: attention ``ctxext_alibi``) vs plain sdpa, on the small benchmark
LLaMA (trained length 1024) at 4k and 16k tokens.

    python benchmarks/bench_remap.py [--lengths 4096,16384] [--methods self-extend,dca,rerope,lm-infinite,string,alibi]
                                     [--repeats 1] [--runs 1] [--warmup 1] [--threads 1] [--strategy scores|concat]
                                     [--no-lse]
                                     [--out benchmarks/results/remap_cost.json]

Each measurement runs in a fresh subprocess (peak RSS of one model and one forward pass), as in
``bench_alibi_memory.py``, whose helpers it reuses: build the model, patch it (factor = length / 1024, the
method's defaults; ``string`` with no factor, its in-length defaults, since STRING cannot reach 4x), one warm-up
forward pass, ``--runs`` timed passes under ``torch.no_grad`` with ``logits_to_keep=1``. Medians over
``--repeats`` subprocesses. Targets at the longest length (issue 23): memory ratio (method / sdpa peak RSS) <= 1.2,
time ratio <= 1.3. ``--no-lse`` measures the chunked path instead of the log-sum-exp one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench_alibi_memory import rss_mib
from common import small_llama_config

L0 = 1024
CONFIG = small_llama_config(L0)
TARGETS = {"memory_ratio": 1.2, "time_ratio": 1.3}  # issue 23
METHODS = ["self-extend", "dca", "rerope", "lm-infinite", "streaming-llm", "string", "alibi"]


def child(variant: str, length: int, runs: int, threads: int, strategy: str, lse: bool, warmup: int = 1) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ctxext.attention.remap as remap_attention
    from ctxext.adapters.remap import apply_remap

    if threads > 0:
        torch.set_num_threads(threads)
    remap_attention.STRATEGY = strategy
    remap_attention.LSE_PATH = lse
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    options = {}
    if variant == "alibi":  # the ALiBi swap: RoPE replaced by ALiBi biases (attention ctxext_alibi)
        import ctxext

        ctxext.patch(model, "alibi", length / L0)
        options = {"slopes": "per head, BLOOM's"}
    elif variant != "sdpa":
        factor = None if variant == "string" else length / L0
        apply_remap(model, variant, factor, {})
        from ctxext.methods.remap import build_map

        options = build_map(variant, L0, factor).options
    ids = torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
    before = rss_mib()
    times, cpu_times = [], []
    with torch.no_grad():
        for i in range(runs + warmup):
            start, cpu_start = time.perf_counter(), time.process_time()
            model(ids, logits_to_keep=1)
            if i >= warmup:
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "variant": variant,
        "length": length,
        "options": options,
        "strategy": strategy,
        "lse_path": lse,
        "attn_implementation": model.config._attn_implementation,
        "rss_after_build_mib": round(before, 1),
        "peak_rss_mib": round(peak, 1),
        "peak_growth_mib": round(peak - before, 1),
        "seconds": round(statistics.median(times), 4),
        "cpu_seconds": round(statistics.median(cpu_times), 4),
        "threads": torch.get_num_threads(),
        "warmup_passes": warmup,
    }


def measure(variant, length, runs, threads, strategy, lse, warmup=1) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, str(length), str(runs), str(threads), strategy, str(int(lse)),
         str(warmup)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--strategy", default="concat", choices=["scores", "concat"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "remap_cost.json"))
    parser.add_argument("--no-lse", action="store_true",
                        help="turn the log-sum-exp path off (remap_attention.LSE_PATH): the chunked path's cost")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed passes before the timed ones (0 at 64k, where one pass takes minutes on CPU)")
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, length, runs, threads, strategy, lse, warmup = args.child
        print(json.dumps(child(variant, int(length), int(runs), int(threads), strategy, lse == "1", int(warmup))))
        return 0

    import torch

    lengths = [int(x) for x in args.lengths.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    load_at_start = list(os.getloadavg())
    samples: dict[tuple[str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        for length in lengths:
            for variant in ["sdpa"] + methods:
                r = measure(variant, length, args.runs, args.threads, args.strategy, not args.no_lse, args.warmup)
                samples.setdefault((variant, length), []).append(r)
                print(f"  [{repeat + 1}/{args.repeats}] {variant:12s} {length:6d}: peak {r['peak_rss_mib']:8.1f} MiB "
                      f"(+{r['peak_growth_mib']:.1f}), {r['seconds']:.3f} s wall, {r['cpu_seconds']:.3f} s cpu",
                      file=sys.stderr, flush=True)

    def median(variant, length, key):
        return statistics.median(s[key] for s in samples[(variant, length)])

    rows = []
    for length in lengths:
        base_mem, base_time = median("sdpa", length, "peak_rss_mib"), median("sdpa", length, "seconds")
        for variant in methods:
            mem, sec = median(variant, length, "peak_rss_mib"), median(variant, length, "seconds")
            rows.append({
                "length": length, "method": variant, "options": samples[(variant, length)][0]["options"],
                "sdpa_peak_rss_mib": base_mem, "peak_rss_mib": mem,
                "sdpa_growth_mib": median("sdpa", length, "peak_growth_mib"),
                "growth_mib": median(variant, length, "peak_growth_mib"),
                "sdpa_seconds": base_time, "seconds": sec,
                "memory_ratio": round(mem / base_mem, 3), "time_ratio": round(sec / base_time, 3),
            })
    header = (f"{'tokens':>7} | {'method':>12} | {'sdpa MiB':>9} | {'MiB':>8} | {'mem ratio':>9} | {'sdpa s':>7} | "
              f"{'s':>7} | {'time ratio':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['length']:>7} | {r['method']:>12} | {r['sdpa_peak_rss_mib']:>9.1f} | {r['peak_rss_mib']:>8.1f} | "
              f"{r['memory_ratio']:>9.3f} | {r['sdpa_seconds']:>7.3f} | {r['seconds']:>7.3f} | {r['time_ratio']:>10.3f}")
    top = max(lengths)
    verdict = {
        r["method"]: {"memory_ratio": r["memory_ratio"], "time_ratio": r["time_ratio"],
                      "memory_ok": r["memory_ratio"] <= TARGETS["memory_ratio"],
                      "time_ok": r["time_ratio"] <= TARGETS["time_ratio"]}
        for r in rows if r["length"] == top
    }
    for method, v in verdict.items():
        print(f"at {top} tokens, {method}: memory ratio {v['memory_ratio']:.3f} "
              f"({'OK' if v['memory_ok'] else 'MISSED'}, target <= {TARGETS['memory_ratio']}), time ratio "
              f"{v['time_ratio']:.3f} ({'OK' if v['time_ok'] else 'MISSED'}, target <= {TARGETS['time_ratio']})")
    result = {
        "benchmark": "remap_cost",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch_threads": args.threads or torch.get_num_threads(), "load_average_at_start": load_at_start,
            "load_average_at_end": list(os.getloadavg()), "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "model": dict(CONFIG),
        "forward": "torch.no_grad, batch 1, logits_to_keep=1",
        "strategy": args.strategy,
        "lse_path": not args.no_lse,
        "repeats": args.repeats, "runs_per_process": args.runs, "warmup_passes": args.warmup, "statistic": "median",
        "targets": TARGETS, "rows": rows, "verdict_at_longest": verdict,
        "samples": {f"{v}@{n}": s for (v, n), s in samples.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
