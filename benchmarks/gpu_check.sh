#!/usr/bin/env bash
# One command for a GPU lease (issues 23 and 24), about 9 minutes, every step under its own time limit so one slow
# step leaves the rest their time. Run from the repository root on a machine with torch, transformers, accelerate
# and peft (no install needed):
#     bash benchmarks/gpu_check.sh            # results under $OUT (default benchmarks/results/gpu)
# 1. the gpu tests: the CUDA merge path first (torch's fused kernels, flash-attn where installed), then the rest of
#    tests/test_gpu.py, then the compiled flex tests with what time is left;
#    meanwhile, issue 24's retrieving-reference search: two induction_search.py runs at batch 256, about 3 minutes
#    each, side by side on the same GPU: e1's half-text mix (which formed a copy on the first lease, only in
#    repeated rows) with random spans planted twice in half / all of the text rows (--planted), for copying in prose;
# 2. issue 23's cost table against sdpa, bf16, on the small benchmark LLaMA at 32k and 128k (merge path, then with
#    a band's blocks batched: CTXEXT_BATCHED_BAND=1), ALiBi at 32k on its own;
# 3. the same on a 7B-class LLaMA config (random weights) at 128k: sdpa, yarn, self-extend.
# At most 8 files of at most 16 MiB come back from a lease: each checkpoint travels as one tar (about 10 MB) with
# its log; seven files in all.
# First run, 2026-11-26, H100: benchmarks/results/gpu/ (the tests took 20 s + 30 s alone; ALiBi at 32k took 70 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu_tests.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu_tests.txt"

IND=$(mktemp -d)
timeout 230 python3 benchmarks/induction_search.py --device cuda --batch 256 --steps 8000 --minutes 3 \
  --synthetic 0.5 --planted 0.5 --period 4,48 --log-every 250 --out "$IND/p50_gpu" >"$IND/p50.log" 2>&1 &
timeout 230 python3 benchmarks/induction_search.py --device cuda --batch 256 --steps 8000 --minutes 3 \
  --synthetic 0.5 --planted 1.0 --period 4,48 --log-every 250 --out "$IND/p100_gpu" >"$IND/p100.log" 2>&1 &

echo "== gpu tests: the merge path on CUDA's fused kernels (and flash-attn where installed)" | tee -a "$OUT/gpu_tests.txt"
MERGE="merge_path or cuda_kernels or flash_attn or batched"
timeout 80 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu.py -k "$MERGE" 2>&1 \
  | tail -30 | tee -a "$OUT/gpu_tests.txt"
echo "== gpu tests: the rest of tests/test_gpu.py" | tee -a "$OUT/gpu_tests.txt"
timeout 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu.py -k "not ($MERGE)" 2>&1 \
  | tail -30 | tee -a "$OUT/gpu_tests.txt"
echo "== gpu tests: the compiled flex path (opt-in)" | tee -a "$OUT/gpu_tests.txt"
timeout 30 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_flex_paths.py 2>&1 \
  | tail -15 | tee -a "$OUT/gpu_tests.txt"

wait
tail -n 3 "$IND"/p50.log "$IND"/p100.log
for run in p50_gpu p100_gpu; do  # the log travels inside its run's tar (a lease returns 8 files at most)
  cp "$IND/$run.jsonl" "$IND/$run/" 2>/dev/null; (cd "$IND" && tar czf "$OUT/$run.tar.gz" "$run" 2>/dev/null)
done

echo "== cost, small benchmark LLaMA, merge path"
timeout 130 python3 benchmarks/bench_gpu.py --remap-path lse --lengths 32768,131072 --runs 3 \
  --variants sdpa,yarn,self-extend,dca,rerope,lm-infinite,streaming-llm,string \
  --out "$OUT/gpu_cost_lse.json" 2>&1 | tail -18
echo "== cost, small benchmark LLaMA, merge path with a band's blocks batched (CTXEXT_BATCHED_BAND=1)"
timeout 100 python3 benchmarks/bench_gpu.py --remap-path lse-batched --lengths 32768,131072 --runs 3 \
  --variants sdpa,self-extend,rerope,lm-infinite,string --out "$OUT/gpu_cost_lse_batched.json" 2>&1 | tail -12
echo "== cost, small benchmark LLaMA, ALiBi swap at 32k (its own step: 70 s on the first run)"
timeout 90 python3 benchmarks/bench_gpu.py --lengths 32768 --runs 3 --variants sdpa,alibi \
  --out "$OUT/gpu_cost_alibi.json" 2>&1 | tail -4
echo "== cost, 7B-class config (random weights), 128k, merge path"
timeout 120 python3 benchmarks/bench_gpu.py --model 7b --remap-path lse --lengths 131072 --runs 1 \
  --variants sdpa,yarn,self-extend --out "$OUT/gpu_cost_7b.json" 2>&1 | tail -6
