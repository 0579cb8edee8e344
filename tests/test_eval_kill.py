"""SIGKILL at several points of `ctxext eval`, then `--resume`: the result equals an uninterrupted run and the
JSONL stays valid (one row per line, no duplicates), also after a write cut mid-line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_eval_fixtures import CORPUS, save_tiny_llama

from ctxext.cli import main

ARGS = ["--no-progress", "--device", "cpu", "--data", str(CORPUS), "--lengths", "32,48,64", "--methods",
        "none,pi,ntk,yarn", "--factor", "2", "--max-windows", "2"]
ROWS = 12  # 4 methods x 3 lengths

# The evaluator, slowed to >= 0.25 s per row so that a kill lands mid-run and not after it.
SLOW_EVAL = """
import sys, time
import ctxext.evaluation.runner as runner
real = runner.score_documents
def slow(*args, **kwargs):
    time.sleep(0.25)
    return real(*args, **kwargs)
runner.score_documents = slow
from ctxext.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def reference(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "r.json"
    assert main(["eval", "--model", str(llama_dir), *ARGS, "--output", str(out)]) == 0
    return _scores(json.loads(out.read_text())["results"])


def _scores(rows):
    return {(r["method"], r["length"]): (r["ppl"], r["tokens"], r["windows"]) for r in rows}


def _lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line is whole JSON


def _signal_after(llama_dir, out: Path, rows: int, sig: int = signal.SIGKILL) -> tuple[int, str, int]:
    """Start the run in a child process, send ``sig`` once the JSONL holds ``rows`` rows; returns the exit status,
    the child's stderr and the rows written."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                   os.environ.get("PYTHONPATH")])))
    err = out.with_name(out.name + ".stderr")
    with err.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_EVAL, "eval", "--model", str(llama_dir), *ARGS,
                                 "--output", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        jsonl = out.with_suffix(".jsonl")
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                if jsonl.exists() and jsonl.read_text().count("\n") >= rows + 1:
                    break
                time.sleep(0.02)
        finally:
            proc.send_signal(sig)
            proc.wait(timeout=60)
    said = err.read_text()
    err.unlink()
    return proc.returncode, said, jsonl.read_text().count("\n") - 1


@pytest.mark.parametrize("after, damage", [(1, None), (5, "cut line"), (9, "stale final temp file")])
def test_kill_then_resume_equals_uninterrupted(after, damage, llama_dir, reference, tmp_path, capsys):
    out = tmp_path / "r.json"
    status, _, written = _signal_after(llama_dir, out, after)
    assert status == -signal.SIGKILL, "the run finished before the kill"
    assert after <= written < ROWS
    jsonl = out.with_suffix(".jsonl")
    if damage == "cut line":  # a kill in the middle of a write leaves half a row and no newline
        whole = jsonl.read_text().splitlines()
        jsonl.write_text("\n".join(whole) + "\n" + whole[-1][: len(whole[-1]) // 2])
    elif damage == "stale final temp file":
        (tmp_path / f".r.json.{os.getpid() + 1}.tmp").write_text('{"results": [')
    capsys.readouterr()
    assert main(["eval", "--model", str(llama_dir), *ARGS, "--output", str(out), "--resume"]) == 0
    assert f"resuming: {written} finished row(s)" in capsys.readouterr().err
    rows = json.loads(out.read_text())["results"]
    assert _scores(rows) == pytest.approx(reference) and len(rows) == ROWS
    lines = _lines(jsonl)
    assert lines[0]["kind"] == "run" and len(lines) == ROWS + 1
    assert len({(r["method"], r["length"]) for r in lines[1:]}) == ROWS


def test_overwrite_keeps_the_old_result_until_a_new_row_exists(llama_dir, tmp_path, capsys, monkeypatch):
    """--overwrite on a finished run whose replacement fails before its first row: the old files stay as they were."""
    out = tmp_path / "r.json"
    args = ["eval", "--model", str(llama_dir), "--no-progress", "--device", "cpu", "--data", str(CORPUS),
            "--lengths", "32", "--methods", "none", "--max-windows", "1", "--output", str(out)]
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    import ctxext.evaluation.runner as runner

    def fail(*a, **k):
        raise ValueError("scoring failed")

    monkeypatch.setattr(runner, "score_documents", fail)
    assert main(args + ["--overwrite"]) == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    assert main(args[:-4] + ["--lengths", "48", "--output", str(out), "--overwrite"]) == 0
    assert [r["length"] for r in json.loads(out.read_text())["results"]] == [48]
    assert [r.get("length") for r in _lines(out.with_suffix(".jsonl"))] == [None, 48]


def test_sigterm_keeps_finished_rows_and_removes_the_lock(llama_dir, reference, tmp_path, capsys):
    """`kill` / `timeout` send SIGTERM: handled as Ctrl-C (the lock file goes, the rows stay), then --resume."""
    out = tmp_path / "r.json"
    status, err, written = _signal_after(llama_dir, out, 2, signal.SIGTERM)
    assert status == 128 + signal.SIGTERM, err
    assert "terminated" in err
    assert not (tmp_path / ".r.json.ctxext-lock").exists()
    assert 2 <= written < ROWS
    assert main(["eval", "--model", str(llama_dir), *ARGS, "--output", str(out), "--resume"]) == 0
    assert _scores(json.loads(out.read_text())["results"]) == pytest.approx(reference)
