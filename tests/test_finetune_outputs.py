"""What `ctxext finetune` does to the files in output.dir: someone's folder is refused, --overwrite leaves nothing of
the old run behind, a run's own saved recipe resumes it, and a non-finite gradient stops the run before its
checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("peft")

from ctxext.cli import main  # noqa: E402
from ctxext.finetune import RecipeError, load_recipe, recipe_from_dict, run  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_finetune import bases, recipe_dict  # noqa: E402,F401  (the module's fixture and recipe)

QUICK = {"steps": 2, "batch_size": 2, "micro_batch_size": 2, "save_every": 1, "gradient_checkpointing": False}


def quick(bases, out, **sections):
    sections["train"] = {**QUICK, **sections.get("train", {})}
    sections["eval"] = {"enabled": False, **sections.get("eval", {})}
    d = recipe_dict(bases, out, **sections)
    d["data"]["max_sequences"] = 8
    return d


def test_a_folder_that_is_not_a_run_is_refused_and_left_as_it_was(bases, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    recipe = recipe_from_dict(quick(bases, out))
    with pytest.raises(RecipeError, match=r"holds files that are not a ctxext finetune run \(README.md\)"):
        run(recipe, progress=False)
    with pytest.raises(RecipeError, match="not a ctxext finetune run"):  # --overwrite replaces only a run's files
        run(recipe_from_dict(quick(bases, out, output={"overwrite": True})), progress=False)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(quick(bases, out)))
    assert main(["finetune", str(path), "--check"]) == 2  # --check says so too
    assert "not a ctxext finetune run" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["README.md"] and (out / "README.md").read_text() == "my notes\n"


@pytest.mark.parametrize("marker", ["checkpoints", "log.jsonl"])
def test_a_folder_with_a_checkpoints_folder_or_log_of_its_own_is_not_taken_for_a_run(bases, tmp_path, marker):
    """Only ctxext's own markers make a run's folder: a user's ``checkpoints/`` (not ctxext's old ``step-N``) or
    ``log.jsonl`` did, and --overwrite then deleted the user's checkpoints, tokenizer/ and merged/."""
    out = tmp_path / "project"
    (out / "merged").mkdir(parents=True)
    (out / "merged" / "model.bin").write_text("weights\n")
    (out / "README.md").write_text("my project\n")
    if marker == "checkpoints":
        (out / "checkpoints" / "my-7b-run").mkdir(parents=True)
        (out / "checkpoints" / "my-7b-run" / "model.bin").write_text("3 days of GPU\n")
    else:
        (out / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    before = {p: p.read_text() for p in out.rglob("*") if p.is_file()}
    for overwrite in (False, True):
        with pytest.raises(RecipeError, match="not a ctxext finetune run"):
            run(recipe_from_dict(quick(bases, out, output={"overwrite": overwrite})), progress=False)
        assert {p: p.read_text() for p in out.rglob("*") if p.is_file()} == before


def test_check_reports_a_finished_run_in_output_dir(bases, tmp_path, capsys):
    out = tmp_path / "run"
    run(recipe_from_dict(quick(bases, out)), progress=False)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(quick(bases, out)))
    assert main(["finetune", str(path), "--check"]) == 2
    assert "holds a finished run" in capsys.readouterr().err


def test_resume_of_a_finished_run_with_another_recipe_is_refused(bases, tmp_path):
    """--resume on a finished run returns its summary only for the recipe that ran (it exited 0 with the old numbers
    for any recipe)."""
    out = tmp_path / "run"
    first = run(recipe_from_dict(quick(bases, out)), progress=False)
    assert run(recipe_from_dict(quick(bases, out)), resume=True, progress=False)["final_loss"] == first["final_loss"]
    changed = quick(bases, out, train={"steps": 3})
    with pytest.raises(RecipeError, match=r"the recipe changed \(train.steps: 2 -> 3\)"):
        run(recipe_from_dict(changed), resume=True, progress=False)


