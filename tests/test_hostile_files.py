"""Hostile cases of issue 57 on processes and files: SIGTERM to `ctxext lab --jobs 2` ends its workers (13), a pickled
adapter_model.bin that torch's safe loader refuses is one error line (14), and `ctxext lab shift` on a .pt file that
holds text is the clean line a truncated file gets (15)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from refusals import assert_refused  # noqa: E402

LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:9f2c5e0b7b1b3a4c6d8e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e\nsize 174812789\n")


# ------------------------------------------------------------------------------------ 13: SIGTERM to lab --jobs

LAB_CLI = "import sys; from ctxext.cli import main; sys.exit(main(sys.argv[1:]))"


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids = []
    for task in tasks:
        try:
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return kids


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8", "replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running (a zombie, ended but not yet reaped by its parent, is not)."""
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _training_workers(pid: int) -> list[int]:
    """The spawned worker processes of ``pid`` that have imported torch (the resource tracker is not one)."""
    return [k for k in _children(pid) if "spawn_main" in _read(f"/proc/{k}/cmdline")
            and "libtorch" in _read(f"/proc/{k}/maps")]


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
                    reason="reads child processes from Linux's /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])  # ~17 s each
def test_signal_to_the_lab_main_process_ends_its_workers(tmp_path, sig):
    """Only the main process is signalled (as `kill PID` does, unlike Ctrl-C at a terminal, which signals the whole
    group): it ends the workers still training, starts no queued scheme, and exits within seconds as other commands
    do on SIGTERM / Ctrl-C. --quick trains each scheme for minutes: a run that waits for its workers cannot pass."""
    out = tmp_path / "lab"
    proc = subprocess.Popen([sys.executable, "-c", LAB_CLI, "lab", "--quick", "--jobs", "2", "--schemes",
                             "rope,alibi,nope", "--no-plot", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = _training_workers(proc.pid)
        assert len(workers) == 2, f"no two workers started: {proc.poll()} {workers}"
        time.sleep(1.0)  # into training
        os.kill(proc.pid, sig)
        try:
            _, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the lab did not exit within 15 s of {sig.name}; its workers kept it waiting")
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "a worker outlived the lab"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    word = "terminated" if sig == signal.SIGTERM else "interrupted"
    assert proc.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else 130), stderr
    assert f"ctxext lab: {word}" in stderr and "Traceback" not in stderr, stderr
    # a run cut short never looks finished, and leaves no half-written file
    assert not (out / "lab.json").exists()
    assert json.loads((out / "models" / "settings.json").read_text())["schemes"] == ["rope", "alibi", "nope"]
    assert not [p.name for p in out.rglob("*") if p.name.endswith(".tmp")]


# ------------------------------------------------------------------- 14: a pickled adapter_model.bin torch refuses

class _Payload:
    """Unpickled without the safe loader, this would run a shell command that creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from test_eval_fixtures import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


def _pickled_adapter(llama_dir, folder: Path, weights: bytes) -> Path:
    """A LoRA adapter folder whose adapter_config.json is real and whose adapter_model.bin holds ``weights``."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(llama_dir), LoraConfig(r=2, target_modules=["q_proj"]))
    peft.save_pretrained(folder, safe_serialization=False)
    (folder / "adapter_model.bin").write_bytes(weights)
    return folder


def _torch_saved(obj) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("form", ["pickle", "torch.save"])
def test_a_pickle_the_safe_loader_refuses_is_one_line_naming_the_file(llama_dir, tmp_path, capsys, form):
    """The file is refused, not run, and the line says what to do instead of torch's advice to load it unsafely."""
    import pickle

    from test_eval_fixtures import CORPUS

    marker = tmp_path / "ran"
    if form == "pickle":
        weights = pickle.dumps(_Payload(marker), protocol=2)
    else:  # a state dict with code where a tensor belongs
        weights = _torch_saved({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": _Payload(marker)})
    adapter = _pickled_adapter(llama_dir, tmp_path / "adapter", weights)
    line = assert_refused(["eval", "--no-progress", "--device", "cpu", "--model", llama_dir, "--adapter", adapter,
                           "--data", CORPUS, "--lengths", "64", "--output", tmp_path / "r.json"], capsys, tmp_path,
                          f"adapter {adapter}: adapter_model.bin is a pickle that torch's safe loader refuses (")
    assert "system" in line and line.endswith("; re-save the adapter as adapter_model.safetensors"), line
    assert "weights_only" not in line and "safe_globals" not in line, line
    assert not marker.exists(), "the pickle ran"


def test_an_adapter_bin_that_holds_an_lfs_pointer_is_named(llama_dir, tmp_path, capsys):
    from test_eval_fixtures import CORPUS

    adapter = _pickled_adapter(llama_dir, tmp_path / "adapter", LFS_POINTER.encode())
    assert_refused(["eval", "--no-progress", "--device", "cpu", "--model", llama_dir, "--adapter", adapter,
                    "--data", CORPUS, "--lengths", "64", "--output", tmp_path / "r.json"], capsys, tmp_path,
                   "adapter_model.bin is a Git LFS pointer, not the weights (fetch them with `git lfs pull`)")


def test_a_safe_adapter_bin_still_loads(llama_dir, tmp_path):
    """The check reads a real adapter_model.bin (torch.save of tensors) as peft does, and lets it through."""
    import torch

    import ctxext

    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(llama_dir),
                          LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter", safe_serialization=False)
    assert (tmp_path / "adapter" / "adapter_model.bin").is_file()
    loaded = ctxext.from_pretrained(str(llama_dir), adapter=str(tmp_path / "adapter"))
    ids = torch.arange(8)[None]
    assert (loaded(ids).logits - peft(ids).logits).abs().max() == 0


# --------------------------------------------------------------- 15: lab shift on a .pt file that holds text

@pytest.fixture(scope="module")
def lab_run_folder(tmp_path_factory):
    """A tiny finished lab run with a RoPE model (a short token stream instead of the Austen novels)."""
    import torch

    from ctxext.lab import run as lab_run
    from ctxext.lab.run import LabSettings

    tiny = LabSettings(train_len=16, d_model=32, n_layers=1, n_heads=4, d_ff=64, batch=4, steps=1, warmup=1,
                       factors=(1,), eval_windows=2, copy_seqs=4, copy_warmup=2)
    stream = torch.arange(5000) % 4096
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lab_run, "corpus", lambda: (stream, stream))
        out = tmp_path_factory.mktemp("lab")
        lab_run.run_lab(tiny, ["rope"], out, plot=False, progress=False)
    return out


def _shift_refusal(folder: Path, content: bytes | None, tmp_path, capsys, monkeypatch) -> str:
    """The error line of `ctxext lab shift` on a copy of ``folder`` whose rope.pt is ``content`` (None: cut in half)."""
    import shutil

    from ctxext.lab import shift as lab_shift

    out = tmp_path / f"lab-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(folder, out)
    model = out / "models" / "rope.pt"
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 2] if content is None else content)
    monkeypatch.setattr(lab_shift, "train_scheme", lambda *a, **k: pytest.fail("trained although refused"))
    return assert_refused(["lab", "shift", "--schemes", "rope", "--out", out, "--no-plot"], capsys, out,
                          "rope.pt does not match the settings in")


