"""`ctxext eval --key-tokens`: key-token perplexity beside perplexity, its evaluator, and its refusals."""

from __future__ import annotations

import json

import pytest

from ctxext.cli import main

from test_eval_fixtures import CORPUS, save_tiny_gpt2, save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


def run(*argv) -> int:
    return main(["eval", "--no-progress", "--device", "cpu", *map(str, argv)])


def test_key_token_perplexity_rows_and_table(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = run("--model", llama_dir, "--data", CORPUS, "--lengths", "64,128", "--methods", "none,yarn", "--factor", "2",
             "--max-windows", "2", "--key-tokens", "--key-short", "8", "--output", out)
    assert rc == 0
    doc = json.loads(out.read_text())
    found = doc["model"]["key_tokens"]
    assert found["evaluator"] == "the model itself, unpatched" and found["context"] == 64 and found["short"] == 8
    assert found["alpha"] == 2.0 and found["beta"] == -2.0 and found["positions"] > 0
    rows = doc["results"]
    assert all("key_tokens" in r and r["key_tokens"] <= r["tokens"] for r in rows)
    assert all((r["ppl_key"] is None) == (r["key_tokens"] == 0) for r in rows)
    assert "key tokens:" in capsys.readouterr().err


def test_marked_tokens_reach_every_row_and_the_table(llama_dir, tmp_path, capsys, monkeypatch):
    """A random model marks no key token; mark every third position to follow the masks through the run (the
    selection itself is tested on a constructed case in test_keytokens.py)."""
    import torch

    from ctxext.evaluation import runner

    def every_third(evaluator, documents, needed, **kwargs):
        masks = []
        for doc, ranges in zip(documents, needed):
            mask = torch.zeros(doc.numel(), dtype=torch.bool)
            for lo, hi in ranges:
                mask[lo:hi] = (torch.arange(lo, hi) % 3) == 0
            masks.append(mask)
        return masks, {"key_tokens": int(sum(m.sum() for m in masks)), "positions": 1, "context": 64, "short": 8}

    monkeypatch.setattr(runner, "key_masks", every_third)
    out = tmp_path / "r.json"
    rc = run("--model", llama_dir, "--data", CORPUS, "--lengths", "64,128", "--methods", "none", "--protocol",
             "chunks", "--max-windows", "2", "--key-tokens", "--output", out)
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    for r in rows:
        # chunks of L score targets 1..L-1 of each window; a third of them are marked
        assert r["key_tokens"] == pytest.approx(r["tokens"] / 3, abs=2 * r["windows"])
        assert r["ppl_key"] > 1 and r["ppl_key"] != r["ppl"]
    assert "key-token perplexity (LongPPL" in capsys.readouterr().out


def test_an_evaluator_with_the_same_tokenizer_is_used(llama_dir, tmp_path, capsys):
    other = save_tiny_gpt2(tmp_path / "gpt2", max_positions=128)  # the same test tokenizer
    out = tmp_path / "r.json"
    rc = run("--model", llama_dir, "--data", CORPUS, "--lengths", "64", "--methods", "none", "--max-windows", "2",
             "--key-tokens", "--evaluator", other, "--output", out)
    assert rc == 0
    found = json.loads(out.read_text())["model"]["key_tokens"]
    assert found["evaluator"] == str(other) and found["context"] == 128 and found["short"] == 16


def test_an_evaluator_with_another_tokenizer_is_refused(llama_dir, tmp_path, capsys):
    from ctxext import reference

    out = tmp_path / "r.json"
    rc = run("--model", llama_dir, "--data", CORPUS, "--lengths", "64", "--methods", "none", "--max-windows", "1",
             "--key-tokens", "--evaluator", reference.reference_path("llama"), "--output", out)
    assert rc == 2
    assert "splits the text differently" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("argv, said", [
    (["--evaluator", "x"], "need --key-tokens"),
    (["--key-short", "8"], "need --key-tokens"),
    (["--key-tokens", "--key-context", "64", "--key-short", "64"], "must be shorter than --key-context 64"),
    (["--key-tokens", "--tasks", "vt"], "add ppl to --tasks"),
    (["--key-tokens", "--evaluator", "./no/such/dir"], "--evaluator"),
])
def test_bad_key_token_options_refused_before_anything_loads(llama_dir, tmp_path, capsys, argv, said):
    out = tmp_path / "r.json"
    assert run("--model", llama_dir, "--output", out, *argv) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()
