#!/usr/bin/env python
"""Probe: which training settings make the lab's decoders learn the copy task at their training length (issue 50).

    python benchmarks/lab_copy_probe.py --schemes alibi,nope,sinusoidal --steps 500 --copy-warmup 500 \
        --out benchmarks/results/lab_issue50/probes.jsonl

Trains one lab decoder per scheme (``ctxext.lab``'s model, data and schedule; the lab's defaults unless an option
says otherwise) with one torch thread and prints, per scheme, the 1x copy accuracy at ``--checkpoints`` evenly
spaced steps (the learning curve). Appends one JSON line per scheme to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ctxext.lab.data import corpus
from ctxext.lab.model import build_model
from ctxext.lab.run import LabSettings
from ctxext.lab.train import copy_accuracy, train_model


def main(argv=None) -> int:
    d = LabSettings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="alibi,nope,sinusoidal")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--copy-fraction", type=float, default=d.copy_fraction)
    p.add_argument("--copy-warmup", type=int, default=d.copy_warmup, help="copy-only warm-up steps before the mixed ones")
    p.add_argument("--checkpoints", type=int, default=5)
    p.add_argument("--copy-seqs", type=int, default=d.copy_seqs)
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    train, _ = corpus()
    cfg = LabSettings().model_config()
    for scheme in a.schemes.split(","):
        model = build_model(cfg, scheme, seed=d.seed)
        curve, t0 = [], time.perf_counter()

        def check(m, step):
            curve.append(round(copy_accuracy(m, d.train_len, a.copy_seqs, d.seed + 101), 4))
            print(f"  {scheme}: step {step}: copy 1x {curve[-1]:.2f} ({time.perf_counter() - t0:.0f}s)",
                  flush=True)

        loss = train_model(model, train, steps=a.steps, batch=a.batch, length=d.train_len, lr=a.lr,
                           warmup=min(a.warmup, a.steps), seed=d.seed + 1, copy_fraction=a.copy_fraction,
                           copy_warmup=a.copy_warmup, checkpoint=check, checkpoints=a.checkpoints)
        row = {"scheme": scheme, **{k: v for k, v in vars(a).items() if k not in ("schemes", "out")},
               "curve_copy_1x": curve, "final_loss": loss, "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
