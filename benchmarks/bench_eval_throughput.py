"""Evaluator throughput and memory.

1. Tokens scored per second of ctxext's ``sliding`` protocol vs the sliding-window loop of the
   transformers perplexity guide ("Perplexity of fixed-length models": windows of ``max_length``
   moved by ``stride``, labels of already-scored tokens set to -100, ``model(input_ids, labels=...)``),
   re-implemented here from the guide's algorithm; same model, length, stride and text; runs alternate
   and medians are compared (ratio in one run). ``chunks`` is timed alongside.
2. The longest window that fits in memory here: one ``chunks`` window per length, lengths doubling,
   each in a child process whose resident memory is watched (killed above the limit) and timed.
   For a small config-built LLaMA, and for SmolLM2-135M (GGUF, trained to 8192) with ``--smollm2``.

    python benchmarks/bench_eval_throughput.py                  # throughput + small-model memory
    python benchmarks/bench_eval_throughput.py --smollm2        # + SmolLM2 (slow: minutes per long window)

Writes benchmarks/results/eval_throughput.json and prints tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import small_llama_config, smollm2_gguf

HERE = Path(__file__).resolve().parent
AUSTEN = HERE.parent.parent / "shared" / "data" / "austen" / "emma.txt"


# -- text and models ---------------------------------------------------------------------------------

def held_out_text() -> tuple[str, str]:
    try:
        from ctxext.reference import reference_text

        return reference_text(), "ctxext.reference.reference_text() (Emma)"
    except (ImportError, FileNotFoundError):
        if AUSTEN.exists():
            return AUSTEN.read_text(), str(AUSTEN)
        raise SystemExit("no text: needs ctxext.reference or ../shared/data/austen/emma.txt")


def small_tokenizer(text: str):
    try:
        from ctxext.reference import reference_tokenizer

        return reference_tokenizer("llama")
    except (ImportError, FileNotFoundError):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=4096, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return PreTrainedTokenizerFast(tokenizer_object=tok)


def small_model(vocab: int, length: int):
    """A small LLaMA built from a config (random weights, seed 0): ~6M parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**small_llama_config(length, vocab_size=vocab))
    return LlamaForCausalLM(cfg).eval()


def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf()
    directory, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return model, tok


# -- the guide's loop --------------------------------------------------------------------------------

