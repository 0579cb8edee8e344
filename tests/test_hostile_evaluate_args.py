"""Issue 57, `ctxext.evaluate`'s arguments: a string is not a switch (case 5), a bool is not a factor (6), methods
that name nothing are not the default set (7), a wrong type is named with what the argument takes (9), and messages
from Python name the keywords, not the command line's flags (10)."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest
import torch
from refusals import assert_refused

import ctxext
from ctxext.reference import reference_model, reference_tokenizer

#: A run of a few seconds: the unpatched reference LLaMA, one window at one length.
QUICK = dict(methods="none", lengths=[64], max_windows=1, progress=False)
#: A command-line flag in a message (``--output``), not a path that holds two dashes (``a--b``).
FLAG = re.compile(r"(?<![\w-])--[a-z]")


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def no_run(monkeypatch):
    """Fails a test whose evaluation begins: a bad argument is refused before anything runs (and a refusal that is
    missing fails at once instead of running the default methods for minutes)."""
    import ctxext.evaluation.runner as runner

    def run(*args, **kwargs):
        raise AssertionError("the evaluation began")

    monkeypatch.setattr(runner.Runner, "run", run)


@pytest.fixture
def finished(tmp_path):
    """A finished run at ``r.json``, and the digests of its two files."""
    out = tmp_path / "r.json"
    ctxext.evaluate("reference:llama", output=str(out), **QUICK)
    rows = out.with_suffix(".jsonl")
    return out, {out: _digest(out), rows: _digest(rows)}


# -- case 5: a string is not a switch ------------------------------------------------------------------------------
def test_overwrite_as_the_string_false_leaves_a_finished_run_alone(finished):
    """``overwrite="False"`` is truthy: it replaced the finished results without a word."""
    out, digests = finished
    with pytest.raises(ValueError, match=r"^overwrite: expected True or False, got 'False' \(str\)"):
        ctxext.evaluate("reference:llama", output=str(out), overwrite="False", **QUICK)
    assert {path: _digest(path) for path in digests} == digests


@pytest.mark.parametrize("name, value", [("resume", "no"), ("passkey", "false"), ("key_tokens", "no"),
                                         ("chat_template", "False"), ("progress", 0), ("overwrite", None)])
def test_a_switch_takes_true_or_false_only(name, value, tmp_path, no_run):
    settings = {**QUICK, "output": str(tmp_path / "r.json"), name: value}
    with pytest.raises(ValueError, match=rf"^{name}: expected True or False, got {re.escape(repr(value))}"):
        ctxext.evaluate("reference:llama", **settings)


# -- case 6: a bool is not a factor --------------------------------------------------------------------------------
@pytest.mark.parametrize("settings", [dict(factor=True, methods="yarn"), dict(methods=[("yarn", True)]),
                                      dict(methods=("yarn", np.bool_(True)))])
def test_a_bool_factor_is_refused_as_patch_refuses_it(settings, no_run):
    """``factor=True`` ran the unpatched model as "yarn x1"; ``ctxext.patch`` refuses a bool, and so does this."""
    with pytest.raises(ValueError, match=r"factor must be a number, got (True|np\.True_) \((bool|bool_)\)"):
        ctxext.evaluate("reference:llama", **{**QUICK, **settings})
    with pytest.raises(ctxext.PatchError, match="factor must be a number"):
        ctxext.patch(reference_model("llama"), "yarn", True)


def test_a_numpy_factor_is_a_number():
    from ctxext.evaluation.request import EvalRequest

    request = EvalRequest(model="reference:llama", methods=[("yarn", np.float32(2))], factor=np.int64(4))
    assert request.factor == 4.0 and type(request.factor) is float
    assert [r.label for r in request.choice.given] == ["yarn x2"]


# -- case 7: methods that name nothing -----------------------------------------------------------------------------
@pytest.mark.parametrize("methods", [[], "", ",", " , ", ()])
def test_methods_that_name_nothing_are_refused_not_the_default_set(methods, no_run):
    """``methods=[]`` ran all 15 default methods (hours on a real model); leaving methods out still asks for them."""
    with pytest.raises(ValueError, match=r"^methods: no methods to evaluate; .*leave methods out for the default set"):
        ctxext.evaluate("reference:llama", methods=methods, lengths=[64])


def test_the_command_refuses_an_empty_methods_flag(tmp_path, capsys, no_run):
    line = assert_refused(["eval", "--model", "reference:llama", "--methods", "", "--lengths", "64", "--output",
                           tmp_path / "r.json"], capsys, tmp_path, "--methods: no methods to evaluate")
    assert "leave --methods out" in line


# -- case 9: the wrong type, named with what the argument takes ----------------------------------------------------
@pytest.mark.parametrize("settings, says", [
    (dict(data=123), "data: expected a path, a dataset name, a list of strings or a datasets.Dataset, got int"),
    (dict(data={"text": ["some words"]}), "data: expected a path, a dataset name, a list of strings or a "
                                          "datasets.Dataset, got dict"),
    (dict(methods=123), "methods: expected a string such as 'none,pi,yarn:8', or a list of names"),
    (dict(methods={"yarn": 4}), "methods: expected a string such as 'none,pi,yarn:8'"),
    (dict(options=123), "options: expected KEY=VALUE strings or a dict"),
    (dict(tasks=123), "tasks: expected task names"),
    (dict(passkey_depths=object()), "passkey_depths: expected fractions of the context"),
    (dict(lengths=object()), "lengths: expected whole numbers of tokens"),
    (dict(text_field=1), "text_field: expected a name"),
    (dict(dtype=torch.float16), "dtype must be one of float32, bfloat16, float16, auto"),
])
def test_a_wrong_type_is_named_with_what_it_takes(settings, says, no_run):
    with pytest.raises(ValueError) as caught:
        ctxext.evaluate("reference:llama", **{**QUICK, **settings})
    assert str(caught.value).startswith(says), str(caught.value)
    assert "DatasetDict" not in str(caught.value)


@pytest.mark.parametrize("tokenizer, says", [
    ("gpt2", "tokenizer: expected the model's tokenizer object, got the name 'gpt2'"),
    (123, "tokenizer: expected the model's tokenizer object (e.g. from AutoTokenizer.from_pretrained), got int"),
])
def test_a_tokenizer_is_an_object(tokenizer, says):
    """A name was called as a tokenizer: "'str' object is not callable", after the run had begun."""
    model = reference_model("llama")
    with pytest.raises(ValueError) as caught:
        ctxext.evaluate(model, tokenizer=tokenizer, **QUICK)
    assert str(caught.value).startswith(says), str(caught.value)


def test_a_model_on_the_meta_device_is_refused_before_anything_runs():
    """"Cannot copy out of meta tensor" came from deep inside the first method."""
    model = reference_model("llama").to("meta")
    with pytest.raises(ValueError, match=r"^model: its weights are on the meta device .*load them first"):
        ctxext.evaluate(model, tokenizer=reference_tokenizer("llama"), **QUICK)
    assert ctxext.describe(model) is None


def test_numpy_numbers_and_bools_are_taken_as_python_ones():
    """numpy integers were refused as "not a whole number"; they are whole numbers (a bool still is not)."""
    plain = ctxext.evaluate("reference:llama", methods="none", lengths=[64, 128], max_windows=2, seed=3,
                            progress=False)
    numpy = ctxext.evaluate("reference:llama", methods="none", lengths=np.array([64, 128]), max_windows=np.int32(2),
                            seed=np.int64(3), progress=np.bool_(False), passkey=np.bool_(False))
    keep = ("label", "length", "tokens", "windows", "ppl")
    assert [{k: r[k] for k in keep} for r in numpy.rows] == [{k: r[k] for k in keep} for r in plain.rows]
    assert [r["windows"] for r in numpy.rows] == [2, 2]
    with pytest.raises(ValueError, match=r"max_windows=True: expected a whole number"):
        ctxext.evaluate("reference:llama", max_windows=True)


# -- case 10: messages from Python name the keywords ---------------------------------------------------------------
def _refusal(**settings) -> str:
    with pytest.raises(ValueError) as caught:
        ctxext.evaluate("reference:llama", **{**QUICK, **settings})
    text = str(caught.value)
    assert not FLAG.search(text), f"a command-line flag in {text!r}"
    return text


def test_a_finished_run_is_refused_in_keywords_from_python_and_in_flags_from_the_command(finished, capsys):
    out, digests = finished
    text = _refusal(output=str(out))
    assert text == (f"output={str(out)!r} holds a finished run (1 row); pass resume=True to continue it, "
                    "overwrite=True to replace it, or choose another output")
    assert _refusal(output=str(out), resume=True, overwrite=True).startswith(
        "resume=True keeps the finished rows and overwrite=True discards them")
    assert_refused(["eval", "--model", "reference:llama", "--methods", "none", "--lengths", "64", "--output", out],
                   capsys, out.parent, f"--output {out} holds a finished run (1 row); pass --resume to continue it, "
                   "--overwrite to replace it, or choose another --output")
    assert {path: _digest(path) for path in digests} == digests


def test_resume_with_other_settings_is_refused_in_keywords(finished):
    out, _ = finished
    text = _refusal(output=str(out), resume=True, lengths=[128])
    assert text.startswith("resume: ") and "use another output or drop resume=True" in text


def test_output_pictures_data_and_options_are_named_as_keywords(finished, tmp_path):
    out, _ = finished
    (tmp_path / "p.png").write_bytes(b"someone's picture")
    assert "pass overwrite=True to replace it" in _refusal(output=str(tmp_path / "new.json"),
                                                           plot=str(tmp_path / "p.png"))
    assert _refusal(output=str(out.with_suffix(".jsonl")), resume=True).startswith("output=")
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("words " * 200)
    assert "inside the data folder" in _refusal(data=str(folder), output=str(folder / "r.json"))
    assert _refusal(options=["beta_fast"], methods="yarn").startswith("options expects KEY=VALUE")
    assert "not among methods" in _refusal(options=["pi.foo=1"], methods="yarn")
    assert _refusal(tasks="ppl,nosuch").startswith("tasks: unknown task(s) 'nosuch'")
    assert _refusal(key_tokens=True, tasks="passkey") == "key_tokens is a perplexity: add ppl to tasks"
    assert _refusal(key_short=8).startswith("evaluator, key_context and key_short need key_tokens=True")
    assert _refusal(key_tokens=True, key_short=8, key_context=8) == "key_short=8 must be shorter than key_context=8"
    assert _refusal(device="tpu").startswith("device must be one of cpu, cuda, auto")


def test_the_command_still_names_its_flags(tmp_path, capsys):
    base = ["eval", "--model", "reference:llama", "--lengths", "64", "--output", tmp_path / "r.json"]
    assert_refused([*base, "--key-short", "8"], capsys, tmp_path,
                   "--evaluator, --key-context and --key-short need --key-tokens")
    assert_refused([*base, "--tasks", "passkey", "--key-tokens"], capsys, tmp_path,
                   "--key-tokens is a perplexity: add ppl to --tasks")
    assert_refused([*base, "--tasks", "nosuch"], capsys, tmp_path, "--tasks: unknown task(s) 'nosuch'")
    assert_refused([*base, "--methods", "yarn", "--option", "beta_fast"], capsys, tmp_path,
                   "--option expects KEY=VALUE")
