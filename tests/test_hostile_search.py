"""Hostile cases of ``ctxext search longrope`` (issue 51, cases 6, 7, 15, 19 and 20): the search runs until its budget
is spent or its space is exhausted and says which; a damaged or hand-edited log row is never a score (and is named by
file and line); a resume compares what changes the scores, not how a path is spelled; --out and --data apart."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from test_eval_fixtures import save_tiny_llama

from ctxext.cli import main
from ctxext.search import SearchSettings
from ctxext.search import evolution
from ctxext.search.evolution import ScoreLog, search

TINY = ["--population", "3", "--parents", "2", "--max-windows", "1", "--no-progress"]


def _args(model, out, *extra, budget=6):
    return ["search", "longrope", str(model), "--factor", "2", "--out", str(out), *TINY, "--budget", str(budget),
            *extra]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("model") / "llama")


@pytest.fixture(scope="module")
def finished(model_dir, tmp_path_factory):
    """A finished search (budget 6) of the tiny model, copied by each test that edits it."""
    out = tmp_path_factory.mktemp("finished") / "search"
    assert main(_args(model_dir, out)) == 0
    return out


def _copy(finished, tmp_path):
    out = tmp_path / "search"
    shutil.copytree(finished, out)
    return out


def _no_weights(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("ctxext.loading.from_pretrained", no_load)


# case 6: the search stops only when its budget is spent, the clock runs out, or its space is exhausted -------------

def _bowl(stage, factors):
    """A perplexity with one best candidate, which a small population converges on quickly."""
    return 1.0 + sum((x - 1.5) ** 2 for x in factors)


def _pi(stage):
    return {"pi": [stage] * 2}


def test_a_converged_population_keeps_searching_until_the_budget_is_spent(tmp_path):
    """A population of 2 with 1 parent makes a generation with no unseen child within a few generations; the search
    stopped there, well short of its budget, without a word."""
    settings = SearchSettings(factor=2, budget=60, population=2, parents=1)
    result = search(_bowl, _pi, settings, ScoreLog(tmp_path / "log.jsonl", {"settings": {}}, resume=False))
    assert result["scored"] == 60 and result["fresh"] == 60 and result["stopped"] == "budget"
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()[1:]]
    assert len({json.dumps(r["factors"]) for r in rows}) == 60  # 60 different candidates, none scored twice


def test_a_larger_budget_on_resume_continues(tmp_path):
    log = tmp_path / "log.jsonl"
    small = SearchSettings(factor=2, budget=10, population=2, parents=1)
    first = search(_bowl, _pi, small, ScoreLog(log, {"settings": {}}, resume=False))
    assert first["scored"] == 10
    larger = SearchSettings(factor=2, budget=40, population=2, parents=1)
    again = search(_bowl, _pi, larger, ScoreLog(log, {"settings": {}}, resume=True))
    assert again["scored"] == 40 and again["fresh"] == 30 and again["best_score"] <= first["best_score"]
    # the same as one uninterrupted search with the larger budget
    whole = search(_bowl, _pi, larger, ScoreLog(tmp_path / "whole.jsonl", {"settings": {}}, resume=False))
    assert whole["best"] == again["best"] and log.read_text() == (tmp_path / "whole.jsonl").read_text()


def test_an_exhausted_space_ends_the_search_and_says_so(tmp_path, monkeypatch):
    """At 1 decimal, 2 factors in [1, 3] (factor 1.5) allow 231 candidates: all are scored, then the search stops
    with budget left, saying why."""
    monkeypatch.setattr(evolution, "DECIMALS", 1)
    assert evolution.space_size(2, 3.0) == 231
    settings = SearchSettings(factor=1.5, budget=1000, population=4, parents=2)
    result = search(_bowl, _pi, settings, ScoreLog(tmp_path / "log.jsonl", {"settings": {}}, resume=False))
    assert result["stopped"] == "exhausted" and result["scored"] == result["fresh"] == 231
    assert "all 231 candidates" in result["exhausted"]


def test_the_report_says_why_the_search_stopped(model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "search"
    assert main(_args(model_dir, out, budget=5)) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "after 5 candidates (5 scored now); --budget 5 spent" in first
    assert main(_args(model_dir, out, "--resume", budget=9)) == 0  # a larger budget on resume continues
    assert "after 9 candidates (4 scored now); --budget 9 spent" in capsys.readouterr().out
    # a space small enough to exhaust (0 decimals: 4 factors in {1, 2, 3, 4}, 35 candidates)
    monkeypatch.setattr(evolution, "DECIMALS", 0)
    assert main(_args(model_dir, tmp_path / "small", budget=100)) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "after 35 candidates" in first and "the search space is exhausted" in first, first


# cases 7 and 15: every log row is checked when a resume reads it -------------------------------------------------

def _edit_row(out, number, edit):
    """Replace line ``number`` (1: the header) of the log by ``edit(row)`` (a JSON value, or text as it is)."""
    path = out / "search.jsonl"
    lines = path.read_text().splitlines()
    row = json.loads(lines[number - 1])
    new = edit(row)
    lines[number - 1] = new if isinstance(new, str) else json.dumps(new)
    path.write_text("\n".join(lines) + "\n")
    return row


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("-inf"), 0.5, 0])
def test_a_score_that_is_not_a_perplexity_never_wins(finished, model_dir, tmp_path, capsys, bad):
    """A row edited to "score": NaN gave "best perplexity nan", rc 0, and its factors as the checkpoint; a negative
    score won likewise."""
    out = _copy(finished, tmp_path)
    row = _edit_row(out, 3, lambda r: {**r, "score": bad})
    assert main(_args(model_dir, out, "--resume")) == 0
    captured = capsys.readouterr()
    assert f"{out / 'search.jsonl'}:3: field 'score' is" in captured.err and "expected a perplexity" in captured.err
    result = json.loads((out / "search.json").read_text())
    assert math.isfinite(result["best_score"]) and result["best_score"] >= 1
    assert "best perplexity nan" not in captured.out and "best perplexity -" not in captured.out
    # the row's candidate was scored again: the log holds its true score, the bad one is gone
    rows = [json.loads(line) for line in (out / "search.jsonl").read_text().splitlines()[1:]]
    again = [r["score"] for r in rows if r["factors"] == row["factors"] and r["stage"] == row["stage"]]
    assert again == [pytest.approx(row["score"])]


@pytest.mark.parametrize("edit, said", [
    (lambda r: {**r, "score": None}, "field 'score' is null"),
    (lambda r: [1, 2], "not a JSON object but [1, 2]"),
    (lambda r: {k: v for k, v in r.items() if k != "score"}, "no field 'score'"),
    (lambda r: {**r, "score": "abc"}, "field 'score' is \"abc\""),
    (lambda r: {**r, "factors": "x"}, "field 'factors' is \"x\""),
    (lambda r: {**r, "stage": None}, "field 'stage' is null"),
    (lambda r: "{not json", "not a line of JSON"),
], ids=["score-null", "list", "no-score", "score-abc", "factors", "stage", "not-json"])
def test_a_damaged_row_is_one_line_naming_file_and_line(finished, model_dir, tmp_path, capsys, edit, said):
    """TypeError / KeyError tracebacks before; "score": "abc" gave a line without the file or line number."""
    out = _copy(finished, tmp_path)
    _edit_row(out, 4, edit)
    assert main(_args(model_dir, out, "--resume")) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(ln for ln in err.splitlines() if "search.jsonl:4:" in ln)
    assert line.startswith("search --resume: " + str(out / "search.jsonl") + ":4: " + said), line
    assert len((out / "search.jsonl").read_text().splitlines()) == 7  # the header and 6 valid scores


def test_a_log_cut_by_a_kill_still_resumes_silently(finished, model_dir, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    path = out / "search.jsonl"
    text = path.read_text()
    path.write_text(text[: text.rstrip("\n").rfind("\n") + 20])  # the last row cut mid-write
    assert main(_args(model_dir, out, "--resume")) == 0
    captured = capsys.readouterr()
    assert "search.jsonl:" not in captured.err and "(1 scored now)" in captured.out


def test_python_api_resume_reports_rejected_rows(tmp_path):
    log = tmp_path / "log.jsonl"
    settings = SearchSettings(factor=2, budget=6, population=2, parents=1)
    search(_bowl, _pi, settings, ScoreLog(log, {"settings": {}}, resume=False))
    lines = log.read_text().splitlines()
    row = json.loads(lines[2])
    lines[2] = json.dumps({**row, "score": -row["score"]})
    log.write_text("\n".join(lines) + "\n")
    resumed = ScoreLog(log, {"settings": {}}, resume=True)
    assert resumed.rejected and resumed.rejected[0].startswith(f"{log}:3: field 'score' is -")
    assert len(resumed.scores) == 5


# case 19: a resume compares what changes the scores -----------------------------------------------------------

def test_resume_with_the_model_and_data_spelled_otherwise(model_dir, tmp_path, capsys, monkeypatch):
    """./m for m, an absolute path: refused "written with other settings" and the whole header, though the model
    fingerprint and the data sha256 matched."""
    from ctxext.reference import reference_text

    work = tmp_path / "work"
    shutil.copytree(model_dir, work / "llama")
    (work / "cal.txt").write_text(reference_text()[:20000])
    monkeypatch.chdir(work)
    assert main(_args("llama", "search", "--data", "cal.txt", budget=4)) == 0
    for model, data in (("./llama", "./cal.txt"), (str(work / "llama"), str(work / "cal.txt")),
                        ("llama/", "../work/cal.txt")):
        assert main(_args(model, "search", "--data", data, "--resume", budget=4)) == 0, capsys.readouterr().err
    assert main(_args("./llama", "search", "--data", "cal.txt", "--resume", budget=6)) == 0
    assert "after 6 candidates (2 scored now)" in capsys.readouterr().out


@pytest.mark.parametrize("flag, logged, now", [("--seed", "0", "3"), ("--max-windows", "1", "2"),
                                               ("--population", "3", "4"), ("--dtype", "float32", "bfloat16")])
def test_a_resume_with_another_setting_names_it(finished, model_dir, tmp_path, capsys, flag, logged, now):
    out = _copy(finished, tmp_path)
    args = _args(model_dir, out, "--resume")
    if flag in args:
        args[args.index(flag) + 1] = now
    else:
        args += [flag, now]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"({flag}): {json.dumps(json.loads(logged) if logged.isdigit() else logged)} in the log" in err, err
    assert f"resume with {flag} {logged}" in err, err
    assert "--overwrite" not in err and "model_files" not in err and "data_sha256" not in err, err


# case 20: --out and --data apart ------------------------------------------------------------------------------

def test_out_inside_the_data_folder_is_refused_before_loading(model_dir, tmp_path, capsys, monkeypatch):
    """eval refuses an --output inside its --data folder; search accepted it, and its --resume then read the search's
    own log as calibration text."""
    from ctxext.reference import reference_text

    data = tmp_path / "texts"
    data.mkdir()
    (data / "book.txt").write_text(reference_text()[:20000])
    _no_weights(monkeypatch)
    for out in (data / "search", data / "deeper" / "search", data):
        for flag in ([], ["--resume"], ["--overwrite"]):
            assert main(_args(model_dir, out, "--data", str(data), *flag)) == 2
            err = capsys.readouterr().err
            assert "inside" in err and "--data" in err and "Traceback" not in err, err
    assert sorted(p.name for p in data.iterdir()) == ["book.txt"]


def test_data_inside_out_is_refused(finished, model_dir, tmp_path, capsys, monkeypatch):
    out = _copy(finished, tmp_path)
    _no_weights(monkeypatch)
    for flag in (["--resume"], ["--overwrite"]):
        assert main(_args(model_dir, out, "--data", str(out / "search.jsonl"), *flag)) == 2
        err = capsys.readouterr().err
        assert f"--data {out / 'search.jsonl'} is inside --out {out}" in err, err
    assert (out / "config.json").exists()


def test_the_folder_check_takes_links_and_loops(model_dir, tmp_path, capsys, monkeypatch):
    from ctxext.reference import reference_text

    data = tmp_path / "texts"
    data.mkdir()
    (data / "book.txt").write_text(reference_text()[:20000])
    (tmp_path / "alias").symlink_to(data)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    _no_weights(monkeypatch)
    assert main(_args(model_dir, data / "search", "--data", str(tmp_path / "alias"))) == 2
    assert "inside the --data folder" in capsys.readouterr().err
    assert main(_args(model_dir, tmp_path / "s", "--data", str(tmp_path / "loop"))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "loop" in err, err


def test_a_search_where_every_candidate_fails_writes_no_checkpoint(model_dir, tmp_path, capsys, monkeypatch):
    """A model whose outputs are not finite at the target length scores every candidate inf: that is no result, and
    a checkpoint of arbitrary factors labelled 'best perplexity inf' would be one."""
    import importlib

    scoring = importlib.import_module("ctxext.evaluation.perplexity")  # the module, not the function of its name
    monkeypatch.setattr(scoring, "perplexity", lambda *a, **k: {"ppl": None})
    out = tmp_path / "search"
    assert main(_args(model_dir, out)) != 0
    err = capsys.readouterr().err
    assert "every candidate scored perplexity inf" in err and "no checkpoint written" in err
    assert not (out / "config.json").exists() and (out / "search.jsonl").exists()