def test_overwrite_that_stops_early_leaves_no_part_of_the_old_run(bases, tmp_path):
    """An adapter of the old run beside no patch file would reload, silently, on an unpatched model."""
    out = tmp_path / "run"
    run(recipe_from_dict(quick(bases, out, output={"merged": True})), progress=False)
    assert (out / "adapter_config.json").exists() and (out / "merged").is_dir()
    part = run(recipe_from_dict(quick(bases, out, output={"overwrite": True})), stop_after=1, progress=False)
    assert not part["finished"]
    left = sorted(p.name for p in out.iterdir())
    assert left == ["checkpoint-1", "log.jsonl", "recipe.yaml"], left
    assert sum(json.loads(line)["event"] == "start" for line in (out / "log.jsonl").read_text().splitlines()) == 1


def test_the_runs_own_saved_recipe_resumes_it(bases, tmp_path):
    """OUT/recipe.yaml holds the data paths made absolute; resuming with it is the same run."""
    here = tmp_path / "project"
    shutil.copytree(bases["data"], here / "data")
    d = quick(bases, here / "out")
    d["data"]["files"] = ["data"]  # relative to the recipe's folder
    (here / "r.yaml").write_text(yaml.safe_dump(d))
    part = run(load_recipe(here / "r.yaml"), stop_after=1, progress=False)
    assert not part["finished"]
    done = run(load_recipe(here / "out" / "recipe.yaml"), resume=True, progress=False)
    assert done["finished"] and done["steps"] == 2


@pytest.mark.parametrize("precision, stops", [("no", True), ("fp16", False)])
def test_a_non_finite_gradient_stops_the_run_before_its_checkpoint(bases, tmp_path, precision, stops):
    """Trainer logs a step, then saves it: the stop in the log callback comes first. fp16's loss scaler skips steps
    with an infinite gradient on its own, so there the run goes on."""
    from ctxext.finetune.trainer import RunCallback, RunLog

    recipe = recipe_from_dict(quick(bases, tmp_path / "out", train={"mixed_precision": precision}))
    callback = RunCallback(recipe, {"losses": []}, RunLog(tmp_path / "log.jsonl", True), 64, None)

    class State:
        global_step, max_steps = 2, 6

    logs = {"loss": 3.2, "grad_norm": float("nan"), "learning_rate": 1e-3}
    if stops:
        with pytest.raises(RecipeError, match="gradient norm is nan at step 2"):
            callback.on_log(None, State(), None, logs=logs)
    else:
        callback.on_log(None, State(), None, logs=logs)
    callback.on_log(None, State(), None, logs=dict(logs, grad_norm=0.5))  # a finite one is a step like any other


def test_the_adapter_reloads_in_the_dtype_it_was_trained_in(bases, tmp_path):
    """A base whose config says float16 (as many checkpoints' do) trained in float32: the documented reload
    ``ctxext.from_pretrained(base, adapter=DIR)`` gives the float32 model the run evaluated, unless told otherwise."""
    import torch

    import ctxext

    base = tmp_path / "base"
    shutil.copytree(bases["llama"], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(dict(config, dtype="float16", torch_dtype="float16")))
    out = tmp_path / "run"
    d = quick(bases, out)
    d["model"]["name"] = str(base)
    run(recipe_from_dict(d), progress=False)
    # (transformers 5 loads the plain base in the float16 its config says; 4.x in float32 unless told)
    assert next(ctxext.from_pretrained(str(base), adapter=str(out)).parameters()).dtype == torch.float32
    asked = ctxext.from_pretrained(str(base), adapter=str(out), dtype=torch.bfloat16)
    assert next(asked.parameters()).dtype == torch.bfloat16


def test_an_output_dir_holding_what_the_run_reads_is_refused(bases, tmp_path):
    """--overwrite clears output.dir: a base model kept there (say an earlier run's merged/) would be deleted."""
    out = tmp_path / "run"
    shutil.copytree(bases["llama"], out / "merged")
    with pytest.raises(RecipeError, match="holds model.name"):
        recipe_from_dict(quick(bases, out, model={"name": str(out / "merged")}, output={"overwrite": True}))
    assert (out / "merged" / "config.json").is_file()


