"""Outputs own only what ctxext wrote (issue 28): export --overwrite, eval --output on devices, pipes and foreign
files, one writer per output (a lock held by another real process), fingerprinted --resume, and the row reader."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from refusals import assert_refused
from test_eval_fixtures import CORPUS, save_tiny_llama

from ctxext.cli import main
from ctxext.evaluation.results import row_problem
from ctxext.core.outputs import OutputLock, lock_path

EVAL = ["--no-progress", "--device", "cpu", "--data", str(CORPUS), "--lengths", "32", "--methods", "none,ntk",
        "--factor", "2", "--max-windows", "1"]
EXPORT = ["--method", "pi", "--factor", "2"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


def _eval(model, out, *extra) -> int:
    return main(["eval", "--model", str(model), *EVAL, "--output", str(out), *extra])


# -- export --overwrite ------------------------------------------------------------------------------------------


def test_export_overwrite_of_the_working_directory_is_refused(tmp_path, llama_dir, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    (work / "sub").mkdir()
    (work / "sub" / "data.bin").write_bytes(b"\0" * 10)
    monkeypatch.chdir(work)
    assert_refused(["export", llama_dir, *EXPORT, "--out", ".", "--overwrite"], capsys, work, "working directory")
    assert_refused(["export", llama_dir, *EXPORT, "--out", "..", "--overwrite"], capsys, tmp_path,
                   "parent of the working directory")


def test_export_overwrite_refuses_home_and_root(tmp_path, llama_dir, capsys, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# mine")
    monkeypatch.setenv("HOME", str(home))
    assert_refused(["export", llama_dir, *EXPORT, "--out", home, "--overwrite"], capsys, home, "home folder")
    # "filesystem root", not "root": the temporary folder's path holds the user name (root in CI), so a message
    # naming the model's path matched "root" and this check passed whatever the refusal said
    assert_refused(["export", llama_dir, *EXPORT, "--out", "/", "--overwrite"], capsys, home, "filesystem root")


def test_export_overwrite_refuses_a_folder_holding_an_input(tmp_path, llama_dir, capsys):
    # the model folder's parent holds the input: replacing it would delete the model being exported
    assert_refused(["export", llama_dir, *EXPORT, "--out", llama_dir.parent, "--overwrite"], capsys,
                   llama_dir.parent, "would overwrite the model")


def test_export_overwrite_replaces_only_its_own_folder(tmp_path, llama_dir, capsys):
    out = tmp_path / "out"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    assert_refused(["export", llama_dir, *EXPORT, "--out", foreign, "--overwrite"], capsys, tmp_path,
                   "holds files ctxext did not write")
    assert main(["export", str(llama_dir), *EXPORT, "--out", str(out)]) == 0
    assert main(["export", str(llama_dir), "--method", "yarn", "--factor", "2", "--out", str(out),
                 "--overwrite"]) == 0  # its own export: replaced
    (out / "my-notes.txt").write_text("added by the user")
    assert_refused(["export", llama_dir, *EXPORT, "--out", out, "--overwrite"], capsys, tmp_path,
                   "holds files ctxext did not write")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(llama_dir), *EXPORT, "--out", str(empty), "--overwrite"]) == 0  # nothing to lose
    assert (empty / "config.json").is_file()
    assert not lock_path(out).exists() and not lock_path(empty).exists()  # locks are released and removed


# -- eval --output: what is not a ctxext result is never replaced ---------------------------------------------------


def test_eval_output_refuses_a_character_device(llama_dir, tmp_path, capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("this system has no /dev/full")
    for extra in ([], ["--overwrite"], ["--resume"]):
        assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", "/dev/full", *extra], capsys, tmp_path,
                       "character device")
    assert not os.path.isfile("/dev/full")


def test_eval_output_refuses_a_named_pipe_and_a_socket(llama_dir, tmp_path, capsys):
    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)
    assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", pipe, "--overwrite"], capsys, tmp_path,
                   "named pipe")
    rows_pipe = tmp_path / "r2.jsonl"
    os.mkfifo(rows_pipe)
    assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", tmp_path / "r2.json", "--overwrite"], capsys,
                   tmp_path, "named pipe")
    sock_path = tmp_path / "s.json"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", sock_path], capsys, tmp_path, "socket")
    assert not pipe.is_file() and not rows_pipe.is_file()


@pytest.mark.parametrize("flag", [[], ["--resume"], ["--overwrite"]])
def test_eval_never_resumes_or_replaces_a_foreign_file(llama_dir, tmp_path, capsys, flag):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, one line\n")
    line = assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", notes, *flag], capsys, tmp_path,
                          "is not a ctxext eval result")
    assert "finished run" not in line and "--resume" not in line
    # a foreign .jsonl where the rows would go
    (tmp_path / "r.jsonl").write_text('{"id": 1}\n')
    assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", tmp_path / "r.json", *flag], capsys, tmp_path,
                   "not a ctxext eval rows file")


@pytest.mark.parametrize("flag", [[], ["--resume"], ["--overwrite"]])
def test_two_outputs_sharing_a_rows_file_do_not_replace_each_others_rows(llama_dir, tmp_path, capsys, flag):
    """``c.json`` and ``c.txt`` keep their rows in one ``c.jsonl``: the second name is refused, with --overwrite too,
    and the first run's rows stay (before, --overwrite replaced them)."""
    assert _eval(llama_dir, tmp_path / "c.json") == 0
    assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", tmp_path / "c.txt", *flag], capsys, tmp_path,
                   "holds the rows of another run, whose results are")
    assert _eval(llama_dir, tmp_path / "c.json", "--resume") == 0  # the first run's own name still resumes


