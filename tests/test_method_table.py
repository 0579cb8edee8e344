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
                                   "BLOOM (ALiBi) | MPT (ALiBi) | Falcon (ALiBi) | temperature |")
    assert "| `alibi` |" in out and "| `nope` |" in out and "error: already ALiBi" in out


def test_docs_show_the_registry_table():
    from pathlib import Path

    from ctxext.adapters.table import format_method_table

    page = (Path(__file__).resolve().parents[1] / "docs" / "methods.md").read_text()
    assert format_method_table(markdown=True) in page, (
        "docs/methods.md's method table is stale: paste `ctxext methods --markdown`")


def test_readme_compact_table_agrees_with_the_registry():
    """README.md shows the table as yes / no per family (and whether a temperature applies): the same cells as
    `ctxext methods`' matrix, read from the registry."""
    from pathlib import Path

    from ctxext.adapters import ADAPTERS
    from ctxext.commands.methods import fits

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    families = [a.family for a in ADAPTERS]
    header = "| method | " + " | ".join(families) + " | temperature |"
    assert header in readme, f"README's compact method table needs the header {header!r}"
    lines = readme.split(header, 1)[1].strip().splitlines()[1:]  # after the |---| line
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    full = format_method_table(markdown=True).splitlines()[2:]
    temperature = {r.split("|")[1].strip().strip("`"): r.split("|")[-2].strip() for r in full}
    expected = {row["method"]: ["yes" if fits(row[f]) else "no" for f in families]
                + ["no" if temperature[row["method"]] == "no" else "yes"] for row in method_table()}
    assert rows == expected, "README's compact method table disagrees with `ctxext methods`: regenerate it"


# -- the text views fit a terminal (issue 26) ------------------------------------------------------------------------


def _methods(capsys, *argv: str) -> str:
    from ctxext.cli import main

    assert main(["methods", *argv]) == 0
    return capsys.readouterr().out


def _families() -> list[str]:
    from ctxext.adapters import ADAPTERS

    return [a.family for a in ADAPTERS]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_default_output_is_a_yes_no_matrix_that_fits_120_columns(capsys):
    out = _methods(capsys)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert lines[0].split() == ["method", *_families()]
    matrix = {line.split()[0]: line.split()[1:] for line in lines[2 : 2 + len(METHODS)]}
    assert list(matrix) == list(METHODS)
    for row in method_table():  # a cell that says why not ("error: ...") is a no, every other a yes
        assert matrix[row["method"]] == ["no" if row[f].startswith("error") else "yes" for f in _families()], row
    for m in METHODS.values():  # the summaries follow, wrapped, words intact
        assert _flat(m.summary) in _flat(out)
    assert "--why" in out and "--family" in out


def test_why_shows_every_cell_in_full_within_120_columns(capsys):
    out = _methods(capsys, "--why")
    assert max(len(line) for line in out.splitlines()) <= 120
    blocks = out.strip().split("\n\n")
    assert [b.split(":")[0] for b in blocks] == _families()
    for family, block in zip(_families(), blocks):
        for row in method_table():
            assert _flat(f"{row['method']} {row[family]}") in _flat(block), (family, row["method"])


def test_family_shows_that_familys_cells(capsys):
    rows = method_table()
    for family in _families():
        out = _methods(capsys, "--family", family.upper())
        assert out.splitlines()[0].startswith(f"{family}: ")
        assert len(out.splitlines()) == 1 + len(rows)
        for row in rows:
            assert _flat(f"{row['method']} {row[family]}") in _flat(out), (family, row["method"])
    assert "error: not rotary" in _methods(capsys, "--family", "gpt2")


def test_long_cells_are_wrapped_not_cut(capsys, monkeypatch):
    from ctxext.adapters import ADAPTERS

    import ctxext.commands.methods as command

    long = "yes: " + " ".join(f"word{i}" for i in range(60))
    table = command.method_table

    def with_a_long_cell():
        rows = table()
        next(r for r in rows if r["method"] == "pi")[ADAPTERS[0].family] = long
        return rows

    monkeypatch.setattr(command, "method_table", with_a_long_cell)
    for argv in (["--why"], ["--family", ADAPTERS[0].family]):
        out = _methods(capsys, *argv)
        assert max(len(line) for line in out.splitlines()) <= 120
        assert _flat(f"pi {long}") in _flat(out)


def test_unknown_family_and_mixed_views_are_one_line_errors(capsys):
    from ctxext.cli import main

    assert main(["methods", "--family", "no-such-family"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown family 'no-such-family'" in err and "rotary" in err
    for argv in (["--why", "--markdown"], ["--family", "rotary", "--json"], ["--why", "--census"]):
        assert main(["methods", *argv]) == 2
        assert "leave out" in capsys.readouterr().err


def test_markdown_and_json_are_unchanged(capsys):
    assert _methods(capsys, "--markdown") == format_method_table(markdown=True) + "\n"
    import json

    rows = json.loads(_methods(capsys, "--json"))
    assert [r["method"] for r in rows] == list(METHODS)
    assert all(r[f] == t[f] for r, t in zip(rows, method_table()) for f in _families())
