#!/usr/bin/env bash
# One command for a GPU lease (issue 48), under 9 minutes, every step under its own time limit so one slow step
# leaves the rest their time. Run from the repository root on a machine with torch, transformers, accelerate and
# peft (no install needed):
#     bash benchmarks/gpu_check.sh            # results under $OUT (default benchmarks/results/gpu)
# 1. the few-call plans (ctxext.attention.cuda_plans) on the real kernel (torch's varlen_attn, else flash-attn)
#    against the CPU emulator of its contract, every remap method and the ALiBi plan, bf16, 4k tokens;
# 2. the gpu tests (tests/test_gpu.py), the CUDA merge path first;
# 3. per-token decode on the GPU (bench_decode.py --device cuda), the small LLaMA at 4k and 32k;
# 4. cost against sdpa, bf16, each variant in a fresh process (first call timed separately): the small benchmark
#    LLaMA at 32k and 128k (plans), the ALiBi swap at 32k, a 7B-class config (random weights) at 128k.
# Earlier leases' steps (issue 24's induction search) are left out: they shared the GPU with these timings.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
LOG="$OUT/gpu_tests.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOG"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$LOG"

echo "== plans on the real kernel against the emulator (bf16, 4k)" | tee -a "$LOG"
timeout 60 python3 benchmarks/bench_gpu.py --check-plans 2>&1 | tail -12 | tee -a "$LOG"

echo "== gpu tests: the merge path on CUDA's fused kernels (and flash-attn where installed)" | tee -a "$LOG"
MERGE="merge_path or cuda_kernels or flash_attn or batched"
timeout 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu.py -k "$MERGE" 2>&1 \
  | tail -20 | tee -a "$LOG"
echo "== gpu tests: the rest of tests/test_gpu.py" | tee -a "$LOG"
timeout 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu.py -k "not ($MERGE)" 2>&1 \
  | tail -20 | tee -a "$LOG"

echo "== cost, small benchmark LLaMA, plans, fresh processes"
timeout 150 python3 benchmarks/bench_gpu.py --remap-path plan --fresh --lengths 32768,131072 --runs 2 \
  --variants sdpa,yarn,self-extend,dca,rerope,lm-infinite,streaming-llm,string \
  --out "$OUT/gpu_cost_plan.json" 2>&1 | tail -18
echo "== decode per token on the GPU, small benchmark LLaMA in bf16, kept rotated keys and --before"
timeout 60 python3 benchmarks/bench_decode.py --models llama --lengths 4096,32768 --steps 8 --device cuda --before \
  --out "$OUT/gpu_decode.json" 2>&1 | tail -28
echo "== cost, small benchmark LLaMA, ALiBi swap at 32k (the block-offset plan, or flash-attn's alibi_slopes)"
timeout 50 python3 benchmarks/bench_gpu.py --remap-path plan --fresh --lengths 32768 --runs 2 --variants sdpa,alibi \
  --out "$OUT/gpu_cost_alibi.json" 2>&1 | tail -4
echo "== cost, 7B-class config (random weights), 128k, plans"
timeout 90 python3 benchmarks/bench_gpu.py --model 7b --remap-path plan --fresh --lengths 131072 --runs 1 \
  --variants sdpa,yarn,self-extend --out "$OUT/gpu_cost_7b.json" 2>&1 | tail -6
