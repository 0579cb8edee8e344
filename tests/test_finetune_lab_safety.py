"""Issue 28, every check before work: `ctxext finetune` and `ctxext lab` refuse what cannot work before a model loads
or training starts (batch sizes that cannot be sane, outputs that cannot be written), `lab shift` says when it must
train, and `finetune --resume` passes over a damaged checkpoint for the newest intact one. Tiny models, seconds each."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from refusals import assert_refused, tree_digest  # noqa: E402

from ctxext.cli import main  # noqa: E402
from ctxext.finetune import checkpoint as ft_checkpoint  # noqa: E402
from ctxext.finetune import train as ft_train  # noqa: E402
from ctxext.lab import run as lab_run  # noqa: E402
from ctxext.lab import shift as lab_shift  # noqa: E402
from ctxext.core.outputs import check_writable_folder, file_damage  # noqa: E402

WORDS = ("the of and to a in that it was her not be he his as had with for she you all which but at on have my "
         "so him by very said from this they no would been were could there an one what or Emma Harriet").split()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny LLaMA (vocab ~128) saved with a small BPE tokenizer, and a folder of training text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import tiny_llama

    root = tmp_path_factory.mktemp("safety")
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(3000))
    (root / "data").mkdir()
    (root / "data" / "a.txt").write_text(text)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    tiny_llama(vocab_size=tok.get_vocab_size()).save_pretrained(root / "llama")
    fast.save_pretrained(root / "llama")
    return root


def recipe(base: Path, out, **changes) -> dict:
    d = {
        "model": {"name": str(base / "llama")},
        "patch": {"method": "pi", "factor": 2},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"files": [str(base / "data")], "seq_length": 32},
        "train": {"steps": 6, "batch_size": 2, "micro_batch_size": 1, "save_every": 2, "warmup_steps": 1,
                  "gradient_checkpointing": False},
        "eval": {"enabled": False},
        "output": {"dir": str(out)},
    }
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        d[section][key] = value
    return d


def write(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the fine-tune gets as far as loading a model."""
    monkeypatch.setattr(ft_train, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(ft_train, "load_tokenizer", lambda *a, **k: pytest.fail("a tokenizer was loaded"))


def assert_refused_at_run(argv: list, capsys, watch: Path, expect: str) -> str:
    """As ``assert_refused``, for a refusal after the run has begun (its ``[finetune]`` progress lines and the weight
    loading bar are allowed): exit 2, one error line, no traceback, nothing changed under ``watch``."""
    before = tree_digest(watch)
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("[finetune] ", "Loading weights"))]
    assert rc == 2, f"exit code {rc}:\n{err}"
    assert len(lines) == 1 and "error:" in lines[0] and expect in lines[0], err
    assert tree_digest(watch) == before
    return lines[0]


