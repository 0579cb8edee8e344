"""Hostile fine-tune cases (issue 51, 16-18 and two of its "Also" list): each is one `ctxext finetune: error:` line with
the key path or the folder, before the model loads where the recipe is at fault.

- train.args.neftune_noise_alpha < 0 (and train.args.label_smoothing_factor outside [0, 1)): refused with the key path
  (a negative NEFTune alpha was a RuntimeError traceback from torch at the first step);
- train.args.use_liger_kernel / train.args.deepspeed without their package: one line naming it, as report_to's and
  optim's packages (an ImportError traceback after the load; deepspeed's read "No package metadata was found for The
  'deepspeed>=0.9.3' distribution was not found");
- train.pose.chunks longer than the training window: refused with its key path before the load;
- a full disk while a checkpoint is written (torch.save's "unexpected pos N vs M"): one line naming the checkpoint
  folder, that the disk is full, and that --resume continues from the last complete checkpoint (which it does); the
  same for the adapter written at the end.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from refusals import assert_refused  # noqa: E402
from test_finetune import bases, make  # noqa: E402,F401

from ctxext.cli import main  # noqa: E402
from ctxext.finetune import RecipeError, run  # noqa: E402
from ctxext.finetune import checkpoint as ckpt  # noqa: E402
from ctxext.finetune.errors import WriteError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny" / "llama_pi_lora.yaml"


@pytest.fixture
def no_load(monkeypatch):
    """A run that reaches the model's weights fails the test: these refusals come before the load."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("ctxext.finetune.train.load_model", loaded)


def _refused(tmp_path, *sets, check=False):
    argv = ["finetune", TINY, "--no-progress", "--set", f"output.dir={tmp_path / 'out'}", "--set", "train.steps=2"]
    for s in sets:
        argv += ["--set", s]
    return argv + (["--check"] if check else [])


# ------------------------------------------------------------------------- 16: train.args values out of range


@pytest.mark.parametrize("setting, expect", [
    ("train.args.neftune_noise_alpha=-1", "train.args.neftune_noise_alpha: must be a finite number >= 0"),
    ("train.args.neftune_noise_alpha=.inf", "train.args.neftune_noise_alpha: must be a finite number >= 0"),
    ("train.args.label_smoothing_factor=1.5", "train.args.label_smoothing_factor: must be a number in [0, 1)"),
    ("train.args.label_smoothing_factor=-0.1", "train.args.label_smoothing_factor: must be a number in [0, 1)"),
])
@pytest.mark.parametrize("check", [False, True])
def test_train_args_out_of_range_are_refused_before_the_load(tmp_path, capsys, no_load, setting, expect, check):
    line = assert_refused(_refused(tmp_path, setting, check=check), capsys, tmp_path, expect)
    assert "got" in line


@pytest.mark.parametrize("args", [{"neftune_noise_alpha": 5}, {"neftune_noise_alpha": 0.0},
                                  {"neftune_noise_alpha": None}, {"label_smoothing_factor": 0.1}])
def test_train_args_in_range_are_taken(bases, tmp_path, args):  # noqa: F811
    recipe = make(bases, tmp_path / "out", train={"args": args})
    assert recipe.train.args == args


def test_a_wrong_type_is_said_once_not_as_a_range(bases, tmp_path):  # noqa: F811
    with pytest.raises(RecipeError) as err:
        make(bases, tmp_path / "out", train={"args": {"neftune_noise_alpha": "loud"}})
    assert [p for p in err.value.problems if "neftune" in p] == [
        "train.args.neftune_noise_alpha: expected a number or null, got 'loud'"]


# ------------------------------------------------------------- 17: packages that train.args fields need


@pytest.mark.parametrize("check", [False, True])
def test_liger_kernel_without_the_package_is_one_line_before_the_load(tmp_path, capsys, no_load, monkeypatch, check):
    monkeypatch.setattr("transformers.utils.import_utils.is_liger_kernel_available", lambda: False)
    line = assert_refused(_refused(tmp_path, "train.args.use_liger_kernel=true", check=check), capsys,
                          tmp_path, "train.args.use_liger_kernel: needs liger-kernel>=0.3.0, which is not installed")
    assert "pip install 'liger-kernel>=0.3.0'" in line


def test_liger_kernel_off_needs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("transformers.utils.import_utils.is_liger_kernel_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["finetune", str(TINY), "--set", "output.dir=out", "--set", "train.args.use_liger_kernel=false",
                 "--check"]) == 0


