"""`ctxext lm-eval` refuses bad input before lm-eval loads any task: exit 2, one `ctxext lm-eval: error: ...` line,
no traceback, nothing under the output folder changed, and quickly. The same model_args checks run in
`CtxextLM.__init__`, so `lm_eval.simple_evaluate(model="ctxext", ...)` gets the same messages."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("lm_eval")

from refusals import assert_refused
from test_eval_fixtures import save_tiny_gpt2, save_tiny_llama

#: Seconds a refusal may take in-process (ctxext, torch and transformers already imported). Measured on a loaded
#: 2-core machine: 0.2-1 s for the first refusal (it imports lm-eval's hf model and config modules), 0.01-0.3 s for
#: the rest. A whole `ctxext lm-eval ...` process adds the torch + transformers import (5-12 s on that machine,
#: the same for every ctxext command); before this check a bad model arg came after task loading (22 s for
#: hellaswag alone, about 85 s for larger task sets).
FAST_S = 10.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("refuse_lm")
    empty = root / "empty"
    empty.mkdir()
    not_adapter = root / "not_adapter"
    not_adapter.mkdir()
    no_tokenizer = save_tiny_llama(root / "no_tokenizer")  # as model.save_pretrained leaves it: no tokenizer files
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (no_tokenizer / name).unlink(missing_ok=True)
    return {
        "NO_TOKENIZER": str(no_tokenizer),
        "LLAMA": str(save_tiny_llama(root / "llama")),
        "GPT2": str(save_tiny_gpt2(root / "gpt2")),
        "EMPTY": str(empty),
        "NOT_ADAPTER": str(not_adapter),
        "MISSING": str(root / "no_such_folder"),
    }


@pytest.fixture
def watch(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results_2020-01-01.json").write_text('{"results": {"earlier": 1}}\n')
    return out


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


# (id, model_args or None for no --model ctxext, extra lm-eval args, expected text in the error line)
CASES = [
    ("unknown-method", "pretrained=LLAMA,method=foo", [], "unknown method 'foo'"),
    ("factor-not-a-number", "pretrained=LLAMA,method=ntk,factor=abc", [], "abc"),
    ("factor-zero", "pretrained=LLAMA,method=pi,factor=0", [], "factor must be"),
    ("factor-negative", "pretrained=LLAMA,method=yarn,factor=-2", [], "factor must be"),
    ("factor-nan", "pretrained=LLAMA,method=pi,factor=nan", [], "factor"),
    ("factor-huge", "pretrained=LLAMA,method=pi,factor=1e9", [], "maximum"),
    ("factor-missing", "pretrained=LLAMA,method=ntk", [], "needs a factor"),
    ("option-of-another-method", "pretrained=LLAMA,method=pi,factor=2,beta_fast=32", [], "unknown option(s) beta_fast"),
    ("option-ill-typed", "pretrained=LLAMA,method=yarn,factor=2,beta_fast=fast", [], "beta_fast"),
    ("option-without-method", "pretrained=LLAMA,beta_fast=32", [], "without method"),
    ("factor-without-method", "pretrained=LLAMA,factor=4", [], "without method"),
    ("options-with-method-none", "pretrained=LLAMA,method=none,beta_slow=2", [], "without method"),
    ("pretrained-missing", "method=yarn,factor=4", [], "pretrained= is required"),
    ("pretrained-empty", "pretrained=,method=yarn,factor=4", [], "pretrained= is required"),
    ("local-folder-missing", "pretrained=MISSING,method=pi,factor=2", [], "folder not found"),
    ("folder-without-config", "pretrained=EMPTY,method=pi,factor=2", [], "no config.json"),
    ("gguf-file-missing", "pretrained=LLAMA,gguf_file=model-q8.gguf", [], "GGUF file 'model-q8.gguf' not found"),
    ("hub-id-offline", "pretrained=ctxext-test/no-such-model,method=pi,factor=2", [], "HF_HUB_OFFLINE"),
    ("adapter-missing", "pretrained=LLAMA,adapter=MISSING", [], "adapter: folder not found"),
    ("adapter-not-an-adapter", "pretrained=LLAMA,adapter=NOT_ADAPTER", [], "adapter_config.json"),
    ("folder-without-tokenizer", "pretrained=NO_TOKENIZER,method=pi,factor=2", [], "holds no tokenizer"),
    ("method-does-not-fit-family", "pretrained=GPT2,method=ntk,factor=2", [], "does not fit"),
    ("tasks-missing", "pretrained=LLAMA,method=pi,factor=2", None, "--tasks is required"),
    ("include-path-missing", "pretrained=LLAMA", ["--include_path", "MISSING"], "--include_path"),
    ("lm-eval-usage-error", "pretrained=LLAMA", ["--limit", "lots"], "--limit"),
    ("max-length-not-a-number", "pretrained=LLAMA,method=yarn,factor=4,max_length=abc", [], "max_length=abc"),
    ("max-length-negative", "pretrained=LLAMA,max_length=-5", [], "max_length=-5"),
    # lm-eval pads a batch to its longest row without a mask: dynamic-ntk's per-sequence scale would follow the batch
    ("dynamic-ntk-batched", "pretrained=LLAMA,method=dynamic-ntk,factor=4", ["--batch_size", "4"], "batch size 1"),
    ("batch-size-twice", "pretrained=LLAMA,batch_size=2", ["--batch_size", "1"], "give --batch_size only"),
    ("device-twice", "pretrained=LLAMA,device=cpu", ["--device", "cpu"], "give --device only"),
]


def _argv(models, model_args, extra, watch):
    def fill(text):
        for key, value in models.items():
            text = text.replace(f"={key}", f"={value}")
        return models.get(text, text)

    argv = ["lm-eval", "--model", "ctxext", "--model_args", fill(model_args), "--device", "cpu",
            "--output_path", str(watch)]
    if extra is None:  # no --tasks
        return argv
    return argv + ["--tasks", "ctxext_no_such_task"] + [fill(x) for x in extra]


@pytest.mark.parametrize("model_args,extra,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_any_task_loads(models, watch, capsys, model_args, extra, expect):
    # --tasks names a task that does not exist: had lm-eval got as far as loading tasks, it would fail differently
    argv = _argv(models, model_args, extra, watch)
    start = time.perf_counter()
    assert_refused(argv, capsys, watch, expect)
    assert time.perf_counter() - start < FAST_S


def test_no_arguments_print_usage_and_exit_2(watch, capsys):
    line = assert_refused(["lm-eval"], capsys, watch, "nothing to run")
    assert line.startswith("ctxext lm-eval: error:")
    # the usage block came first, on stderr (assert_refused has read it; run again to look at it)
    from ctxext.cli import main

    assert main(["lm-eval"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: ctxext lm-eval --model ctxext")


def test_help_still_shows_help(capsys):
    from ctxext.cli import main

    assert main(["lm-eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model ctxext" in out and "lm-eval" in out


def test_error_line_matches_the_exception_message(models, watch, capsys):
    """The CLI line is `ctxext lm-eval: error: ` + the message that check_model_args raises."""
    from ctxext.integrations.lm_eval import check_model_args

    line = assert_refused(_argv(models, "pretrained=LLAMA,method=foo", [], watch), capsys, watch, "foo")
    with pytest.raises(ValueError) as exc:
        check_model_args({"pretrained": models["LLAMA"], "method": "foo"})
    assert line == f"ctxext lm-eval: error: {exc.value}"


# The Python API (`lm_eval.simple_evaluate(model="ctxext", model_args="...")` builds the model with
# create_from_arg_string) refuses with the same message, before any weights load.
API_CASES = [c for c in CASES if c[2] == [] and c[0] != "method-does-not-fit-family"]


@pytest.mark.parametrize("model_args,expect", [(c[1], c[3]) for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_python_api_refuses_with_the_same_message(models, monkeypatch, model_args, expect):
    import functools

    import ctxext.integrations.lm_eval as m

    @functools.wraps(m.HFLM.__init__)  # its signature stays: the accepted model_args are read from it
    def no_load(*args, **kwargs):  # nothing may load before the checks pass
        raise AssertionError("the model loaded before its arguments were checked")

    monkeypatch.setattr(m.HFLM, "__init__", no_load)
    args = model_args
    for key, value in models.items():
        args = args.replace(f"={key}", f"={value}")
    with pytest.raises((ValueError, OSError)) as exc:
        m.CtxextLM.create_from_arg_string(args, {"device": "cpu"})
    assert expect.lower() in str(exc.value).lower()
    assert "\n" not in str(exc.value)


def test_python_api_factor_strings_become_numbers(models):
    """lm-eval model_args are strings; a number-like factor string is converted before `ctxext.patch`,
    whose API takes numbers only."""
    from ctxext.integrations.lm_eval import check_model_args

    checked = check_model_args({"pretrained": models["LLAMA"], "method": "yarn", "factor": "4", "beta_fast": "16"})
    assert checked == {"method": "yarn", "factor": 4.0, "options": {"beta_fast": 16.0}}
    assert check_model_args({"pretrained": models["LLAMA"], "method": "none"})["method"] is None


def test_an_abbreviated_model_args_flag_is_checked_too(models, watch, capsys):
    """argparse takes `--model_a` for `--model_args`; a key given twice there is refused as with the full flag."""
    argv = ["lm-eval", "--model", "ctxext", "--model_a", f"pretrained={models['LLAMA']},method=yarn,factor=4,factor=8",
            "--device", "cpu", "--output_path", str(watch), "--tasks", "ctxext_no_such_task"]
    assert_refused(argv, capsys, watch, "factor is given twice")


def test_an_output_path_that_is_a_file_is_refused_before_the_run(models, watch, capsys):
    """lm-eval writes into a folder there; with a file in the way it found out after the whole run (exit 0)."""
    mine = watch / "notes.txt"
    mine.write_text("mine\n")
    argv = _argv(models, "pretrained=LLAMA", [], watch)
    argv[argv.index("--output_path") + 1] = str(mine)
    assert_refused(argv, capsys, watch, "an existing file")
    assert mine.read_text() == "mine\n"


def test_a_model_object_is_patched_in_place_with_a_warning(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ctxext
    from ctxext.integrations.lm_eval import CtxextLM

    model = AutoModelForCausalLM.from_pretrained(models["LLAMA"])
    tokenizer = AutoTokenizer.from_pretrained(models["LLAMA"])
    with pytest.warns(UserWarning, match="in place"):
        lm = CtxextLM(pretrained=model, tokenizer=tokenizer, method="yarn", factor=4, device="cpu")
    assert ctxext.describe(model)["method"] == "yarn" and lm.ctxext_spec == ctxext.describe(model)