def test_an_output_dir_inside_a_data_folder_is_refused(bases, tmp_path):
    data = tmp_path / "texts"
    shutil.copytree(bases["data"], data)
    with pytest.raises(RecipeError, match="inside the data.files folder"):
        recipe_from_dict(quick(bases, data / "run", data={"files": [str(data)]}))


def test_a_home_output_dir_is_one_folder(bases, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    recipe = recipe_from_dict(quick(bases, "~/run"))
    assert recipe.output.dir == str(tmp_path / "home" / "run")


def test_check_refuses_a_shift_attention_length_that_does_not_split(bases, tmp_path, capsys):
    path = tmp_path / "r.yaml"  # pi x2 of the tiny llama's 64: 128 tokens, not 5 groups of an even size
    path.write_text(yaml.safe_dump(quick(bases, tmp_path / "run", train={"shift_attention": True,
                                                                         "shift_group_ratio": 0.2})))
    assert main(["finetune", str(path), "--check"]) == 2
    assert "train.shift_attention" in capsys.readouterr().err


def test_resume_refuses_data_whose_content_changed(bases, tmp_path):
    data = tmp_path / "texts"
    shutil.copytree(bases["data"], data)
    out = tmp_path / "run"
    d = quick(bases, out, data={"files": [str(data)]}, train={"steps": 4, "save_every": 1})
    run(recipe_from_dict(d), progress=False, stop_after=1)
    (data / "book0.txt").write_text((data / "book1.txt").read_text())  # same path, other text
    with pytest.raises(RecipeError, match="the training data changed"):
        run(recipe_from_dict(d), progress=False, resume=True)


def test_resume_refuses_a_base_model_whose_weights_changed(bases, tmp_path):
    """The probe's case: the base model's weights halved in place between the stop and --resume. The adapter would
    have been trained on two different bases; the run now refuses, and resumes on the same files."""
    import os

    from safetensors.torch import load_file, save_file

    model = tmp_path / "base"
    shutil.copytree(bases["llama"], model)
    out = tmp_path / "run"
    d = quick(bases, out, model={"name": str(model)}, train={"steps": 3, "save_every": 1})
    run(recipe_from_dict(d), progress=False, stop_after=1)
    weights = model / "model.safetensors"
    original, stamp = weights.read_bytes(), weights.stat().st_mtime_ns
    save_file({k: v * 0.5 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    with pytest.raises(RecipeError, match="is not the one the run began with"):
        run(recipe_from_dict(d), progress=False, resume=True)
    weights.write_bytes(original)
    os.utime(weights, ns=(stamp, stamp))  # the same file back, as `cp -p` would bring it
    assert run(recipe_from_dict(d), progress=False, resume=True)["finished"]


def test_resume_with_other_eval_settings_measures_before_again(bases, tmp_path):
    out, fresh = tmp_path / "run", tmp_path / "fresh"
    first = {"data": [str(bases["data"] / "heldout.txt")], "max_windows": 2, "lengths": [64], "enabled": True}
    other = dict(first, data=[str(bases["data"] / "book2.txt")])
    run(recipe_from_dict(quick(bases, out, eval=first, train={"steps": 3})), progress=False, stop_after=1)
    resumed = run(recipe_from_dict(quick(bases, out, eval=other, train={"steps": 3})), progress=False, resume=True)
    expected = run(recipe_from_dict(quick(bases, fresh, eval=other, train={"steps": 3})), progress=False)
    assert resumed["before"] is not None and resumed["before"] == expected["before"]


def test_a_kill_while_a_checkpoint_is_saved_leaves_the_one_before(bases, tmp_path, monkeypatch):
    """train.keep_checkpoints rotates only after ctxext's record completes the new checkpoint: a kill in between
    leaves the previous complete one to resume from."""
    import ctxext.finetune.checkpoint as ckpt

    out = tmp_path / "run"
    d = quick(bases, out, train={"steps": 4, "save_every": 1, "keep_checkpoints": 1})
    write_state = ckpt.write_state

    def killed_at_step_3(path, record):
        if record["step"] == 3:
            raise KeyboardInterrupt  # stands in for a kill after Trainer's files, before ctxext's record
        write_state(path, record)

    monkeypatch.setattr(ckpt, "write_state", killed_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run(recipe_from_dict(d), progress=False)
    assert [p.name for p in ckpt.checkpoints(out)] == ["checkpoint-2"]
    monkeypatch.undo()
    resumed = run(recipe_from_dict(d), progress=False, resume=True)
    uninterrupted = run(recipe_from_dict(quick(bases, tmp_path / "once", train={"steps": 4, "save_every": 1,
                                                                                "keep_checkpoints": 1})),
                        progress=False)
    assert resumed["losses"] == uninterrupted["losses"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]


def test_a_checkpoint_reloads_as_an_adapter_patched_and_in_its_trained_dtype(bases, tmp_path):
    """``from_pretrained(base, adapter=OUT/checkpoint-N)``: the checkpoint holds the patch file and the recipe beside
    its adapter (before, it loaded silently unpatched, in the base config's dtype), and the files are listed in the
    checkpoint's record, so a resume still checks them."""
    import torch

    import ctxext

    out = tmp_path / "run"
    base = bases["llama"]
    run(recipe_from_dict(quick(bases, out, model={"dtype": "bfloat16"})), progress=False)  # the base is float32
    checkpoint = out / "checkpoint-1"
    model = ctxext.from_pretrained(str(base), adapter=str(checkpoint))
    spec = ctxext.describe(model.get_base_model())
    assert (spec["method"], spec["factor"]) == ("pi", 2.0)
    assert next(model.parameters()).dtype == torch.bfloat16
    listed = json.loads((checkpoint / "ctxext_state.json").read_text())["files"]
    assert {"ctxext_patch.json", "recipe.yaml"} <= set(listed)


def test_a_checkpoint_whose_trainer_state_disagrees_with_its_record_is_passed_over(bases, tmp_path, capsys):
    """trainer_state.json's global_step edited (same size): Trainer would resume from its step and ctxext from its
    record's, training a step twice. The checkpoint counts as damaged; the run resumes from the one before."""
    out = tmp_path / "run"
    d = quick(bases, out, train={"steps": 3, "save_every": 1, "keep_checkpoints": 3})
    run(recipe_from_dict(d), progress=False, stop_after=2)
    state = out / "checkpoint-2" / "trainer_state.json"
    state.write_text(state.read_text().replace('"global_step": 2', '"global_step": 1'))
    assert run(recipe_from_dict(d), progress=False, resume=True)["finished"]
    assert "global_step 1, where the checkpoint's record says 2" in capsys.readouterr().err
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["event"] == "step"] == [1, 2, 3]


def test_trainer_refusing_train_args_is_one_recipe_error(bases, tmp_path):
    """report_to an integration that is not installed: Trainer raises RuntimeError; a RecipeError names train.args."""
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    d = quick(bases, tmp_path / "run", train={"args": {"report_to": ["wandb"]}})
    from ctxext.finetune.train import check

    # refused by the checks, before the model loads (a `ctxext finetune --check` catches it too)
    with pytest.raises(RecipeError, match="train.args.report_to: wandb is not installed"):
        check(recipe_from_dict(d))
    with pytest.raises(RecipeError, match="train.args.report_to: wandb is not installed"):
        run(recipe_from_dict(d), progress=False)
    assert not (tmp_path / "run").exists()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["building Trainer", "Trainer's start"])
def test_overwrite_keeps_the_old_run_until_training_begins(bases, tmp_path, monkeypatch, where):
    """--overwrite replaces a finished run only once the new run is at its first step: a refusal from Trainer (an
    offline push_to_hub, an evaluation it has no data for, an optimizer it cannot build) leaves the old run as it was,
    and a rerun starts from a folder that holds one run, not a log with two starts."""
    import transformers

    out = tmp_path / "run"
    run(recipe_from_dict(quick(bases, out)), progress=False)
    before = _snapshot(out)

    def refuse(*args, **kwargs):
        raise ValueError("refused by Trainer")

    target = "__init__" if where == "building Trainer" else "create_optimizer"
    monkeypatch.setattr(transformers.Trainer, target, refuse)
    with pytest.raises(ValueError, match="refused by Trainer"):
        run(recipe_from_dict(quick(bases, out, output={"overwrite": True}, train={"steps": 3})), progress=False)
    assert _snapshot(out) == before


def test_overwrite_removes_only_the_folders_trainer_and_ctxext_write(bases, tmp_path):
    """Trainer writes checkpoint-<digits>, ctxext sets damaged ones aside as damaged-checkpoint-<digits>: a folder
    of the user's whose name only starts so stays."""
    out = tmp_path / "run"
    run(recipe_from_dict(quick(bases, out)), progress=False)
    for name in ("checkpoint-1-keep", "checkpoint-notes", "damaged-checkpoint-9"):
        (out / name).mkdir()
        (out / name / "f.txt").write_text("mine\n")
    run(recipe_from_dict(quick(bases, out, output={"overwrite": True})), progress=False)
    assert (out / "checkpoint-1-keep" / "f.txt").exists() and (out / "checkpoint-notes" / "f.txt").exists()
    assert not (out / "damaged-checkpoint-9").exists()


@pytest.mark.parametrize("arg", ["save_only_model", "ignore_data_skip", "eval_on_start", "load_best_model_at_end",
                                 "eval_strategy"])
def test_train_args_that_would_break_resume_or_need_an_evaluation_set_are_refused(bases, tmp_path, arg):
    """A checkpoint without the optimizer, or a resume that does not skip the batches already trained, would make
    --resume silently differ from an uninterrupted run; Trainer gets no evaluation set to evaluate or pick by. Their
    defaults (a recipe may spell them out) are taken."""
    with pytest.raises(RecipeError, match=f"train.args.{arg}: only its default"):
        recipe_from_dict(quick(bases, tmp_path / "o", train={"args": {arg: True}}))
    recipe_from_dict(quick(bases, tmp_path / "o", train={"args": {arg: "no" if arg == "eval_strategy" else False}}))


def test_an_eval_stride_past_the_training_length_is_refused_before_training(bases, tmp_path):
    out = tmp_path / "run"
    d = quick(bases, out, eval={"enabled": True, "protocol": "sliding", "stride": 10_000, "before": False})
    with pytest.raises(RecipeError, match="eval.stride: stride must be between 1 and length - 1"):
        run(recipe_from_dict(d), progress=False)
    assert not out.exists()


def test_scheduler_kwargs_the_schedule_does_not_take_are_refused_by_the_check(bases, tmp_path):
    from ctxext.finetune.train import check

    d = quick(bases, tmp_path / "o", train={"args": {"lr_scheduler_kwargs": {"foo": 1}}})
    with pytest.raises(RecipeError, match="train.args.lr_scheduler_kwargs: the cosine schedule refused"):
        check(recipe_from_dict(d))


def test_resume_asking_a_merged_model_of_a_finished_run_says_it_is_not_written(bases, tmp_path):
    out = tmp_path / "run"
    run(recipe_from_dict(quick(bases, out)), progress=False)
    before = _snapshot(out)
    with pytest.raises(RecipeError, match="finished without a merged model"):
        run(recipe_from_dict(quick(bases, out, output={"merged": True})), resume=True, progress=False)
    assert _snapshot(out) == before


def test_a_fresh_run_that_fails_to_start_leaves_no_folder(bases, tmp_path, monkeypatch):
    """Trainer makes output.dir when it is built; a run that then fails before its first step removes it again."""
    import transformers

    out = tmp_path / "new" / "run"

    def refuse(*args, **kwargs):
        raise ValueError("refused by Trainer")

    monkeypatch.setattr(transformers.Trainer, "create_optimizer", refuse)
    with pytest.raises(ValueError, match="refused by Trainer"):
        run(recipe_from_dict(quick(bases, out)), progress=False)
    assert not out.exists()


def test_an_adapter_named_by_hub_id_goes_to_peft(monkeypatch):
    """Only a local folder is checked for its files: a hub id is peft's to fetch."""
    import peft

    from ctxext.loading import load_adapter

    monkeypatch.setattr(peft.PeftModel, "from_pretrained", classmethod(lambda cls, model, name, **kw: ("peft", name)))
    assert load_adapter(torch.nn.Linear(2, 2), "someone/some-lora") == ("peft", "someone/some-lora")
