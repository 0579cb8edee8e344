"""Inputs that were accepted although they do nothing or are malformed (issue 28): each is now one error line with
nothing written."""

from __future__ import annotations

import json

import pytest

import ctxext
from conftest import tiny_llama
from refusals import assert_refused
from test_eval_fixtures import CORPUS, save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


def _eval(llama_dir, tmp_path, *argv):
    return ["eval", "--no-progress", "--device", "cpu", "--model", llama_dir, "--lengths", "32", "--max-windows", "1",
            "--output", tmp_path / "r.json", *argv]


@pytest.mark.parametrize("methods", ["yarn:", "none,yarn:", "yarn: "])
def test_an_empty_factor_after_a_method_is_refused(llama_dir, tmp_path, capsys, methods):
    assert_refused(_eval(llama_dir, tmp_path, "--data", CORPUS, "--methods", methods, "--factor", "2"), capsys,
                   tmp_path, "nothing after ':'")


def test_a_sink_count_that_evicts_nothing_is_refused(llama_dir, tmp_path, capsys):
    model = tiny_llama()
    length = model.config.max_position_embeddings
    with pytest.raises(ctxext.PatchError, match="option sinks=.* larger than needed"):
        ctxext.patch(model, "streaming-llm", 2, sinks=10 ** 6)
    assert ctxext.describe(model) is None
    with pytest.raises(ctxext.PatchError, match="option sinks"):
        ctxext.patch(model, "streaming-llm", 1, sinks=length + 1, window=2)  # sinks alone outnumber every input
    ctxext.patch(model, "streaming-llm", 2, sinks=4)  # the default window: a cache of the trained length
    ctxext.unpatch(model)
    assert_refused(_eval(llama_dir, tmp_path, "--data", CORPUS, "--methods", "streaming-llm", "--factor", "2",
                         "--option", "sinks=1000000"), capsys, tmp_path, "larger than needed")


@pytest.mark.parametrize("value", [5, None, ["a", "b"], {"t": "x"}, True])
def test_a_text_field_that_is_not_text_is_refused(llama_dir, tmp_path, capsys, value):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": CORPUS.read_text()}) + "\n" + json.dumps({"text": value}) + "\n")
    assert_refused(_eval(llama_dir, tmp_path, "--data", data), capsys, tmp_path, f"{data}:2: field 'text' is")
    listed = tmp_path / "docs.json"
    listed.write_text(json.dumps([{"text": "fine"}, {"text": value}]))
    assert_refused(_eval(llama_dir, tmp_path, "--data", listed), capsys, tmp_path, "item 1: field 'text' is")


@pytest.mark.parametrize("encoding", ["utf-16", "binary"])
def test_undecodable_data_names_the_file(llama_dir, tmp_path, capsys, encoding):
    data = tmp_path / "book.txt"
    if encoding == "binary":
        data.write_bytes(bytes(range(256)) * 40)
    else:
        data.write_text(CORPUS.read_text()[:2000], encoding=encoding)
    assert_refused(_eval(llama_dir, tmp_path, "--data", data), capsys, tmp_path, f"{data}: not UTF-8 text")


@pytest.mark.parametrize("flag", ["--models", "--only"])
@pytest.mark.parametrize("value", ["", ",", " , "])
def test_an_empty_census_list_is_refused(tmp_path, capsys, flag, value):
    assert_refused(["methods", "--census", flag, value], capsys, tmp_path, "names nothing")
