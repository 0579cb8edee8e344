"""`ctxext eval` / `ctxext demo` refuse bad input before any model loads, and never damage an earlier result.

Each case runs against an output folder that holds a finished run; the refusal must exit 2 with one error line,
no traceback, and leave every file in that folder byte for byte as it was.
"""

from __future__ import annotations

import shutil
import time

import pytest

from refusals import assert_refused
from test_eval_fixtures import CORPUS, save_tiny_gpt2, save_tiny_llama

from ctxext.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    no_tokenizer = save_tiny_llama(root / "no_tokenizer")  # as model.save_pretrained leaves it: no tokenizer files
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (no_tokenizer / name).unlink(missing_ok=True)
    return {"llama": save_tiny_llama(root / "llama"), "gpt2": save_tiny_gpt2(root / "gpt2"),
            "no_tokenizer": no_tokenizer}


@pytest.fixture(scope="module")
def finished(models, tmp_path_factory):
    """A folder holding a finished run: r.json and r.jsonl (4 rows)."""
    folder = tmp_path_factory.mktemp("finished")
    rc = main(["eval", "--no-progress", "--device", "cpu", "--model", str(models["llama"]), "--data", str(CORPUS),
               "--lengths", "32,64", "--methods", "none,ntk", "--factor", "2", "--max-windows", "1",
               "--output", str(folder / "r.json")])
    assert rc == 0
    return folder


@pytest.fixture
def out(finished, tmp_path):
    """A copy of the finished run's folder for one test."""
    folder = tmp_path / "out"
    shutil.copytree(finished, folder)
    return folder