@pytest.mark.parametrize("check", [False, True])
def test_deepspeed_without_the_package_is_one_clean_line(tmp_path, capsys, no_load, monkeypatch, check):
    monkeypatch.setattr("transformers.integrations.deepspeed.is_deepspeed_available", lambda: False)
    line = assert_refused(_refused(tmp_path, "train.args.deepspeed=ds.json", check=check), capsys, tmp_path,
                          "train.args.deepspeed: needs deepspeed, which is not installed")
    assert "No package metadata" not in line


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
def test_transformers_missing_package_message_is_read_as_a_sentence(tmp_path, capsys, no_load, monkeypatch):
    """Where TrainingArguments itself finds a package missing (PackageNotFoundError, whose text begins "No package
    metadata was found for" the sentence transformers gives as the name), the line holds that sentence."""
    monkeypatch.setattr("ctxext.finetune.trainer.NEEDS_PACKAGE", {})  # ctxext's own check left out
    line = assert_refused(_refused(tmp_path, "train.args.deepspeed=ds.json", check=True), capsys, tmp_path,
                          "The 'deepspeed>=")
    assert "No package metadata" not in line and "distribution was not found" in line


# ------------------------------------------------------------------------ Also: train.pose.chunks


@pytest.mark.parametrize("check", [False, True])
def test_pose_chunks_longer_than_the_window_are_refused_before_the_load(tmp_path, capsys, no_load, check):
    line = assert_refused(_refused(tmp_path, "train.pose.chunks=1000", check=check), capsys, tmp_path,
                          "train.pose.chunks (1000) is more than the 128 tokens of the training window")
    assert "use at most 128 chunks" in line


def test_pose_chunks_up_to_the_window_pass_the_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["finetune", str(TINY), "--set", "output.dir=out", "--set", "train.pose.chunks=128", "--check"]) == 0


# --------------------------------------------------------------------- 18: a full disk while a checkpoint is written

QUICK = dict(train={"steps": 4, "save_every": 1, "keep_checkpoints": 0, "gradient_checkpointing": False},
             eval={"enabled": False})

FULL = Path("/dev/full")  # every write to it fails with ENOSPC: a real short write, as on a full disk
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")


def _short_write_at(monkeypatch, folder: Path, name: str = "optimizer.pt") -> list:
    """torch.save of ``folder/name`` writes into /dev/full (torch's zip writer meets a real short write and raises its
    "unexpected pos N vs M"); the file is left cut short, as a full disk leaves it. Returns the errors raised."""
    real, raised = torch.save, []

    def save(obj, f, *args, **kwargs):
        if not (isinstance(f, (str, os.PathLike)) and Path(f) == folder / name):
            return real(obj, f, *args, **kwargs)
        Path(f).symlink_to(FULL)
        try:
            return real(obj, f, *args, **kwargs)
        except BaseException as exc:
            raised.append(exc)
            raise
        finally:
            Path(f).unlink()
            Path(f).write_bytes(b"PK\x03\x04" + bytes(100))

    monkeypatch.setattr(torch, "save", save)
    return raised


def _no_space_under(monkeypatch, folder: Path) -> None:
    """shutil.disk_usage reports the disk of ``folder`` full (as it is after a short write)."""
    real = shutil.disk_usage

    def usage(path):
        found = real(path)
        if Path(path).resolve() == folder.resolve() or folder.resolve() in Path(path).resolve().parents:
            return type(found)(found.total, found.total, 0)
        return found

    monkeypatch.setattr(shutil, "disk_usage", usage)


