"""Checks for bad input: a CLI command that refuses must exit 2 with one `ctxext CMD: error: ...` line (argparse's
usage lines aside), print no traceback, and leave every file under the watched folder exactly as it was."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

from ctxext.cli import main


def tree_digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` (folders included as entries, so new ones show)."""
    folder = Path(folder)
    if not folder.exists():
        return {}
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_dir():
            out[rel] = "dir"
        elif not path.is_file():  # a pipe, socket or device: reading it could block; its kind is what must stay
            out[rel] = f"special {stat.S_IFMT(path.lstat().st_mode)}"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def error_lines(stderr: str) -> list[str]:
    """stderr without argparse's usage block (the `usage:` line and its indented continuation lines)."""
    lines, in_usage = [], False
    for line in stderr.splitlines():
        if line.startswith("usage:"):
            in_usage = True
            continue
        if in_usage and (line.startswith(" ") or not line.strip()):
            continue
        in_usage = False
        if line.strip():
            lines.append(line)
    return lines


def assert_refused(argv: list, capsys, watch: Path, expect: str, *, code: int = 2) -> str:
    """Run ``ctxext *argv`` in this process; it must refuse with one error line containing ``expect``
    (case-insensitive) and change nothing under ``watch``. Returns the error line."""
    argv = [str(a) for a in argv]
    before = tree_digest(watch)
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = error_lines(err)
    assert rc == code, f"exit code {rc} for {argv}:\n{err}"
    assert len(lines) == 1, f"expected one error line for {argv}, got:\n{err}"
    assert "error:" in lines[0] and expect.lower() in lines[0].lower(), f"{expect!r} not in {lines[0]!r}"
    assert tree_digest(watch) == before, f"{argv} changed files under {watch}"
    return lines[0]
