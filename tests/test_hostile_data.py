"""Evaluation data, as a hostile user brings it (issue 57): a long file is tokenized a piece at a time with the ids of
tokenizing it whole (case 11), and a file that is not UTF-8 gets advice that fits its bytes (case 12)."""

from __future__ import annotations

import gzip
import json
import random

import pytest
import torch
from test_eval_fixtures import CORPUS, build_tokenizer

import ctxext
from ctxext.data import pieces
from ctxext.evaluation.data import load_texts, tokenize_texts
from ctxext.reference import reference_model, reference_tokenizer

TIMING = ("seconds", "tokens_per_second")


# -- case 11: a long file, a piece at a time ---------------------------------------------------------------------

class Counting:
    """A tokenizer that notes the longest text it was given in one call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, **kwargs)


def _sentencepiece_like(tmp_path, kind: str):
    """A SentencePiece-style BPE trained on the corpus: one that marks the start of every text (a Llama-2
    tokenizer.json's ``Prepend`` normalizer) or the first (transformers' LlamaTokenizer: Metaspace, not split)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if kind == "prepend":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.train_from_iterator([CORPUS.read_text()], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _tokenizer(kind: str, tmp_path):
    if kind == "test-bpe":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    if kind == "reference":
        return reference_tokenizer("llama")
    return _sentencepiece_like(tmp_path, kind)


def _odd_spacing(text: str) -> str:
    """The corpus's words with every kind of white space between them (double spaces, tabs, blank lines, CRLF)."""
    rng = random.Random(0)
    spaces = [" ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "   \n\n"]
    return "".join(word + rng.choice(spaces) for word in text.split())


@pytest.mark.parametrize("kind", ["test-bpe", "reference", "prepend", "metaspace"])
def test_a_long_document_gets_the_ids_of_tokenizing_it_whole(kind, tmp_path):
    tok = _tokenizer(kind, tmp_path)
    for text in (CORPUS.read_text(), _odd_spacing(CORPUS.read_text())):
        whole = torch.tensor(tok(text, add_special_tokens=True, verbose=False)["input_ids"])
        for piece in (500, 1200, 2500):
            counting = Counting(tok)
            (ids,) = tokenize_texts(counting, [text], piece_chars=piece)
            assert torch.equal(ids, whole), (kind, piece)
            assert counting.longest <= 5 * piece < len(text)  # it was cut: never the whole text at once


def _rows(results):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in results.rows]


@pytest.mark.parametrize("max_windows", [1, 4])
def test_a_run_in_pieces_scores_the_windows_of_whole_tokenization(max_windows, monkeypatch):
    """The same windows and numbers as tokenizing the file whole (as before): many pieces of the bundled corpus."""
    model, tok = reference_model("llama"), reference_tokenizer("llama")

    def run(piece_chars):
        monkeypatch.setattr(pieces, "PIECE_CHARS", piece_chars)
        return _rows(ctxext.evaluate(model, tokenizer=tok, data=str(CORPUS), methods="none", lengths=[64, 256],
                                     max_windows=max_windows, progress=False))

    whole, cut = run(10**9), run(1500)
    assert cut == whole and all(r["windows"] for r in cut)


def test_a_long_file_is_never_given_to_the_tokenizer_whole(tmp_path, monkeypatch):
    """`max_windows=1` on a large file: the tokenizer is given a piece at a time (its encoding holds about 170 bytes a
    character: the whole 8 MB file took 1.75 GB), and the run scores what it scored before."""
    text = (CORPUS.read_text() + "\n\n") * 100  # 1.6 MB: 25 pieces
    data = tmp_path / "big.txt"
    data.write_text(text)
    model, tok = reference_model("llama"), reference_tokenizer("llama")
    longest = [0]
    call = type(tok).__call__

    def counting(self, text, *args, **kwargs):
        longest[0] = max(longest[0], len(text) if isinstance(text, str) else 0)
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tok), "__call__", counting)
    results = ctxext.evaluate(model, tokenizer=tok, data=str(data), methods="none", lengths=[128], max_windows=1,
                              progress=False)
    assert longest[0] <= 5 * pieces.PIECE_CHARS < len(text) // 4
    (row,) = results.rows
    assert row["windows"] == 1 and row["tokens"] == 64  # sliding: the middle window's second half


