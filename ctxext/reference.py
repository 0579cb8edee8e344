"""The reference checkpoints shipped inside the package, and the held-out book to measure them on.

Three small causal LMs (about 2.6M parameters each, one byte-level BPE tokenizer of 4096 entries)
pretrained from scratch on five Jane Austen novels at a context of ``TRAIN_LENGTH`` = 256 tokens,
one per positional family:

* ``"llama"``: LlamaForCausalLM, rotary positions (rope_theta 10000, grouped-query attention);
* ``"gpt2"``:  GPT2LMHeadModel, learned absolute positions (256 rows in ``wpe``);
* ``"bloom"``: BloomForCausalLM, ALiBi.

The sixth novel, *Emma*, was held out; ``reference_text()`` returns it. Everything loads from the
installed package, with no network and no data outside it::

    from ctxext.reference import reference_model, reference_text, reference_tokenizer

    model = reference_model("llama")          # float32, eval mode
    tok = reference_tokenizer()
    ids = tok(reference_text())["input_ids"]  # about 247k tokens

``benchmarks/train_reference.py`` rebuilds the checkpoints; ``training.json`` beside them records how.
"""

from __future__ import annotations

import functools
import lzma
from pathlib import Path
from typing import Any

#: The reference models, one per positional family.
REFERENCE_NAMES: tuple[str, ...] = ("llama", "gpt2", "bloom")
#: The context length the reference models were trained at.
TRAIN_LENGTH = 256

_ROOT = Path(__file__).resolve().parent / "assets" / "reference"
_TEXT = "emma.txt.xz"


def _check_name(name: str) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in REFERENCE_NAMES:
        raise ValueError(f"unknown reference model {name!r}; choose one of {', '.join(REFERENCE_NAMES)}")
    return key


def reference_path(name: str) -> Path:
    """The folder of the shipped checkpoint ``name`` (a ``save_pretrained`` directory)."""
    folder = _ROOT / _check_name(name)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"reference checkpoint {name!r} is missing from {folder}; the package was installed without its "
            "assets (reinstall ctxext, or rebuild them with benchmarks/train_reference.py)"
        )
    return folder


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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(reference_path(name)), local_files_only=True)


@functools.lru_cache(maxsize=1)
def reference_text() -> str:
    """The held-out book (Jane Austen, *Emma*: about 880k characters, 247k reference tokens)."""
    path = _ROOT / _TEXT
    if not path.exists():
        raise FileNotFoundError(f"the held-out text {path} is missing; the package was installed without its assets")
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return f.read()
