"""Fingerprints that decide whether ``--resume`` may keep a row: the same data and the same model files.

- Data: the number of documents and characters and a sha256 of what was read (after decoding), so an edited file
  under the same path, or another ``--text-field``, is a different run.
- Model: for a local folder, a sha256 of ``config.json`` and the name, size and modification time of every weight
  file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf`` and their index files), the GGUF file and the adapter's
  files likewise. Weights are not hashed: reading gigabytes before every resume would cost more than the rows. A
  hub id is recorded with the commit of its cached snapshot where the cache has one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def data_fingerprint(texts: list[str]) -> dict[str, Any]:
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))  # document boundaries count
        digest.update(data)
    return {"documents": len(texts), "characters": sum(map(len, texts)), "sha256": digest.hexdigest()}


def _file_entry(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def folder_fingerprint(folder: Path) -> dict[str, Any]:
    """config.json's sha256 and the weight files' (name, size, mtime) of a local model or adapter folder."""
    out: dict[str, Any] = {}
    for name in ("config.json", "adapter_config.json"):
        if (folder / name).is_file():
            out[name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    out["weights"] = sorted(_file_entry(p) for p in folder.iterdir()
                            if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    return out


def _hub_commit(model_id: str, revision: str | None = None) -> str | None:
    """The commit of the cached snapshot ``from_pretrained`` would read (``revision``: a branch, tag or commit;
    default the cache's ``main``)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_id, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - not a repo id, no hub library: nothing to record
        return None
    return Path(found).parent.name if isinstance(found, str) else None


def _folder(model: str) -> Path:
    """The local folder a job's ``model`` names (a shipped reference model's, or the path itself)."""
    from ..reference import reference_name, reference_path

    name = reference_name(model)  # reference:NAME or ctxext.reference:NAME, as every command reads them
    return Path(reference_path(name)) if name is not None else Path(model).expanduser()


def model_fingerprint(info: dict[str, Any]) -> dict[str, Any]:
    """The files behind a job's ``info`` (``model``, optional ``gguf_file`` and ``adapter``)."""
    model = str(info.get("model") or "")
    folder = _folder(model)
    out: dict[str, Any] = {}
    if folder.is_dir():
        out["model"] = folder_fingerprint(folder)
        gguf = info.get("gguf_file")
        if gguf and (folder / gguf).is_file():
            out["gguf_file"] = _file_entry(folder / gguf)
    elif model:
        out["hub_commit"] = _hub_commit(model, info.get("revision"))
    adapter = info.get("adapter")
    if adapter and Path(adapter).is_dir():
        out["adapter"] = folder_fingerprint(Path(adapter))
    return out


#: Files that decide how a folder's tokenizer splits text and which chat template it applies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def tokenizer_fingerprint(info: dict[str, Any]) -> dict[str, str]:
    """sha256 of the tokenizer and chat-template files of a job's local model folder (task prompts depend on them;
    a GGUF file's tokenizer is inside the file, which :func:`model_fingerprint` covers)."""
    folder = _folder(str(info.get("model") or ""))
    out = {}
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
