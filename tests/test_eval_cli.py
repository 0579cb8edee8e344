"""`ctxext eval` end to end on tiny saved models: rows, JSON, plot, resume, data formats, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ctxext.cli import main

from test_eval_fixtures import CORPUS, save_tiny_gpt2, save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("models") / "gpt2")


def run(*argv) -> int:
    return main(["eval", "--no-progress", "--device", "cpu", *map(str, argv)])


def rows_of(path):
    return [json.loads(line) for line in path.with_suffix(".jsonl").read_text().splitlines()][1:]


def test_eval_writes_rows_json_table_and_plot(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = run("--model", llama_dir, "--data", CORPUS, "--lengths", "32,64,128", "--methods", "none,pi,yarn:4",
             "--factor", "2", "--max-windows", "3", "--output", out, "--plot", tmp_path / "p.png")
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["model"]["architecture"] == "LlamaForCausalLM" and doc["model"]["original_length"] == 64
    specs = doc["model"]["methods"]
    assert specs["none"] is None
    assert specs["pi x2"]["method"] == "pi" and specs["pi x2"]["patched_length"] == 128
    assert specs["yarn x4"]["factor"] == 4.0
    assert doc["data"]["format"] == "text" and doc["protocol"]["name"] == "sliding"
    keys = [(r["method"], r["factor"], r["length"]) for r in doc["results"]]
    assert keys == [(m, f, L) for m, f in (("none", None), ("pi", 2.0), ("yarn", 4.0)) for L in (32, 64, 128)]
    for r in doc["results"]:
        assert r["ppl"] > 1 and r["windows"] == 3 and r["tokens"] == 3 * r["length"] // 2
        assert r["ppl_last_quarter"] > 1 and r["stride"] == r["length"] // 2
    assert rows_of(out) == doc["results"]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "perplexity (sliding" in table and "yarn x4" in table and "128" in table


def test_chunks_protocol_and_default_methods(gpt2_dir, tmp_path):
    out = tmp_path / "r.json"
    rc = run("--model", gpt2_dir, "--data", CORPUS, "--lengths", "32,64", "--protocol", "chunks",
             "--max-windows", "2", "--output", out)
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    import ctxext
    from transformers import AutoModelForCausalLM

    fits = list(ctxext.available_methods(AutoModelForCausalLM.from_pretrained(gpt2_dir)))
    assert [r["method"] for r in rows[::2]] == ["none"] + fits
    for r in rows:
        assert r["protocol"] == "chunks" and r["tokens"] == 2 * (r["length"] - 1)


def test_resume_skips_finished_rows(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--model", llama_dir, "--data", CORPUS, "--lengths", "32,64", "--methods", "none,ntk",
            "--factor", "2", "--max-windows", "2", "--output", out]
    assert run(*args) == 0
    first = rows_of(out)
    lines = out.with_suffix(".jsonl").read_text().splitlines()
    # interrupted after two rows, the third cut mid-line
    out.with_suffix(".jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])
    capsys.readouterr()
    assert run(*args, "--resume") == 0
    assert "resuming: 2 finished row(s)" in capsys.readouterr().err
    again = json.loads(out.read_text())["results"]
    assert again[:2] == first[:2]  # kept as written (same timings), not recomputed
    assert [r["ppl"] for r in again] == pytest.approx([r["ppl"] for r in first], rel=1e-6)
    # other settings: refuse to mix
    assert run(*args, "--resume", "--protocol", "chunks") == 2
    assert "other settings (protocol)" in capsys.readouterr().err


def test_data_formats_and_short_documents(llama_dir, tmp_path):
    text = CORPUS.read_text()
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(text[:3000])
    (folder / "b.txt").write_text("Too short.")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": t}) for t in (text[:3000], "Too short.")) + "\n")
    as_json = tmp_path / "docs.json"
    as_json.write_text(json.dumps([{"text": t} for t in (text[:3000], "Too short.")]))
    from datasets import Dataset

    Dataset.from_dict({"text": [text[:3000], "Too short."]}).save_to_disk(str(tmp_path / "ds"))
    results = []
    for i, (data, extra) in enumerate(((folder, []), (jsonl, ["--text-field", "body"]), (as_json, []), (tmp_path / "ds", []))):
        out = tmp_path / f"out{i}.json"
        assert run("--model", llama_dir, "--data", data, *extra, "--lengths", "64", "--methods", "none",
                   "--max-windows", "2", "--output", out) == 0
        doc = json.loads(out.read_text())
        (row,) = doc["results"]
        assert row["documents_skipped"] == 1 and row["documents_scored"] == 1
        assert doc["data"]["documents"] == 2
        results.append(row["ppl"])
    assert results == pytest.approx([results[0]] * 4)


def test_unfit_method_is_refused_before_loading(gpt2_dir, tmp_path, capsys):
    """A requested method that does not fit the model's family is refused before any work (the demo, with
    several models, runs it where it fits instead)."""
    out = tmp_path / "r.json"
    rc = run("--model", gpt2_dir, "--data", CORPUS, "--lengths", "32", "--methods", "none,yarn,pi",
             "--factor", "2", "--max-windows", "1", "--output", out)
    assert rc == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if "error" in l]
    assert len(lines) == 1 and "yarn" in lines[0] and "does not fit" in lines[0]
    assert not out.exists() and not out.with_suffix(".jsonl").exists()


def test_length_longer_than_every_document(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    short = tmp_path / "short.txt"
    short.write_text(CORPUS.read_text()[:400])
    rc = run("--model", llama_dir, "--data", short, "--lengths", "32,100000", "--methods", "none",
             "--max-windows", "1", "--output", out)
    assert rc == 2
    err = capsys.readouterr().err
    assert "length 100000 is longer than every document" in err
    assert [r["length"] for r in json.loads(out.read_text())["results"]] == [32]


def test_gpt2_past_its_position_table_is_not_applicable(gpt2_dir, tmp_path):
    out = tmp_path / "r.json"
    assert run("--model", gpt2_dir, "--data", CORPUS, "--lengths", "64,128", "--methods", "none",
               "--max-windows", "1", "--output", out) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows[0]["ppl"] > 1 and rows[1]["ppl"] is None and "position table" in rows[1]["not_applicable"]


def test_gpt2_past_its_patched_position_table_is_not_applicable(gpt2_dir, tmp_path):
    """A patched table (pi / extrapolate x2: 128 rows) does not reach 256: n/a there, not positions read from its last
    row; nope keeps no table and runs at any length."""
    out = tmp_path / "r.json"
    assert run("--model", gpt2_dir, "--data", CORPUS, "--lengths", "128,256", "--methods", "extrapolate,pi,nope",
               "--factor", "2", "--max-windows", "1", "--output", out) == 0
    ppl = {(r["method"], r["length"]): r for r in json.loads(out.read_text())["results"] if r["kind"] == "ppl"}
    for method in ("extrapolate", "pi"):
        assert ppl[method, 128]["ppl"] > 1
        assert ppl[method, 256]["ppl"] is None and "128" in ppl[method, 256]["not_applicable"]
    assert ppl["nope", 256]["ppl"] > 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "missing.txt"], "data file not found: missing.txt"),
        (["--model", "./no-such-model"], "folder not found: ./no-such-model"),
        (["--methods", "none,bogus"], "unknown method 'bogus'"),
        (["--lengths", "64", "--stride", "64"], "stride must be between 1 and length - 1"),
        (["--option", "beta_fast=3", "--methods", "pi"], "apply to none of the methods"),
    ],
)
def test_bad_input_one_line_no_traceback(llama_dir, tmp_path, argv, message):
    argv = list(argv)
    if "--model" not in argv:
        argv = ["--model", str(llama_dir)] + argv
    if "--data" not in argv:
        argv += ["--data", str(CORPUS)]
    proc = subprocess.run(
        [sys.executable, "-m", "ctxext", "eval", "--no-progress", "--output", str(tmp_path / "r.json"), *argv],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("ctxext eval: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_adapter_directory_brings_its_patch(llama_dir, tmp_path):
    """--adapter DIR: a LoRA adapter saved with its ctxext patch is evaluated with that patch by default."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import ctxext

    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(llama_dir), "yarn", 2)
    adapter = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
    (adapter / "ctxext_patch.json").write_text(json.dumps(ctxext.describe(model)))
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, "--adapter", adapter, "--data", CORPUS, "--lengths", "64,128",
               "--max-windows", "1", "--output", out) == 0
    doc = json.loads(out.read_text())
    assert doc["model"]["loaded_patch"]["method"] == "yarn" and doc["model"]["adapter"] == str(adapter)
    assert [(r["method"], r["factor"]) for r in doc["results"]] == [("yarn", 2.0)] * 2


