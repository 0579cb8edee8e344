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
    assert "niah_single_1 needs about" in capsys.readouterr().err  # and how many it needs


@pytest.mark.parametrize("argv, said", [
    (["--tasks", "nope"], "unknown task(s) 'nope'"),
    (["--tasks", "qa_2"], "not offline"),
    (["--tasks", "vt", "--task-samples", "0"], "must be >= 1"),
    (["--tasks", "niah", "--task-depths", "0,2"], "between 0 and 1"),
    (["--tasks", "niah", "--plot", "x.png", "--heatmap", "x.png"], "is the --plot file"),
    (["--tasks", ""], "no task given"),  # not read as "the default, perplexity"
    (["--tasks", "niah", "--heatmap", "r.json"], "would overwrite the --output results"),
    (["--tasks", "niah", "--heatmap", "r.jsonl"], "would overwrite the --output rows file"),
    (["--plot", "r.json"], "would overwrite the --output results"),
    (["--tasks", "niah", "--heatmap", "needles.txt"], "matplotlib cannot write .txt pictures"),
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
    assert "retrieval (average of 2 tasks) at 400 = 4x: unpatched 10% (90% at 100), best yarn 70%" in sentence
    assert "streaming-llm holds perplexity (x0.97) but retrieves 0% at 400 = 4x" in sentence


def test_verdict_says_when_retrieval_cannot_rank_methods():
    rows, models = _rows()
    for r in rows:
        if r["kind"] != "ppl" and r["label"] == "none" and r["length"] == 100:
            r["accuracy"] = 0.0
    [sentence] = verdicts(rows, models)
    assert "unpatched scores 0% even at its trained length 100, too little to rank methods by" in sentence
    assert "but retrieves" not in sentence


def test_verdict_names_perplexity_that_does_not_retrieve_without_a_task_row_at_the_trained_length():
    """A task may not fit the trained length (the reference LLaMA's 128 tokens): a method that retrieves at 4x shows
    the model can, so one that holds perplexity there and misses is still named."""
    rows, models = _rows()
    rows = [r for r in rows if r["kind"] == "ppl" or r["length"] != 100]
    [sentence] = verdicts(rows, models)
    assert "best yarn 70%" in sentence
    assert "streaming-llm holds perplexity (x0.97) but retrieves 0% at 400 = 4x" in sentence
    for r in rows:  # nothing retrieves anywhere: a miss tells nothing about the method
        if r["kind"] != "ppl":
            r["accuracy"] = 0.0
    assert "but retrieves" not in verdicts(rows, models)[0]


def test_verdict_does_not_round_a_small_accuracy_to_zero():
    rows, models = _rows()
    for r in rows:
        if r["kind"] != "ppl" and r["label"] == "yarn":
            r["accuracy"] = 0.004
    assert "best yarn <1%" in verdicts(rows, models)[0]


@pytest.fixture
def weights_never_load(monkeypatch):
    """A refusal that should come before the weights load fails the test if they load."""
    import ctxext.evaluation.plan as plan

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(plan, "load_model", no_load)


def test_a_task_that_fits_no_length_is_refused_before_the_weights_load(llama_dir, tmp_path, capsys,
                                                                        weights_never_load):
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, "--lengths", "96", "--methods", "none", "--tasks", "niah_single_1",
               "--output", out) == 2
    assert "niah_single_1 needs about" in capsys.readouterr().err
    assert not out.exists() and not out.with_suffix(".jsonl").exists()


@pytest.mark.parametrize("argv, said", [
    (["--key-short", "4096"], "must be shorter than the long context"),  # the tiny model is trained at 64
    (["--key-context", "1"], "give --key-context of at least 2"),
    (["--key-context", "32", "--key-short", "32"], "must be shorter than --key-context 32"),
])
def test_key_token_contexts_are_checked_before_the_weights_load(llama_dir, tmp_path, capsys, weights_never_load,
                                                                argv, said):
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, "--lengths", "128", "--methods", "none", "--key-tokens", *argv,
               "--output", out) == 2
    assert said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_task_rows_are_checked_like_passkey_rows():
    row = {"kind": "vt", "model": "m", "method": "none", "label": "none", "factor": None, "length": 512,
           "spec": None, "accuracy": 0.5, "trials": 2}
    assert row_problem(row) is None
    assert "accuracy" in row_problem(dict(row, accuracy=2))
    assert "kind" in row_problem(dict(row, kind="nonsense"))
    assert row_problem(dict(row, depths={"0": 1.0, "0.5": 0.0})) is None
    for depths in ({"deep": 1.0}, {"0.5": 2}, {"1.5": 1.0}, [1.0]):  # the heatmap reads these: recomputed instead
        assert "depths" in row_problem(dict(row, depths=depths))


