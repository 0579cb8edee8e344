"""``ctxext search longrope`` and its --out folder: an earlier result survives a failed --overwrite, one writer at a
time, no checkpoint from an unfinished progressive search, a clear refusal when nothing was scored, and --resume only
on the same model files."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from test_eval_fixtures import save_tiny_llama

from ctxext.cli import main
from ctxext.core.outputs import OutputLock
from ctxext.search import SearchSettings, longrope_search
from ctxext.search.longrope import SearchIncomplete

TINY = ["--population", "3", "--parents", "2", "--max-windows", "1", "--budget", "4", "--no-progress"]


def _args(model, out, *extra):
    return ["search", "longrope", str(model), "--factor", "2", "--out", str(out), *TINY, *extra]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("model") / "llama")


def test_a_failed_overwrite_keeps_the_earlier_search(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "search"
    assert main(_args(model_dir, out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "search.json" in before and "config.json" in before

    def broken(*a, **k):
        raise RuntimeError("stopped mid-search")  # a run that failed or was killed mid-search

    monkeypatch.setattr("ctxext.search.longrope.search", broken)
    with pytest.raises(RuntimeError, match="stopped mid-search"):
        main(_args(model_dir, out, "--overwrite"))
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["search"]  # no staging folder or lock left
    monkeypatch.undo()
    assert main(_args(model_dir, out, "--overwrite", "--seed", "1")) == 0  # a complete run replaces it
    assert json.loads((out / "search.json").read_text())["settings"]["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["search"]


def test_a_second_run_on_the_same_out_is_refused(model_dir, tmp_path, capsys):
    out = tmp_path / "search"
    with OutputLock(out, "--out"):
        assert main(_args(model_dir, out)) == 2
    assert "being written by another ctxext run" in capsys.readouterr().err
    assert not out.exists()


def test_a_progressive_budget_that_cannot_reach_the_last_stage_is_refused_before_loading(model_dir, tmp_path,
                                                                                          capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("ctxext.loading.from_pretrained", no_load)
    out = tmp_path / "search"
    assert main(["search", "longrope", str(model_dir), "--factor", "4", "--progressive", "--out", str(out),
                 *TINY]) == 2
    assert "cannot reach the last stage" in capsys.readouterr().err and not out.exists()


def test_a_progressive_search_out_of_time_early_writes_no_checkpoint(tmp_path, monkeypatch):
    clock = [0.0]

    def tick():
        clock[0] += 1.0  # one second per look at the clock
        return clock[0]

    monkeypatch.setattr("ctxext.search.evolution.time.monotonic", tick)
    settings = SearchSettings(factor=4, budget=20, minutes=0.1, population=3, parents=2, progressive=True)
    tokens = torch.randint(2, 128, (3000,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(SearchIncomplete, match=r"ran out of --minutes at stage x2 and never reached the final "
                                               r"factor x4"):
        longrope_search(tiny_llama(), tokens, settings, tmp_path, max_windows=1, progress=False)
    assert (tmp_path / "search.jsonl").exists()  # kept for --resume
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "search.json").exists()


def test_minutes_too_short_to_score_anything_is_a_one_line_refusal(model_dir, tmp_path, capsys):
    assert main(_args(model_dir, tmp_path / "search", "--minutes", "1e-9")) == 2
    err = capsys.readouterr().err
    assert "scored no candidate" in err and "Traceback" not in err


def test_resume_refuses_another_model_at_the_same_path(tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "llama")
    out = tmp_path / "search"
    assert main(_args(model, out)) == 0
    header = json.loads((out / "search.jsonl").read_text().splitlines()[0])
    assert header["settings"]["model_files"]["model"]["config.json"]
    assert main(_args(model, out, "--resume")) == 0  # the same files: resumed
    capsys.readouterr()
    save_tiny_llama(tmp_path / "llama", seed=1)  # other weights under the same path
    assert main(_args(model, out, "--resume")) == 2
    assert "is not the one the search began with" in capsys.readouterr().err


def _no_weights(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("ctxext.loading.from_pretrained", no_load)


@pytest.fixture
def weights_never_load(monkeypatch):
    _no_weights(monkeypatch)


def test_outputs_that_cannot_be_a_folder_are_refused_before_loading(model_dir, tmp_path, capsys, weights_never_load):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("mine\n")
    for out, said in ((tmp_path / "dangling", "is a link"), (tmp_path / "afile" / "x", "afile is a file")):
        assert main(_args(model_dir, out)) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "afile").read_text() == "mine\n"


@pytest.mark.parametrize("text", ["my notes\n", '{"a": 1}\n'])
@pytest.mark.parametrize("flag", [[], ["--resume"], ["--overwrite"]])
def test_a_users_search_jsonl_is_not_taken_for_a_search(model_dir, tmp_path, capsys, weights_never_load, text, flag):
    """A folder holding only a file named search.jsonl that no search wrote: refused with every flag, the file kept
    (--overwrite replaced it, --resume gave a bare JSON error or "other settings (None)")."""
    out = tmp_path / "search"
    out.mkdir()
    (out / "search.jsonl").write_text(text)
    assert main(_args(model_dir, out, *flag)) == 2
    err = capsys.readouterr().err
    assert "not a ctxext search" in err and "Traceback" not in err, err
    assert [p.name for p in out.iterdir()] == ["search.jsonl"] and (out / "search.jsonl").read_text() == text


def test_a_factor_that_does_not_pass_the_trained_length_is_refused(model_dir, tmp_path, capsys, weights_never_load):
    """transformers' longrope uses short_factor up to the trained length: long factors searched there are never used."""
    out = tmp_path / "search"
    args = _args(model_dir, out)
    args[args.index("--factor") + 1] = "1.005"
    assert main(args) == 2
    assert "not past it" in capsys.readouterr().err and not out.exists()


def test_a_checkpoint_saved_patched_is_refused_before_loading(model_dir, tmp_path, capsys, monkeypatch):
    exported = tmp_path / "exported"
    assert main(["export", str(model_dir), "--method", "ntk", "--factor", "4", "--out", str(exported)]) == 0
    capsys.readouterr()
    _no_weights(monkeypatch)
    assert main(_args(exported, tmp_path / "search")) == 2
    assert "saved from a model patched by ctxext (ntk x4" in capsys.readouterr().err


def test_resume_refuses_other_calibration_text_at_the_same_path(model_dir, tmp_path, capsys):
    """The scores in the log are of the text scored: another text under the same --data path (same token count
    here, which the settings alone would not tell apart) is refused on --resume."""
    from ctxext.loading import auto_tokenizer

    from ctxext.reference import reference_text

    sentences = [s.strip() for s in reference_text()[:20000].split(".") if len(s.strip()) > 20][:120]
    first, second = "\n".join(sentences), "\n".join(reversed(sentences))
    tokenizer = auto_tokenizer(str(model_dir))
    assert len(tokenizer(first)["input_ids"]) == len(tokenizer(second)["input_ids"])  # the case the count misses
    data, out = tmp_path / "cal.txt", tmp_path / "search"
    data.write_text(first)
    assert main(_args(model_dir, out, "--data", str(data))) == 0
    assert main(_args(model_dir, out, "--data", str(data), "--resume")) == 0  # the same text: resumed
    capsys.readouterr()
    data.write_text(second)
    assert main(_args(model_dir, out, "--data", str(data), "--resume")) == 2
    assert "calibration text" in capsys.readouterr().err
