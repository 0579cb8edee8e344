"""`ctxext demo` / `ctxext eval` without --model: every reference model, every method that fits it."""

from __future__ import annotations

import json
import sys
import types

import pytest

import ctxext
import ctxext.evaluation.plan  # noqa: F401  imported with the real ctxext.reference, before a test replaces it
from ctxext.cli import main

from test_eval_fixtures import CORPUS, build_tokenizer

TRAIN = 32


@pytest.fixture
def fake_reference(tmp_path, monkeypatch):
    """A stand-in for ctxext.reference: tiny random models 'trained' at 32 tokens."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    import torch

    tok_dir = build_tokenizer(tmp_path / "tok")

    def reference_model(name):
        torch.manual_seed(0)
        if name == "llama":
            return LlamaForCausalLM(LlamaConfig(
                vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=TRAIN, attn_implementation="sdpa")).eval()
        return GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=4, n_positions=TRAIN)).eval()

    def reference_path(name):
        folder = tmp_path / "reference" / name
        if not folder.exists():
            reference_model(name).save_pretrained(folder)
        return folder

    import ctxext.reference as real_reference

    fake = types.ModuleType("ctxext.reference")
    fake.REFERENCE_NAMES = ("llama", "gpt2")
    fake.RETRIEVAL_NAMES = ()  # no passkey by default: its prompt does not fit these models' 32 tokens
    fake.train_length = lambda name: TRAIN
    fake.reference_model = reference_model
    fake.reference_path = reference_path
    fake.reference_name = real_reference.reference_name  # how commands read reference:NAME (no files behind it)
    fake.reference_tokenizer = lambda name: AutoTokenizer.from_pretrained(tok_dir)
    fake.reference_text = lambda: CORPUS.read_text()
    monkeypatch.setitem(sys.modules, "ctxext.reference", fake)
    monkeypatch.setattr(ctxext, "reference", fake, raising=False)
    return fake


def _fits(model, method, factor) -> bool:
    """Whether the default set keeps ``method`` at ``factor`` (STRING, e.g., reaches about 2x only)."""
    from ctxext.evaluation.requests import parse_methods, check_request

    try:
        check_request(model, parse_methods(method, factor=factor)[0])
    except ctxext.PatchError:
        return False
    return True


@pytest.mark.parametrize("command", [["demo"], ["eval"]])
def test_default_run_covers_every_fitting_method(fake_reference, tmp_path, capsys, command):
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    rc = main(command + ["--no-progress", "--device", "cpu", "--max-windows", "1", "--output", str(out), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [m["label"] for m in doc["models"]] == ["llama", "gpt2"]
    assert doc["data"]["format"] == "bundled"
    for name in ("llama", "gpt2"):
        model = fake_reference.reference_model(name)
        expected = ["none"] + [m for m in ctxext.available_methods(model) if _fits(model, m, 8.0)]
        rows = [r for r in doc["results"] if r["model"] == name]
        assert sorted({r["method"] for r in rows}) == sorted(expected) and (name != "llama" or "self-extend" in expected)
        for method in expected:
            assert sorted(r["length"] for r in rows if r["method"] == method) == [TRAIN, 2 * TRAIN, 4 * TRAIN, 8 * TRAIN]
        patched = [r for r in rows if r["method"] not in ("none", "alibi", "nope") and r["factor"] is not None]
        assert all(r["factor"] == 8.0 for r in patched)
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "llama (trained to 32 tokens)" in text and "gpt2 (trained to 32 tokens)" in text


def test_demo_factor_follows_the_lengths_it_runs(fake_reference, tmp_path):
    """As `demo --help` and `ctxext eval` say: without --factor, the longest length run / the trained length (8 at
    the default 1x..8x; 2 for --lengths up to 2x)."""
    out = tmp_path / "demo.json"
    rc = main(["demo", "--no-progress", "--device", "cpu", "--max-windows", "1", "--methods", "none,pi", "--tasks",
               "ppl", "--lengths", f"{TRAIN},{2 * TRAIN}", "--output", str(out)])
    assert rc == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["method"] == "pi"]
    assert rows and {r["factor"] for r in rows} == {2.0}


@pytest.mark.parametrize("flags, passkey_models", [
    ([], ["llama"]),  # the default: passkey where the reference was trained to retrieve
    (["--passkey"], ["llama", "gpt2"]),  # asked for: on every model
    (["--tasks", "ppl"], []),
])
def test_demo_passkey_runs_on_the_reference_trained_to_retrieve(fake_reference, tmp_path, flags, passkey_models):
    fake_reference.RETRIEVAL_NAMES = ("llama",)
    out = tmp_path / "demo.json"
    rc = main(["demo", "--no-progress", "--device", "cpu", "--max-windows", "1", "--methods", "none", "--lengths",
               "512", "--passkey-trials", "1", "--passkey-depths", "0.5", "--output", str(out)] + flags)
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert sorted({r["model"] for r in rows if r["kind"] == "passkey"}) == sorted(passkey_models)
    assert {r["model"] for r in rows if r["kind"] == "ppl"} == {"llama", "gpt2"}
    # passkey by depth is drawn beside the plot, as the needle tasks are
    assert (tmp_path / "demo_needles.png").exists() == bool(passkey_models)


def test_the_demos_own_passkey_skips_lengths_its_prompt_does_not_fit(fake_reference, tmp_path, capsys):
    """Asked for, a passkey that does not fit a length is an error; the demo's default notes it and goes on."""
    fake_reference.RETRIEVAL_NAMES = ("llama",)
    argv = ["demo", "--no-progress", "--device", "cpu", "--max-windows", "1", "--methods", "none", "--lengths",
            "64,512", "--passkey-trials", "1", "--passkey-depths", "0.5"]
    assert main(argv + ["--output", str(tmp_path / "a.json")]) == 0
    rows = json.loads((tmp_path / "a.json").read_text())["results"]
    assert [(r["model"], r["length"]) for r in rows if r["kind"] == "passkey"] == [("llama", 512)]
    assert "passkey length 64 is too short" in capsys.readouterr().err
    assert main(argv + ["--passkey", "--output", str(tmp_path / "b.json")]) == 2


def test_a_resume_tells_the_demos_passkey_from_passkey_on_every_model(fake_reference, tmp_path, capsys):
    fake_reference.RETRIEVAL_NAMES = ("llama",)
    argv = ["demo", "--no-progress", "--device", "cpu", "--max-windows", "1", "--methods", "none", "--lengths",
            "512", "--passkey-trials", "1", "--passkey-depths", "0.5", "--output", str(tmp_path / "d.json")]
    assert main(argv + ["--passkey"]) == 0
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 2  # passkey on llama only is another run than passkey on both
    assert "written by a run with other settings (passkey)" in capsys.readouterr().err


def test_demo_without_reference_models_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ctxext.reference", None)  # import fails
    monkeypatch.delattr(ctxext, "reference", raising=False)
    assert main(["demo", "--no-progress", "--output", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reference models are not part of this installation" in err[0]
