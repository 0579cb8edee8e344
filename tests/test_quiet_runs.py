"""Quiet runs (issue 49, item 6): what ctxext's own calls make the libraries print is silenced, and only that.

- A fine-tune printed ``FutureWarning: `is_gradient_checkpointing` is deprecated``: peft's ``get_peft_model`` reads
  that deprecated transformers property when ctxext wraps the model with LoRA.
- ``ctxext lm-eval`` printed ``fatal: not a git repository``: lm-eval runs ``git describe --always`` for the results'
  ``git_hash`` without redirecting git's stderr.
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPRECATED = "is_gradient_checkpointing"


# -- fine-tune -----------------------------------------------------------------------------------------------------


def test_a_fine_tune_prints_no_gradient_checkpointing_deprecation(tmp_path, monkeypatch, capfd):
    pytest.importorskip("peft")
    from ctxext.finetune import load_recipe
    from ctxext.finetune import run as run_recipe
    from ctxext.reference import reference_text


    monkeypatch.chdir(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text(reference_text()[:20000], encoding="utf-8")  # a few sequences: packing the novels takes seconds
    recipe = load_recipe(str(ROOT / "recipes" / "tiny" / "llama_pi_lora.yaml"), [
        "train.steps=1", "train.batch_size=1", "train.micro_batch_size=1", "train.warmup_steps=0",
        "train.gradient_checkpointing=true", "eval.enabled=false", f"data.files=[{text}]",
        f"output.dir={tmp_path / 'out'}"])
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, however often it was shown before
        summary = run_recipe(recipe, progress=False)
    assert summary["finished"] and summary["steps"] == 1
    noise = [str(w.message) for w in caught if DEPRECATED in str(w.message)]
    assert not noise, noise
    assert DEPRECATED not in capfd.readouterr().err
    assert warnings.filters == filters  # nothing left behind: the user's own warnings show as before


def test_the_silencing_is_narrow():
    """Only that deprecation, and only inside ctxext's LoRA wrap; any other warning there still shows."""
    from ctxext.compat.transformers import peft_wrap_quietly

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with peft_wrap_quietly():
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("something else", FutureWarning)
            warnings.warn("`is_gradient_checkpointing` is deprecated", UserWarning)  # another category
        warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)  # outside: the user's, shown
    assert [(type(w.message), str(w.message)) for w in caught] == [
        (FutureWarning, "something else"), (UserWarning, "`is_gradient_checkpointing` is deprecated"),
        (FutureWarning, "`is_gradient_checkpointing` is deprecated")]


# -- lm-eval -------------------------------------------------------------------------------------------------------


def _git_works() -> bool:
    try:
        return subprocess.run(["git", "--version"], capture_output=True).returncode == 0
    except OSError:
        return False


def test_git_hash_quietly_gives_lm_evals_answer_without_gits_stderr(tmp_path, monkeypatch, capfd):
    pytest.importorskip("lm_eval")
    import lm_eval.evaluator as evaluator

    from ctxext.compat.lm_eval import git_hash_quietly

    monkeypatch.chdir(tmp_path)  # not a git checkout
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # even if a parent folder were one
    original = evaluator.get_git_commit_hash
    expected = original()
    if _git_works():  # what the test guards against: lm-eval's own call is noisy here
        assert "not a git repository" in capfd.readouterr().err
    with git_hash_quietly():
        assert evaluator.get_git_commit_hash is not original
        assert evaluator.get_git_commit_hash() == expected
    assert capfd.readouterr().err == ""
    assert evaluator.get_git_commit_hash is original  # put back: lm-eval used directly is as it was


def test_git_hash_quietly_keeps_the_hash_of_a_checkout(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    if not _git_works():
        pytest.skip("no git")
    import lm_eval.evaluator as evaluator

    from ctxext.compat.lm_eval import git_hash_quietly

    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    monkeypatch.chdir(tmp_path)
    expected = evaluator.get_git_commit_hash()
    with git_hash_quietly():
        assert evaluator.get_git_commit_hash() == expected and expected


def test_ctxext_lm_eval_outside_a_checkout_prints_no_git_error(tmp_path, monkeypatch, capfd):
    pytest.importorskip("lm_eval")
    from test_eval_fixtures import CORPUS, save_tiny_llama
    from test_eval_lm_eval import TASK

    from ctxext.cli import main

    model_dir = save_tiny_llama(tmp_path / "llama")
    text = CORPUS.read_text()
    data = tmp_path / "docs.json"
    data.write_text(json.dumps({"context": text[:200], "continuation": text[200:230]}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "loglik.yaml").write_text(TASK.format(
        kind="loglikelihood", data=data, text="{{context}}", target="{{continuation}}",
        metrics="  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    capfd.readouterr()
    rc = main(["lm-eval", "--model", "ctxext", "--model_args", f"pretrained={model_dir},method=pi,factor=2",
               "--device", "cpu", "--tasks", "ctxext_tiny_loglikelihood", "--include_path", str(tasks),
               "--output_path", str(tmp_path / "out"), "--batch_size", "1"])
    err = capfd.readouterr().err
    assert rc == 0, err[-3000:]
    assert "not a git repository" not in err and "fatal:" not in err, err[-3000:]
    (result,) = (tmp_path / "out").rglob("results*.json")
    assert "git_hash" in json.loads(result.read_text())  # lm-eval still records it (none here)
