"""``ctxext search longrope``: LongRoPE's factor search, its starting points, its constraint, its resumable log, and
the native ``longrope`` checkpoint it writes (plain transformers must run exactly the factors that were scored)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_llama

import ctxext
from ctxext import PatchError
from ctxext.cli import main
from ctxext.methods.rope import RopeInputs
from ctxext.search import SearchSettings, longrope_search, rescaled, start_points
from ctxext.search.evolution import ScoreLog, search
from ctxext.search.longrope_factors import attention_factor, monotone, plain_rope_inputs

L0 = 64  # tiny_llama's trained length


def _tokens(n=3000, seed=0):
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed))


def test_starting_points_are_the_training_free_methods_per_dimension():
    model = tiny_llama()
    inputs = plain_rope_inputs(model, L0)
    starts = start_points(inputs, 4.0)
    assert starts["pi"] == [4.0] * 8
    # YaRN keeps the highest frequencies and interpolates the lowest by the full factor
    yarn = starts["yarn"]
    assert yarn[0] == pytest.approx(1.0) and yarn[-1] == pytest.approx(4.0)
    # static NTK: a base change, frequency i divided by s^(2i/(d-2))
    assert starts["ntk"] == pytest.approx([4.0 ** (2 * i / 14) for i in range(8)], rel=1e-6)
    for factors in starts.values():
        assert factors == sorted(factors) and min(factors) >= 1


def test_the_constraint_projects_onto_non_decreasing_factors_of_at_least_one():
    assert monotone([0.5, 3.0, 2.0, 5.0, 4.0], upper=4.5) == [1.0, 3.0, 3.0, 4.5, 4.5]


def test_attention_factor_is_longropes():
    assert attention_factor(4.0, 8192) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(8192)))
    assert attention_factor(1.0, 8192) == 1.0


def test_rescaled_runs_the_candidate_and_restores_bit_exactly():
    model = tiny_llama()
    ids = _tokens(200)[None]
    inputs = plain_rope_inputs(model, L0)
    with torch.no_grad():
        before = model(ids).logits
        with rescaled(model, inputs, start_points(inputs, 4.0)["pi"], 4.0):
            during = model(ids).logits
        assert torch.equal(model(ids).logits, before)
        # PI's factors are ctxext's pi x4 with LongRoPE's attention factor on q and k
        ctxext.patch(model, "pi", 4)
        rotary = model.model.rotary_emb
        rotary.attention_scaling = attention_factor(4.0, L0)
        torch.testing.assert_close(model(ids).logits, during, atol=1e-5, rtol=0)


def _search(tmp_path, budget=10, resume=False, **settings):
    model = tiny_llama()
    settings = SearchSettings(factor=4, budget=budget, population=5, parents=2, **settings)
    return model, longrope_search(model, _tokens(), settings, tmp_path, max_windows=2, resume=resume,
                                  progress=False)


def test_a_short_search_never_ends_worse_than_its_start_and_loads_natively(tmp_path):
    from transformers import AutoModelForCausalLM

    model, result = _search(tmp_path)
    assert result["best_score"] <= min(result["starts"].values())
    assert set(result["starts"]) == {"pi", "yarn", "ntk"} and result["scored"] == 10
    logged = [json.loads(line) for line in (tmp_path / "search.jsonl").read_text().splitlines()[1:]]
    assert len(logged) == 10
    for rec in logged:  # every scored candidate meets the constraint
        f = rec["factors"]
        assert f == sorted(f) and f[0] >= 1 and f[-1] <= 8
    # the checkpoint: plain transformers runs exactly the factors that were scored, past the trained length
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    rope = getattr(plain.config, "rope_parameters", None) or plain.config.rope_scaling  # 5.x / 4.x
    assert rope["rope_type"] == "longrope" and rope["long_factor"] == result["best"]
    original = rope.get("original_max_position_embeddings") or plain.config.original_max_position_embeddings
    assert original == L0 and plain.config.max_position_embeddings == 4 * L0
    ids = _tokens(4 * L0, seed=3)[None]
    with torch.no_grad(), rescaled(model, plain_rope_inputs(model, L0), result["best"], 4.0):
        ours = model(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, ours, atol=1e-5, rtol=0)
    # and ctxext loads it as the shipped longrope it is (nothing re-applied)
    loaded = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(loaded) is None
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ours, atol=1e-5, rtol=0)


def test_a_resumed_search_replays_its_log_and_rescores_nothing(tmp_path):
    _, first = _search(tmp_path, budget=8)
    lines = (tmp_path / "search.jsonl").read_text().splitlines()
    (tmp_path / "search.jsonl").write_text("\n".join(lines[:6]) + "\n" + lines[6][:20])  # a kill cut a line
    _, again = _search(tmp_path, budget=8, resume=True)
    assert again["best"] == first["best"] and again["fresh"] == 3  # the 2 lines lost and the cut one
    _, longer = _search(tmp_path, budget=12, resume=True)  # a larger budget continues the same path
    assert longer["fresh"] == 4 and longer["best_score"] <= first["best_score"]
    with pytest.raises(ValueError, match="other settings"):
        _search(tmp_path, budget=8, resume=True, seed=1)


def test_progressive_extension_seeds_each_stage_with_the_previous_best(tmp_path):
    settings = SearchSettings(factor=8, budget=14, population=4, parents=2, progressive=True)
    assert settings.stages() == [2.0, 4.0, 8.0]
    seen = []

    def score(stage, factors):
        seen.append(stage)
        return sum((f - stage) ** 2 for f in factors)  # best: every factor at the stage's factor

    starts = lambda stage: {"pi": [stage] * 4, "ntk": [1.0, 2.0, 3.0, 4.0]}  # noqa: E731
    log = ScoreLog(tmp_path / "log.jsonl", {"settings": {}}, resume=False)
    result = search(score, starts, settings, log)
    assert sorted(set(seen)) == [2.0, 4.0, 8.0] and result["stage"] == 8.0
    assert "previous stage" in result["starts"] and result["best_score"] == 0.0


def test_bad_models_and_settings_are_refused_before_scoring(tmp_path):
    with pytest.raises(ValueError, match="factor > 1"):
        SearchSettings(factor=1)
    with pytest.raises(ValueError, match="budget"):
        SearchSettings(factor=2, budget=0)
    model = tiny_llama()
    with pytest.raises(ValueError, match="fewer than one window"):
        longrope_search(model, _tokens(100), SearchSettings(factor=4), tmp_path / "a", progress=False)
    ctxext.patch(model, "yarn", 2)
    with pytest.raises(PatchError, match="patched by ctxext"):
        longrope_search(model, _tokens(), SearchSettings(factor=4), tmp_path / "b", progress=False)
    shipped = tiny_llama(rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32})
    with pytest.raises(PatchError, match="already uses rope type 'yarn'"):
        longrope_search(shipped, _tokens(), SearchSettings(factor=4), tmp_path / "c", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_cli_searches_a_reference_model_and_guards_its_folder(tmp_path, capsys):
    out = tmp_path / "search"
    args = ["search", "longrope", "reference:llama", "--factor", "2", "--out", str(out), "--budget", "4",
            "--population", "3", "--parents", "2", "--max-windows", "1", "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "longrope x2 (256 tokens): best perplexity" in printed and "starting points at x2" in printed
    result = json.loads((out / "search.json").read_text())
    assert result["best_score"] <= min(result["starts"].values())
    assert main(args) == 2 and "pass --resume" in capsys.readouterr().err  # nothing replaced
    assert main(args + ["--resume"]) == 0
    assert main(args + ["--overwrite"]) == 0
    (out / "notes.txt").write_text("mine")
    assert main(args + ["--overwrite"]) == 2 and (out / "notes.txt").exists()  # not a folder the search wrote
    assert main(["search", "longrope", "reference:llama", "--factor", "2", "--out", str(tmp_path / "new"),
                 "--resume"]) == 2
    assert main(["search", "longrope", "reference:gpt2", "--factor", "2", "--out", str(tmp_path / "g")]) == 2
    assert "no rotary module" in capsys.readouterr().err and not (tmp_path / "g").exists()