@pytest.mark.slow
def test_tokenizing_a_large_file_takes_memory_for_its_ids_not_its_encoding(tmp_path):
    """8 MB of text took 1.3 GB more memory tokenized whole; in pieces it takes its ids (8 bytes a token) and one
    piece's encoding."""
    import subprocess
    import sys
    import textwrap

    data = tmp_path / "big.txt"
    data.write_text((CORPUS.read_text() + "\n\n") * 500)  # 8 MB
    script = textwrap.dedent(f"""
        import resource
        from ctxext.evaluation.data import load_texts, tokenize_texts
        from ctxext.reference import reference_tokenizer
        tok, texts = reference_tokenizer("llama"), load_texts({str(data)!r}).texts
        tok("warm up")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        docs = tokenize_texts(tok, texts)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    grown_mb = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert grown_mb < 200


# -- case 12: a file that is not UTF-8 ---------------------------------------------------------------------------

def _refusal(path) -> str:
    with pytest.raises(ValueError) as caught:
        load_texts(str(path))
    return str(caught.value)


def test_a_latin1_file_is_told_to_convert_from_latin1(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes("A caf\u00e9 in the village.\n".encode("latin-1") * 50)
    said = _refusal(path)
    assert said.startswith(f"{path}: not UTF-8 text (byte 5 is 0xE9)")
    assert f"iconv -f LATIN1 -t UTF-8 {path} > {tmp_path / 'book.utf8.txt'}" in said and "UTF-16" not in said


def test_a_windows_file_is_told_to_convert_from_cp1252(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_bytes(json.dumps({"text": "She said \u201chello\u201d \u2014 twice."}, ensure_ascii=False)
                     .encode("cp1252") + b"\n")
    said = _refusal(path)
    assert f"{path}: not UTF-8 text (byte 19 is 0x93)" in said
    assert "iconv -f CP1252 -t UTF-8" in said and "UTF-16" not in said


@pytest.mark.parametrize("encoding, advice", [("utf-16", "iconv -f UTF-16 -t UTF-8"),
                                              ("utf-16-le", "iconv -f UTF-16LE -t UTF-8"),
                                              ("utf-16-be", "iconv -f UTF-16BE -t UTF-8")])
def test_a_utf16_file_is_told_to_convert_from_utf16(tmp_path, encoding, advice):
    path = tmp_path / "book.txt"
    path.write_bytes(CORPUS.read_text()[:2000].encode(encoding))
    said = _refusal(path)
    assert said.startswith(f"{path}: not UTF-8 text (byte ") and advice in said and "LATIN1" not in said


def test_the_offset_is_that_of_the_first_bad_byte_in_the_whole_file(tmp_path):
    """Far into a JSON lines file (read 8 KB at a time: the offset was counted from the last read), and in a
    compressed file's decompressed text."""
    lines = b"".join(json.dumps({"text": f"line {i} of plain words"}).encode() + b"\n" for i in range(5000))
    path = tmp_path / "docs.jsonl"
    path.write_bytes(lines + b'{"text": "caf\xe9"}\n')
    said = _refusal(path)
    assert f"(byte {len(lines) + 13} is 0xE9)" in said and "iconv -f LATIN1 -t UTF-8" in said
    raw = b"plain words " * 20_000 + "caf\u00e9".encode("latin-1")
    packed = tmp_path / "book.txt.gz"
    packed.write_bytes(gzip.compress(raw))
    said = _refusal(packed)
    assert f"(byte {len(raw) - 1} of its decompressed text is 0xE9)" in said
    assert f"gzip -dc {packed} | iconv -f LATIN1 -t UTF-8 > {tmp_path / 'book.utf8.txt'}" in said


def test_a_utf8_file_with_one_stray_byte_is_not_told_to_convert_all_of_it(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes("na\u00efve caf\u00e9 ".encode() * 10 + b"\xe9t\xe9")
    said = _refusal(path)
    assert "mixes encodings" in said and "iconv -f UTF-8 -t UTF-8 -c" in said and "LATIN1" not in said


def test_a_binary_file_is_called_binary(tmp_path):
    path = tmp_path / "model.txt"
    path.write_bytes(bytes(range(256)) * 40)
    said = _refusal(path)
    assert "binary file" in said and "iconv" not in said
