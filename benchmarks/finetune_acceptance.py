#!/usr/bin/env python
"""Acceptance runs of the fine-tune recipes on the shipped LLaMA reference checkpoint (CPU, minutes each).

    python benchmarks/finetune_acceptance.py [--steps-pi N] [--steps-alibi N] [--only pi|alibi|...] [--out DIR]

1. ``recipes/tiny/llama_pi_lora.yaml``: PI x4 + LoRA at 4x the training length (512 tokens). Expected:
   held-out perplexity at 4x below training-free PI's at 4x.
2. ``recipes/tiny/llama_alibi_lora.yaml``: ALiBi swap + LoRA at 1x (128 tokens). Expected: LoRA recovers
   most of the swap's loss at 1x: (loss_swap - loss_after) / (loss_swap - loss_original) > 0.5, in nats/token.

Optional extras (``--only``): ``yarn``, ``nope``, ``gpt2`` (the other tiny recipes), and ``pose``:
``recipes/tiny/llama_pi_pose_lora.yaml``, PI x4 + LoRA trained with PoSE on 128-token windows whose positions span
512, the same steps as the PI run. Expected: fine-tuned perplexity at 512 below training-free PI's.
``--time-steps N`` times N training steps of the full-length PI recipe and of the PoSE recipe back to back (same
machine, same load, no evaluation) and adds seconds per step to the report.
Writes ``benchmarks/finetune_report.json`` and ``benchmarks/finetune_report.md`` with machine and date.
The training novels ship with the package (``data.files: [reference:train]`` in the tiny recipes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {
    "pi": ("recipes/tiny/llama_pi_lora.yaml", "LLaMA reference, PI x4 + LoRA at 512 tokens (4x)"),
    "alibi": ("recipes/tiny/llama_alibi_lora.yaml", "LLaMA reference, ALiBi swap + LoRA at 128 tokens (1x)"),
    "yarn": ("recipes/tiny/llama_yarn_lora.yaml", "LLaMA reference, YaRN x4 + LoRA at 512 tokens (4x)"),
    "nope": ("recipes/tiny/llama_nope_lora.yaml", "LLaMA reference, NoPE + LoRA at 128 tokens (1x)"),
    "gpt2": ("recipes/tiny/gpt2_pi_lora.yaml", "GPT-2 reference, PI x4 (table trained) + LoRA at 1024 tokens (4x)"),
    "pose": ("recipes/tiny/llama_pi_pose_lora.yaml",
             "LLaMA reference, PI x4 + LoRA with PoSE: 128-token windows, positions spanning 512"),
}


def machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


def checkpoint_ids(results: dict) -> dict:
    """sha256 (first 16 hex digits) of each reference checkpoint used: the numbers belong to these weights."""
    import hashlib

    from ctxext.finetune.model import model_source
    from ctxext.finetune.config import ModelConfig

    ids = {}
    for s in results.values():
        name = s["model"]
        try:
            path = Path(model_source(ModelConfig(name=name))) / "model.safetensors"
            ids[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        except Exception as exc:  # noqa: BLE001
            ids[name] = f"unknown ({exc})"
    return ids


def nats(ppl: float | None) -> float | None:
    return None if ppl is None else math.log(ppl)


def run_one(key: str, steps: int | None, out_root: Path, extra: list[str]) -> dict:
    from ctxext.finetune import load_recipe, run

    recipe_path, title = RUNS[key]
    overrides = [f"output.dir={out_root / key}", "output.overwrite=true"]
    if steps:
        overrides.append(f"train.steps={steps}")
    overrides += extra
    recipe = load_recipe(ROOT / recipe_path, overrides)
    tic = time.perf_counter()
    summary = run(recipe, progress=sys.stderr.isatty())
    summary["wall_seconds"] = round(time.perf_counter() - tic, 1)
    summary["recipe"] = recipe_path
    summary["title"] = title
    summary["overrides"] = overrides
    return summary


def evaluate_checkpoint(run_dir: Path, checkpoint: str, lengths: list[int] | None = None) -> dict:
    """Held-out perplexity of an intermediate checkpoint (Trainer's ``checkpoint-N``) of a run, with its recipe's eval
    settings: for a run stopped before its last step."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from ctxext.evaluation.perplexity import perplexity
    from ctxext.finetune import load_recipe
    from ctxext.finetune.data import read_eval_tokens
    from ctxext.finetune.model import add_lora, apply_patch, load_model, load_tokenizer, model_source

    recipe = load_recipe(run_dir / "recipe.yaml")
    tokenizer = load_tokenizer(recipe.model)
    ids, _ = read_eval_tokens(recipe, tokenizer)
    model = load_model(recipe.model)
    spec = apply_patch(recipe, model)
    model = add_lora(recipe, model, model_source(recipe.model))
    set_peft_model_state_dict(model, load_file(str(run_dir / checkpoint / "adapter_model.safetensors")))
    model.eval()
    e = recipe.eval
    lengths = lengths or list(e.lengths) or [recipe.data.seq_length or spec["patched_length"]]
    out = {}
    for length in lengths:
        r = perplexity(model, ids, length, protocol=e.protocol, stride=e.stride, max_windows=e.max_windows,
                       progress=False)
        out[str(length)] = {k: r[k] for k in ("ppl", "ppl_last_quarter", "tokens", "windows", "nll_sum")}
    return out


def partial_summary(run_dir: Path, checkpoint: str) -> dict:
    """A run summary for a run stopped at ``checkpoint``: its log up to there, the checkpoint evaluated now."""
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    step = int(checkpoint.split("-")[1])
    start = next(e for e in events if e["event"] == "start")
    evals = {e["when"]: e["results"] for e in events if e["event"] == "eval"}
    steps = [e for e in events if e["event"] == "step" and e["step"] <= step]
    planned = start["recipe"]["train"]["steps"]
    return {
        "finished": False,
        "stopped": f"stopped at step {step} of {planned} (time); evaluated from {checkpoint}",
        "model": start["recipe"]["model"]["name"],
        "patch": start["patch"],
        "seq_length": start["seq_length"],
        "steps": step,
        "tokens": steps[-1]["tokens"],
        "train_seconds": round(sum(e["seconds"] for e in steps), 1),
        "world_size": start["world_size"],
        "final_loss": steps[-1]["loss"],
        "losses": [e["loss"] for e in steps],
        "unpatched": evals.get("unpatched"),
        "before": evals.get("before"),
        "after": evaluate_checkpoint(run_dir, checkpoint),
    }


def judge(key: str, s: dict) -> dict:
    """The acceptance criterion of a run, from its summary."""
    if key == "pose":
        length = str(s["pose"]["target_length"])
        free, tuned = s["before"][length]["ppl"], s["after"][length]["ppl"]
        return {"criterion": f"fine-tuned ppl at {length} < training-free ppl at {length}",
                "training_free": free, "fine_tuned": tuned, "pass": tuned < free}
    if key in ("pi", "yarn", "gpt2"):
        length = str(s["seq_length"])
        free, tuned = s["before"][length]["ppl"], s["after"][length]["ppl"]
        return {"criterion": f"fine-tuned ppl at {length} < training-free ppl at {length}",
                "training_free": free, "fine_tuned": tuned, "pass": tuned < free}
    if key in ("alibi", "nope"):
        length = str(s["seq_length"])
        orig, swap, tuned = (s["unpatched"][length]["ppl"], s["before"][length]["ppl"], s["after"][length]["ppl"])
        recovered = (nats(swap) - nats(tuned)) / (nats(swap) - nats(orig)) if swap != orig else float("nan")
        return {"criterion": f"LoRA recovers > 50% of the swap's loss at {length} (nats/token)",
                "original": orig, "swapped": swap, "fine_tuned": tuned, "recovered_fraction": recovered,
                "pass": recovered > 0.5}
    raise KeyError(key)


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def write_report(results: dict, info: dict, notes: Path | None = None) -> None:
    (ROOT / "benchmarks" / "finetune_report.json").write_text(json.dumps({**info, "runs": results}, indent=2) + "\n")
    lines = [
        "# Fine-tune recipes: acceptance on the reference checkpoints",
        "",
        f"Date: {info['date']}. Machine: {info['machine']['cpu']}, {info['machine']['cores']} cores, "
        f"torch {info['machine']['torch']} (CPU, {info.get('torch_threads', info['machine']['torch_threads'])} threads), "
        f"transformers {info['machine']['transformers']}.",
        "Produced by `python benchmarks/finetune_acceptance.py`; numbers in `finetune_report.json`.",
        "Checkpoints (sha256 of model.safetensors, first 16 hex digits): "
        + ", ".join(f"`{k}` {v}" for k, v in info.get("checkpoints", {}).items()) + ".",
        "Held-out perplexity on Emma (not in the training novels), `chunks` windows, first windows of the book.",
        "",
        "| run | steps x batch x length | train time | length | unpatched | patched, training-free | patched + LoRA | "
        "criterion | pass |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in results.items():
        verdict = s["acceptance"]
        train = s["recipe_train"]
        judged = str((s.get("pose") or {}).get("target_length") or s["seq_length"])
        for length in s["after"]:
            crit = verdict["criterion"] if length == judged else ""
            ok = ("yes" if verdict["pass"] else "**no**") if crit else ""
            if crit and "recovered_fraction" in verdict:
                crit += f": {100 * verdict['recovered_fraction']:.0f}% recovered"
            lines.append(
                f"| {s['title']} | {s['steps']} x {train['batch_size']} x {s['seq_length']} | "
                f"{s['train_seconds']:.0f} s | {length} | {fmt((s.get('unpatched') or {}).get(length, {}).get('ppl'))} | "
                f"{fmt(s['before'][length]['ppl'])} | {fmt(s['after'][length]['ppl'])} | {crit} | {ok} |"
            )
    for key, s in results.items():
        if s.get("stopped"):
            lines.append(f"\n`{key}`: {s['stopped']}; its learning-rate schedule was planned for the full run.")
    lines += ["", "Final training loss per run: " + ", ".join(
        f"{k} {s['final_loss']:.3f}" for k, s in results.items()) + ".", ""]
    dated = {k: s["date"] for k, s in results.items() if s.get("date")}
    if dated:
        lines += ["Run dates: " + ", ".join(
            f"{k} {d}" + (f" ({results[k]['torch_threads']} torch threads)" if results[k].get("torch_threads") else "")
            for k, d in dated.items()) + ".", ""]
    lines += pose_comparison(results, info)
    if notes is not None:
        lines += [notes.read_text().rstrip(), ""]
    (ROOT / "benchmarks" / "finetune_report.md").write_text("\n".join(lines))


def pose_comparison(results: dict, info: dict) -> list[str]:
    """PoSE beside the full-length LoRA run and training-free PI, at equal steps, with time per step."""
    if "pose" not in results or "pi" not in results:
        return []
    pi, pose = results["pi"], results["pose"]
    target = str(pose["pose"]["target_length"])
    if target not in pi["after"]:
        return []
    timing = info.get("timing") or {}
    def per_step(key, s):
        t = timing.get(key)
        return f"{t['median_s']:.2f} s" if t else "n/a"
    def tokens(s):
        return s["recipe_train"]["batch_size"] * s["seq_length"]
    lines = [
        f"## PoSE: PI x4 at {target} tokens, trained at {pose['seq_length']} vs at {target}",
        "",
        f"Same recipe (LoRA r 8 on q,k,v,o, lr 1e-3 cosine, batch 4, seed 0), same steps; held-out Emma at {target} "
        f"tokens ({pose['after'][target]['windows']} windows).",
        "",
        f"| PI x4 | steps | tokens / step | s / step (timed together) | ppl at {target} |"
        + (f" ppl at {pose['seq_length']} |" if str(pose["seq_length"]) in pose["after"] else ""),
        "|---|---|---|---|---|" + ("---|" if str(pose["seq_length"]) in pose["after"] else ""),
    ]
    short = str(pose["seq_length"])
    has_short = short in pose["after"]
    def row(label, steps, tok, sec, ppl, ppl_short=None):
        line = f"| {label} | {steps} | {tok} | {sec} | {fmt(ppl)} |"
        return line + (f" {fmt(ppl_short)} |" if has_short else "")
    lines.append(row("training-free", 0, "-", "-", pose["before"][target]["ppl"],
                     pose["before"].get(short, {}).get("ppl")))
    lines.append(row(f"LoRA at {pi['seq_length']} (full length)", pi["steps"], tokens(pi), per_step("pi", pi),
                     pi["after"][target]["ppl"], None))
    lines.append(row(f"LoRA + PoSE at {pose['seq_length']}, positions to {target}", pose["steps"], tokens(pose),
                     per_step("pose", pose), pose["after"][target]["ppl"], pose["after"].get(short, {}).get("ppl")))
    if timing:
        lines += ["", "Seconds per step: median of " + ", ".join(
            f"{k} {t['steps']} steps" for k, t in timing.items()) + f" timed back to back on {timing_machine(info)} "
            f"({timing[next(iter(timing))].get('date', '')}), no evaluation, the first step dropped."]
    lines.append("")
    return lines


def timing_machine(info: dict) -> str:
    """The machine the steps were timed on, with the threads of the timing runs (not of a later --report-only)."""
    m = info.get("machine", {})
    threads = next((t["torch_threads"] for t in info.get("timing", {}).values() if t.get("torch_threads")),
                   m.get("torch_threads", "?"))
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {threads} torch threads"


def time_steps(keys: list[str], steps: int, out_root: Path) -> dict:
    """Seconds per optimizer step of each run's recipe, N steps each, no evaluation, no checkpoints."""
    import statistics

    import torch

    from ctxext.finetune import load_recipe, run

    timing = {}
    for key in keys:
        out = out_root / f"timing-{key}"
        recipe = load_recipe(ROOT / RUNS[key][0], [f"output.dir={out}", "output.overwrite=true",
                                                   f"train.steps={steps}", "eval.enabled=false",
                                                   "train.save_every=0"])
        run(recipe, progress=False)
        seconds = [json.loads(line)["seconds"] for line in (out / "log.jsonl").read_text().splitlines()
                   if json.loads(line).get("event") == "step"]
        timing[key] = {"steps": len(seconds), "median_s": statistics.median(seconds[1:] or seconds),
                       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "torch_threads": torch.get_num_threads()}
        print(f"timing {key}: {timing[key]}", flush=True)
    return timing


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(RUNS), default=["pi", "alibi"])
    p.add_argument("--steps-pi", type=int, default=None, help="override train.steps of the PI run")
    p.add_argument("--steps-alibi", type=int, default=None, help="override train.steps of the ALiBi run")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "finetune-acceptance")
    p.add_argument("--keep", action="store_true", help="merge into an existing finetune_report.json")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the report from the results.json of runs already in --out")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra recipe override for every run (e.g. train.steps=20)")
    p.add_argument("--notes", type=Path, help="a Markdown file appended to the report (how the runs were made)")
    p.add_argument("--time-steps", type=int, default=0, metavar="N",
                   help="time N steps of the pi and pose recipes back to back; adds seconds per step to the report")
    p.add_argument("--checkpoint", action="append", default=[], metavar="RUN=checkpoint-N",
                   help="report a run stopped early from its checkpoint (e.g. pi=checkpoint-50), evaluated now")
    args = p.parse_args()
    args.checkpoint = dict(item.split("=", 1) for item in args.checkpoint)

    import torch
    import yaml

    report = ROOT / "benchmarks" / "finetune_report.json"
    results, timing = {}, {}
    if args.keep and report.exists():
        kept = json.loads(report.read_text())
        results = kept.get("runs", {})
        timing = kept.get("timing", {})
        for s in results.values():
            s.setdefault("date", kept.get("date"))
            s.setdefault("torch_threads", kept.get("torch_threads"))
    if args.time_steps:
        timing = time_steps(["pi", "pose"], args.time_steps, args.out)
    for key in args.only:
        steps = {"pi": args.steps_pi, "alibi": args.steps_alibi}.get(key)
        if key in args.checkpoint:
            s = partial_summary(args.out / key, args.checkpoint[key])
            s.update(recipe=RUNS[key][0], title=RUNS[key][1])
        elif args.report_only:
            done = args.out / key / "results.json"
            s = json.loads(done.read_text())
            s.update(recipe=RUNS[key][0], title=RUNS[key][1])
            s["date"] = datetime.datetime.fromtimestamp(  # when the run finished
                done.stat().st_mtime, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        else:
            s = run_one(key, steps, args.out, args.overrides)
            s["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        if args.report_only and results.get(key, {}).get("torch_threads"):  # the run's threads, kept from its report
            s.setdefault("torch_threads", results[key]["torch_threads"])
        s.setdefault("torch_threads", torch.get_num_threads())
        s["recipe_train"] = yaml.safe_load((args.out / key / "recipe.yaml").read_text())["train"]
        s["acceptance"] = judge(key, s)
        s.pop("losses_all", None)
        results[key] = s
        print(f"{key}: {json.dumps(s['acceptance'])}", flush=True)
        ran = {r.get("torch_threads") for r in results.values()} - {None}  # the runs' threads, not --report-only's
        info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": machine(), "torch_threads": ran.pop() if len(ran) == 1 else torch.get_num_threads(),
                "checkpoints": checkpoint_ids(results), "timing": timing}
        write_report(results, info, args.notes)
    return 0 if all(r["acceptance"]["pass"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
