"""Evaluation texts: a text file, a folder of text files, a JSONL file, or a `datasets` dataset."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.pieces import tokenize_document
from ..data.textfiles import check_data_path, find_files, inner_suffix, read_documents
from .requests import FLAGS, Spelling

_DATASET_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")


@dataclass
class Texts:
    texts: list[str]
    #: How the data was found (recorded in the results JSON).
    info: dict[str, Any] = field(default_factory=dict)


def _hint(spelling: Spelling) -> str:
    """What a text without the text field is told to do."""
    return f"choose one with {spelling.name('text_field')}"


def _column(dataset, text_field: str, where: str, spelling: Spelling = FLAGS) -> list[str]:
    columns = list(getattr(dataset, "column_names", []) or [])
    if text_field not in columns:
        raise ValueError(f"{where} has no {text_field!r} column (columns: {', '.join(columns)}); "
                         f"use {spelling.name('text_field')}")
    return [str(t) for t in dataset[text_field]]


def _pick_split(data, split: str, where: str, spelling: Spelling = FLAGS):
    if hasattr(data, "keys") and not hasattr(data, "column_names"):  # a DatasetDict
        if split not in data:
            raise ValueError(f"{where} has no split {split!r} (splits: {', '.join(data.keys())}); "
                             f"use {spelling.name('data_split')}")
        return data[split]
    return data


def _load_dataset(name: str, split: str, text_field: str, spelling: Spelling = FLAGS) -> list[str]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - declared in the eval extra
        raise ImportError("loading a dataset needs `datasets`: pip install 'ctxext[eval]'") from None
    from ..data.sources import hub_reachable

    path = Path(name)
    offline = not path.exists() and not hub_reachable()
    try:
        if path.is_dir() and any((path / m).exists() for m in _DATASET_MARKERS):
            data = _pick_split(datasets.load_from_disk(str(path)), split, str(path), spelling)
        else:
            with _datasets_offline(offline):  # the local cache or a fast failure, instead of ~25 s of retries
                data = datasets.load_dataset(name, split=split)
    except ValueError:
        raise
    except Exception as exc:  # network, missing dataset, bad split: one line for the user
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = ""
        if offline:
            hint = (" (the Hugging Face hub is unreachable and the dataset is not in the local cache; pass a text "
                    "file, a folder of .txt files, a JSONL file, or a folder written by datasets' save_to_disk)")
        elif not path.exists():
            hint = " (a hub dataset needs network access or a local cache)"
        raise OSError(f"cannot load dataset {name!r} (split {split!r}): {first}{hint}") from exc
    return _column(data, text_field, f"dataset {name!r}", spelling)


@contextlib.contextmanager
def _datasets_offline(offline: bool):
    """datasets' and huggingface_hub's offline switches, for one call (both are read when a download starts)."""
    if not offline:
        yield
        return
    import datasets.config
    from huggingface_hub import constants

    saved = (datasets.config.HF_HUB_OFFLINE, getattr(datasets.config, "HF_DATASETS_OFFLINE", None),
             constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    if saved[1] is not None:
        datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved[0], saved[2]
        if saved[1] is not None:
            datasets.config.HF_DATASETS_OFFLINE = saved[1]


def load_texts(data: str, *, split: str = "test", text_field: str = "text", spelling: Spelling = FLAGS) -> Texts:
    """Read evaluation documents (one string each) from ``data``.

    - a ``.jsonl`` file (also ``.jsonl.gz`` / ``.jsonl.xz``): one document per line, from ``text_field``; a
      ``.json`` list of such objects;
    - a text file (``.txt``, ``.txt.gz``, ``.txt.xz`` or any other non-JSON file): one document;
    - a folder of such files (searched recursively, sorted by path; ``ctxext.data.textfiles.find_files``, as a recipe's
      data folders are);
    - a folder saved by ``datasets`` (``save_to_disk``) or loadable by ``datasets.load_dataset``, or a hub
      dataset name: the ``text_field`` column of ``split``.

    ``spelling``: how messages name ``data``, ``data_split`` and ``text_field`` (the command's flags by default).
    """
    check_data_path(data, spelling.name("data"))  # a link loop is neither a file nor a folder: said as what it is
    path = Path(data)
    info: dict[str, Any] = {"data": data}
    if path.is_file():
        texts = list(read_documents(path, text_field, _hint(spelling)))
        kind = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}.get(inner_suffix(path), "text")
        info.update(format=kind, **({"text_field": text_field} if kind != "text" else {}))
    elif path.is_dir():
        files = find_files(path)
        if files and not any((path / m).exists() for m in _DATASET_MARKERS):
            texts = [t for f in files for t in read_documents(f, text_field, _hint(spelling))]
            info.update(format="text-folder", files=[str(p.relative_to(path)) for p in files])
        else:
            texts = _load_dataset(data, split, text_field, spelling)
            info.update(format="dataset", split=split, text_field=text_field)
    elif data.startswith((".", "/", "~")) or data.endswith((".txt", ".jsonl", ".gz", ".xz", ".json")):
        raise FileNotFoundError(f"data file not found: {data}")
    else:
        texts = _load_dataset(data, split, text_field, spelling)
        info.update(format="dataset", split=split, text_field=text_field)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"no text found in {data}")
    info["documents"] = len(texts)
    return Texts(texts, info)


def tokenize_texts(tokenizer, texts: list[str], *, piece_chars: int | None = None) -> list[torch.Tensor]:
    """Token ids of each document (special tokens as the tokenizer adds them, e.g. a leading BOS): those of tokenizing
    it whole, found a piece of about ``piece_chars`` characters (None: ``ctxext.data.pieces.PIECE_CHARS``) at a time,
    so memory holds one piece's encoding, not the whole text's (see :mod:`ctxext.data.pieces`)."""
    return [tokenize_document(tokenizer, text, piece_chars) for text in texts]
