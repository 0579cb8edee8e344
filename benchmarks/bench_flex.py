"""Time sdpa vs ctxext_alibi / ctxext_remap with and without the flex path (ctxext.attention.flex_paths), small LLaMA.

    python bench_flex.py            # from the repo root; env: T=16384 RUNS=5 METHODS=alibi,self-extend,...
"""
import os, statistics, sys, time
import torch

sys.path.insert(0, "benchmarks")
from common import small_llama_config  # noqa: E402
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402

import ctxext  # noqa: E402
import ctxext.attention as A  # noqa: E402
import ctxext.attention.flex_functions as FF  # noqa: E402
import ctxext.attention.remap as R  # noqa: E402

DEV = os.environ.get("DEVICE", "cuda")
DT = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
T = int(os.environ.get("T", 16384))
RUNS = int(os.environ.get("RUNS", 5))
METHODS = os.environ.get("METHODS", "alibi,self-extend,rerope,lm-infinite,string,dca").split(",")
L0 = 1024
ids = torch.randint(0, 4096, (1, T), generator=torch.Generator().manual_seed(1)).to(DEV)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def build(method):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**small_llama_config(L0))).eval().to(DEV, DT)
    if method != "sdpa":
        ctxext.patch(model, method, factor=None if method == "string" else T / L0)
    return model


def swap(flex):
    AttentionInterface.register(A.ALIBI, FF.alibi_attention_forward_flex if flex else A.alibi_attention_forward)
    AttentionInterface.register(R.REMAP, FF.remap_attention_forward_flex if flex else R.remap_attention_forward)


def run(model, keep=1):
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model(ids, logits_to_keep=keep).logits
    sync()
    return time.perf_counter() - start, out


def measure(method, flex):
    swap(flex)
    model = build(method)
    first, full = run(model, keep=0)  # warm-up (compiles on first use) + all logits for the comparison
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    times = [run(model)[0] for _ in range(RUNS)]
    peak = (torch.cuda.max_memory_allocated() - held) / 2**20 if DEV == "cuda" else float("nan")
    swap(False)
    return statistics.median(times), first, peak, full.float()


base, first, peak, _ = measure("sdpa", False)
print(f"T={T} {DT} {torch.cuda.get_device_name() if DEV == 'cuda' else DEV}  torch {torch.__version__}")
print(f"{'variant':24s} {'median s':>9s} {'x sdpa':>7s} {'1st call s':>10s} {'peak MiB':>9s} {'max|dlogit|':>11s}")
print(f"{'sdpa':24s} {base:9.4f} {1:7.2f} {first:10.2f} {peak:9.0f}")
for method in METHODS:
    t0, f0, p0, ref = measure(method, False)
    print(f"{method:24s} {t0:9.4f} {t0 / base:7.2f} {f0:10.2f} {p0:9.0f}", flush=True)
    t1, f1, p1, out = measure(method, True)
    diff = (out - ref).abs().max().item()
    print(f"{method + ' +flex':24s} {t1:9.4f} {t1 / base:7.2f} {f1:10.2f} {p1:9.0f} {diff:11.2e}", flush=True)
# recompiles: a second length (automatic dynamic shapes: one more compile, then none)
ids = ids[:, : T - 1000]
swap(True)
model = build(METHODS[-1] if "self-extend" not in METHODS else "self-extend")
for i in range(3):
    print(f"self-extend +flex at T={ids.shape[1]}: call {i}: {run(model)[0]:.3f} s", flush=True)
