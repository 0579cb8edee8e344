"""Which of lm-eval's RULER tasks run offline through ``ctxext lm-eval`` (issue 49: the docs' offline claims, checked
per task rather than read from lm-eval's source).

    python benchmarks/lm_eval_offline.py [--model reference:llama] [--model-args method=yarn,factor=8]
                                         [--length 1024] [--limit 1] [--timeout 300]
                                         [--tasks niah_single_1,...] [--out benchmarks/results/lm_eval_offline.json]

Each task runs in its own process with ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1``: ``ctxext lm-eval --model
ctxext --model_args pretrained=MODEL,MODEL_ARGS --tasks TASK --limit LIMIT --metadata '{"max_seq_lengths":[LENGTH]}'``. A task
"runs" when lm-eval exits 0 and prints its results table; otherwise the row keeps the last line that names the cause.
What is in this machine's caches decides the answer (lm-eval's essay haystack, nltk's punkt data): the JSON records
the cache folders checked, so a row is read with its machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe", "ruler_qa_squad",
         "ruler_qa_hotpot"]


def cause(text: str) -> str:
    """The last line of the output that names an error, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(word in line for word in ("Error", "error", "refused", "offline", "Exception", "not found")):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def model_path(name: str) -> str:
    """A shipped reference (``reference:llama``) as its folder: lm-eval's ``pretrained`` takes folders and hub ids."""
    if name.startswith("reference:"):
        from ctxext.reference import reference_path

        return str(reference_path(name.split(":", 1)[1]))
    return name


def run_task(task: str, args) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "ctxext", "lm-eval", "--model", "ctxext", "--model_args", ",".join(filter(None, [f"pretrained={model_path(args.model)}", args.model_args])),
           "--tasks", task, "--limit", str(args.limit), "--batch_size", "1",
           "--metadata", json.dumps({"max_seq_lengths": [args.length]})]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"task": task, "runs": False, "seconds": args.timeout, "cause": f"timed out after {args.timeout} s"}
    out = done.stdout + done.stderr
    runs = done.returncode == 0 and "|" in done.stdout
    return {"task": task, "runs": runs, "seconds": round(time.perf_counter() - start, 1), "returncode": done.returncode,
            "cause": None if runs else cause(out)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reference:llama")
    parser.add_argument("--model-args", default="method=yarn,factor=8",
                        help="more ctxext model_args (the reference LLaMA reads 128 tokens unpatched)")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "lm_eval_offline.json"))
    args = parser.parse_args()
    rows = []
    for task in args.tasks.split(","):
        row = run_task(task, args)
        rows.append(row)
        print(f"{task:18} {'runs' if row['runs'] else 'fails':6} {row['seconds']:7.1f} s  {row['cause'] or ''}",
              flush=True)
    caches = {name: str(Path(path).expanduser()) for name, path in (
        ("HF_HOME", os.environ.get("HF_HOME", "~/.cache/huggingface")), ("nltk_data", "~/nltk_data"))}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "model": args.model, "model_args": args.model_args, "length": args.length, "limit": args.limit,
              "caches": {k: {"path": v, "exists": Path(v).exists()} for k, v in caches.items()}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
