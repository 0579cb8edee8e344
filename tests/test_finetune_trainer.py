"""`ctxext finetune` on transformers' Trainer: train.args passes TrainingArguments through (refused with its key path
where unknown or owned by a recipe key), the run's callback stops on a non-finite loss, and an old-layout output
folder is refused with the new layout named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from test_finetune import bases, make  # noqa: E402,F401

from ctxext.finetune import RecipeError, check, run  # noqa: E402
from ctxext.finetune.trainer import training_arguments  # noqa: E402

QUICK = dict(train={"steps": 2, "save_every": 0, "gradient_checkpointing": False}, eval={"enabled": False})


def _make(bases, out, args=None, **sections):  # noqa: F811
    train = {**QUICK["train"], **sections.pop("train", {}), **({"args": args} if args is not None else {})}
    return make(bases, out, train=train, eval=QUICK["eval"], **sections)


@pytest.mark.parametrize("args, message", [
    ({"bogus_field": 1}, "train.args.bogus_field: not a transformers.TrainingArguments field"),
    ({"learning_rate": 0.1}, "train.args.learning_rate: set by train.lr"),
    ({"per_device_train_batch_size": 8}, "train.args.per_device_train_batch_size: set by train.micro_batch_size"),
    ({"output_dir": "/tmp/x"}, "train.args.output_dir: set by output.dir"),
    # values of the wrong type: TrainingArguments takes them and the run failed mid-way with a traceback
    ({"label_smoothing_factor": "abc"}, "train.args.label_smoothing_factor: expected a number, got 'abc'"),
    ({"report_to": {"x": 1}}, "train.args.report_to: expected null or a string or a list"),
    ({"dataloader_num_workers": 1.5}, "train.args.dataloader_num_workers: expected a whole number"),
    ({"torch_compile": 1}, "train.args.torch_compile: expected true/false, got 1"),
    # a list or mapping for a field that takes an enum's name raised a bare TypeError (unhashable) before
    ({"optim": ["adamw_torch"]}, "train.args.optim: expected a string, got ['adamw_torch']"),
    ({"hub_strategy": {"a": 1}}, "train.args.hub_strategy: expected a string, got {'a': 1}"),
    ({"debug": ["underflow_overflow", 3]}, "train.args.debug: expected"),
])
def test_train_args_refused_with_their_key_path(bases, tmp_path, args, message):  # noqa: F811
    with pytest.raises(RecipeError) as err:
        _make(bases, tmp_path / "out", args=args)
    assert any(message in p for p in err.value.problems), err.value.problems
    assert not (tmp_path / "out").exists()


def test_train_args_reach_trainingarguments(bases, tmp_path):  # noqa: F811
    recipe = _make(bases, tmp_path / "out", args={"optim": "sgd", "adam_epsilon": 1e-6, "dataloader_num_workers": 0})
    args = training_arguments(recipe, accumulation=2, progress=False, use_cpu=True)
    assert args.optim == "sgd" and args.adam_epsilon == 1e-6
    # the recipe's own keys, mapped
    t = recipe.train
    assert (args.max_steps, args.learning_rate, args.per_device_train_batch_size, args.gradient_accumulation_steps,
            args.lr_scheduler_type, args.warmup_steps, args.seed) == (t.steps, t.lr, t.micro_batch_size, 2, "cosine",
                                                                      t.warmup_steps, t.seed)
    assert args.output_dir == str(tmp_path / "out") and args.save_strategy == "no"


def test_train_args_take_an_enum_fields_values_as_yaml_gives_them(bases, tmp_path):  # noqa: F811
    """``debug: [underflow_overflow]`` (a list of enum values): strict validation alone takes only enum members, which
    YAML cannot write."""
    for args in ({"debug": ["underflow_overflow"]}, {"debug": "underflow_overflow"}, {"optim": "adamw_torch"},
                 {"hub_strategy": "end"}):
        assert _make(bases, tmp_path / "out", args=args).train.args == args
    with pytest.raises(RecipeError, match=r"train.args.debug: expected"):
        _make(bases, tmp_path / "out", args={"debug": ["underflow_overflow", 3]})


def test_train_args_change_the_training(bases, tmp_path):  # noqa: F811
    """The optimizer named in train.args is the one that trains: SGD and the default AdamW part at step 2."""
    no_warmup = {"warmup_steps": 0}  # (a warmup step trains at lr 0)
    adamw = run(_make(bases, tmp_path / "adamw", train=no_warmup), progress=False)
    sgd = run(_make(bases, tmp_path / "sgd", args={"optim": "sgd"}, train=no_warmup), progress=False)
    assert adamw["losses"][0] == pytest.approx(sgd["losses"][0], rel=1e-6)  # same start
    assert adamw["losses"][1] != pytest.approx(sgd["losses"][1], rel=1e-6)


def test_a_bad_train_args_value_is_refused_before_anything_is_written(bases, tmp_path):  # noqa: F811
    recipe = _make(bases, tmp_path / "out", args={"optim": "no_such_optimizer"})
    with pytest.raises(RecipeError, match="train: transformers.TrainingArguments refused the training settings"):
        check(recipe)  # --check builds the TrainingArguments too
    with pytest.raises(RecipeError, match="train: transformers.TrainingArguments refused the training settings"):
        run(recipe, progress=False)
    assert not (tmp_path / "out").exists()


def test_non_finite_loss_stops_the_run(bases, tmp_path, monkeypatch):  # noqa: F811
    """A loss that turns non-finite stops the run with the step and what to lower (Trainer's own nan/inf filter is
    off, so the logged loss is the real one)."""
    from ctxext.finetune import data as ft_data

    real = ft_data.PackedData.example

    def poisoned(self, index):  # from the run's sample 2 (step 2) on, no token is scored: the loss is 0 / 0
        example = real(self, index)
        return example if index < 2 else dict(example, labels=example["labels"].clone().fill_(-100))

    monkeypatch.setattr(ft_data.PackedData, "example", poisoned)
    with pytest.raises(RecipeError, match=r"loss is nan at step 2: lower train.lr"):
        run(_make(bases, tmp_path / "out", train={"batch_size": 2, "micro_batch_size": 2}), progress=False)
    steps = [json.loads(x) for x in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["event"] == "step"] == [1, 2]


def test_trainer_checkpoint_holds_ctxext_record(bases, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    recipe = _make(bases, out, train={"steps": 4, "save_every": 2})
    part = run(recipe, stop_after=3, progress=False)
    assert not part["finished"] and part["step"] == 3
    # save_every 2 wrote checkpoint-2; --stop-after 3 wrote checkpoint-3
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    record = json.loads((out / "checkpoint-3" / "ctxext_state.json").read_text())
    assert record["step"] == 3 and len(record["losses"]) == 3 and record["recipe"]["train"]["steps"] == 4
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    done = run(recipe, resume=True, progress=False)
    assert done["finished"] and len(done["losses"]) == 4
    assert not (out / "checkpoint-4").exists()  # the end saves the adapter, not a last checkpoint
    assert torch.isfinite(torch.tensor(done["losses"])).all()


def test_log_every_keeps_one_loss_per_step_and_logs_the_last(bases, tmp_path):  # noqa: F811
    every = run(_make(bases, tmp_path / "every", train={"steps": 6}), progress=False)
    sparse = run(_make(bases, tmp_path / "sparse", train={"steps": 6, "log_every": 4}), progress=False)
    assert sparse["losses"] == every["losses"] and len(sparse["losses"]) == 6
    steps = [json.loads(x) for x in (tmp_path / "sparse" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["event"] == "step"] == [4, 6]
    past = run(_make(bases, tmp_path / "past", train={"steps": 2, "log_every": 5}), progress=False)
    assert past["finished"] and past["final_loss"] == pytest.approx(every["losses"][1])


def test_a_non_finite_loss_stops_before_the_checkpoint_of_its_step(bases, tmp_path, monkeypatch):  # noqa: F811
    from ctxext.finetune import data as ft_data

    real = ft_data.PackedData.example
    monkeypatch.setattr(ft_data.PackedData, "example", lambda self, i: real(self, i) if i < 2 else dict(
        real(self, i), labels=real(self, i)["labels"].clone().fill_(-100)))
    with pytest.raises(RecipeError, match=r"loss is nan at step 2"):
        run(_make(bases, tmp_path / "out", train={"steps": 4, "batch_size": 2, "micro_batch_size": 2,
                                                  "save_every": 1, "log_every": 4}), progress=False)
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-1"]


def test_save_every_may_change_on_resume(bases, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    run(_make(bases, out, train={"steps": 6, "save_every": 0}), stop_after=2, progress=False)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # --stop-after's
    done = run(_make(bases, out, train={"steps": 6, "save_every": 2}), resume=True, progress=False)
    assert done["finished"] and (out / "checkpoint-4").is_dir()


def test_overwrite_clears_the_old_layout_so_a_resume_works(bases, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    old = out / "checkpoints" / "step-000002"
    old.mkdir(parents=True)
    (old / "state.json").write_text("{}")
    with pytest.raises(RecipeError, match=r"old layout \(checkpoints/step-N/\)"):
        run(_make(bases, out, train={"steps": 4}), resume=True, progress=False)
    run(_make(bases, out, train={"steps": 4}, output={"overwrite": True}), stop_after=2, progress=False)
    assert not (out / "checkpoints").exists()
    assert run(_make(bases, out, train={"steps": 4}), resume=True, progress=False)["finished"]


def test_several_gpus_in_one_process_are_refused(bases, tmp_path, monkeypatch):  # noqa: F811
    """Trainer would wrap the model in DataParallel: n_gpu x the global batch, the run's samples read twice."""
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(RecipeError, match=r"2 GPUs are visible to one process: .*torchrun --nproc_per_node 2"):
        run(_make(bases, tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()
