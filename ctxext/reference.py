"""The reference checkpoints shipped inside the package, and the held-out book to measure them on.

Three small causal LMs (about 2.6M parameters each, one byte-level BPE tokenizer of 4096 entries)
pretrained from scratch on five Jane Austen novels, one per positional family, at the context lengths that
``training.json`` records (``train_length(name)``):

* ``"llama"``: LlamaForCausalLM, rotary positions (rope_theta 10000, grouped-query attention), trained at 128
  tokens on a mix that teaches it to copy by content (random spans repeated inside prose, repeated random rows,
  then rows in the passkey task's format), so that it retrieves at its trained length and the methods can be told
  apart by whether they still retrieve at 4x (issue 24);
* ``"gpt2"``:  GPT2LMHeadModel, learned absolute positions (256 rows in ``wpe``), trained at 256;
* ``"bloom"``: BloomForCausalLM, ALiBi, trained at 256 (its config says so in ``max_position_embeddings``: ALiBi has
  no table whose size would, and without it a BLOOM is read as trained to 2048, the family's length).

The sixth novel, *Emma*, was held out; ``reference_text()`` returns it. The five training novels ship too
(``training_files()``, ``training_texts()``; fine-tune recipes name them ``data.files: [reference:train]``).
Everything loads from the installed package, with no network and no data outside it::

    from ctxext.reference import reference_model, reference_text, reference_tokenizer

    model = reference_model("llama")          # float32, eval mode
    tok = reference_tokenizer()
    ids = tok(reference_text())["input_ids"]  # about 247k tokens

``benchmarks/train_reference.py`` rebuilds the checkpoints; ``training.json`` beside them records how.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import lzma
from pathlib import Path
from typing import Any

from .core.shipped import MODEL_PREFIXES, REFERENCE_NAMES, model_source, reference_name, reference_path  # noqa: F401
from .core.shipped import ROOT as _ROOT
from .core.shipped import check_name as _check_name

#: Those trained to retrieve (passkey at their trained length); the others find no key even there.
RETRIEVAL_NAMES: tuple[str, ...] = ("llama",)


def train_length(name: str) -> int:
    """The context length reference model ``name`` was trained at, as ``training.json`` records it (a model trained
    apart from the others carries its own ``training`` settings). Each shipped config advertises the same length
    (BLOOM's in ``max_position_embeddings``, which ALiBi does not use), so a patch, ``ctxext eval`` and lm-eval read
    it from the model as they do for any checkpoint."""
    record = _training_record()
    return int(record["models"][_check_name(name)].get("training", record["training"])["length"])


@functools.lru_cache(maxsize=1)
def _training_record() -> dict[str, Any]:
    return json.loads((_ROOT / "training.json").read_text(encoding="utf-8"))


_TEXT = "emma.txt.xz"
#: The five novels the reference models were trained on (``assets/reference/train/NAME.txt.xz``, see SOURCES.md there).
TRAIN_BOOKS: tuple[str, ...] = ("mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
#: Names for shipped text in recipes (``data.files: [reference:train]``): name -> what it is.
DATA_NAMES: dict[str, str] = {
    "train": "the five training novels, 3.1M characters",
    "emma": "the held-out novel, Emma",
}


def reference_model(name: str, **from_pretrained_kwargs: Any):
    """Load reference model ``name`` with ``ctxext.from_pretrained``, in float32 unless a ``dtype`` is given.

    The weights are stored in 16 bits; other keyword arguments go to ``from_pretrained``. Returns the
    model in eval mode.
    """
    import torch

    from .loading import from_pretrained

    kwargs = dict(from_pretrained_kwargs)
    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        kwargs["dtype"] = torch.float32
    kwargs.setdefault("local_files_only", True)
    model = from_pretrained(str(reference_path(name)), **kwargs)
    return model.eval()


def reference_tokenizer(name: str = "llama"):
    """The tokenizer of reference model ``name`` (all three share one byte-level BPE of 4096 entries)."""
    from .loading import auto_tokenizer

    return auto_tokenizer(str(reference_path(name)), local_files_only=True)


@functools.lru_cache(maxsize=1)
def reference_text() -> str:
    """The held-out book (Jane Austen, *Emma*: about 880k characters, 247k reference tokens)."""
    path = _ROOT / _TEXT
    if not path.exists():
        raise FileNotFoundError(f"the held-out text {path} is missing; the package was installed without its assets")
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def _asset(*parts: str) -> Path:
    """A file shipped under ``ctxext/assets`` (read through importlib.resources, so an installed wheel works)."""
    return Path(str(importlib.resources.files("ctxext").joinpath("assets", *parts)))


def training_files() -> list[Path]:
    """The five training novels, xz-compressed text files in a fixed (sorted) order."""
    files = [_asset("reference", "train", f"{book}.txt.xz") for book in TRAIN_BOOKS]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the training text {', '.join(missing)} is missing from "
                                f"{files[0].parent}; the package was installed without its assets")
    return files


def training_texts() -> list[str]:
    """The five training novels as strings (about 3.1M characters in all), in ``TRAIN_BOOKS`` order."""
    out = []
    for path in training_files():
        with lzma.open(path, "rt", encoding="utf-8") as f:
            out.append(f.read())
    return out


def data_files(name: str) -> list[Path]:
    """The shipped text files named ``name`` (a key of ``DATA_NAMES``): ``"train"`` or ``"emma"``."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "train":
        return training_files()
    if key == "emma":
        path = _asset("reference", _TEXT)
        if not path.is_file():
            raise FileNotFoundError(f"the held-out text {path} is missing; the package was installed without its assets")
        return [path]
    raise ValueError(f"unknown shipped text {name!r}; choose one of {', '.join(DATA_NAMES)}")
