"""`ctxext eval --tasks`: RULER-style task rows beside perplexity, tables, the needle heatmap, resume, refusals, and
verdicts that use retrieval."""

from __future__ import annotations

import json

import pytest

from ctxext.cli import main
from ctxext.evaluation.results import row_problem
from ctxext.evaluation.verdict import verdicts

from test_eval_fixtures import CORPUS, save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


def run(*argv) -> int:
    return main(["eval", "--no-progress", "--device", "cpu", *map(str, argv)])


def rows_of(path):
    return [json.loads(line) for line in path.with_suffix(".jsonl").read_text().splitlines()][1:]


def test_tasks_run_beside_perplexity_with_tables_heatmap_and_resume(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--model", llama_dir, "--data", CORPUS, "--lengths", "512,1024", "--methods", "none,yarn",
            "--factor", "2", "--max-windows", "1", "--tasks", "ppl,niah_single_1,vt", "--task-samples", "2",
            "--task-depths", "0,1", "--output", out, "--plot", tmp_path / "p.png"]
    assert run(*argv) == 0
    rows = rows_of(out)
    kinds = sorted({(r["kind"], r["label"], r["length"]) for r in rows})
    assert kinds == sorted((k, m, n) for k in ("ppl", "niah_single_1", "vt") for m in ("none", "yarn x2")
                           for n in (512, 1024))
    needle = [r for r in rows if r["kind"] == "niah_single_1"]
    assert all(r["trials"] == 2 and set(r["depths"]) == {"0", "1"} and 0 <= r["accuracy"] <= 1 for r in needle)
    assert all(r["prompt_tokens"] < r["length"] and r["chat_template"] is False for r in needle)
    assert all(row_problem(r) is None for r in rows)
    doc = json.loads(out.read_text())
    assert doc["tasks"]["names"] == ["niah_single_1", "vt"] and doc["tasks"]["samples"] == 2
    printed = capsys.readouterr()
    assert "niah_single_1 (RULER score, 2 samples)" in printed.out and "average of 2 tasks" in printed.out
    assert (tmp_path / "p_needles.png").stat().st_size > 0 and "needle heatmap" in printed.err

    assert run(*argv, "--resume") == 0  # nothing left to do: every row is kept
    printed = capsys.readouterr()
    assert f"resuming: {len(rows)} finished row(s)" in printed.err
    assert rows_of(out) == rows


def test_tasks_only_skips_perplexity_and_too_short_lengths_are_reported(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = run("--model", llama_dir, "--lengths", "96,512", "--methods", "none", "--tasks", "niah_single_1",
             "--task-samples", "1", "--output", out)
    assert rc == 2  # 96 tokens do not hold the task's instructions: reported, the rest runs
    rows = rows_of(out)
    assert [(r["kind"], r["length"]) for r in rows] == [("niah_single_1", 512)]
    assert "niah_single_1 needs more than 96 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--tasks", "nope"], "unknown task(s) 'nope'"),
    (["--tasks", "qa_2"], "not offline"),
    (["--tasks", "vt", "--task-samples", "0"], "must be >= 1"),
    (["--tasks", "niah", "--task-depths", "0,2"], "between 0 and 1"),
    (["--tasks", "niah", "--plot", "x.png", "--heatmap", "x.png"], "is the --plot file"),
])
def test_bad_tasks_refused_before_anything_loads(tmp_path, capsys, monkeypatch, argv, said):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    try:
        rc = run("--model", tmp_path / "missing-model", "--output", out, *argv)
    except SystemExit as exc:  # argparse's refusal of a bad value
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert said in err
    assert "missing-model" not in err  # refused before the model path is even looked at
    assert list(tmp_path.iterdir()) == []


def _rows(model="m", trained=100):
    ppl = {("none", 100): 10.0, ("none", 400): 30.0, ("yarn", 400): 12.0, ("streaming-llm", 400): 9.7}
    acc = {("none", 100): 0.9, ("none", 400): 0.1, ("yarn", 400): 0.7, ("streaming-llm", 400): 0.0}
    rows = []
    for (label, n), v in ppl.items():
        rows.append({"kind": "ppl", "model": model, "label": label, "length": n, "ppl": v})
    for task in ("niah_single_1", "vt"):
        for (label, n), a in acc.items():
            rows.append({"kind": task, "model": model, "label": label, "length": n, "accuracy": a, "trials": 4})
    return rows, [{"label": model, "original_length": trained}]


def test_verdict_names_the_best_retriever_and_perplexity_that_does_not_retrieve():
    rows, models = _rows()
    [sentence] = verdicts(rows, models)
    assert "streaming-llm holds (x0.97 at 400 = 4x)" in sentence  # perplexity alone would crown it
    assert "retrieval (average of 2 tasks) at 400 = 4x: unpatched 10%, best yarn 70%" in sentence
    assert "streaming-llm holds perplexity (x0.97) but retrieves 0% at 400 = 4x" in sentence


def test_verdict_says_when_retrieval_cannot_rank_methods():
    rows, models = _rows()
    for r in rows:
        if r["kind"] != "ppl" and r["label"] == "none" and r["length"] == 100:
            r["accuracy"] = 0.0
    [sentence] = verdicts(rows, models)
    assert "unpatched scores 0% even at its trained length 100, too little to rank methods by" in sentence
    assert "but retrieves" not in sentence


def test_task_rows_are_checked_like_passkey_rows():
    row = {"kind": "vt", "model": "m", "method": "none", "label": "none", "factor": None, "length": 512,
           "spec": None, "accuracy": 0.5, "trials": 2}
    assert row_problem(row) is None
    assert "accuracy" in row_problem(dict(row, accuracy=2))
    assert "kind" in row_problem(dict(row, kind="nonsense"))


def test_evaluator_without_model_is_refused(tmp_path, capsys):
    rc = main(["eval", "--key-tokens", "--evaluator", str(tmp_path), "--output", str(tmp_path / "r.json")])
    assert rc == 2
    assert "--evaluator need --model" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
