"""`torchrun --nproc_per_node 2 -m ctxext eval` (gloo on CPU) gives the numbers of a one-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_eval_fixtures import CORPUS, save_tiny_llama


def _eval(cmd, tmp_path, model, name):
    out = tmp_path / f"{name}.json"
    args = ["-m", "ctxext", "eval", "--model", str(model), "--data", str(CORPUS), "--device", "cpu",
            "--lengths", "192,256", "--methods", "none,yarn", "--factor", "2", "--max-windows", "5",
            "--passkey", "--passkey-trials", "1", "--passkey-depths", "0,1", "--batch-size", "2",
            "--no-progress", "--output", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    return proc, out


def test_two_processes_equal_one(tmp_path):
    # torchrun's module under this interpreter: a `torchrun` on PATH may belong to another environment
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    model = save_tiny_llama(tmp_path / "llama", max_positions=32)
    one, out1 = _eval([sys.executable], tmp_path, model, "one")
    assert one.returncode == 0, one.stderr
    two, out2 = _eval(launcher + ["--standalone", "--nproc_per_node", "2"], tmp_path, model, "two")
    assert two.returncode == one.returncode, two.stderr[-3000:]
    doc1, doc2 = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert doc1["processes"] == 1 and doc2["processes"] == 2
    rows1 = [r for r in doc1["results"] if r["kind"] == "ppl"]
    rows2 = [r for r in doc2["results"] if r["kind"] == "ppl"]
    assert len(rows1) == 4 and len(doc1["results"]) == 8
    assert [(r["method"], r["length"], r["tokens"], r["windows"]) for r in rows1] == \
        [(r["method"], r["length"], r["tokens"], r["windows"]) for r in rows2]
    for a, b in zip(rows1, rows2):
        assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-5)
        assert b["ppl_last_quarter"] == pytest.approx(a["ppl_last_quarter"], rel=1e-5)
    keys = lambda doc: [(r["method"], r["length"], r["correct"], r["trials"], r["depths"]) for r in doc["results"]
                        if r["kind"] == "passkey"]
    assert keys(doc1) == keys(doc2)
