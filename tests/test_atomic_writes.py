"""The one atomic writer and the staging folder of ``ctxext.core.outputs`` (issue 46): a file is replaced whole or
not at all, on disk before it is renamed into place, with no temporary file left behind, and a staging folder never
touches the output it stands beside."""

from __future__ import annotations

import os

import pytest

from ctxext.core.outputs import staging_folder, write_atomic


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("data, expected", [("héllo\n", "héllo\n".encode()), (b"\x00\xffbytes", b"\x00\xffbytes")])
def test_text_and_bytes_are_written_whole_with_the_usual_mode(tmp_path, data, expected):
    path = tmp_path / "new" / "folder" / "f.json"  # folders on the way are made
    write_atomic(path, data)
    assert path.read_bytes() == expected
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()  # open()'s mode, not mkstemp's 0600
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]


def test_a_file_is_on_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    path.write_text("old")
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    write_atomic(path, "new")
    assert calls == ["fsync", "replace"] and path.read_text() == "new"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, error):
    path = tmp_path / "f.txt"
    path.write_text("old")

    def fail(fd):
        raise error

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(type(error)):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_a_staging_folder_keeps_what_was_moved_out_and_never_touches_the_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.jsonl").write_text("kept\n")
    with pytest.raises(RuntimeError):
        with staging_folder(out) as staging:
            assert staging.parent == tmp_path and staging.stat().st_mode & 0o777 == 0o777 & ~_umask()
            (staging / "half.bin").write_bytes(b"x")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl"]
    with staging_folder(out) as staging:
        (staging / "done.txt").write_text("whole\n")
        os.replace(staging / "done.txt", out / "done.txt")
        (staging / "left.txt").write_text("not moved\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["done.txt", "log.jsonl"]