@pytest.mark.parametrize("text, reason", [(LFS_POINTER.encode(), "a Git LFS pointer"),
                                          (b"just a note: the model is on the other disk\n", "text"),
                                          ("été\n".encode("latin-1"), "text")],
                         ids=["lfs-pointer", "text", "latin-1 text"])
def test_lab_shift_on_a_model_file_that_holds_text_is_the_truncated_files_line(lab_run_folder, tmp_path, capsys,
                                                                               monkeypatch, text, reason):
    truncated = _shift_refusal(lab_run_folder, None, tmp_path, capsys, monkeypatch)
    line = _shift_refusal(lab_run_folder, text, tmp_path, capsys, monkeypatch)

    def frame(x):  # the line without the folder and the reason in parentheses
        head, _, rest = x.partition(" (")
        return Path(head.split()[-1]).name, rest.rpartition("); ")[2].split("--out")[0]

    assert frame(line) == frame(truncated), (line, truncated)
    assert reason in line.partition(" (")[2], line


def test_lab_shift_on_a_model_file_with_code_gives_torchs_reason_without_its_advice(lab_run_folder, tmp_path, capsys,
                                                                                    monkeypatch):
    marker = tmp_path / "ran"
    line = _shift_refusal(lab_run_folder, _torch_saved({"tok.weight": _Payload(marker)}), tmp_path, capsys,
                          monkeypatch)
    assert "GLOBAL" in line and "system" in line and "weights_only" not in line, line
    assert not marker.exists()
