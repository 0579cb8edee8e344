"""One reader for evaluation and fine-tuning data files: the same files (plain, .gz, .xz; text and JSON lines) give
the same documents through `ctxext eval`'s loader and a recipe's data, and a bad line is named the same way."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path

import pytest

from ctxext.evaluation.data import load_texts
from ctxext.finetune.config import DataConfig, RecipeError
from ctxext.finetune.data import iter_documents

DOCS = ["First document, with an é.", "Second one.\nTwo lines."]
OPENERS = {"": open, ".gz": gzip.open, ".xz": lzma.open}


def _write(path: Path, text: str) -> Path:
    opener = OPENERS[path.suffix if path.suffix in (".gz", ".xz") else ""]
    with opener(path, "wt", encoding="utf-8") as fh:
        fh.write(text)
    return path


@pytest.mark.parametrize("compression", ["", ".gz", ".xz"])
def test_eval_and_finetune_read_the_same_jsonl(tmp_path, compression):
    import json

    path = _write(tmp_path / f"docs.jsonl{compression}", "".join(json.dumps({"text": d}) + "\n\n" for d in DOCS))
    assert load_texts(str(path)).texts == DOCS
    assert list(iter_documents([path], DataConfig(files=[str(path)]))) == DOCS


@pytest.mark.parametrize("compression", ["", ".gz", ".xz"])
def test_eval_and_finetune_read_the_same_text(tmp_path, compression):
    path = _write(tmp_path / f"book.txt{compression}", DOCS[0])
    assert load_texts(str(path)).texts == [DOCS[0]]
    assert list(iter_documents([path], DataConfig(files=[str(path)]))) == [DOCS[0]]


def test_a_bad_line_is_named_by_file_and_line_in_both(tmp_path):
    path = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"other": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'text' field \(choose one with --text-field\)"):
        load_texts(str(path))
    with pytest.raises(RecipeError, match=r"data.files: .*bad.jsonl:2: no 'text' field \(set data.text_field\)"):
        list(iter_documents([path], DataConfig(files=[str(path)])))
    _write(path, '{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        load_texts(str(path))


def test_a_damaged_compressed_file_is_one_clear_error(tmp_path):
    path = tmp_path / "book.txt.xz"
    path.write_bytes(b"not xz at all")
    with pytest.raises(ValueError, match=r"book.txt.xz: not a valid .xz file"):
        load_texts(str(path))
    with pytest.raises(RecipeError, match=r"data: .*book.txt.xz: not a valid .xz file"):
        list(iter_documents([path], DataConfig(files=[str(path)])))


@pytest.mark.parametrize("name", ["book.txt.gz", "docs.jsonl.gz"])
def test_a_gzip_file_damaged_inside_is_one_clear_error(tmp_path, name):
    """A flipped byte in a gzip body raises zlib.error (not BadGzipFile): it was a traceback."""
    import json

    text = "It is a truth universally acknowledged. " * 500 if name.startswith("book") else \
        "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(200))
    raw = bytearray(gzip.compress(text.encode()))
    raw[30:60] = bytes(b ^ 0xFF for b in raw[30:60])
    path = tmp_path / name
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"{name}: not a valid .gz file"):
        load_texts(str(path))
    with pytest.raises(RecipeError, match=rf"data(\.files)?: .*{name}: not a valid .gz file"):
        list(iter_documents([path], DataConfig(files=[str(path)])))


def test_eval_and_finetune_read_the_same_folder(tmp_path):
    """One folder search for both: text (also .md, compressed) and JSON lines, recursively, sorted by path; other
    files (a JSON config, binaries, hidden files) are not data."""
    import json

    (tmp_path / "b").mkdir()
    _write(tmp_path / "b" / "notes.md", "Notes.")
    _write(tmp_path / "a.txt.xz", DOCS[0])
    _write(tmp_path / "c.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    (tmp_path / "config.json").write_text('{"not": "data"}')
    (tmp_path / ".hidden.txt").write_text("hidden")
    expected = [DOCS[0], "Notes.", *DOCS]
    assert load_texts(str(tmp_path)).texts == expected
    assert list(iter_documents([tmp_path], DataConfig(files=[str(tmp_path)]))) == expected


def test_a_json_list_is_read_by_both(tmp_path):
    import json

    path = tmp_path / "docs.json"
    path.write_text(json.dumps([{"text": d} for d in DOCS]))
    assert load_texts(str(path)).texts == DOCS
    assert list(iter_documents([path], DataConfig(files=[str(path)]))) == DOCS
    path.write_text(json.dumps([{"body": "x"}]))
    with pytest.raises(RecipeError, match=r"data.files: .*docs.json: expected a list of objects with a 'text' field"):
        list(iter_documents([path], DataConfig(files=[str(path)])))


def test_a_folder_search_skips_hidden_files_and_everything_in_hidden_folders(tmp_path):
    """``.git`` and ``.ipynb_checkpoints`` hold copies and notes, not the data: read as data they would train and
    score text twice. A hidden folder above the searched one is the user's choice and is read."""
    from ctxext.data.textfiles import find_files

    root = tmp_path / ".work" / "data"
    for name in ("a.txt", ".b.txt", ".ipynb_checkpoints/a-checkpoint.txt", ".git/notes.md", "sub/c.jsonl"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x\n")
    assert [p.relative_to(root).as_posix() for p in find_files(root)] == ["a.txt", "sub/c.jsonl"]
