"""The declared transformers range, the docs' table (docs/architectures.md) and the CI matrix's record
(.ci/supported_versions.json) agree.

Whether every entry passed is the matrix's own exit status (CI fails on it), not asserted here: this suite runs
inside the matrix, while the record is being rewritten."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / ".ci" / "supported_versions.json"


def _results() -> dict:
    return json.loads(RESULTS.read_text())


def _declared() -> str:
    """pyproject's transformers requirement, read from [project] dependencies (the name also appears in keywords)."""
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in dependencies if re.match(r"transformers\b", d))


def test_pyproject_states_the_range_the_matrix_proves():
    assert _declared() == _results()["requirement"]


def test_docs_table_is_the_matrix_output():
    table = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "matrix"), "--markdown"], capture_output=True, text=True, check=True
    ).stdout.strip()
    page = (ROOT / "docs" / "architectures.md").read_text()
    section = page.split("## Supported transformers versions", 1)[1].split("\n## ", 1)[0]
    assert table in section, "docs/architectures.md's versions table is stale: paste `python3 .ci/matrix --markdown`"


def test_readme_states_the_declared_range():
    declared = _declared().removeprefix("transformers")
    assert f"Supported transformers: `{declared}`" in (ROOT / "README.md").read_text()
