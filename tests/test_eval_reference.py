"""The default run on the shipped reference checkpoints."""

from __future__ import annotations

import json

import pytest

from ctxext.cli import main


def test_demo_smoke_on_the_references(tmp_path):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--methods", "none,pi", "--lengths", "256,512", "--max-windows", "1", "--no-progress",
               "--output", str(out), "--plot", str(tmp_path / "demo.png")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [m["label"] for m in doc["models"]] == ["llama", "gpt2", "bloom"]
    assert [m["original_length"] for m in doc["models"]] == [128, 256, 256]  # each at its own training length
    cells = {(r["model"], r["method"], r["length"]): r for r in doc["results"] if r["kind"] == "ppl"}
    assert len(cells) == 12
    # passkey by default on the reference trained to retrieve, only there
    assert {(r["model"], r["method"], r["length"]) for r in doc["results"] if r["kind"] == "passkey"} == {
        ("llama", m, n) for m in ("none", "pi") for n in (256, 512)}
    assert cells[("gpt2", "none", 512)]["not_applicable"]  # GPT-2's table has 256 rows
    for (model, method, length), row in cells.items():
        if not row.get("not_applicable"):
            assert 1 < row["ppl"] < 4096, (model, method, length)  # a language model, not uniform over the vocab


@pytest.mark.slow
def test_default_run_covers_every_method_of_every_family(tmp_path):
    import ctxext
    from ctxext import reference

    out = tmp_path / "demo.json"
    assert main(["demo", "--no-progress", "--output", str(out), "--plot", str(tmp_path / "demo.png")]) == 0
    doc = json.loads(out.read_text())
    from ctxext.evaluation.requests import check_request, parse_methods

    def fits(model, method) -> bool:  # at the demo's factor 8 (STRING's defaults reach about 2x on the 128 LLaMA)
        try:
            check_request(model, parse_methods(method, factor=8.0)[0])
        except ctxext.PatchError:
            return False
        return True

    for name in reference.REFERENCE_NAMES:
        model = reference.reference_model(name)
        expected = {"none"} | {m for m in ctxext.available_methods(model) if fits(model, m)}
        assert name != "llama" or {"self-extend", "dca", "yarn"} <= expected
        rows = [r for r in doc["results"] if r["model"] == name]
        assert {r["method"] for r in rows} == expected
        # perplexity everywhere; passkey on the reference trained to retrieve
        assert len(rows) == 4 * len(expected) * (2 if name in reference.RETRIEVAL_NAMES else 1)