def test_ctrl_c_keeps_finished_rows(llama_dir, tmp_path, monkeypatch, capsys):
    import ctxext.evaluation.runner as runner

    real, calls = runner.score_documents, []

    def interrupted_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "score_documents", interrupted_on_third)
    out = tmp_path / "r.json"
    args = ["--model", llama_dir, "--data", CORPUS, "--lengths", "32,64", "--methods", "none,pi", "--factor", "2",
            "--max-windows", "1", "--output", out]
    assert run(*args) == 130
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and len(doc["results"]) == 2 and len(rows_of(out)) == 2
    monkeypatch.setattr(runner, "score_documents", real)
    capsys.readouterr()
    assert run(*args, "--resume") == 0
    assert "resuming: 2 finished row(s)" in capsys.readouterr().err
    assert len(json.loads(out.read_text())["results"]) == 4


def test_output_never_overwrites_the_data(llama_dir, tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": CORPUS.read_text()}) + "\n")
    assert run("--model", llama_dir, "--data", data, "--lengths", "32", "--output", tmp_path / "docs.json") == 2
    assert "would overwrite the data" in capsys.readouterr().err
    assert json.loads(data.read_text())["text"]


def test_folder_saved_patched_is_evaluated_with_its_patch(llama_dir, tmp_path):
    """A checkpoint saved from a patched model (whose config.json plain transformers refuses) passes the checks
    before loading and is evaluated with its patch by default."""
    import shutil

    from transformers import AutoModelForCausalLM

    import ctxext

    saved = tmp_path / "patched"
    ctxext.patch(AutoModelForCausalLM.from_pretrained(llama_dir), "yarn", 2).save_pretrained(saved)
    for f in llama_dir.iterdir():
        if f.is_file() and not (saved / f.name).exists():
            shutil.copy(f, saved / f.name)  # the tokenizer
    out = tmp_path / "r.json"
    assert run("--model", saved, "--data", CORPUS, "--lengths", "64,128", "--max-windows", "1", "--output", out) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["method"], r["factor"], r["length"]) for r in rows] == [("yarn", 2.0, 64), ("yarn", 2.0, 128)]
    assert run("--model", saved, "--data", CORPUS, "--lengths", "64", "--methods", "none,ntk", "--factor", "2",
               "--max-windows", "1", "--output", tmp_path / "r2.json") == 0