@torch.no_grad()
def guide_sliding(model, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """The transformers perplexity guide's algorithm: returns (ppl, tokens scored)."""
    seq_len = ids.size(1)
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end  # tokens not scored by the previous window
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        loss = model(input_ids, labels=labels).loss  # mean over the (shifted) valid labels
        valid = int((labels[:, 1:] != -100).sum())
        nll_sum += loss.item() * valid
        n_tokens += valid
        prev_end = end
        if end == seq_len:
            break
    return float(torch.exp(torch.tensor(nll_sum / n_tokens))), n_tokens


def throughput(model, ids: torch.Tensor, length: int, stride: int, repeats: int) -> dict:
    """Tokens scored per second (wall clock and CPU time) of the three loops; the order rotates every repeat,
    so a change of machine load hits each loop alike; medians over repeats."""
    from ctxext.evaluation.perplexity import perplexity

    names = ["guide", "sliding", "chunks"]
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    out: dict = {}
    perplexity(model, ids[0, : 2 * length], length, protocol="chunks", progress=False)  # warm up (and the head check)
    for rep in range(repeats):
        for name in names[rep % 3:] + names[: rep % 3]:
            start, start_cpu = time.perf_counter(), time.process_time()
            if name == "guide":
                ppl, tokens = guide_sliding(model, ids, length, stride)
            else:
                res = perplexity(model, ids[0], length, protocol=name, stride=stride if name == "sliding" else None,
                                 progress=False)
                ppl, tokens = res["ppl"], res["tokens"]
            wall[name].append(tokens / (time.perf_counter() - start))
            cpu[name].append(tokens / (time.process_time() - start_cpu))
            out[name] = {"ppl": ppl, "tokens": tokens}
    for name in names:
        out[name].update(tokens_per_second_median=statistics.median(wall[name]), tokens_per_second_runs=wall[name],
                         tokens_per_cpu_second_median=statistics.median(cpu[name]))
    for name in ("sliding", "chunks"):
        out[f"ratio_{name}_vs_guide"] = out[name]["tokens_per_second_median"] / out["guide"]["tokens_per_second_median"]
        out[f"ratio_{name}_vs_guide_cpu_time"] = (
            out[name]["tokens_per_cpu_second_median"] / out["guide"]["tokens_per_cpu_second_median"])
    return out


# -- memory: one window per child process ---------------------------------------------------------------

def _child(args) -> None:
    """Score one chunks window of --length tokens; print peak memory and time as JSON."""
    import resource

    text, _ = held_out_text()
    if args.which == "smollm2":
        model, tok = smollm2()
    else:
        tok = small_tokenizer(text)
        model = small_model(len(tok), args.length)
    ids = torch.tensor(tok(text, verbose=False)["input_ids"])
    while ids.numel() < args.length:
        ids = torch.cat([ids, ids])
    from ctxext.evaluation.perplexity import perplexity

    import gc

    gc.collect()
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before = _status_gb(os.getpid(), "VmRSS")
    try:  # reset the high-water mark, so VmHWM below is the forward pass's own peak
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    start = time.perf_counter()
    res = perplexity(model, ids[: args.length], args.length, protocol="chunks", progress=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = {"ppl": res["ppl"], "seconds": seconds, "peak_rss_gb": peak / 2**20, "load_peak_gb": load_peak / 2**20,
           "before_forward_gb": before}
    if reset:
        row["forward_peak_gb"] = _status_gb(os.getpid(), "VmHWM")
        row["forward_extra_gb"] = row["forward_peak_gb"] - before
    print(json.dumps(row))


def _available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 8.0


def _status_gb(pid: int, field: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _rss_gb(pid: int) -> float:
    return _status_gb(pid, "VmRSS")


def try_length(which: str, length: int, limit_gb: float, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", which, "--length", str(length)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, start, status = 0.0, time.time(), None
    while proc.poll() is None:
        peak = max(peak, _rss_gb(proc.pid))
        if peak > limit_gb:
            status = "over memory limit"
        elif time.time() - start > timeout:
            status = "timed out"
        if status:
            proc.kill()
            proc.wait()
            break
        time.sleep(0.05)
    out, err = proc.communicate()
    row = {"length": length, "watched_peak_rss_gb": round(peak, 2)}
    if status:
        row.update(fits=status != "over memory limit", status=status, seconds=round(time.time() - start, 1))
    elif proc.returncode != 0:
        last = (err.strip().splitlines() or ["?"])[-1]
        row.update(fits=False, status=f"failed: {last[:200]}")
    else:
        row.update(fits=True, status="ok", **json.loads(out.strip().splitlines()[-1]))
    return row


def memory_search(which: str, start: int, stop: int, limit_gb: float, timeout: float) -> dict:
    rows, length = [], start
    while length <= stop:
        row = try_length(which, length, limit_gb, timeout)
        rows.append(row)
        print(f"  {which:8s} L={length:<7d} {row['status']:<18s} peak {row.get('peak_rss_gb', row['watched_peak_rss_gb']):.2f} GB"
              + (f"  {row['seconds']:.1f} s" if "seconds" in row else ""), flush=True)
        if row["status"] != "ok":
            break
        length *= 2
    ok = [r for r in rows if r["status"] == "ok"]
    result = {"rows": rows, "memory_limit_gb": round(limit_gb, 1), "timeout_s": timeout,
              "longest_measured": max((r["length"] for r in ok), default=None)}
    if len(ok) >= 2:  # memory grows linearly in the length with sdpa (no T x T matrix): extrapolate
        key = "forward_peak_gb" if all("forward_peak_gb" in r for r in ok[-2:]) else "peak_rss_gb"
        (l1, m1), (l2, m2) = [(r["length"], r[key]) for r in ok[-2:]]
        slope = (m2 - m1) / (l2 - l1)
        if slope > 0:
            result["estimated_longest_that_fits"] = int(l2 + (limit_gb - m2) / slope)
            result["gb_per_1k_tokens"] = round(slope * 1024, 4)
            result["estimated_from"] = key
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--tokens", type=int, default=16384, help="tokens of text scored in the throughput part")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M (throughput at --length and memory)")
    p.add_argument("--no-memory", action="store_true", help="skip the longest-length search")
    p.add_argument("--skip-small", action="store_true", help="only SmolLM2 (with --smollm2)")
    p.add_argument("--max-length", type=int, default=65536, help="stop the small model's search here")
    p.add_argument("--smollm2-max-length", type=int, default=32768)
    p.add_argument("--smollm2-tokens", type=int, default=8192, help="tokens scored in SmolLM2's throughput part")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per window in the memory search")
    p.add_argument("--output", default=str(HERE / "results" / "eval_throughput.json"))
    p.add_argument("--child", choices=["small", "smollm2"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.which = args.child
        return _child(args)

    text, source = held_out_text()
    tok = small_tokenizer(text)
    ids = torch.tensor([tok(text, verbose=False)["input_ids"][: args.tokens]])
    model = small_model(len(tok), args.length)
    report = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "memory_available_gb": round(_available_gb(), 1),
                    "load_average_at_start": list(os.getloadavg())},
        "text": source, "tokens": int(ids.shape[1]), "length": args.length, "stride": args.stride,
        "repeats": args.repeats,
        "small_model": {"config": "LLaMA, hidden 256, 4 layers, 8 heads / 4 KV, vocab %d" % len(tok),
                        "parameters": sum(p.numel() for p in model.parameters())},
    }
    report["throughput"] = {}
    if not args.skip_small:
        print(f"throughput: small model, L={args.length}, stride {args.stride}, {ids.shape[1]} tokens, "
              f"median of {args.repeats}", flush=True)
        report["throughput"]["small"] = throughput(model, ids, args.length, args.stride, args.repeats)
    if args.smollm2:
        smol, smol_tok = smollm2()
        smol_ids = torch.tensor([smol_tok(text, verbose=False)["input_ids"][: args.smollm2_tokens]])
        print(f"throughput: SmolLM2, L={args.length}, stride {args.stride}, {smol_ids.shape[1]} tokens, "
              f"median of {args.repeats}", flush=True)
        report["throughput"]["smollm2"] = throughput(smol, smol_ids, args.length, args.stride, args.repeats)
        del smol
    print_throughput(report["throughput"])
    if not args.no_memory:
        limit = 0.85 * _available_gb()
        print(f"longest window that fits: chunks protocol, one window, memory limit {limit:.1f} GB", flush=True)
        report["memory"] = {}
        if not args.skip_small:
            report["memory"]["small"] = memory_search("small", 4096, args.max_length, limit, args.timeout)
        if args.smollm2:
            report["memory"]["smollm2"] = memory_search("smollm2", 4096, args.smollm2_max_length, limit, args.timeout)
    report["machine"]["load_average_at_end"] = list(os.getloadavg())
    for name, mem in report.get("memory", {}).items():
        est = mem.get("estimated_longest_that_fits")
        print(f"{name}: longest measured {mem['longest_measured']} tokens"
              + (f"; memory grows {mem['gb_per_1k_tokens']} GB per 1k tokens, so about {est} tokens would fit "
                 f"in {mem['memory_limit_gb']} GB (an extrapolation; time, not memory, stops the search)" if est else ""))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def print_throughput(results: dict) -> None:
    print(f"{'model':10s} {'loop':8s} {'tokens':>8s} {'tok/s':>9s} {'vs guide':>9s} {'tok/cpu-s':>10s} {'vs guide':>9s} {'ppl':>9s}")
    for name, res in results.items():
        guide, guide_cpu = res["guide"]["tokens_per_second_median"], res["guide"]["tokens_per_cpu_second_median"]
        for loop in ("guide", "sliding", "chunks"):
            r = res[loop]
            print(f"{name:10s} {loop:8s} {r['tokens']:8d} {r['tokens_per_second_median']:9.1f} "
                  f"{r['tokens_per_second_median'] / guide:9.2f} {r['tokens_per_cpu_second_median']:10.1f} "
                  f"{r['tokens_per_cpu_second_median'] / guide_cpu:9.2f} {r['ppl']:9.2f}")


if __name__ == "__main__":
    main()
