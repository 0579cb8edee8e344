"""`ctxext eval` keeps a run's results its own: a retrained tokenizer does not resume, rows the plan does not hold
(a rows file edited by hand) stay out of the tables, an --output inside the --data folder is refused, an --evaluator
with another tokenizer is refused before any weights load, and a picture already there is replaced only with
--overwrite / --resume."""

from __future__ import annotations

import json
import shutil

import pytest

import test_eval_fixtures as fixtures
from ctxext.cli import main
from test_eval_fixtures import CORPUS, save_tiny_llama


def run(*argv) -> int:
    return main(["eval", "--no-progress", "--device", "cpu", *map(str, argv)])


@pytest.fixture
def llama_dir(tmp_path):
    return save_tiny_llama(tmp_path / "llama")


@pytest.fixture
def weights_never_load(monkeypatch):
    import ctxext.evaluation.plan as plan

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(plan, "load_model", no_load)


BASE = ["--data", CORPUS, "--methods", "none", "--max-windows", "1"]


def test_a_retrained_tokenizer_does_not_resume(llama_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, *BASE, "--lengths", "32,48", "--output", out) == 0
    monkeypatch.setattr(fixtures, "VOCAB", 200)
    fixtures.build_tokenizer(llama_dir)  # retrained in place: the same files, other tokens
    capsys.readouterr()
    assert run("--model", llama_dir, *BASE, "--lengths", "32,48", "--output", out, "--resume") == 2
    assert "tokenizers" in capsys.readouterr().err


def test_rows_outside_the_plan_stay_out_of_the_results(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, *BASE, "--lengths", "32,48", "--output", out) == 0
    jsonl = out.with_suffix(".jsonl")
    row = json.loads(jsonl.read_text().splitlines()[-1])
    edited = [dict(row, method="ntk", label="ntk x2", factor=2.0), dict(row, model="othermodel"),
              dict(row, length=4096)]
    with jsonl.open("a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in edited)
    capsys.readouterr()
    assert run("--model", llama_dir, *BASE, "--lengths", "32,48", "--output", out, "--resume") == 0
    err = capsys.readouterr().err
    assert "3 row(s) of the rows file are not part of this run's plan" in err
    results = json.loads(out.read_text())["results"]
    assert sorted((r["model"], r["label"], r["length"]) for r in results) == [
        ("llama", "none", 32), ("llama", "none", 48)]


def test_an_output_inside_the_data_folder_is_refused(llama_dir, tmp_path, capsys, weights_never_load):
    data = tmp_path / "texts"
    data.mkdir()
    shutil.copy(CORPUS, data / "a.txt")
    assert run("--model", llama_dir, "--data", data, "--methods", "none", "--lengths", "32",
               "--output", data / "res" / "r.json") == 2
    assert "inside the --data folder" in capsys.readouterr().err
    assert sorted(p.name for p in data.iterdir()) == ["a.txt"]


def test_an_evaluator_with_another_tokenizer_is_refused_before_the_weights_load(llama_dir, tmp_path, capsys,
                                                                                 monkeypatch, weights_never_load):
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    monkeypatch.setattr(fixtures, "VOCAB", 200)
    fixtures.build_tokenizer(other)
    assert run("--model", llama_dir, *BASE, "--lengths", "64", "--key-tokens", "--evaluator", other,
               "--output", tmp_path / "r.json") == 2
    assert "splits the text differently" in capsys.readouterr().err


def test_a_picture_already_there_is_replaced_only_with_overwrite(llama_dir, tmp_path, capsys):
    mine = tmp_path / "photo.png"
    mine.write_text("not a plot")
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--plot", mine) == 2
    assert "photo.png exists; pass --overwrite" in capsys.readouterr().err
    assert mine.read_text() == "not a plot" and not out.exists()
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--plot", mine, "--overwrite") == 0
    assert mine.read_bytes().startswith(b"\x89PNG")


def test_resume_with_no_earlier_run_does_not_replace_a_picture_already_there(llama_dir, tmp_path, capsys):
    """--resume keeps what an earlier run drew; with no earlier run at --output, the file is someone else's."""
    mine = tmp_path / "holiday.png"
    mine.write_text("not a plot")
    out = tmp_path / "new.json"
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--plot", mine, "--resume") == 2
    assert "--resume finds no earlier run" in capsys.readouterr().err
    assert mine.read_text() == "not a plot" and not out.exists()


def test_resume_replaces_only_a_picture_its_earlier_run_drew(llama_dir, tmp_path, capsys):
    """A run without --plot, then --resume --plot NAME: NAME was not drawn by that run, so a file there is kept. The
    earlier run's own picture is redrawn on --resume, also after a resume that drew none."""
    mine, ours, out = tmp_path / "holiday.png", tmp_path / "ours.png", tmp_path / "r.json"
    mine.write_text("not a plot")
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out) == 0
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--plot", mine, "--resume") == 2
    assert "the earlier run at --output" in capsys.readouterr().err and mine.read_text() == "not a plot"
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--plot", ours, "--overwrite") == 0
    ours.write_text("drawn before")
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--resume") == 0
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--plot", ours, "--resume") == 0
    assert ours.read_bytes().startswith(b"\x89PNG")


