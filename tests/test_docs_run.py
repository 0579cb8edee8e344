"""The documentation stays true (issue 49, item 7): every Python block in README.md and docs/*.md runs, offline, with a
shipped reference model standing in for the hub ids it names; every `ctxext ...` command shown in a shell block
parses with the real command-line parser, with no flag the subcommand lacks.

A Python block that is deliberately not runnable is marked in the Markdown with an HTML comment on the line before
its fence, ``<!-- not run: why -->``; it is reported as skipped with that reason (``-ra`` lists them), and there may
be at most ``MAX_NOT_RUN`` of them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The pages whose code blocks are checked.
PAGES = sorted({ROOT / "README.md", *(ROOT / "docs").glob("*.md")})

#: Hub ids (as quoted in the Python blocks) -> what stands in for them. ``{model}`` is a folder holding the shipped
#: reference LLaMA (``ctxext.from_pretrained("reference:llama")``) and its tokenizer, saved by the test.
SUBSTITUTIONS: dict[str, str] = {
    '"YOUR_MODEL"': '"{model}"',
    '"HuggingFaceTB/SmolLM2-135M"': '"{model}"',
    "'YOUR_MODEL'": '"{model}"',
    "'HuggingFaceTB/SmolLM2-135M'": '"{model}"',
}

#: Python blocks marked ``<!-- not run: ... -->`` allowed in all (keep them few).
MAX_NOT_RUN = 3

#: Seconds for all runnable Python blocks together (one process).
RUN_TIMEOUT = 300

_PYTHON = {"python", "py", "python3"}
_SHELL = {"bash", "sh", "shell", "console"}
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.*?)\s*-->\s*$", re.I)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason, when marked <!-- not run: ... -->

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the language of each and its ``not run`` mark, if any."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s{0,3}(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _NOT_RUN.match(before)
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n", mark.group(1) if mark else None))
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in code_blocks(page)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang in _PYTHON]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in _SHELL]


# -- Python blocks -------------------------------------------------------------------------------------------------

_RUNNER = r'''
import json, os, sys, traceback
from pathlib import Path

spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
work = Path(spec["work"])
import ctxext
from ctxext.reference import reference_tokenizer

model_dir = work / "model"
ctxext.from_pretrained("reference:llama").save_pretrained(model_dir)
reference_tokenizer("llama").save_pretrained(model_dir)
results = {}
for n, block in enumerate(spec["blocks"]):
    code = block["code"]
    for old, new in spec["substitutions"].items():
        code = code.replace(old, new.format(model=model_dir))
    cwd = work / f"block{n}"
    cwd.mkdir()
    os.chdir(cwd)
    try:
        exec(compile(code, block["where"], "exec"), {"__name__": "__main__"})
        results[block["where"]] = None
    except BaseException:
        results[block["where"]] = traceback.format_exc()
Path(sys.argv[2]).write_text(json.dumps(results), encoding="utf-8")
'''


def _offline_env() -> dict[str, str]:
    import ctxext

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1")
    # the ctxext this test imported, whichever way it is installed
    package_root = str(Path(ctxext.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def python_results(tmp_path_factory) -> dict[str, str | None]:
    """Runs every runnable Python block, each in a fresh namespace and working directory, in one offline process
    (one import of torch and transformers for all). Returns where -> None (ran) or the traceback."""
    work = tmp_path_factory.mktemp("doc_blocks")
    runnable = [b for b in PYTHON_BLOCKS if b.not_run is None]
    spec = {"work": str(work), "substitutions": SUBSTITUTIONS,
            "blocks": [{"where": b.where, "code": b.code} for b in runnable]}
    (work / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    (work / "runner.py").write_text(_RUNNER, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(work / "runner.py"), str(work / "spec.json"), str(work / "out.json")],
                          cwd=work, env=_offline_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if not (work / "out.json").exists():
        pytest.fail(f"the doc-block runner failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((work / "out.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_python_block_runs(block: Block, python_results):
    if block.not_run is not None:
        pytest.skip(f"{block.where}: not run: {block.not_run}")
    problem = python_results[block.where]
    assert problem is None, f"the Python block at {block.where} does not run as written:\n{problem}"


def test_python_blocks_exist_and_few_are_not_run():
    assert len(PYTHON_BLOCKS) >= 3, "the README and docs lost their Python examples?"
    not_run = [f"{b.where}: {b.not_run}" for b in PYTHON_BLOCKS if b.not_run is not None]
    assert all(b.not_run.strip() for b in PYTHON_BLOCKS if b.not_run is not None), "a not-run mark needs a reason"
    assert len(not_run) <= MAX_NOT_RUN, "too many Python blocks are not run:\n" + "\n".join(not_run)


# -- ctxext command lines ------------------------------------------------------------------------------------------

#: Subcommands whose arguments belong to another program (lm-eval's own parser): only the subcommand is checked.
PASSTHROUGH = {"lm-eval"}

_OPERATORS = {"&&", "||", ";", "|", "&"}
_REDIRECT = re.compile(r"(?<!\S)\d*(?:&>|>>|>&|>\||<&|>|<)\s*\S+")  # > out, 2>&1, >> log


def _logical_lines(code: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    out, pending = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def ctxext_commands(code: str) -> list[list[str]]:
    """The argument lists given to ctxext in a shell block: ``ctxext ARGS`` and ``... -m ctxext ARGS`` (python,
    torchrun, accelerate launch), with comments, redirections, ``...`` and the ``[optional]`` brackets of a usage
    line dropped."""
    found = []
    for line in _logical_lines(code):
        segment: list[str] = []
        segments = [segment]
        for tok in _tokens(_REDIRECT.sub(" ", line)):
            if tok in _OPERATORS:
                segment = []
                segments.append(segment)
            else:
                segment.append(tok)
        for seg in segments:
            if seg[:1] == ["ctxext"]:
                args = seg[1:]
            elif "ctxext" in seg and seg.index("ctxext") > 0 and seg[seg.index("ctxext") - 1] == "-m":
                args = seg[seg.index("ctxext") + 1:]
            else:
                continue
            args = [a.strip("[]") for a in args if a not in ("...", "…")]
            found.append([a for a in args if a and a not in ("--help", "-h")])
    return found


COMMANDS = [(b, args) for b in SHELL_BLOCKS for args in ctxext_commands(b.code)]


def _subcommand_parsers(parser, args: list[str]):
    """The chain of parsers ``args`` reaches (``ctxext``, then e.g. ``search``, then ``longrope``)."""
    import argparse

    chain, rest = [parser], list(args)
    while True:
        subs = [a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return chain
        word = next((a for a in rest if not a.startswith("-")), None)
        if word not in subs[0].choices:
            return chain
        chain.append(subs[0].choices[word])
        rest = rest[rest.index(word) + 1:]


@pytest.mark.parametrize("block,args", COMMANDS, ids=lambda x: x.where if isinstance(x, Block) else " ".join(x)[:60])
def test_ctxext_command_parses(block: Block, args: list[str], capsys):
    from ctxext.cli import build_parser

    where = f"{block.where}: ctxext {' '.join(args)}"
    assert args, f"{where}: no subcommand"
    parser = build_parser()
    chain = _subcommand_parsers(parser, args)
    assert len(chain) > 1, f"{where}: {args[0]!r} is not a ctxext subcommand"
    if args[0] not in PASSTHROUGH:
        known = {opt for p in chain for action in p._actions for opt in action.option_strings}
        unknown = [a.split("=", 1)[0] for a in args
                   if re.match(r"^--?[A-Za-z]", a) and a.split("=", 1)[0] not in known]
        assert not unknown, f"{where}: no such flag {unknown} (the flags of `ctxext {args[0]}`: {sorted(known)})"
    try:
        parser.parse_args(args)  # parses only: nothing runs
    except SystemExit as exc:
        err = capsys.readouterr().err
        elided = "..." in block.code and "the following arguments are required" in err
        assert exc.code == 0 or elided, f"{where}: the parser refuses it:\n{err}"


def test_recipes_named_in_commands_exist():
    missing = [f"{b.where}: {a}" for b, args in COMMANDS for a in args
               if a.endswith((".yaml", ".yml")) and "/" in a and not (ROOT / a).exists()]
    assert not missing, "recipes named in the docs do not exist:\n" + "\n".join(missing)


def test_commands_are_found():
    subcommands = {args[0] for _, args in COMMANDS if args}
    assert {"demo", "eval", "finetune", "export", "methods", "lm-eval"} <= subcommands, subcommands


# -- the checker itself --------------------------------------------------------------------------------------------


def test_ctxext_commands_finds_every_form():
    code = ("python3 -m pip install -e '.[all]' && ctxext demo   # a comment --not-a-flag\n"
            "ctxext eval --model M \\\n    --factor 4 > out.txt 2>&1\n"
            "torchrun --nproc_per_node 2 -m ctxext eval ...\n"
            "ctxext search longrope M --factor 4 --out o \\\n    [--data d/] [--resume]\n"
            "python3 -m pytest -m slow\n")
    assert ctxext_commands(code) == [["demo"], ["eval", "--model", "M", "--factor", "4"], ["eval"],
                                     ["search", "longrope", "M", "--factor", "4", "--out", "o", "--data", "d/",
                                      "--resume"]]


def test_code_blocks_read_marks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("x\n<!-- not run: needs a GPU -->\n```python\nimport torch\n```\n\n```bash\nctxext demo\n```\n")
    blocks = code_blocks(page)
    assert [(b.line, b.lang, b.code, b.not_run) for b in blocks] == [
        (3, "python", "import torch\n", "needs a GPU"), (7, "bash", "ctxext demo\n", None)]
