"""Issue 51, `ctxext eval`: an adapter is evaluated as it was trained and its rows say so (case 10), a --data link
loop (12), a --key-context the evaluator cannot read (13), unbounded --task-samples / --passkey-trials (14), a picture
that cannot be written (21), and the rows-file lock's message: each one error line, or the right numbers."""

from __future__ import annotations

import errno
import json
from types import SimpleNamespace

import pytest
import torch

import ctxext
from ctxext.cli import main
from refusals import assert_refused
from test_eval_fixtures import CORPUS, save_tiny_gpt2, save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("models") / "gpt2")


def _eval(model, out, *argv):
    return ["eval", "--no-progress", "--device", "cpu", "--model", model, "--data", CORPUS, "--output", out, *argv]


def run(*argv) -> int:
    return main([str(a) for a in argv])


def rows_of(out):
    return [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()][1:]


# -- case 10: an adapter is evaluated with its patch, as loaded, and labelled ---------------------------------------
@pytest.fixture(scope="module")
def llama_adapter(llama_dir, tmp_path_factory):
    """A LoRA adapter on the tiny LLaMA trained under yarn x2, its patch recorded as a ctxext fine-tune records it."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(llama_dir), "yarn", 2)
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    folder = tmp_path_factory.mktemp("adapters") / "llama-yarn2"
    peft.save_pretrained(folder)
    (folder / "ctxext_patch.json").write_text(json.dumps(ctxext.describe(model)))
    return folder


@pytest.fixture(scope="module")
def gpt2_adapter(gpt2_dir, tmp_path_factory):
    """A LoRA adapter on the tiny GPT-2 trained under pi x2 with the interpolated position table trained in full
    (``lora.trainable: [wpe]``, as the shipped GPT-2 recipes do), the table moved away from its interpolation."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ctxext.adapters import adapter_for

    torch.manual_seed(2)
    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(gpt2_dir), "pi", 2)
    family = adapter_for(model)
    family.make_trainable(model, ["wpe"])
    config = LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["wpe"], **family.lora_settings(model))
    peft = get_peft_model(model, config)
    family.after_lora(peft)
    with torch.no_grad():
        trained = [p for n, p in peft.named_parameters() if p.requires_grad and "wpe" in n]
        assert trained
        for p in trained:
            p.add_(0.5 * torch.randn_like(p))  # "training" that moved the table well away from its interpolation
    folder = tmp_path_factory.mktemp("adapters") / "gpt2-pi2"
    peft.save_pretrained(folder)
    (folder / "ctxext_patch.json").write_text(json.dumps(ctxext.describe(model)))
    return folder


@pytest.mark.parametrize("methods", ["none", "none,yarn:2", "yarn:2,none"])
def test_methods_none_on_an_adapter_with_a_patch_is_refused(llama_dir, llama_adapter, tmp_path, capsys, methods):
    """--methods none evaluated the LoRA weights without the patch they were trained with, without a word."""
    line = assert_refused(_eval(llama_dir, tmp_path / "r.json", "--adapter", llama_adapter, "--methods", methods,
                                "--lengths", "64"), capsys, tmp_path, "'none' would evaluate the adapter's LoRA")
    assert "yarn x2" in line and str(llama_adapter) in line and "without --adapter" in line


@pytest.mark.parametrize("extra, flag", [(["--factor", "4"], "--factor"), (["--option", "beta_fast=16"], "--option")])
def test_factor_or_option_without_methods_on_an_adapter_is_refused(llama_dir, llama_adapter, tmp_path, capsys,
                                                                    extra, flag):
    """Without --methods the adapter's own patch is evaluated: a --factor or --option would have been ignored."""
    line = assert_refused(_eval(llama_dir, tmp_path / "r.json", "--adapter", llama_adapter, "--lengths", "64", *extra),
                          capsys, tmp_path, f"{flag} without --methods")
    assert "yarn x2" in line and "--methods yarn:2" in line