def deny_writes(monkeypatch, folder: Path) -> None:
    """Simulate a folder nobody may create files or folders in (tests run as root, where chmod stops nothing): the
    calls ``tempfile.mkstemp``, ``os.mkdir`` and ``Path.mkdir`` go through fail with EACCES inside ``folder``."""
    folder = Path(folder).absolute()
    real_open, real_mkdir = os.open, os.mkdir

    def inside(path) -> bool:
        p = Path(os.fsdecode(path)).absolute()
        return p.parent == folder or folder in p.parents

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and inside(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
        return real_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if inside(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


# ------------------------------------------------------------------------------ the generic helpers (outputs.py)


def test_check_writable_folder_probes_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "f.txt").write_text("a file")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = tree_digest(tmp_path)
    check_writable_folder(tmp_path, "--out")  # exists
    check_writable_folder(tmp_path / "new" / "deeper", "--out")  # made later, under a folder that exists
    assert tree_digest(tmp_path) == before  # the probe file is gone
    with pytest.raises(ValueError, match=r"--out .*f\.txt is a file, not a folder"):
        check_writable_folder(tmp_path / "f.txt", "--out")
    with pytest.raises(ValueError, match=r"cannot be made: .*f\.txt is a file"):
        check_writable_folder(tmp_path / "f.txt" / "out", "--out")
    with pytest.raises(ValueError, match="is a link to nothing"):
        check_writable_folder(tmp_path / "dangling" / "out", "--out")
    with pytest.raises(ValueError, match="is a character device"):
        check_writable_folder("/dev/null/out", "--out")
    locked = tmp_path / "locked"
    locked.mkdir()
    deny_writes(monkeypatch, locked)
    with pytest.raises(ValueError, match=r"cannot create files in .*locked \(Permission denied\); choose a folder"):
        check_writable_folder(locked / "run", "--out")
    monkeypatch.undo()
    assert tree_digest(tmp_path) == {**before, "locked": "dir"}


def test_file_damage_reads_the_formats(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "a.safetensors"))
    torch.save({"x": torch.arange(100)}, tmp_path / "b.bin")
    (tmp_path / "c.json").write_text('{"step": 2}')
    for name in ("a.safetensors", "b.bin", "c.json"):
        assert file_damage(tmp_path / name) is None, name
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[: len(data) // 2])
        assert file_damage(tmp_path / name), name
        (tmp_path / name).write_bytes(b"")
        assert file_damage(tmp_path / name) == "empty"
    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "a.safetensors"))
    size = (tmp_path / "a.safetensors").stat().st_size
    with open(tmp_path / "a.safetensors", "r+b") as fh:
        fh.truncate(size - 10)
    assert file_damage(tmp_path / "a.safetensors") == f"truncated: {size - 10} of {size} bytes"
    assert "cannot be read" in file_damage(tmp_path / "missing.bin")


# ------------------------------------------------------------------------------ 1. batch sizes


def test_absurd_accumulation_is_refused_at_check(base, tmp_path, capsys, no_model_load):
    """10**12 sequences per step passed --check and the run sat at step 0; now --check names the bound."""
    r = write(tmp_path / "r.yaml", recipe(base, tmp_path / "out"))
    line = assert_refused(["finetune", r, "--set", "train.batch_size=1000000000000", "--check"], capsys, tmp_path,
                          "micro-batches per optimizer step")
    assert "1000000000000" in line and "4096" in line and "raise train.micro_batch_size" in line
    assert_refused(["finetune", r, "--set", "train.batch_size=1000000000000"], capsys, tmp_path,
                   "more than the 4096")
    # the largest count allowed passes (only the sizes are checked: no data is read)
    capsys.readouterr()
    assert main(["finetune", str(r), "--set", "train.batch_size=8192", "--set", "train.micro_batch_size=2",
                 "--check"]) == 0


def test_batch_larger_than_max_sequences_is_refused_at_check(base, tmp_path, capsys, no_model_load):
    r = write(tmp_path / "r.yaml", recipe(base, tmp_path / "out", data__max_sequences=3, train__batch_size=4))
    line = assert_refused(["finetune", r, "--check"], capsys, tmp_path, "train.batch_size (4) is larger than "
                          "data.max_sequences (3)")
    assert line.count("error:") == 1


def test_batch_larger_than_the_data_is_refused_before_the_output_is_made(base, tmp_path, capsys):
    """A global batch past the packed sequences is refused once the data is read, before output.dir is touched,
    naming both numbers."""
    out = tmp_path / "out"
    r = write(tmp_path / "r.yaml", recipe(base, out, train__batch_size=512, train__micro_batch_size=256))
    line = assert_refused_at_run(["finetune", r, "--no-progress"], capsys, tmp_path,
                                 "train.batch_size (512) is larger than")
    assert "packed sequences of 32 tokens" in line and "at most" in line
    n = int(line.split("larger than the ")[1].split()[0])
    assert 0 < n < 512 and f"at most {n}" in line
    assert not out.exists()


# ------------------------------------------------------------------------------ 2. output.dir cannot be written