@pytest.mark.parametrize("flag", [["--resume"], ["--overwrite"]])
def test_a_rows_file_from_before_headers_named_their_output_is_still_protected(llama_dir, tmp_path, capsys, flag):
    """Rows headers written before ctxext recorded their results file: the sibling result with the same stem
    (``c.json``) is taken as the owner, so ``c.txt --overwrite`` still cannot replace its rows."""
    assert _eval(llama_dir, tmp_path / "c.json") == 0
    rows = tmp_path / "c.jsonl"
    header, *rest = rows.read_text().splitlines(keepends=True)
    old_header = json.loads(header)
    del old_header["output"]
    rows.write_text(json.dumps(old_header) + "\n" + "".join(rest))
    before = rows.read_bytes()
    (tmp_path / "c.json.bak").write_bytes((tmp_path / "c.json").read_bytes())  # a backup is not the owner
    assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", tmp_path / "c.txt", *flag], capsys, tmp_path,
                   "holds the rows of another run, whose results are")
    assert rows.read_bytes() == before
    assert _eval(llama_dir, tmp_path / "c.json", "--resume") == 0  # the first run's own name still resumes


# -- one writer per output ---------------------------------------------------------------------------------------


def _holder(out) -> subprocess.Popen:
    """Another process holding the output's lock, as a run loading its model would."""
    code = textwrap.dedent(f"""
        import sys, time
        from ctxext.core.outputs import OutputLock
        with OutputLock({str(out)!r}):
            print("locked", flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_on_the_same_output_is_refused_with_the_first_ones_pid(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    holder = _holder(out)
    try:
        line = assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", out], capsys, tmp_path,
                              f"pid {holder.pid}")
        assert "being written by another ctxext run" in line
        assert_refused(["export", llama_dir, *EXPORT, "--out", out], capsys, tmp_path, f"pid {holder.pid}")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder was killed: its lock file stays, but the lock died with it; the next run takes it over and says so
    assert lock_path(out).read_text().strip() == str(holder.pid)
    capsys.readouterr()
    assert _eval(llama_dir, out) == 0
    err = capsys.readouterr().err
    assert f"stale lock on {out} left by pid {holder.pid}" in err
    assert not lock_path(out).exists()
    assert len(json.loads(out.read_text())["results"]) == 2


def test_a_run_on_another_name_of_the_same_rows_file_waits_for_the_first(llama_dir, tmp_path, capsys):
    """X.json and X.txt keep their rows in one X.jsonl: while a run on X.json holds its output (before its first
    row, when the rows file names no owner yet), a run on X.txt is refused, not interleaved into the same file."""
    code = textwrap.dedent(f"""
        import time
        from types import SimpleNamespace
        from ctxext.evaluation.session import open_run
        with open_run(SimpleNamespace(device="cpu", output={str(tmp_path / "x.json")!r}, resume=False,
                                      overwrite=False)):
            print("locked", flush=True)
            time.sleep(120)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = assert_refused(["eval", "--model", llama_dir, *EVAL, "--output", tmp_path / "x.txt"], capsys,
                              tmp_path, f"pid {holder.pid}")
        assert "rows file" in line and "being written by another ctxext run" in line
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_the_lock_is_exclusive_within_one_process_too(tmp_path):
    with OutputLock(tmp_path / "x.json"):
        with pytest.raises(ValueError, match=f"pid {os.getpid()}"):
            OutputLock(tmp_path / "x.json").acquire()
    with OutputLock(tmp_path / "x.json"):  # released: free again
        pass


# -- fingerprinted resume ----------------------------------------------------------------------------------------


def _eval_in_a_process(model, data, out, *extra) -> subprocess.CompletedProcess:
    argv = ["eval", "--model", str(model), *EVAL[:3], "--lengths", "32", "--methods", "none", "--max-windows", "1",
            "--data", str(data), "--output", str(out), *extra]
    return subprocess.run([sys.executable, "-m", "ctxext", *argv], capture_output=True, text=True, timeout=300)


def test_resume_refuses_changed_data_weights_and_plan(llama_dir, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    data = tmp_path / "book.txt"
    data.write_text(CORPUS.read_text())
    out = tmp_path / "r.json"
    first = _eval_in_a_process(model, data, out)
    assert first.returncode == 0, first.stderr
    rows = out.with_suffix(".jsonl").read_text().splitlines()
    out.with_suffix(".jsonl").write_text("\n".join(rows[:1]) + "\n")  # interrupted before its row: resumable
    same = _eval_in_a_process(model, data, out, "--resume")
    assert same.returncode == 0, same.stderr
    base = ["--model", model, "--no-progress", "--device", "cpu", "--lengths", "32", "--methods", "none",
            "--max-windows", "1", "--output", out, "--resume"]
    # the same path, other contents
    data.write_text(CORPUS.read_text()[:-20] + "x" * 20)  # same size, other text
    line = assert_refused(["eval", *base, "--data", data], capsys, tmp_path, "data.content.sha256")
    assert "characters" not in line
    data.write_text(CORPUS.read_text())
    # the same model folder, other weights
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # rewritten: a new modification time
    os.utime(weights, ns=(1, 1))
    assert_refused(["eval", *base, "--data", data], capsys, tmp_path, "models[0].files.model.weights")
    # another plan
    other = ["eval", "--model", model, *EVAL[:3], "--lengths", "32", "--methods", "none,ntk", "--factor", "2",
             "--max-windows", "1", "--output", out, "--resume", "--data", data]
    assert_refused(other, capsys, tmp_path, "plan.factor, plan.methods")


# -- the row reader ---------------------------------------------------------------------------------------------

GOOD = {"kind": "ppl", "model": "m", "method": "ntk", "factor": 2.0, "length": 32, "label": "ntk x2", "ppl": 12.5,
        "tokens": 31, "windows": 1, "spec": None}

BAD_VALUES = [None, "x", -1, 0, True, [], {}, 1.5, "32", 1e308 * 10]


def _mutations():
    out = []
    for field in ("kind", "model", "method", "factor", "length", "label", "ppl", "tokens", "windows", "spec"):
        for value in BAD_VALUES:
            row = dict(GOOD, **{field: value})
            if row_problem(json.loads(json.dumps(row))) is None:
                continue  # a value the field takes (e.g. factor null, spec {})
            out.append(pytest.param(row, id=f"{field}={json.dumps(value)}"))
        out.append(pytest.param({k: v for k, v in GOOD.items() if k != field}, id=f"no {field}"))
    return out


def test_a_good_row_passes():
    assert row_problem(GOOD) is None
    assert row_problem(dict(GOOD, kind="passkey", accuracy=0.5, trials=4)) is None
    assert row_problem(dict(GOOD, ppl=None, accuracy=None, not_applicable="table too short")) is None


@pytest.mark.parametrize("row", _mutations())
def test_the_row_reader_names_what_is_wrong(row):
    problem = row_problem(json.loads(json.dumps(row)))
    assert problem and ("field" in problem or "JSON object" in problem)


@pytest.mark.parametrize("line", ["[1, 2]", "42", '"text"', "null", '{"kind": "ppl"}', '{"kind": ["ppl"]}',
                                  "[" * 100000 + "]" * 100000], ids=lambda line: line[:20])
def test_lines_that_are_not_rows(tmp_path, line):
    from ctxext.evaluation.results import _read_lines

    path = tmp_path / "r.jsonl"
    path.write_text(line + "\n")
    parsed, unreadable, cut = _read_lines(path)  # never raises
    assert not cut
    assert unreadable == 1 or row_problem(parsed[0][1])


def test_resume_reports_damaged_rows_by_line_and_never_copies_them(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _eval(llama_dir, out) == 0
    first = json.loads(out.read_text())["results"]
    jsonl = out.with_suffix(".jsonl")
    header, ppl_none, ppl_ntk = jsonl.read_text().splitlines()
    bad = json.loads(ppl_ntk)
    bad["ppl"] = None
    bad["length"] = "32"
    jsonl.write_text("\n".join([header, ppl_none, json.dumps(bad), "[1]"]) + "\n")
    capsys.readouterr()
    assert _eval(llama_dir, out, "--resume") == 0
    err = capsys.readouterr().err
    assert f"line 3 of {jsonl}: field 'length'" in err and f"line 4 of {jsonl}: not a JSON object" in err
    again = json.loads(out.read_text())["results"]
    assert len(again) == 2 and all(row_problem(r) is None for r in again)
    assert again[0] == first[0]  # the good row kept as written
    assert again[1]["ppl"] == pytest.approx(first[1]["ppl"], rel=1e-6)  # the damaged one recomputed
    capsys.readouterr()
    assert _eval(llama_dir, out, "--resume") == 0  # and a later resume still works
    assert json.loads(out.read_text())["results"] == again


def test_a_lock_leaves_no_folder_it_made(tmp_path):
    with OutputLock(tmp_path / "a" / "b" / "r.json"):
        assert (tmp_path / "a" / "b").is_dir()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "keep").mkdir()
    with OutputLock(tmp_path / "keep" / "r.json"):
        pass
    assert (tmp_path / "keep").is_dir()  # it was there before


def test_a_staged_folder_replaces_the_output_only_when_its_block_completes(tmp_path):
    """The staged write that export and search --overwrite share: a failure leaves the earlier output as it was."""
    from ctxext.core.outputs import staged_folder

    out = tmp_path / "result"
    out.mkdir()
    (out / "earlier.txt").write_text("earlier\n")
    with pytest.raises(RuntimeError):
        with staged_folder(out) as staging:
            (staging / "new.txt").write_text("half\n")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in out.iterdir()) == ["earlier.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result"]  # no staging folder left behind

    with staged_folder(out) as staging:
        (staging / "new.txt").write_text("whole\n")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result"]
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask  # mkdir's mode, not mkdtemp's 0700
