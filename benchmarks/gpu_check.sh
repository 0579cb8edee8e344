#!/usr/bin/env bash
# One command for a GPU lease (issue 23): the gpu tests of the CUDA merge path, then its cost against sdpa on the
# small benchmark LLaMA at 32k and 128k and on a 7B-class config at 128k, bf16. Run from the repository root on a
# machine with torch, transformers, accelerate and peft (no install needed):
#     bash benchmarks/gpu_check.sh            # results under $OUT (default benchmarks/results/gpu)
# Each step has its own time limit, so one slow step leaves the rest their time; the whole is about 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
echo "== gpu tests: the merge path on CUDA's fused kernels (and flash-attn where installed)"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "merge_path or cuda_kernels or flash_attn" 2>&1 \
  | tail -40 | tee "$OUT/gpu_tests_merge_path.txt"
echo "== cost, small benchmark LLaMA, merge path"
timeout 240 python3 benchmarks/bench_gpu.py --remap-path lse --lengths 32768,131072 --runs 3 \
  --variants sdpa,yarn,alibi,self-extend,dca,rerope,lm-infinite,streaming-llm,string \
  --out "$OUT/gpu_cost_lse.json" 2>&1 | tail -25
echo "== cost, 7B-class config (random weights), 128k, merge path"
timeout 180 python3 benchmarks/bench_gpu.py --model 7b --remap-path lse --lengths 131072 --runs 2 \
  --variants sdpa,yarn,self-extend --out "$OUT/gpu_cost_7b.json" 2>&1 | tail -8
