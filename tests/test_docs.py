"""The documentation stays navigable: relative links resolve, anchors name real headings, README and CHANGELOG stay
short (issue 49)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The Markdown files whose links are checked.
PAGES = sorted({ROOT / "README.md", ROOT / "recipes" / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "benchmarks").glob("*.md")})

README_MAX_LINES = 250
CHANGELOG_MAX_LINES = 160

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!\\)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, with inline code spans blanked out."""
    return [(number, re.sub(r"`+[^`]*`+", "``", line)) for number, line in _outside_fences(text)]


def links(text: str) -> list[tuple[int, str]]:
    """Every link target in Markdown prose: inline links, images and reference definitions."""
    found = []
    for number, line in _prose_lines(text):
        found += [(number, m.group(1)) for m in _LINK.finditer(line)]
        ref = _REF_DEF.match(line)
        if ref:
            found.append((number, ref.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_' (of any script)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, duplicates numbered as GitHub numbers them, and HTML anchors."""
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    for _, line in _outside_fences(text):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)) or target.startswith("//")


def test_the_pages_exist():
    assert (ROOT / "README.md") in PAGES and (ROOT / "docs" / "methods.md") in PAGES
    for name in ("methods", "evaluation", "finetuning", "export", "architectures", "safety", "performance", "lab",
                 "search", "development"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    problems = []
    for number, target in links(page.read_text(encoding="utf-8")):
        if _external(target):
            continue
        path_part, _, anchor = target.partition("#")
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        dest = page if not path_part else (page.parent / path_part).resolve()
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and dest.suffix.lower() == ".md":
            if dest.is_dir() or anchor.lower() not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_changelog_is_short():
    lines = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= CHANGELOG_MAX_LINES, f"CHANGELOG.md has {len(lines)} lines; one line per user-visible change"


def test_readme_shows_your_own_model_on_the_first_screen():
    first_screen = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:45])
    assert "ctxext eval --model YOUR_MODEL" in first_screen
    assert "ctxext.patch(model" in first_screen


# -- the checker itself --------------------------------------------------------------------------------------------


def test_slug_follows_github():
    assert slug("Searching LongRoPE factors: `ctxext search longrope`") == "searching-longrope-factors-ctxext-search-longrope"
    assert slug("Which method, where (measured so far)") == "which-method-where-measured-so-far"
    assert slug("S²-Attn: LongLoRA's shifted sparse attention") == "s²-attn-longloras-shifted-sparse-attention"
    assert slug("Trainer, `train.args`, several processes") == "trainer-trainargs-several-processes"
    assert slug("The default run: `ctxext demo`") == "the-default-run-ctxext-demo"


def test_links_skip_code_and_find_every_form(tmp_path):
    text = ("See [a](x.md), ![img](pic.png) and [b](y.md#part).\n"
            "`[not](code.md)`\n```\n[not](fenced.md)\n```\n[ref]: z.md\n")
    assert [t for _, t in links(text)] == ["x.md", "pic.png", "y.md#part", "z.md"]
    page = tmp_path / "p.md"
    page.write_text("# Title\n## Title\n## A `code` head\n```\n# not a heading\n```\n")
    assert anchors(page) == {"title", "title-1", "a-code-head"}