# (name, argv after `eval`, expected text in the error line). MODEL / GPT2 / OUT / DATA are filled in.
EVAL_CASES = [
    ("factor 0 on a finished run", ["--methods", "ntk", "--factor", "0"], "between 1 and 1024"),
    ("factor 0 without --methods", ["--factor", "0"], "between 1 and 1024"),
    ("factor -2", ["--factor=-2"], "between 1 and 1024"),
    ("factor abc", ["--factor", "abc"], "factor must be a number"),
    ("factor 1e9", ["--methods", "pi", "--factor", "1e9"], "between 1 and 1024"),
    ("factor nan", ["--factor", "nan"], "between 1 and 1024"),
    ("method factor abc", ["--methods", "yarn:abc"], "factor must be a number"),
    ("method factor 2000", ["--methods", "yarn:2000"], "between 1 and 1024"),
    ("derived factor past the cap", ["--methods", "pi", "--lengths", "100000"], "between 1 and 1024"),
    ("none with a factor", ["--methods", "none:2"], "takes no factor"),
    ("unknown method", ["--methods", "none,bogus"], "unknown method 'bogus'"),
    ("empty methods", ["--methods", ","], "no methods"),
    ("method that does not fit the family", ["--model", "GPT2", "--methods", "none,yarn,pi", "--factor", "2"],
     "does not fit"),
    ("option no method takes", ["--option", "beta_fast=3", "--methods", "pi"], "apply to none of the methods"),
    ("option without =", ["--option", "beta_fast"], "KEY=VALUE"),
    ("option without a name", ["--methods", "yarn", "--factor", "2", "--option", "=3"], "no option name before '='"),
    ("method option without a name", ["--methods", "yarn", "--factor", "2", "--option", "yarn.=3"],
     "no option name before '='"),
    ("option of an unknown method", ["--option", "bogus.x=1"], "unknown method"),
    ("unknown option of a method", ["--methods", "yarn", "--factor", "2", "--option", "yarn.bogus=1"],
     "unknown option"),
    ("ill-typed option", ["--methods", "yarn", "--factor", "2", "--option", "yarn.beta_fast=fast"],
     "must be a number"),
    ("passkey depth 2", ["--passkey", "--passkey-depths", "2"], "between 0 and 1"),
    ("passkey depth abc", ["--passkey", "--passkey-depths", "abc"], "between 0 and 1"),
    ("passkey trials 0", ["--passkey", "--passkey-trials", "0"], "must be >= 1"),
    ("unknown reference model", ["--model", "reference:nosuch"], "--model reference:nosuch: unknown reference model"),
    ("unknown reference evaluator", ["--key-tokens", "--evaluator", "reference:x"], "--evaluator reference:x: unknown"),
    ("length 0", ["--lengths", "0"], "length must be a whole number of tokens >= 2"),
    ("length -5", ["--lengths=-5"], "length must be a whole number of tokens >= 2"),
    ("length abc", ["--lengths", "abc"], "not a length: 'abc'"),
    ("length 1.5k", ["--lengths", "1.3"], "whole number"),
    ("stride too long", ["--lengths", "64", "--stride", "64"], "stride must be between 1 and length - 1"),
    ("stride 0", ["--stride", "0"], "must be >= 1"),
    ("stride too long for the default lengths", ["--stride", "100000"], "--stride: stride must be between 1"),
    ("method option named factor", ["--methods", "pi", "--option", "pi.factor=3"], "pi.factor: not an option"),
    ("method option named method", ["--methods", "yarn", "--option", "yarn.method=pi"], "yarn.method: not an option"),
    ("max-windows 0", ["--max-windows", "0"], "must be >= 1"),
    ("batch-size abc", ["--batch-size", "abc"], "whole number"),
    ("protocol", ["--protocol", "rolling"], "invalid choice"),
    ("device", ["--device", "tpu"], "--device must be one of"),
    ("dtype", ["--dtype", "int8"], "--dtype must be one of"),
    ("output is a folder", ["--output", "OUT"], "is a directory"),
    ("output under a file", ["--output", "DATA/r.json"], "is a file, not a folder"),
    ("output holds a finished run", ["--output", "OUT/r.json"], "holds a finished run (4 rows)"),
    ("resume and overwrite", ["--output", "OUT/r.json", "--resume", "--overwrite"], "give one of them"),
    ("resume with other settings", ["--output", "OUT/r.json", "--resume", "--protocol", "chunks"],
     # the plan (methods, factor, lengths) is part of what must match since issue 28: this run names none of them
     "other settings (max_windows, plan.factor, plan.lengths, plan.methods, protocol)"),
    ("output is the data", ["--output", "DATA"], "would overwrite the data"),
    ("plot is a folder", ["--plot", "OUT"], "is a directory"),
    ("data missing", ["--data", "missing.txt"], "data file not found: missing.txt"),
    ("model folder missing", ["--model", "./no-such-model"], "folder not found: ./no-such-model"),
    ("model is a file", ["--model", "DATA"], "is a file"),
    ("model folder without config", ["--model", "OUT"], "has no config.json"),
    ("gguf file missing", ["--gguf-file", "/abs/model.gguf"], "GGUF file '/abs/model.gguf' not found"),
    ("adapter missing", ["--adapter", "OUT/adapter"], "not a LoRA adapter folder"),
    ("adapter without weights", ["--adapter", "CONFIG_ONLY_ADAPTER"], "no adapter weights"),
    ("model folder without a tokenizer", ["--model", "NO_TOKENIZER"], "holds no tokenizer"),
]


@pytest.fixture(scope="module")
def config_only_adapter(tmp_path_factory):
    """A LoRA folder whose weights are missing (peft would look for them on the hub under the folder's name)."""
    folder = tmp_path_factory.mktemp("adapter")
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
    return folder


def _fill(argv, models, out, adapter=None):
    values = {"MODEL": models["llama"], "GPT2": models["gpt2"], "NO_TOKENIZER": models["no_tokenizer"], "OUT": out,
              "DATA": CORPUS,
              "CONFIG_ONLY_ADAPTER": adapter}
    filled = []
    for a in argv:
        for key, value in values.items():
            if a == key or a.startswith(key + "/"):
                a = str(value) + a[len(key):]
        filled.append(a)
    return filled