def test_adapter_rows_are_labelled_and_a_method_without_factor_takes_the_adapters(llama_dir, llama_adapter, tmp_path,
                                                                                   capsys):
    out, named = tmp_path / "default.json", tmp_path / "named.json"
    common = ["--adapter", llama_adapter, "--lengths", "64,128", "--max-windows", "2"]
    assert run(*_eval(llama_dir, out, *common)) == 0
    table = capsys.readouterr().out
    assert "yarn x2 +LoRA" in table and f"with the LoRA adapter {llama_adapter}" in table
    assert run(*_eval(llama_dir, named, *common, "--methods", "yarn,yarn:4")) == 0
    default, both = rows_of(out), rows_of(named)
    assert [(r["label"], r["factor"]) for r in default] == [("yarn x2 +LoRA", 2.0)] * 2
    assert [(r["label"], r["factor"]) for r in both] == [("yarn x2 +LoRA", 2.0)] * 2 + [("yarn x4 +LoRA", 4.0)] * 2
    assert [r["ppl"] for r in both[:2]] == [r["ppl"] for r in default]  # the adapter's patch, named or not
    doc = json.loads(named.read_text())
    assert set(doc["model"]["methods"]) == {"yarn x2 +LoRA", "yarn x4 +LoRA"}


def _as_loaded_ppl(base, adapter, length):
    """Perplexity of ``ctxext.from_pretrained(base, adapter=...)`` exactly as it loads, over the same windows."""
    from ctxext.evaluation.data import load_texts, tokenize_texts
    from ctxext.evaluation.models import load_tokenizer
    from ctxext.evaluation.perplexity import score_documents

    model = ctxext.from_pretrained(str(base), adapter=str(adapter)).eval()
    docs = tokenize_texts(load_tokenizer(str(base)), load_texts(str(CORPUS)).texts)
    return model, docs, score_documents(model, docs, length, protocol="chunks", stride=None, max_windows=2,
                                        batch_size=1, progress=False)["ppl"]


def test_an_adapter_with_a_trained_position_table_is_evaluated_as_trained(gpt2_dir, gpt2_adapter, tmp_path):
    """The runner took the loaded patch off and applied it again: GPT-2's trained table became the untrained
    interpolation, so eval reported another model than the fine-tune trained (and than ctxext.from_pretrained loads)."""
    from ctxext.evaluation.perplexity import score_documents

    out = tmp_path / "r.json"
    assert run(*_eval(gpt2_dir, out, "--adapter", gpt2_adapter, "--lengths", "128", "--protocol", "chunks",
                      "--max-windows", "2", "--batch-size", "1")) == 0
    (row,) = rows_of(out)
    model, docs, expected = _as_loaded_ppl(gpt2_dir, gpt2_adapter, 128)
    assert row["label"] == "pi x2 +LoRA" and row["ppl"] == pytest.approx(expected, rel=1e-9)
    ctxext.unpatch(model)
    ctxext.patch(model, "pi", 2)  # what eval did before: the table interpolated again, its training gone
    again = score_documents(model, docs, 128, protocol="chunks", stride=None, max_windows=2, batch_size=1,
                            progress=False)["ppl"]
    assert abs(again - expected) > 1e-3 * expected


@pytest.mark.parametrize("extra, expect", [
    (["--methods", "pi:4"], "would put untrained wpe in place of the trained"),
    (["--methods", "pi:2,pi:4"], "pi x4 would put untrained wpe"),
    (["--key-tokens"], "give --evaluator"),
])
def test_an_adapter_with_a_trained_table_refuses_what_would_drop_it(gpt2_dir, gpt2_adapter, tmp_path, capsys,
                                                                    extra, expect):
    assert_refused(_eval(gpt2_dir, tmp_path / "r.json", "--adapter", gpt2_adapter, "--lengths", "128", *extra),
                   capsys, tmp_path, expect)


def test_an_adapter_of_another_patch_is_evaluated_with_it_and_labelled(llama_dir, llama_adapter, tmp_path):
    """A rotary adapter has nothing trained under its patch but the LoRA weights: another patch is a fair question
    (yarn x4 on a yarn x2 fine-tune) and runs, labelled."""
    out = tmp_path / "r.json"
    assert run(*_eval(llama_dir, out, "--adapter", llama_adapter, "--methods", "pi", "--lengths", "64",
                      "--max-windows", "1")) == 0
    assert [(r["label"], r["factor"]) for r in rows_of(out)] == [("pi x2 +LoRA", 2.0)]


def test_a_damaged_adapter_patch_record_is_refused_before_loading(llama_dir, llama_adapter, tmp_path, capsys):
    import shutil

    broken = tmp_path / "adapter"
    shutil.copytree(llama_adapter, broken)
    (broken / "ctxext_patch.json").write_text("{not json")
    assert_refused(_eval(llama_dir, tmp_path / "r.json", "--adapter", broken, "--lengths", "64"), capsys, tmp_path,
                   "ctxext_patch.json cannot be read")


