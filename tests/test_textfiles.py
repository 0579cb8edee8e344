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
