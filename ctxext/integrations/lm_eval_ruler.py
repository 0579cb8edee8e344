"""A tokenizer lm-eval's RULER tasks can load, for ``--model ctxext`` on a GGUF file.

lm-eval's RULER tasks build their samples with ``AutoTokenizer.from_pretrained(tokenizer or pretrained)``, which
cannot read the tokenizer inside a GGUF file (it fails with "Couldn't instantiate the backend tokenizer").
:func:`ruler_tokenizer` saves the GGUF's tokenizer once under ctxext's cache and names its folder for the run's
metadata.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path

from ..core.outputs import staging_folder
from .lm_eval_tasks import cache_dir

#: lm-eval's RULER tasks and group, which build their samples with a tokenizer of their own
RULER_TASKS = re.compile(r"^(ruler|niah_|ruler_|qa_squad|qa_hotpot)")


def ruler_tokenizer(model_args: dict, tasks, metadata: dict) -> str | None:
    """For ``--model ctxext`` with a ``gguf_file``, RULER tasks and no ``tokenizer`` in the metadata, the GGUF's
    tokenizer is saved once under ctxext's cache (``$CTXEXT_CACHE_DIR/gguf-tokenizers/``, keyed by the file's path,
    size and time) and its folder returned for the metadata; otherwise None (nothing written). Where the cache cannot
    be written, the tokenizer goes to a temporary folder of this run."""
    gguf, pretrained = model_args.get("gguf_file"), model_args.get("pretrained")
    names = []
    for task in ([tasks] if isinstance(tasks, str) else list(tasks or [])):
        task = task.get("task", "") if isinstance(task, dict) else task  # an inline task config of a --config
        names += str(task).split(",")
    if not gguf or not pretrained or metadata.get("tokenizer") or not any(
            RULER_TASKS.match(n.strip()) for n in names):
        return None
    options = {k: model_args[k] for k in ("revision", "trust_remote_code") if model_args.get(k) is not None}
    path = Path(str(pretrained)).expanduser() / str(gguf)
    stamp = f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}" if path.is_file() else \
        f"{pretrained}:{gguf}:{sorted(options.items())}"
    folder = cache_dir() / "gguf-tokenizers" / hashlib.sha256(stamp.encode()).hexdigest()[:16]
    if not (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(pretrained), gguf_file=str(gguf), **options)
        try:
            with staging_folder(folder) as staging:  # saved whole, then renamed into place
                os.chmod(staging, 0o755)  # a shared cache stays readable
                tokenizer.save_pretrained(staging)
                os.replace(staging, folder)  # fails where another process saved it first
        except OSError:
            if not (folder / "tokenizer_config.json").is_file():  # not another process saving it first
                folder = Path(tempfile.mkdtemp(prefix="ctxext-gguf-tokenizer-"))  # an unwritable cache: this run's
                tokenizer.save_pretrained(folder)
    print(f"ctxext lm-eval: RULER tasks read the GGUF's tokenizer from {folder} (saved from {gguf}; give "
          "--metadata tokenizer=... to use another)", file=sys.stderr)
    return str(folder)