def test_a_row_label_without_lora_is_relabelled_on_resume(llama_dir, llama_adapter, tmp_path, capsys):
    """Rows written before adapter rows were labelled resume under the label the run gives them now."""
    out = tmp_path / "r.json"
    args = _eval(llama_dir, out, "--adapter", llama_adapter, "--lengths", "64,128", "--max-windows", "1")
    assert run(*args) == 0
    jsonl = out.with_suffix(".jsonl")
    lines = jsonl.read_text().splitlines()
    old = [json.loads(line) for line in lines[1:2]]
    old[0]["label"] = "yarn x2"
    jsonl.write_text("\n".join([lines[0], json.dumps(old[0])]) + "\n")
    assert run(*args, "--resume") == 0
    assert [r["label"] for r in json.loads(out.read_text())["results"]] == ["yarn x2 +LoRA"] * 2


def test_verdict_reads_none_with_lora_as_the_unpatched_row():
    from ctxext.evaluation.verdict import verdicts

    rows = [{"kind": "ppl", "model": "m", "label": label, "length": n, "ppl": p}
            for label, n, p in (("none +LoRA", 64, 10.0), ("none +LoRA", 256, 100.0), ("yarn x4 +LoRA", 64, 11.0),
                                ("yarn x4 +LoRA", 256, 12.0))]
    (sentence,) = verdicts(rows, [{"label": "m", "original_length": 64}])
    assert "unpatched fails" in sentence and "yarn x4 +LoRA holds" in sentence


# -- case 12: --data that is a link loop ------------------------------------------------------------------------------
def test_data_that_is_a_link_loop_is_one_line(llama_dir, tmp_path, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    argv = ["eval", "--no-progress", "--device", "cpu", "--model", llama_dir, "--data", tmp_path / "a", "--output",
            tmp_path / "out" / "r.json", "--lengths", "64"]
    assert_refused(argv, capsys, tmp_path, f"--data {tmp_path / 'a'} is a loop of symbolic links")
    # the reader search and eval share says it too (search's --data goes through it)
    from ctxext.evaluation.data import load_texts

    with pytest.raises(ValueError, match="is a loop of symbolic links"):
        load_texts(str(tmp_path / "a"))
    # a plot or output that is a loop: one line as well
    assert_refused(["eval", "--no-progress", "--device", "cpu", "--model", llama_dir, "--data", CORPUS, "--output",
                    tmp_path / "r.json", "--plot", tmp_path / "a", "--lengths", "64"], capsys, tmp_path, "--plot")


# -- case 13: --key-context past what the evaluator can read ---------------------------------------------------------
@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if any model's weights are loaded."""
    import ctxext.evaluation.plan as plan

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(plan, "load_model", refuse)


def test_key_context_past_a_position_table_is_refused_before_loading(gpt2_dir, llama_dir, tmp_path, capsys, no_load):
    line = assert_refused(_eval(gpt2_dir, tmp_path / "r.json", "--lengths", "64", "--key-tokens", "--key-context",
                                "128", "--key-short", "16"), capsys, tmp_path, "--key-context 128 is longer than")
    assert "position table has 64 rows" in line and "--key-context 64 or less" in line
    line = assert_refused(_eval(llama_dir, tmp_path / "r.json", "--lengths", "64", "--key-tokens", "--evaluator",
                                gpt2_dir, "--key-context", "128"), capsys, tmp_path, f"the evaluator {gpt2_dir}")
    assert "position table has 64 rows" in line


def test_key_context_past_a_rotary_evaluators_training_is_refused(llama_dir, tmp_path, capsys, no_load):
    line = assert_refused(_eval(llama_dir, tmp_path / "r.json", "--lengths", "64", "--key-tokens", "--key-context",
                                "100000"), capsys, tmp_path, "--key-context 100000 is longer than")
    assert "trained to 64 tokens" in line


def test_key_context_within_the_evaluator_still_runs(llama_dir, tmp_path):
    out = tmp_path / "r.json"
    assert run(*_eval(llama_dir, out, "--lengths", "64", "--methods", "none", "--max-windows", "1", "--key-tokens",
                      "--key-context", "64", "--key-short", "8")) == 0
    assert json.loads(out.read_text())["model"]["key_tokens"]["context"] == 64


# -- case 14: sample counts are bounded -------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--task-samples", "100000000000"), ("--passkey-trials", "100000000000"),
                                         ("--task-samples", "10001"), ("--passkey-trials", "1e11")])
