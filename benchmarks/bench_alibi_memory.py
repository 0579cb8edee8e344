"""Memory and time of the ALiBi swap at long context: a small LLaMA patched with ``alibi`` (attention
``ctxext_alibi``) vs the same weights unpatched (sdpa with its causal kernel), at 4k, 8k and 16k tokens.

    python benchmarks/bench_alibi_memory.py [--lengths 4096,8192,16384] [--repeats 3] [--runs 2] [--threads 1]
                                            [--out benchmarks/results/alibi_memory.json]

Each measurement runs in a fresh subprocess (so peak RSS is that of one model and one forward pass): build the
model, patch it or not, one warm-up forward pass, then ``--runs`` timed forward passes under ``torch.no_grad``.
Peak RSS is the process's ``ru_maxrss``; the growth over the RSS right after building the model is reported too.
The forward pass keeps only the last position's logits (``logits_to_keep=1``), so the logits do not hide the
attention's memory. Subprocesses alternate between the two variants; medians over ``--repeats`` subprocesses.
Times are wall-clock (``seconds``) and process CPU time (``cpu_seconds``). ``--threads`` sets torch's intra-op
threads (default 1: on a shared, oversubscribed machine, idle OpenMP threads spinning at every barrier distort
multi-threaded timings; 0 keeps torch's default).

Targets at 16k tokens: memory ratio (alibi / sdpa peak RSS) <= 1.5 and time ratio <= 2.
A (heads x T x T) float32 bias would be 8 x 16384^2 x 4 bytes = 8 GiB per layer at 16k.
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

from common import small_llama_config

L0 = 1024
CONFIG = small_llama_config(L0)
TARGETS = {"memory_ratio": 1.5, "time_ratio": 2.0}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(variant: str, length: int, runs: int, threads: int) -> dict:
    """One measurement, in this (fresh) process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ctxext

    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    if variant == "alibi":
        ctxext.patch(model, "alibi", length / L0)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
    before = rss_mib()
    times, cpu_times = [], []
    with torch.no_grad():
        for i in range(runs + 1):
            start, cpu_start = time.perf_counter(), time.process_time()
            model(ids, logits_to_keep=1)
            if i:  # the first pass is a warm-up
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "variant": variant,
        "length": length,
        "attn_implementation": model.config._attn_implementation,
        "rss_after_build_mib": round(before, 1),
        "peak_rss_mib": round(peak, 1),
        "peak_growth_mib": round(peak - before, 1),
        "seconds": round(statistics.median(times), 4),
        "cpu_seconds": round(statistics.median(cpu_times), 4),
        "threads": torch.get_num_threads(),
    }


def measure(variant: str, length: int, runs: int, threads: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, str(length), str(runs), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=3, help="fresh subprocesses per variant and length")
    parser.add_argument("--runs", type=int, default=2, help="timed forward passes per subprocess")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "alibi_memory.json"))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (0: default)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, length, runs, threads = args.child
        print(json.dumps(child(variant, int(length), int(runs), int(threads))))
        return 0

    import torch

    lengths = [int(x) for x in args.lengths.split(",")]
    load_at_start = list(os.getloadavg())
    samples: dict[tuple[str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        for length in lengths:
            for variant in (("sdpa", "alibi") if repeat % 2 == 0 else ("alibi", "sdpa")):
                r = measure(variant, length, args.runs, args.threads)
                samples.setdefault((variant, length), []).append(r)
                print(
                    f"  [{repeat + 1}/{args.repeats}] {variant:5s} {length:6d}: peak {r['peak_rss_mib']:8.1f} MiB "
                    f"(+{r['peak_growth_mib']:.1f}), {r['seconds']:.3f} s wall, {r['cpu_seconds']:.3f} s cpu",
                    file=sys.stderr,
                    flush=True,
                )

    def median(variant, length, key):
        return statistics.median(s[key] for s in samples[(variant, length)])

    rows = []
    for length in lengths:
        row = {"length": length}
        for variant in ("sdpa", "alibi"):
            for key in ("peak_rss_mib", "peak_growth_mib", "seconds", "cpu_seconds"):
                row[f"{variant}_{key}"] = median(variant, length, key)
            row[f"{variant}_attn_implementation"] = samples[(variant, length)][0]["attn_implementation"]
        row["memory_ratio"] = round(row["alibi_peak_rss_mib"] / row["sdpa_peak_rss_mib"], 3)
        row["growth_ratio"] = round(row["alibi_peak_growth_mib"] / max(row["sdpa_peak_growth_mib"], 1e-9), 3)
        row["time_ratio"] = round(row["alibi_seconds"] / row["sdpa_seconds"], 3)
        row["cpu_time_ratio"] = round(row["alibi_cpu_seconds"] / row["sdpa_cpu_seconds"], 3)
        row["full_bias_mib"] = round(CONFIG["num_attention_heads"] * length * length * 4 / 2**20, 1)
        rows.append(row)

    header = (
        f"{'tokens':>7} | {'sdpa peak MiB':>13} | {'alibi peak MiB':>14} | {'mem ratio':>9} | "
        f"{'growth sdpa/alibi MiB':>21} | {'sdpa s':>7} | {'alibi s':>7} | {'time ratio':>10} | {'cpu ratio':>9} | "
        f"{'full bias MiB':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        growth = f"{r['sdpa_peak_growth_mib']:.0f} / {r['alibi_peak_growth_mib']:.0f}"
        print(
            f"{r['length']:>7} | {r['sdpa_peak_rss_mib']:>13.1f} | {r['alibi_peak_rss_mib']:>14.1f} | "
            f"{r['memory_ratio']:>9.3f} | {growth:>21} | {r['sdpa_seconds']:>7.3f} | {r['alibi_seconds']:>7.3f} | "
            f"{r['time_ratio']:>10.3f} | {r['cpu_time_ratio']:>9.3f} | {r['full_bias_mib']:>13.1f}"
        )
    last = rows[-1]
    verdict = {
        "length": last["length"],
        "memory_ratio": last["memory_ratio"],
        "time_ratio": last["time_ratio"],
        "cpu_time_ratio": last["cpu_time_ratio"],
        "memory_ok": last["memory_ratio"] <= TARGETS["memory_ratio"],
        "time_ok": last["time_ratio"] <= TARGETS["time_ratio"],
    }
    print(
        f"\nat {verdict['length']} tokens: memory ratio {verdict['memory_ratio']:.3f} "
        f"(target <= {TARGETS['memory_ratio']}) {'OK' if verdict['memory_ok'] else 'MISSED'}, "
        f"time ratio {verdict['time_ratio']:.3f} (target <= {TARGETS['time_ratio']}) "
        f"{'OK' if verdict['time_ok'] else 'MISSED'}"
    )

    result = {
        "benchmark": "alibi_memory",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": args.threads or torch.get_num_threads(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": list(os.getloadavg()),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "model": {k: v for k, v in CONFIG.items()},
        "forward": "torch.no_grad, batch 1, logits_to_keep=1",
        "repeats": args.repeats,
        "runs_per_process": args.runs,
        "statistic": "median",
        "targets": TARGETS,
        "rows": rows,
        "verdict": verdict,
        "samples": {f"{v}@{n}": s for (v, n), s in samples.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
