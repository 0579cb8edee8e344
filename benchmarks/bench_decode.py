"""Per-token decode time of every remap method against yarn (issue 48, item 2): prefill a prompt with a KV cache, then
time single-token greedy steps; the kept rotated keys (``ctxext.attention.key_cache``) against the same model without
them (``--before``: every step re-rotates the whole cache, the path before issue 48).

    python benchmarks/bench_decode.py [--models llama,smollm2] [--lengths 4096,16384] [--steps 6] [--threads 1]
                                      [--methods self-extend,dca,...] [--before] [--skip smollm2:16384]
                                      [--device cpu|cuda]
                                      [--out benchmarks/results/decode_cost.json]

Per (model, length), one process holds every variant on the same weights: ``ctxext.patch`` (factor = length / trained
length; ``string`` with no factor, its in-length defaults, as ``bench_remap.py``) and a prefilled cache each; then
``--steps`` single-token steps, timed round-robin over the variants (ratios to yarn from the same process and the same
minutes, so a change of the machine's load skews them less than the seconds). The first step is reported apart (it
builds the kept copies: one full rotation), the median of the others is the per-token time. With ``--shared-prefill``
(default) the remap methods decode from copies of one prefill's cache (made under the first method; every remap method
caches un-rotated keys, and a step's work depends on the cache's length, not on what it holds): one long prefill
instead of six; yarn has its own. ``kept_mib`` is what the kept copies hold at the end, ``kv_cache_mib`` the KV cache beside them.
Models: the small random LLaMA (6 layers, hidden 512, 8 heads / 4 KV, trained length 1024) and SmolLM2-135M (GGUF from
``../shared/tools/smollm2.sh``; factor = length / 2048, while the maps take the config's own length as the trained
one, so at 4k some methods still run their within-window path there). 16k on SmolLM2 is left out by default
(``--skip``): its two prefills alone take several minutes on one thread. ``--device cuda`` runs the small LLaMA in
bfloat16 on the GPU (the remap methods' cached steps on the CUDA plans where the kernel is installed), each step
between two ``torch.cuda.synchronize``, cuDNN's attention off (it builds a graph per key length, billed to whichever
variant reaches a length first). ``--methods none,...`` adds the model unpatched. Target: per-token time <= 1.3x yarn's.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

METHODS = ["self-extend", "dca", "rerope", "lm-infinite", "streaming-llm", "string"]
LLAMA_L0 = 1024
SMOLLM2_L0 = 2048
TARGET = 1.3


def llama(device: str = "cpu"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=LLAMA_L0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    if device != "cpu":
        model = model.to(device=device, dtype=torch.bfloat16)
    return model, LLAMA_L0


def smollm2(device: str = "cpu"):
    import torch

    import ctxext
    from common import smollm2_gguf

    gguf = smollm2_gguf()
    model = ctxext.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    if device != "cpu":
        model = model.to(device=device, dtype=torch.bfloat16)
    return model, SMOLLM2_L0


def prepared(base, l0, variant, length, cache=None):
    """(model, cache, next token): ``base`` copied and patched; the prompt prefilled into a new cache, or ``cache``
    copied (``--shared-prefill``)."""
    import torch
    from transformers import DynamicCache

    import ctxext

    model = copy.deepcopy(base)
    if variant != "none":  # "none": the model as loaded, a floor for the step's cost
        ctxext.patch(model, variant, None if variant == "string" else length / l0)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(model.device)
    start = time.perf_counter()
    if cache is None:
        cache = DynamicCache()
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    else:
        cache = copy.deepcopy(cache)
    return model, cache, ids[:, -1:], time.perf_counter() - start


def step(model, cache, token, keep: bool) -> float:
    import torch

    from ctxext.attention import key_cache

    key_cache.KEEP = keep
    cuda = model.device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model(token, past_key_values=cache, use_cache=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start
    finally:
        key_cache.KEEP = True


def measure(base, l0, length, methods, steps, before, shared):
    """Every variant prefilled, then their decode steps timed round-robin (a change of the machine's load hits all
    variants alike). Returns one row per variant."""
    from ctxext.attention import key_cache

    variants = [("yarn", True)] + [(m, True) for m in methods] + ([(m, False) for m in methods] if before else [])
    ready, shared_cache = {}, None
    for name, keep in variants:
        cache = shared_cache if shared and name != "yarn" else None
        ready[name, keep] = prepared(base, l0, name, length, cache)
        if shared and name != "yarn" and shared_cache is None:
            shared_cache = ready[name, keep][1]
    times = {v: [] for v in variants}
    for _ in range(steps):
        for v in variants:
            model, cache, token, _ = ready[v]
            times[v].append(step(model, cache, token, v[1]))
    rows = []
    for (name, keep), t in times.items():
        model, cache, _, prefill = ready[name, keep]
        kv = sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values))
        rows.append({"variant": name + ("" if keep else " (before)"), "length": length,
                     "prefill_s": round(prefill, 3), "first_step_s": round(t[0], 4),
                     "per_token_s": round(statistics.median(t[1:]), 4), "steps_timed": len(t) - 1,
                     "kept_mib": round(key_cache.kept_bytes(model) / 2**20, 1), "kv_cache_mib": round(kv / 2**20, 1)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,smollm2")
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=6, help="decode steps per variant (the first is reported apart)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before", action="store_true", help="also time each method without the kept copies")
    parser.add_argument("--shared-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="the remap methods decode from one prefill's cache (copied; made under the first method)")
    parser.add_argument("--skip", default="smollm2:16384", help="model:length pairs left out (comma-separated)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bfloat16)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_cost.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        # cuDNN's attention builds a graph per new key length (torch 2.11, H200: 46-70 ms in the first model to reach
        # a length, ~0 in the next): round-robin steps would bill it to whichever variant goes first
        torch.backends.cuda.enable_cudnn_sdp(False)
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]  # this checkout's ctxext, and common.py
    skip = {s for s in args.skip.split(",") if s}
    rows, left_out = [], sorted(skip)
    for name in args.models.split(","):
        base, l0 = {"llama": llama, "smollm2": smollm2}[name](args.device)
        for length in (int(n) for n in args.lengths.split(",")):
            if f"{name}:{length}" in skip:
                continue
            group = measure(base, l0, length, args.methods.split(","), args.steps, args.before,
                            args.shared_prefill)
            yarn = group[0]
            for row in group:
                row.update(model=name, ratio_to_yarn=round(row["per_token_s"] / yarn["per_token_s"], 2))
                row["meets_target"] = row["ratio_to_yarn"] <= TARGET
                print(f"{name:8} {length:6} {row['variant']:26} per token {row['per_token_s']:8.4f} s  "
                      f"x{row['ratio_to_yarn']:5.2f} yarn  first step {row['first_step_s']:7.3f} s  "
                      f"prefill {row['prefill_s']:7.2f} s  kept {row['kept_mib']:6.1f} MiB "
                      f"(KV cache {row['kv_cache_mib']:6.1f} MiB)", flush=True)
            rows.extend(group)
        del base
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "target_ratio": TARGET, "left_out": left_out, "shared_prefill": args.shared_prefill, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