def test_sample_counts_are_bounded(llama_dir, tmp_path, capsys, flag, value):
    extra = ["--tasks", "quick"] if flag == "--task-samples" else ["--passkey"]
    assert_refused(_eval(llama_dir, tmp_path / "r.json", "--lengths", "64", *extra, flag, value), capsys, tmp_path,
                   f"argument {flag}")


def test_sample_counts_are_bounded_where_the_request_is_built(llama_dir, tmp_path):
    """Arguments made in Python (not through the command line's parsers) are held to the same bounds."""
    import ctxext
    from ctxext.evaluation.request import MAX_PASSKEY_TRIALS, MAX_TASK_SAMPLES, parse_passkey_trials

    with pytest.raises(ValueError, match=f"task_samples={10 ** 11}: expected a whole number from 1 to 10,000"):
        ctxext.evaluate(str(llama_dir), task_samples=10 ** 11)
    with pytest.raises(ValueError, match="passkey_trials=2.5"):
        ctxext.evaluate(str(llama_dir), passkey_trials=2.5)
    assert parse_passkey_trials(str(MAX_PASSKEY_TRIALS)) == MAX_PASSKEY_TRIALS == MAX_TASK_SAMPLES
    assert not list(tmp_path.iterdir())


# -- case 21: a picture that cannot be written -------------------------------------------------------------------------
def test_a_plot_that_cannot_be_written_names_the_file_and_resume_draws_it(llama_dir, tmp_path, capsys, monkeypatch):
    import ctxext.evaluation.report as report
    import ctxext.evaluation.runner as runner

    out, picture = tmp_path / "r.json", tmp_path / "p.png"
    args = _eval(llama_dir, out, "--lengths", "32,64", "--methods", "none", "--max-windows", "1", "--plot", picture)
    real = report.plot

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "plot", full_disk)
    capsys.readouterr()
    assert run(*args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert f"--plot {picture}: not written (No space left on device)" in line
    assert f"the results are kept in {out}" in line and "free some space" in line and "--resume" in line
    assert not picture.exists() and not list(tmp_path.glob(".p.*"))  # no temporary file left behind
    rows = rows_of(out)
    assert len(rows) == 2 and json.loads(out.read_text())["results"] == rows

    monkeypatch.setattr(report, "plot", real)

    def recomputed(*a, **k):
        raise AssertionError("a finished row was computed again")

    monkeypatch.setattr(runner, "score_documents", recomputed)
    assert run(*args, "--resume") == 0
    assert picture.read_bytes()[:4] == b"\x89PNG"
    assert rows_of(out) == rows


def test_an_unwritten_picture_after_overwrite_says_resume_in_its_place(tmp_path):
    from ctxext.evaluation.report import unwritten_picture

    plan = SimpleNamespace(output=str(tmp_path / "r.json"), overwrite=True)
    text = unwritten_picture("heatmap", str(tmp_path / "h"), OSError(errno.EACCES, "Permission denied"), plan)
    assert text.startswith(f"--heatmap {tmp_path / 'h.png'}: not written (Permission denied)")
    assert "--resume in place of --overwrite" in text and "free some space" not in text


def test_results_that_cannot_be_written_name_the_file(tmp_path, monkeypatch):
    import ctxext.evaluation.results as results

    store = results.ResultStore(tmp_path / "r.json", {"x": 1})
    store.add({"kind": "ppl", "model": "m", "method": "none", "label": "none", "factor": None, "length": 8,
               "ppl": 2.0, "tokens": 4, "windows": 1, "spec": None})

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results, "write_atomic", full_disk)
    with pytest.raises(OSError, match=r"--output .*r\.json: not written \(No space left on device\); the finished "
                                      r"rows are kept in .*r\.jsonl"):
        store.write_final({"results": []})


# -- the rows-file lock's message -------------------------------------------------------------------------------------
def test_the_rows_file_lock_message_names_the_flag_once(llama_dir, tmp_path, capsys):
    pytest.importorskip("fcntl")
    from ctxext.core.outputs import OutputLock
    from ctxext.evaluation.results import jsonl_path

    out = tmp_path / "r.json"
    with OutputLock(jsonl_path(out)):  # another run on r.txt, whose rows are r.jsonl too
        line = assert_refused(_eval(llama_dir, out, "--lengths", "64"), capsys, tmp_path / "none",
                              f"--output {out}: its rows file {jsonl_path(out)} is being written by another")
    assert line.endswith("wait for it to finish or choose another --output")
