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


def _refused(model="reference:llama", **settings) -> str:
    """The message ``ctxext.evaluate`` refuses ``settings`` with (any error type), checked to name no flag."""
    with pytest.raises((ValueError, OSError, ctxext.PatchError)) as caught:
        ctxext.evaluate(model, **{**QUICK, **settings})
    text = str(caught.value)
    assert not FLAG.search(text), f"a command-line flag in {text!r}"
    return text


def test_a_missing_cuda_device_is_named_as_the_device_keyword(monkeypatch, no_run):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _refused(device="cuda") == "device='cuda': no CUDA device is available"


def test_the_data_and_its_text_field_are_named_as_keywords(tmp_path, no_run):
    rows = tmp_path / "d.jsonl"
    rows.write_text(json.dumps({"body": "words " * 100}) + "\n")
    assert _refused(data=str(rows)).endswith("no 'text' field (choose one with text_field)")
    loop_a, loop_b = tmp_path / "a", tmp_path / "b"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    assert _refused(data=str(loop_a)).startswith(f"data {loop_a} is a loop of symbolic links")


def test_a_stride_past_the_default_lengths_says_give_lengths(no_run):
    text = _refused(lengths=None, stride=100000)
    assert text.startswith("stride: ") and text.endswith("; give lengths)")


def test_models_evaluators_and_adapters_that_cannot_load_are_named_as_keywords(tmp_path, no_run):
    assert _refused(model="reference:nosuch").startswith("model='reference:nosuch': unknown reference model")
    assert _refused(evaluator="reference:nosuch", key_tokens=True).startswith(
        "evaluator='reference:nosuch': unknown reference model")
    reference_model("llama").save_pretrained(tmp_path / "bare")
    assert _refused(model=str(tmp_path / "bare")).startswith(f"model={str(tmp_path / 'bare')!r} holds no tokenizer")
    (tmp_path / "empty").mkdir()
    assert _refused(adapter=str(tmp_path / "empty")) == (f"adapter={str(tmp_path / 'empty')!r}: not a LoRA adapter "
                                                          "folder (no adapter_config.json)")


def test_an_adapters_recorded_patch_is_explained_in_keywords(tmp_path, no_run):
    """An adapter trained under yarn x2 asked to run without it (``methods="none"``), or with a stray factor."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from test_eval_fixtures import save_tiny_llama
    from transformers import AutoModelForCausalLM

    base = save_tiny_llama(tmp_path / "llama")
    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(base), "yarn", 2)
    adapter = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    (adapter / "ctxext_patch.json").write_text(json.dumps(ctxext.describe(model)))
    text = _refused(model=str(base), adapter=str(adapter), methods="none")
    assert text.startswith("methods='none': 'none' would evaluate") and text.endswith("without adapter")
    text = _refused(model=str(base), adapter=str(adapter), methods=None, factor=4)
    assert text.startswith("factor without methods") and "(e.g. methods='yarn:2,yarn:4')" in text


def test_key_token_contexts_are_named_as_keywords(no_run):
    text = _refused(key_tokens=True, key_context=100000)
    assert text.startswith("key_context=100000 is longer than the evaluator")
    assert "give key_context=128 or less, or an evaluator trained to 100000 tokens" in text
    assert _refused(key_tokens=True, key_context=1).endswith("give key_context of at least 2")


def test_a_failing_chat_template_says_chat_template_false():
    tokenizer = reference_tokenizer("llama")
    tokenizer.chat_template = "{{ raise_exception('no') }}"
    text = _refused(model=reference_model("llama"), tokenizer=tokenizer, tasks="niah_single_1", task_samples=1)
    assert text.endswith("use chat_template=False")


def test_an_unwritten_picture_from_python_says_to_call_evaluate_again(tmp_path):
    import errno
    from types import SimpleNamespace

    from ctxext.evaluation.report import unwritten_picture

    plan = SimpleNamespace(output=str(tmp_path / "r.json"), overwrite=True, command="evaluate")
    text = unwritten_picture("plot", str(tmp_path / "p"), OSError(errno.ENOSPC, "No space left on device"), plan)
    assert not FLAG.search(text), text
    assert text.startswith(f"plot={str(tmp_path / 'p.png')!r}: not written (No space left on device)")
    assert text.endswith("free some space, then call ctxext.evaluate again with the same arguments with "
                         "resume=True in place of overwrite=True to draw it (no row is computed again)")