@needs_dev_full
def test_a_full_disk_at_a_checkpoint_is_one_line_and_resume_continues(bases, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "out"
    recipe = make(bases, out, **QUICK)
    raised = _short_write_at(monkeypatch, out / "checkpoint-2")
    _no_space_under(monkeypatch, tmp_path)
    with pytest.raises(WriteError) as err:
        run(recipe, progress=False)
    # torch raised what it raises on a full disk: a RuntimeError with no errno anywhere in its chain
    assert raised and isinstance(raised[0], RuntimeError) and "unexpected pos" in str(raised[0])
    message = str(err.value)
    assert "\n" not in message and err.value.errno == errno.ENOSPC
    assert message.startswith(f"writing checkpoint {out / 'checkpoint-2'} failed: the disk is full (0 bytes free)")
    assert "--resume: it continues from the last complete checkpoint, checkpoint-1" in message
    assert "unexpected pos" not in message
    assert ckpt.latest(out).name == "checkpoint-1" and not (out / "checkpoint-2" / ckpt.STATE).exists()

    monkeypatch.undo()  # space freed
    done = run(recipe, resume=True, progress=False)
    whole = run(make(bases, tmp_path / "whole", **QUICK), progress=False)
    assert done["finished"] and done["losses"] == whole["losses"]


@needs_dev_full
def test_a_failed_write_on_a_disk_with_room_says_the_write_failed(bases, tmp_path, monkeypatch):  # noqa: F811
    """Without errno and with room on the disk (a quota, a file size limit, a network disk), the line says the write
    failed and what torch said, not that the disk is full."""
    out = tmp_path / "out"
    _short_write_at(monkeypatch, out / "checkpoint-1")
    monkeypatch.setattr(ckpt, "FULL_BELOW", 0)  # whatever this machine's disk holds, it is not taken as full
    with pytest.raises(WriteError) as err:
        run(make(bases, out, **QUICK), progress=False)
    message = str(err.value)
    assert message.startswith(f"writing checkpoint {out / 'checkpoint-1'} failed: the write failed: RuntimeError: ")
    assert "full" not in message and "no checkpoint is complete yet, so it starts the run over" in message


def test_no_space_for_ctxexts_record_leaves_the_checkpoint_incomplete(bases, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "out"
    real = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name == ckpt.STATE and self.parent.name == "checkpoint-2":
            real(self, text[: len(text) // 2], *args, **kwargs)  # cut short, as a full disk leaves it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(WriteError) as err:
        run(make(bases, out, **QUICK), progress=False)
    message = str(err.value)
    assert message.startswith(f"writing checkpoint {out / 'checkpoint-2'} failed: the disk is full")
    assert "checkpoint-1" in message
    assert not (out / "checkpoint-2" / ckpt.STATE).exists()  # no half record: the folder is plainly incomplete
    monkeypatch.undo()
    assert run(make(bases, out, **QUICK), resume=True, progress=False)["finished"]


def test_a_full_disk_at_the_adapter_is_one_line_and_resume_finishes(bases, tmp_path, monkeypatch):  # noqa: F811
    """The last write of a run, the adapter into output.dir: the same line, and --resume trains again from the last
    complete checkpoint."""
    from peft import PeftModel

    out = tmp_path / "out"
    real = PeftModel.save_pretrained

    def save_pretrained(self, folder, *args, **kwargs):
        if Path(folder) == out:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "adapter_model.safetensors"))
        return real(self, folder, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "save_pretrained", save_pretrained)
    recipe = make(bases, out, **QUICK)
    with pytest.raises(WriteError) as err:
        run(recipe, progress=False)
    message = str(err.value)
    assert message.startswith(f"writing the adapter to {out} failed: the disk is full")
    assert message.endswith("--resume: it continues from the last complete checkpoint, checkpoint-3")
    assert not (out / "results.json").exists()
    monkeypatch.undo()
    done = run(recipe, resume=True, progress=False)
    assert done["finished"] and (out / "adapter_model.safetensors").is_file() and len(done["losses"]) == 4


def test_the_cli_prints_one_line(bases, tmp_path, monkeypatch, capsys):  # noqa: F811
    import yaml

    from test_finetune import recipe_dict

    out = tmp_path / "out"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(bases, out, **QUICK)))

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("ctxext.finetune.trainer.RunTrainer._save_optimizer_and_scheduler", full)
    assert main(["finetune", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ctxext finetune: error: writing checkpoint {out / 'checkpoint-1'} failed: the disk is full")
    assert last.endswith("--resume: no checkpoint is complete yet, so it starts the run over")


def test_write_failure_sorts_what_is_a_failed_write(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    folder, out = tmp_path / "out" / "checkpoint-3", tmp_path / "out"
    # safetensors' I/O error carries the errno only in its text
    found = ckpt.write_failure(
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"), folder, out)
    assert found is not None and "the disk is full" in str(found) and found.errno == errno.ENOSPC
    # another OSError: the write failed, with what the system said
    found = ckpt.write_failure(OSError(errno.EIO, "Input/output error"), folder, out)
    assert "the write failed: [Errno 5] Input/output error" in str(found) and found.errno == errno.EIO
    # not a write: left as it was (a traceback, for a bug), also a RuntimeError raised elsewhere with room on the disk
    monkeypatch.setattr(ckpt, "FULL_BELOW", 0)
    assert ckpt.write_failure(ValueError("a bug"), folder, out) is None
    assert ckpt.write_failure(RuntimeError("a bug"), folder, out) is None
