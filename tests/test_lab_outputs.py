"""`ctxext lab` outputs (found by a hostile probe): --overwrite clears the earlier run before training, `lab shift`
reuses only the models the lab's settings.json lists and refuses one that does not match them, a folder that is not
a lab run is refused, files get the usual mode, and shift's --window is checked before training. Tiny models."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from refusals import assert_refused, tree_digest  # noqa: E402

from ctxext.cli import main  # noqa: E402
from ctxext.lab import run as lab_run  # noqa: E402
from ctxext.lab import shift as lab_shift  # noqa: E402
from ctxext.core.outputs import write_atomic  # noqa: E402
from ctxext.lab.model import build_model  # noqa: E402
from ctxext.lab.run import LabSettings, run_lab  # noqa: E402

TINY = LabSettings(train_len=16, d_model=32, n_layers=1, n_heads=4, d_ff=64, batch=4, steps=1, warmup=1,
                   factors=(1,), eval_windows=2, copy_seqs=4, copy_warmup=2)
STREAM = torch.arange(5000) % 4096


@pytest.fixture(autouse=True)
def small_corpus(monkeypatch):
    """A short token stream instead of the Austen novels: tokenizing them takes seconds."""
    monkeypatch.setattr(lab_run, "corpus", lambda: (STREAM, STREAM))
    monkeypatch.setattr(lab_shift, "corpus", lambda: (STREAM, STREAM))


def no_training(monkeypatch):
    for module in (lab_run, lab_shift):
        monkeypatch.setattr(module, "train_scheme", lambda *a, **k: pytest.fail("trained although refused"))


def lab(out, schemes, settings=TINY, **kw):
    return run_lab(settings, schemes, out, plot=False, progress=False, **kw)


# ------------------------------------------------------------------------------------------------ --overwrite

def test_overwrite_clears_the_earlier_run(tmp_path):
    lab(tmp_path, ["nope", "alibi"])
    (tmp_path / "lab.png").write_bytes(b"\x89PNG old")  # as an earlier run with the plot would leave it
    (tmp_path / "notes.txt").write_text("mine")
    lab(tmp_path, ["rope"], overwrite=True)  # --no-plot: the old figure must not stay beside the new results
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["rope.pt", "settings.json"]
    assert not (tmp_path / "lab.png").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only the lab's own files are cleared
    with pytest.raises(ValueError, match="lack nope"):
        lab_shift.run_shift(tmp_path, schemes="nope", plot=False, progress=False)


def test_shift_reuses_only_the_schemes_settings_json_lists(tmp_path):
    lab(tmp_path, ["rope"])
    torch.save(build_model(TINY.model_config(), "nope").state_dict(), tmp_path / "models" / "nope.pt")
    with pytest.raises(ValueError, match="are rope; they lack nope"):
        lab_shift.run_shift(tmp_path, schemes="nope", plot=False, progress=False)


class _Killed(Exception):
    pass


def test_interrupted_overwrite_never_looks_finished(tmp_path, monkeypatch):
    lab(tmp_path, ["nope", "rope"])
    evaluate = lab_run.evaluate

    def killed_after_first(*a, **k):
        evaluate(*a, **k)
        raise _Killed  # as SIGTERM once the first scheme is evaluated

    monkeypatch.setattr(lab_run, "evaluate", killed_after_first)
    bigger = dataclasses.replace(TINY, d_model=64)
    with pytest.raises(_Killed):
        lab(tmp_path, ["nope", "rope"], settings=bigger, overwrite=True)
    assert not (tmp_path / "lab.json").exists() and not (tmp_path / "lab.md").exists()
    assert not (tmp_path / "models" / "rope.pt").exists()
    saved = json.loads((tmp_path / "models" / "settings.json").read_text())
    assert saved["settings"]["d_model"] == 64
    doc = lab_shift.run_shift(tmp_path, schemes="nope", window=4, offsets=[0, 8], n_windows=2, plot=False,
                              progress=False)
    assert doc["reused_lab_models"] and doc["settings"]["d_model"] == 64


def test_shift_refuses_a_model_that_does_not_match_settings_json(tmp_path, capsys, monkeypatch):
    lab(tmp_path, ["rope"])
    bigger = dataclasses.replace(TINY, d_model=64)
    torch.save(build_model(bigger.model_config(), "rope").state_dict(), tmp_path / "models" / "rope.pt")
    no_training(monkeypatch)
    line = assert_refused(["lab", "shift", "--schemes", "rope", "--out", tmp_path, "--no-plot"], capsys, tmp_path,
                          "does not match")
    assert "rope.pt" in line and "settings.json" in line and "--overwrite" in line


# ------------------------------------------------------------------------------------------------ foreign folders

@pytest.mark.parametrize("probe", [[], ["shift"]], ids=["lab", "shift"])
def test_folder_that_is_not_a_lab_run_is_refused(tmp_path, capsys, monkeypatch, probe):
    (tmp_path / "lab.md").write_text("my notes")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "rope.pt").write_bytes(b"my model")
    no_training(monkeypatch)
    for extra in ([], ["--overwrite"]):
        line = assert_refused(["lab", *probe, "--quick", "--steps", "1", "--out", tmp_path, "--no-plot", *extra],
                              capsys, tmp_path, "not a ctxext lab run")
        assert "lab.md" in line and "models" in line


def test_empty_or_missing_folder_and_an_earlier_run_are_fine(tmp_path):
    lab(tmp_path / "missing", ["nope"])
    (tmp_path / "empty").mkdir()
    lab(tmp_path / "empty", ["nope"])
    before = tree_digest(tmp_path / "empty")
    with pytest.raises(ValueError, match="--overwrite"):
        lab(tmp_path / "empty", ["nope"])
    assert tree_digest(tmp_path / "empty") == before
    lab(tmp_path / "empty", ["nope"], overwrite=True)


def test_written_files_get_the_usual_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


# ------------------------------------------------------------------------------------------------ shift --window

def test_shift_window_zero_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lab_shift, "corpus", lambda: pytest.fail("read the corpus despite a bad --window"))
    no_training(monkeypatch)
    assert_refused(["lab", "shift", "--quick", "--window", "0", "--out", tmp_path / "o"], capsys, tmp_path,
                   "--window must be at least 2, got 0")
    assert not (tmp_path / "o").exists()


def test_shift_window_longer_than_the_held_out_text_is_refused_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lab_shift, "corpus", lambda: (STREAM, STREAM[:100]))
    no_training(monkeypatch)
    line = assert_refused(["lab", "shift", "--quick", "--schemes", "alibi", "--window", "500", "--out",
                           tmp_path / "o", "--no-plot"], capsys, tmp_path, "--window 500")
    assert "100 tokens" in line and "longest window that fits is 99" in line


@pytest.mark.parametrize("threads", ["0", "100000"])
def test_a_thread_count_out_of_range_is_refused(tmp_path, capsys, monkeypatch, threads):
    """100000 threads ended in a MemoryError inside torch."""
    no_training(monkeypatch)
    assert_refused(["lab", "--quick", "--threads", threads, "--out", tmp_path / "o"], capsys, tmp_path,
                   f"--threads must be between 1 and 1024, got {threads}")


def test_lab_out_expands_the_home_folder(tmp_path, monkeypatch):
    """`--out '~/x'` is the home folder's x, as finetune's output.dir: the run wrote a literal ./~ folder."""
    from ctxext.cli import main

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert main(["lab", "--out", "~/labx", "--steps", "1", "--schemes", "rope", "--quick", "--no-plot"]) == 0
    assert (home / "labx" / "lab.json").is_file() and list(work.iterdir()) == []