def test_the_demos_default_picture_does_not_replace_a_file_already_there(tmp_path, capsys):
    """`ctxext demo --output X.json` draws X.png: a file of the user's there is refused, as with --plot."""
    mine = tmp_path / "photo.png"
    mine.write_text("not a plot")
    out = tmp_path / "photo.json"
    assert main(["demo", "--no-progress", "--methods", "none", "--lengths", "128", "--max-tokens", "128",
                 "--output", str(out)]) == 2
    assert "photo.png exists; pass --overwrite" in capsys.readouterr().err
    assert mine.read_text() == "not a plot" and not out.exists()


def test_a_heatmap_name_beside_the_plot_is_left_alone_when_no_needle_task_runs(llama_dir, tmp_path):
    mine = tmp_path / "p_needles.png"
    mine.write_text("not a heatmap")
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--plot", tmp_path / "p.png") == 0
    assert mine.read_text() == "not a heatmap" and (tmp_path / "p.png").exists()


def test_a_plot_name_without_a_suffix_is_written_as_png(llama_dir, tmp_path):
    """The pre-run check says matplotlib writes NAME.png; the picture is written there (it failed after the run)."""
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, *BASE, "--lengths", "32", "--output", out, "--plot", tmp_path / "pic") == 0
    assert (tmp_path / "pic.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".pic", "pic"))) == ["pic.png"]


def test_a_hub_models_fingerprint_follows_the_pinned_revision(tmp_path, monkeypatch):
    """A run pinned to a revision is identified by that snapshot, not by the cache's main (which may move)."""
    import huggingface_hub.constants

    from ctxext.evaluation.fingerprint import model_fingerprint

    repo = tmp_path / "models--org--m"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_fingerprint({"model": "org/m"}) == {"hub_commit": "a" * 40}
    assert model_fingerprint({"model": "org/m", "revision": "b" * 40}) == {"hub_commit": "b" * 40}


def test_a_shipped_models_fingerprint_is_its_files_under_either_name():
    """``reference:llama`` and ``ctxext.reference:llama`` name one shipped folder: both are fingerprinted by its files
    (not looked up as a hub id), so a resume sees a changed checkpoint whichever name the run was given."""
    from ctxext.evaluation.fingerprint import model_fingerprint, tokenizer_fingerprint

    short, long = {"model": "reference:llama"}, {"model": "ctxext.reference:llama"}
    assert "model" in model_fingerprint(short) and model_fingerprint(short) == model_fingerprint(long)
    assert tokenizer_fingerprint(short) and tokenizer_fingerprint(short) == tokenizer_fingerprint(long)