def test_evaluator_without_model_is_refused(tmp_path, capsys):
    rc = main(["eval", "--key-tokens", "--evaluator", str(tmp_path), "--output", str(tmp_path / "r.json")])
    assert rc == 2
    assert "--evaluator need --model" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_heatmap_draws_passkey_by_depth_where_no_needle_task_ran(tmp_path):
    """The demo runs passkey, not the RULER tasks: its heatmap shows by depth what a windowed method loses."""
    from ctxext.evaluation.report import needle_depths, needle_heatmap

    def row(kind, label, n, depths):
        return {"kind": kind, "model": "m", "label": label, "length": n, "accuracy": sum(depths.values()) / 2,
                "depths": depths}

    rows = [{"kind": "ppl", "model": "m", "label": "none", "length": 100, "ppl": 10.0},
            row("passkey", "none", 100, {"0": 1.0, "1": 1.0}), row("passkey", "streaming-llm", 400, {"0": 0.0, "1": 1.0})]
    assert needle_depths(rows) == {("m", "none"): {(0.0, 100): 1.0, (1.0, 100): 1.0},
                                   ("m", "streaming-llm"): {(0.0, 400): 0.0, (1.0, 400): 1.0}}
    assert needle_heatmap(rows, [{"label": "m", "original_length": 100}], tmp_path / "h.png").stat().st_size > 0
    # where a needle task ran, it alone is drawn: passkey's template is another, not averaged in
    rows.append(row("niah_single_1", "none", 100, {"0": 0.5, "1": 0.0}))
    assert needle_depths(rows) == {("m", "none"): {(0.0, 100): 0.5, (1.0, 100): 0.0}}
    assert needle_depths(rows[:1]) == {}


def test_verdict_names_a_method_that_misses_under_passkey_and_tasks_once():
    """Passkey and RULER-style tasks in one run: a method that holds perplexity and misses both is one clause with
    both scores, not two clauses that repeat its perplexity."""
    rows, models = _rows()
    rows += [{"kind": "passkey", "model": "m", "label": lab, "length": n, "accuracy": a}
             for lab, n, a in (("none", 100, 1.0), ("none", 400, 0.0), ("yarn", 400, 0.8),
                               ("streaming-llm", 400, 0.1))]
    [sentence] = verdicts(rows, models)
    assert "passkey at 400 = 4x: unpatched 0% (100% at 100), best yarn 80%" in sentence
    assert "retrieval (average of 2 tasks) at 400 = 4x: unpatched 10% (90% at 100), best yarn 70%" in sentence
    assert sentence.count("streaming-llm holds perplexity") == 1
    assert sentence.endswith(
        "streaming-llm holds perplexity (x0.97) but retrieves 10% (passkey), 0% (average of 2 tasks) at 400 = 4x")


def test_verdict_names_the_measure_a_method_misses_when_both_ran():
    """A method that misses only under passkey, with the task sentence between: its clause says which measure."""
    rows, models = _rows()
    for r in rows:
        if r["kind"] != "ppl" and r["label"] == "streaming-llm":
            r["accuracy"] = 0.6  # retrieves on the tasks
    rows += [{"kind": "passkey", "model": "m", "label": lab, "length": n, "accuracy": a}
             for lab, n, a in (("none", 100, 1.0), ("none", 400, 0.0), ("yarn", 400, 0.8),
                               ("streaming-llm", 400, 0.1))]
    [sentence] = verdicts(rows, models)
    assert sentence.endswith("streaming-llm holds perplexity (x0.97) but retrieves 10% (passkey) at 400 = 4x")