@pytest.mark.parametrize("name, argv, expect", EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_eval_refuses_before_work(name, argv, expect, models, out, capsys, config_only_adapter):
    argv = _fill(argv, models, out, config_only_adapter)
    if "--model" not in argv:
        argv = ["--model", str(models["llama"])] + argv
    if "--data" not in argv:
        argv += ["--data", str(CORPUS)]
    if "--output" not in argv:
        argv += ["--output", str(out / "new.json")]
    started = time.perf_counter()
    assert_refused(["eval", "--no-progress", "--device", "cpu", *argv], capsys, out, expect)
    assert time.perf_counter() - started < 20  # refused before any model weights load


DEMO_CASES = [
    ("demo factor 0", ["--factor", "0"], "between 1 and 1024"),
    ("demo unknown method", ["--methods", "bogus"], "unknown method"),
    ("demo lengths abc", ["--lengths", "abc"], "not a length"),
    ("demo method that fits no reference model", ["--methods", "none,pi", "--option", "pi.bogus=1"],
     "unknown option"),
    ("demo output holds a finished run", ["--output", "OUT/r.json"], "holds a finished run"),
    ("demo output is a folder", ["--output", "OUT"], "is a directory"),
    ("demo --model-only flag", ["--gguf-file", "x.gguf"], "unrecognized arguments"),
    ("eval without --model takes no --adapter", ["EVAL", "--adapter", "OUT"], "need --model"),
]


@pytest.mark.parametrize("name, argv, expect", DEMO_CASES, ids=[c[0] for c in DEMO_CASES])
def test_demo_refuses_before_work(name, argv, expect, models, out, capsys):
    argv = _fill(argv, models, out)
    command = "demo"
    if argv[0] == "EVAL":
        command, argv = "eval", argv[1:]
    if "--output" not in argv:
        argv += ["--output", str(out / "new.json")]
    assert_refused([command, "--no-progress", "--device", "cpu", *argv], capsys, out, expect)


def test_hub_id_offline_fails_at_once(models, out, capsys, monkeypatch):
    """No network: a hub id fails in well under a second, with a hint about local folders and GGUF files."""
    import ctxext.data.sources as sources

    from huggingface_hub import constants

    monkeypatch.setattr(sources, "hub_reachable", lambda: False)
    # a network that is down, not the offline switch: unset it, also where huggingface_hub read it at import (a user
    # or cluster that exports HF_HUB_OFFLINE=1 runs this test too)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    started = time.perf_counter()
    line = assert_refused(["eval", "--model", "meta-llama/Llama-2-7b-hf", "--data", CORPUS, "--output",
                           out / "new.json"], capsys, out, "hub is unreachable")
    assert time.perf_counter() - started < 2 and "local folder" in line and "GGUF" in line
    started = time.perf_counter()
    assert_refused(["eval", "--model", str(models["llama"]), "--data", "org/some-dataset", "--output",
                    out / "new.json"], capsys, out, "hub is unreachable and the dataset is not in the local cache")
    assert time.perf_counter() - started < 15  # datasets' offline mode: no retries
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_refused(["eval", "--model", "org/model", "--data", CORPUS, "--output", out / "new.json"], capsys, out,
                   "HF_HUB_OFFLINE is set")


@pytest.mark.parametrize("name", ["reference:llama", "ctxext.reference:gpt2"])
def test_eval_reads_a_shipped_reference_model_by_name(name, tmp_path, capsys):
    """As export, search and recipes do: ``reference:NAME`` is the shipped checkpoint, not a hub id."""
    rc = main(["eval", "--no-progress", "--device", "cpu", "--model", name, "--data", str(CORPUS), "--lengths", "32",
               "--methods", "none", "--max-windows", "1", "--output", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "r.json").is_file()


def test_resume_of_a_finished_run_whose_rows_file_is_gone_is_refused(models, out, capsys):
    """--resume continues from the rows file (it checks model, data and plan there): without it, a resume of another
    run would replace the finished results."""
    (out / "r.jsonl").unlink()
    assert_refused(["eval", "--no-progress", "--device", "cpu", "--model", str(models["gpt2"]), "--data", str(CORPUS),
                    "--lengths", "32", "--methods", "none", "--output", str(out / "r.json"), "--resume"], capsys, out,
                   "its rows file")