@pytest.mark.parametrize("check", [True, False], ids=["check", "run"])
def test_unwritable_output_dir_is_refused_before_any_model_loads(base, tmp_path, capsys, monkeypatch,
                                                                 no_model_load, check):
    locked = tmp_path / "locked"
    locked.mkdir()
    r = write(tmp_path / "r.yaml", recipe(base, locked / "run"))
    deny_writes(monkeypatch, locked)
    line = assert_refused(["finetune", r, *(["--check"] if check else ["--no-progress"])], capsys, tmp_path,
                          "cannot create files in")
    assert "output.dir" in line and "locked" in line and "choose a folder you can write" in line


@pytest.mark.parametrize("where, expect", [
    ("notes.txt/deeper/run", "cannot be made"),  # under a regular file, two levels down
    ("dangling/run", "is a link to nothing"),  # under a link to nothing: mkdir would fail after training
])
def test_output_dir_that_cannot_be_made_is_refused(base, tmp_path, capsys, no_model_load, where, expect):
    (tmp_path / "notes.txt").write_text("a file\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    r = write(tmp_path / "r.yaml", recipe(base, tmp_path / where))
    for extra in (["--check"], ["--no-progress"]):
        assert_refused(["finetune", r, *extra], capsys, tmp_path, expect)


# ------------------------------------------------------------------------------ 3. lab --out


def _no_training(monkeypatch):
    for module in (lab_run, lab_shift):
        monkeypatch.setattr(module, "corpus", lambda: pytest.fail("training started"))


@pytest.mark.parametrize("probe", [[], ["shift"]], ids=["lab", "shift"])
def test_lab_out_that_is_a_file_is_refused_before_training(tmp_path, capsys, monkeypatch, probe):
    _no_training(monkeypatch)
    (tmp_path / "results.txt").write_text("not a folder\n")
    assert_refused(["lab", *probe, "--quick", "--out", tmp_path / "results.txt", "--no-plot"], capsys, tmp_path,
                   "results.txt is a file, not a folder")
    assert_refused(["lab", *probe, "--quick", "--out", tmp_path / "results.txt" / "lab", "--no-plot"], capsys,
                   tmp_path, "cannot be made")


@pytest.mark.parametrize("probe", [[], ["shift"]], ids=["lab", "shift"])
def test_lab_unwritable_out_is_refused_before_training(tmp_path, capsys, monkeypatch, probe):
    _no_training(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    deny_writes(monkeypatch, locked)
    assert_refused(["lab", *probe, "--quick", "--out", locked / "lab", "--no-plot"], capsys, tmp_path,
                   "cannot create files in")


# ------------------------------------------------------------------------------ 4. lab shift says it must train


class _Stop(Exception):
    pass


@pytest.mark.parametrize("empty", ["missing", "empty-folder"])
def test_lab_shift_says_it_must_train_before_training(tmp_path, capsys, monkeypatch, empty):
    out = tmp_path / "lab"
    if empty == "empty-folder":
        out.mkdir()
    stream = torch.arange(5000) % 4096
    monkeypatch.setattr(lab_shift, "corpus", lambda: (stream, stream))

    def stop(*a, **k):
        raise _Stop  # the first model would start training here

    monkeypatch.setattr(lab_shift, "train_scheme", stop)
    capsys.readouterr()
    with pytest.raises(_Stop):
        main(["lab", "shift", "--quick", "--out", str(out), "--no-plot"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("lab shift: no trained lab models in ") and "must train its own" in line
    assert "4 models (learned, sinusoidal, rope, alibi) x 200 steps" in line and "min on 2 idle CPU cores" in line
    assert f"ctxext lab --quick --out {out}" in line
    # the full settings: a longer estimate; --steps: says why it trains
    with pytest.raises(_Stop):
        main(["lab", "shift", "--out", str(out), "--no-plot"])
    full = capsys.readouterr().err.strip()
    assert "x 500 steps" in full
    quick_min = int(line.split("about ")[1].split()[0])
    full_min = int(full.split("about ")[1].split()[0])
    assert 1 <= quick_min < full_min <= 30
    with pytest.raises(_Stop):
        main(["lab", "shift", "--quick", "--steps", "5", "--out", str(out), "--no-plot"])
    assert "--steps was given, so it trains new models" in capsys.readouterr().err


def test_training_estimate_matches_the_measured_full_run():
    """The estimate is anchored on the measured full lab (benchmarks/results/lab, 2026-11-28: 345-401 s of training
    per scheme, two at a time, 19 min 24 s wall)."""
    seconds = lab_run.estimated_train_seconds(lab_run.FULL, 6, jobs=2)
    assert 14 * 60 < seconds < 20 * 60
    assert lab_run.estimated_train_seconds(lab_run.FULL, 6) == pytest.approx(2 * seconds)  # one at a time
    quick = lab_run.estimated_train_seconds(lab_run.QUICK, 6, jobs=2)
    assert 1 * 60 < quick < 5 * 60


# ------------------------------------------------------------------------------ 5. damaged checkpoints


@pytest.fixture(scope="module")
def stopped(base, tmp_path_factory):
    """A run of 6 steps stopped after 4, with checkpoints at steps 2 and 4 (and the losses an unbroken run has)."""
    from ctxext.finetune import recipe_from_dict, run

    root = tmp_path_factory.mktemp("stopped")
    run(recipe_from_dict(recipe(base, root / "out")), stop_after=4, progress=False)
    ck = root / "out"  # Trainer's layout: OUT/checkpoint-N, with ctxext's record written last
    assert sorted(p.name for p in ck.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    losses = json.loads((ck / "checkpoint-4" / "ctxext_state.json").read_text())["losses"]
    return root / "out", losses


def _copy_run(stopped, tmp_path) -> tuple[Path, Path]:
    out = tmp_path / "out"
    shutil.copytree(stopped[0], out)
    data = yaml.safe_load((out / "recipe.yaml").read_text())
    data["output"]["dir"] = str(out)
    return out, write(tmp_path / "r.yaml", data)


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage", ["adapter_model.safetensors", "optimizer.pt", "rng_state.pth", "ctxext_state.json",
                                    "trainer_state.json", "missing:scheduler.pt"])
def test_resume_passes_over_a_damaged_checkpoint(stopped, tmp_path, capsys, damage):
    out, r = _copy_run(stopped, tmp_path)
    step4 = out / "checkpoint-4"
    if damage.startswith("missing:"):
        damage = damage.split(":", 1)[1]
        (step4 / damage).unlink()
    else:
        _truncate(step4 / damage)
    capsys.readouterr()
    assert main(["finetune", str(r), "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    notes = [x for x in err.splitlines() if "is damaged" in x]
    assert len(notes) == 1, err
    assert f"checkpoint {step4} is damaged ({damage}: " in notes[0]
    assert "resuming from checkpoint-2, the newest intact one" in notes[0]
    result = json.loads((out / "results.json").read_text())
    assert result["finished"] and result["steps"] == 6
    assert result["losses"][:4] == pytest.approx(stopped[1], abs=1e-6)  # steps 3-4 redone, the same
    names = sorted(p.name for p in out.glob("*checkpoint-*"))
    assert names == ["checkpoint-2", "checkpoint-4", "damaged-checkpoint-4"], names  # new step 4; the bad one aside
    assert ft_checkpoint.damage(out / "checkpoint-4") is None


def test_resume_refuses_when_no_checkpoint_is_intact(stopped, tmp_path, capsys, monkeypatch):
    out, r = _copy_run(stopped, tmp_path)
    _truncate(out / "checkpoint-4" / "adapter_model.safetensors")
    _truncate(out / "checkpoint-2" / "optimizer.pt", 0.1)
    with monkeypatch.context() as m:  # refused before the model loads
        m.setattr(ft_train, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
        line = assert_refused(["finetune", r, "--resume", "--no-progress"], capsys, out, "cannot resume")
    assert "checkpoint-4/adapter_model.safetensors is damaged (truncated: " in line
    assert "earlier checkpoint(s) are damaged too" in line and "--set output.overwrite=true" in line
    # starting over as told works past the damage
    capsys.readouterr()
    assert main(["finetune", str(r), "--set", "output.overwrite=true", "--set", "train.steps=2",
                 "--no-progress"]) == 0


def test_checkpoints_record_their_file_sizes(stopped):
    folder = stopped[0] / "checkpoint-4"
    state = json.loads((folder / "ctxext_state.json").read_text())
    assert state["files"]["adapter_model.safetensors"] == (folder / "adapter_model.safetensors").stat().st_size
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(state["files"])


def test_damaged_adapter_file_is_named(base, stopped, tmp_path):
    import ctxext
    from ctxext.finetune import recipe_from_dict, run

    out = tmp_path / "done"
    run(recipe_from_dict(recipe(base, out, train__steps=1)), progress=False)
    _truncate(out / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        ctxext.from_pretrained(str(base / "llama"), adapter=str(out))


# ------------------------------------------------------------------------------ hostile recipe values


def _alarm(seconds: int):
    def handler(*_):
        raise TimeoutError(f"hung for {seconds} s")

    signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)


#: (override, text of the error line, refused at --check: else --check passes and the run refuses before writing)
HOSTILE = [
    ("train.batch_size=1000000000000", "micro-batches per optimizer step", True),
    ("train.micro_batch_size=1000000000000", "must be a multiple of train.micro_batch_size", True),
    ("train.seed=-1", "train.seed: input should be greater than or equal to 0, got -1", True),
    ("train.seed=100000000000000000000", "train.seed: input should be less than 4294967296", True),
    ("train.lr=1e300", "train.lr: input should be less than or equal to 1", True),
    ("lora.r=1000000000", "lora.r (1000000000) is larger than the rank any targeted layer can have (at most 48", True),
    ("lora.trainable=['']", "lora.trainable: an empty module name", True),
    ("lora.target_modules=[q_proj, '']", "lora.target_modules: an empty module name", True),
    ("data.files=['']", "data.files: an empty path", True),
    ("eval.data=''", "eval.data: an empty path", True),
    ("train.steps=''", "train.steps: input should be a valid integer, unable to parse string as an integer, got ''", True),
    ("lora.alpha=[]", "lora.alpha: input should be a valid number", True),
    ("output.dir=''", "output.dir is required", True),
    ("data.text_field=''", "data.text_field must not be empty", True),
    ("data.seq_length=1000000000000", "fewer than one sequence of data.seq_length=1000000000000", False),
    ("eval.lengths=[64, 1000000000000]", "eval.lengths: 1000000000000 longer than the", False),
]


@pytest.mark.parametrize("override, expect, at_check", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_values_are_refused_cleanly(base, tmp_path, capsys, monkeypatch, override, expect, at_check):
    """Huge numbers, empty strings and wrong types in a recipe: one error line, never a traceback or a hang; refused
    by --check where no data is needed, else by the run before output.dir is made."""
    r = write(tmp_path / "r.yaml", recipe(base, tmp_path / "out", eval__enabled=True))
    _alarm(60)
    try:
        if at_check:
            monkeypatch.setattr(ft_train, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
            for extra in (["--check"], ["--no-progress"]):
                assert_refused(["finetune", r, "--set", override, *extra], capsys, tmp_path, expect)
        else:
            capsys.readouterr()
            assert main(["finetune", str(r), "--set", override, "--check"]) == 0
            assert_refused_at_run(["finetune", r, "--set", override, "--no-progress"], capsys, tmp_path, expect)
        assert not (tmp_path / "out").exists()
    finally:
        signal.alarm(0)
