"""PoSE (positional skip-wise training) as a fine-tune recipe option: the position ids of a sample, their
determinism, the recipe checks, the capability probe, the mask trap, and short runs on the tiny LLaMA recipe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("peft")

import ctxext  # noqa: E402
from ctxext.finetune import RecipeError, check, load_recipe, recipe_from_dict, run  # noqa: E402
from ctxext.finetune.data import PackedData, pose_position_ids  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_bloom, tiny_gpt2, tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny" / "llama_pi_pose_lora.yaml"


def chunks_of(positions: torch.Tensor) -> list[torch.Tensor]:
    """Runs of consecutive positions."""
    cuts = (torch.nonzero(positions.diff() != 1).flatten() + 1).tolist()
    return list(torch.tensor_split(positions, cuts))


# ------------------------------------------------------------------------------------------- position ids


@pytest.mark.parametrize("length,target", [(16, 64), (256, 1024), (7, 8), (5, 500)])
def test_two_chunks_as_in_the_paper(length, target):
    firsts, skips = set(), set()
    for index in range(300):
        pos = pose_position_ids(length, target, 2, seed=0, index=index)
        assert pos.shape == (length,) and pos.dtype == torch.long
        assert pos[0] == 0  # the first chunk keeps positions 0.. (u_0 = 0, as the authors' code)
        assert int(pos.max()) <= target - 1 and bool((pos.diff() >= 1).all())  # increasing, below the target
        parts = chunks_of(pos)
        assert 1 <= len(parts) <= 2  # one run when the skip drawn is 0
        first = int((pos.diff() != 1).nonzero().flatten()[0]) + 1 if len(parts) == 2 else None
        if first is not None:
            assert 1 <= first <= (length + 1) // 2  # first chunk 1 .. ceil(L/2) tokens
            firsts.add(first)
        skip = int(pos[-1]) - (length - 1)  # the second chunk's shift
        assert 0 <= skip <= target - length
        skips.add(skip)
    # the draws cover their ranges (skips 0 .. target - length; short and long first chunks)
    assert max(skips) >= 0.9 * (target - length) and min(skips) <= 0.1 * (target - length)
    if length > 8:
        assert min(firsts) <= 0.1 * length and max(firsts) >= 0.4 * length


def test_more_chunks_keep_consecutive_runs_with_non_decreasing_skips():
    for index in range(200):
        pos = pose_position_ids(32, 256, 4, seed=3, index=index)
        assert pos[0] == 0 and int(pos.max()) <= 255 and bool((pos.diff() >= 1).all())
        assert len(chunks_of(pos)) <= 4


def test_position_ids_are_a_function_of_seed_and_index():
    a = pose_position_ids(256, 1024, 2, seed=0, index=5)
    assert torch.equal(a, pose_position_ids(256, 1024, 2, seed=0, index=5))
    assert not torch.equal(a, pose_position_ids(256, 1024, 2, seed=1, index=5))
    assert len({tuple(pose_position_ids(256, 1024, 2, seed=0, index=i).tolist()) for i in range(20)}) == 20
    # pinned: resuming a run (or running it with another Python) must draw the same positions
    pinned = pose_position_ids(12, 48, 2, seed=0, index=0).tolist()
    assert pinned == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
    assert pose_position_ids(12, 48, 3, seed=0, index=1).tolist() == [0, 28, 29, 30, 31, 32, 33, 37, 38, 39, 40, 41]
    with pytest.raises(ValueError):
        pose_position_ids(16, 8, 2, seed=0, index=0)
    with pytest.raises(ValueError):
        pose_position_ids(16, 64, 1, seed=0, index=0)


def test_positions_follow_the_sample_index():
    """A run's example i carries PoSE positions of (seed, i) and an all-ones mask (without it transformers would
    read the position jumps as packed-document boundaries); the process count does not enter."""
    from ctxext.finetune.data import RunSamples

    seqs = torch.arange(7 * 16).view(7, 16)
    data = PackedData(seqs, seed=3, pose=(64, 2))
    assert PackedData(seqs, seed=3).positions(0, 4) is None  # no PoSE: the model's own
    samples = RunSamples(data, 16)
    for i in range(16):
        item = samples[i]
        assert torch.equal(item["position_ids"], pose_position_ids(16, 64, 2, seed=3, index=i))
        assert torch.equal(item["attention_mask"], torch.ones(16, dtype=torch.long))
    # the same sequence drawn again in a later epoch gets new positions (index, not sequence, seeds them)
    assert not torch.equal(data.positions(0, 1), data.positions(7, 1))


# ------------------------------------------------------------------------------------------------ recipe


def tiny_dict(out, **train):
    data = yaml.safe_load(TINY.read_text())
    data["output"]["dir"] = str(out)
    data["train"].update(train)
    return data


@pytest.mark.parametrize("pose,message", [
    ({"chunks": 1}, "train.pose.chunks: input should be greater than or equal to 2, got 1"),
    ({"chunks": "two"}, "train.pose.chunks: input should be a valid integer, unable to parse string as an integer, got 'two'"),
    ({"target": 1024}, "unknown key(s) train.pose.target; train.pose accepts: target_length, chunks"),
    ({"target_length": 128}, "train.pose.target_length (128) must be longer than data.seq_length (128)"),
    ({"target_length": -3}, "train.pose.target_length: input should be greater than or equal to 2, got -3"),
    (4, "train.pose: input should be a valid dictionary or instance of PoseConfig, got 4"),
    ("yes please", "train.pose: input should be a valid dictionary"),
])
def test_bad_pose_options_are_refused_with_their_key_path(tmp_path, pose, message):
    with pytest.raises(RecipeError) as exc:
        recipe_from_dict(tiny_dict(tmp_path / "o", pose=pose))
    assert message in str(exc.value)


def test_pose_shorthands_and_overrides(tmp_path):
    assert recipe_from_dict(tiny_dict(tmp_path / "o", pose=True)).train.pose.target_length is None
    assert recipe_from_dict(tiny_dict(tmp_path / "o", pose=False)).train.pose is None
    assert recipe_from_dict(tiny_dict(tmp_path / "o", pose=None)).train.pose is None
    r = load_recipe(TINY, ["train.pose.chunks=3", "train.pose.target_length=512"])
    assert (r.train.pose.chunks, r.train.pose.target_length) == (3, 512)
    # the recipe round-trips (the run saves it, resume compares it)
    again = recipe_from_dict(yaml.safe_load(r.to_yaml()))
    assert again.train.pose == r.train.pose
    # every problem at once, nested ones with their paths
    with pytest.raises(RecipeError) as exc:
        load_recipe(TINY, ["train.pose.chunks=0", "train.steps=zero", "train.pose.bogus=1"])
    assert len(exc.value.problems) == 3


def test_pose_needs_positions_in_the_model_input(tmp_path):
    for method in ("nope", "alibi"):
        d = tiny_dict(tmp_path / "o")
        d["patch"] = {"method": method}
        d["train"]["pose"] = {"target_length": 1024}
        with pytest.raises(RecipeError, match=f"train.pose: PoSE trains through the position ids, and patch.method "
                                              f"'{method}' takes them out"):
            recipe_from_dict(d)
    d = tiny_dict(tmp_path / "o", pose=True)
    d["patch"] = {"method": None}
    with pytest.raises(RecipeError, match="train.pose.target_length is required without a patch"):
        recipe_from_dict(d)


def test_check_refuses_a_target_past_the_patched_length(tmp_path):
    """--check (no weights): the target against what the patched model has, the window defaulting to the
    original length."""
    d = tiny_dict(tmp_path / "o", pose={"target_length": 1024})
    with pytest.raises(RecipeError, match=r"train.pose.target_length \(1024\) is past the 512 positions the "
                                          r"patched model has; use patch.factor >= 8"):
        check(recipe_from_dict(d))
    d = tiny_dict(tmp_path / "o", pose=True)
    del d["data"]["seq_length"]
    checked = check(recipe_from_dict(d))
    assert (checked["seq_length"], checked["pose_target"]) == (128, 512)  # the LLaMA reference, trained at 128


# ------------------------------------------------------------------------------------ capability probe


def test_probe_accepts_rotary_and_learned_tables_and_refuses_models_without_position_input():
    from ctxext.finetune.model import check_position_input

    check_position_input(ctxext.patch(tiny_llama(), "pi", 4), 256)
    check_position_input(ctxext.patch(tiny_llama(), "yarn", 4), 256)
    check_position_input(ctxext.patch(tiny_gpt2(), "pi", 4), 128)  # the interpolated wpe table has the rows
    with pytest.raises(RecipeError, match="ignores position_ids"):
        check_position_input(ctxext.patch(tiny_llama(), "nope"), 256, "nope")
    with pytest.raises(RecipeError, match="ignores position_ids|takes no position_ids"):
        check_position_input(tiny_bloom(), 256)  # ALiBi by token order


def test_gpt2_without_a_longer_table_is_refused(tmp_path):
    from ctxext.finetune.checks import lengths
    from ctxext.finetune.config import Recipe

    model = tiny_gpt2()  # 32 rows
    recipe = Recipe(train={"pose": {"target_length": 128}}, data={"seq_length": 16})
    with pytest.raises(RecipeError, match="past the 32 positions the model has"):
        lengths(recipe, None, model)


def test_chunks_attend_to_each_other():
    """The training forward of a PoSE example (its position ids + all-ones mask, as the run's data emits it) lets the
    second chunk see the first: perturbing the first token changes the last token's logits. Without the mask,
    transformers 5.x would cut the window into 'packed documents' at the skip."""
    from transformers import default_data_collator

    model = ctxext.patch(tiny_llama(), "pi", 4)
    x = (torch.arange(16) * 5 + 2).remainder(128).unsqueeze(0)
    y = x.clone()
    y[0, 0] = (y[0, 0] + 1) % 128

    def inputs(tokens):
        batch = default_data_collator([PackedData(tokens, seed=0, pose=(256, 2)).example(0)])
        return {k: v for k, v in batch.items() if k != "labels"}

    pos = inputs(x)["position_ids"]
    assert int(pos.diff().max()) > 1  # a skip between the chunks
    with torch.no_grad():
        a = model(**inputs(x)).logits[0, -1]
        b = model(**inputs(y)).logits[0, -1]
        assert (a - b).abs().max() > 1e-4
        # and the positions are used: the same tokens at consecutive positions give other logits
        c = model(input_ids=x).logits[0, -1]
        assert (a - c).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------------- runs


def tiny_run(out, *extra):
    """The shipped tiny PoSE recipe, cut to a few steps and a small evaluation."""
    return load_recipe(TINY, [f"output.dir={out}", "train.steps=4", "train.save_every=2", "train.warmup_steps=1",
                              "eval.max_windows=1", *extra])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("pose") / "straight"
    return out, run(tiny_run(out), progress=False)


def test_tiny_recipe_trains_with_pose_and_reports_before_after(straight):
    out, summary = straight
    assert summary["finished"] and summary["steps"] == 4
    assert summary["seq_length"] == 128 and summary["pose"] == {"target_length": 512, "chunks": 2}
    assert summary["tokens"] == 4 * 4 * 128  # each step costs a 128-token step
    for name in ("adapter_config.json", "adapter_model.safetensors", "ctxext_patch.json", "results.json"):
        assert (out / name).exists(), name
    for when in ("unpatched", "before", "after"):
        assert set(summary[when]) == {"512", "128"} and summary[when]["512"]["ppl"] > 0
    assert summary["after"]["512"]["ppl"] != summary["before"]["512"]["ppl"]
    start = next(json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if '"start"' in x)
    assert start["pose_target"] == 512 and start["recipe"]["train"]["pose"] == {"target_length": 512, "chunks": 2}
    model = ctxext.from_pretrained(str(_reference()), adapter=str(out))
    assert ctxext.describe(model)["method"] == "pi"


def _reference() -> Path:
    from ctxext.finetune.config import ModelConfig
    from ctxext.finetune.model import model_source

    return Path(model_source(ModelConfig(name="reference:llama")))


def test_the_positions_reach_the_model(straight, tmp_path):
    """Same batches at the same window without PoSE: another loss from the first step on."""
    _, summary = straight
    plain = run(tiny_run(tmp_path / "plain", "train.pose=null", "train.steps=1", "eval.enabled=false"),
                progress=False)
    assert plain["losses"][0] != pytest.approx(summary["losses"][0], abs=1e-6)


def test_pose_resume_is_bit_identical(straight, tmp_path):
    from safetensors.torch import load_file

    out_a, summary = straight
    out = tmp_path / "resumed"
    recipe = tiny_run(out, "eval.enabled=false")  # eval may change on resume; the training must not
    assert not run(recipe, stop_after=2, progress=False)["finished"]
    with pytest.raises(RecipeError, match="recipe changed.*train.pose.chunks"):
        run(tiny_run(out, "eval.enabled=false", "train.pose.chunks=3"), resume=True, progress=False)
    resumed = run(recipe, resume=True, progress=False)
    assert resumed["losses"] == summary["losses"]
    a, b = load_file(str(out_a / "adapter_model.safetensors")), load_file(str(out / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_processes_train_like_one_with_pose(straight, tmp_path):
    _, summary = straight
    out = tmp_path / "two"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "ctxext", "finetune", str(TINY), "--no-progress", "--set", f"output.dir={out}",
         "--set", "train.steps=4", "--set", "train.save_every=2", "--set", "train.warmup_steps=1",
         "--set", "eval.max_windows=1"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((out / "results.json").read_text())
    assert two["world_size"] == 2
    assert two["losses"] == pytest.approx(summary["losses"], rel=1e-4)



@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """test_finetune's tiny LLaMA and GPT-2 (64 positions) with a small BPE tokenizer and text."""
    import test_finetune

    return test_finetune.bases.__wrapped__(tmp_path_factory)


def test_gpt2_pi_trains_the_far_rows_of_its_table_with_pose(small, tmp_path):
    """GPT-2 + PI x2 (a 128-row table) trained on 32-token windows with positions up to 128: rows past the window
    and past the original 64 are trained, so the positions reached the learned table."""
    from safetensors.torch import load_file
    from test_finetune import make

    out = tmp_path / "gpt2"
    r = make(small, out, model={"name": str(small["gpt2"])}, patch={"method": "pi", "factor": 2},
             lora={"target_modules": ["c_attn"], "trainable": ["wpe"]}, data={"seq_length": 32},
             train={"steps": 2, "lr": 1e-2, "save_every": 0, "pose": {"target_length": 128}},
             eval={"enabled": False})
    summary = run(r, progress=False)
    assert summary["finished"] and summary["pose"] == {"target_length": 128, "chunks": 2}
    saved = load_file(str(out / "adapter_model.safetensors"))
    table = next(v for k, v in saved.items() if "wpe" in k and k.endswith("table"))
    base = ctxext.patch(ctxext.from_pretrained(str(small["gpt2"])), "pi", 2)
    start = next(m for m in base.modules() if type(m).__name__ == "PositionTable").table
    changed = (table - start).abs().amax(dim=1) > 0
    assert table.shape[0] == 128 and bool(changed[64:].any()) and not bool(changed.all())
