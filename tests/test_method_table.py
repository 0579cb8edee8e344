"""`ctxext methods`: the method x architecture table covers all three families, from the registry."""

from __future__ import annotations

import subprocess
import sys

import ctxext
from ctxext.adapters.table import format_method_table, method_table
from ctxext.methods.registry import METHODS


def test_every_cell_says_what_happens_or_why_not():
    for row in method_table():
        for family in ("rotary", "sincos", "gpt2", "bloom"):
            assert row[family].startswith(("yes", "error: ")), row
    cells = {row["method"]: row for row in method_table()}
    assert cells["ntk"]["gpt2"] == "error: not rotary" and cells["yarn"]["bloom"] == "error: not rotary"
    assert cells["alibi"]["bloom"] == "error: already ALiBi"
    everywhere = ("pi", "nope", "extrapolate")
    assert all(cells[m][f].startswith("yes") for m in everywhere for f in ("rotary", "gpt2", "bloom"))
    assert cells["alibi"]["rotary"].startswith("yes") and cells["alibi"]["gpt2"].startswith("yes")


def test_available_methods_matches_the_table():
    table = ctxext.available_methods()
    assert set(table) == set(METHODS)
    assert table["pi"] == ["rotary", "sincos", "gpt2", "gpt-neo", "offset-table", "bloom", "mpt", "falcon-alibi"]
    assert table["alibi"] == ["rotary", "gpt2", "offset-table"]
    assert table["yarn"] == ["rotary", "sincos"] and table["dynamic-ntk"] == ["rotary"]


def test_cli_prints_the_markdown_table():
    out = subprocess.run(
        [sys.executable, "-m", "ctxext", "methods", "--markdown"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == format_method_table(markdown=True)
    assert out.splitlines()[0] == ("| method | LLaMA-family (rotary) | GPT-J / CodeGen (rotary sin-cos table) | "
                                   "GPT-2 (learned absolute) | GPT-Neo (learned absolute + causal-mask buffers) | "
                                   "OPT-style (learned absolute, embed_positions) | "
                                   "BLOOM (ALiBi) | MPT (ALiBi) | Falcon (ALiBi) |")
    assert "| `alibi` |" in out and "| `nope` |" in out and "error: already ALiBi" in out


def test_readme_shows_the_registry_table():
    from pathlib import Path

    from ctxext.adapters.table import format_method_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert format_method_table(markdown=True) in readme, "README's method table is stale: paste `ctxext methods --markdown`"
