"""Where a model comes from, checked before anything loads: a local folder, a GGUF file in a folder, or a hub id.

Every command calls :func:`check_source` while it validates its arguments, so a missing folder, a missing GGUF file
or a hub id without network fails in well under a second with a message that says what to pass instead, rather
than after transformers' download retries (about 40 s offline) or with a hub URL built from a local path.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

#: How long to wait for the hub's host before calling it unreachable.
HUB_TIMEOUT_S = 3.0

OFFLINE_HINT = (
    "offline, pass a local folder: one written by save_pretrained, a hub snapshot downloaded elsewhere "
    "(`hf download ID --local-dir DIR`), or a folder holding a GGUF file with gguf_file / --gguf-file"
)


def _looks_like_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that names a location is a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or name.endswith(".gguf")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set (as huggingface_hub reads it)."""
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        pass
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def hub_reachable() -> bool:
    """One TCP connection to the hub endpoint's host, with a short timeout (no retries)."""
    if hub_offline():
        return False
    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except ImportError:  # pragma: no cover
        endpoint = "https://huggingface.co"
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=HUB_TIMEOUT_S):
            return True
    except OSError:
        return False


def _in_hub_cache(repo_id: str, filename: str, revision: str | None) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename, revision=revision)
    except Exception:  # noqa: BLE001 - a malformed id is reported by the caller's own check
        return False
    return isinstance(found, str)


def check_source(pretrained, *, gguf_file: str | None = None, revision: str | None = None,
                 what: str = "model") -> str:
    """Raise a clear ``FileNotFoundError`` / ``OSError`` if ``pretrained`` (with ``gguf_file``) cannot be loaded
    from here; touches nothing and does not download. Returns ``"local"``, ``"cache"`` or ``"hub"``."""
    if not isinstance(pretrained, (str, os.PathLike)) or not str(pretrained).strip():
        raise ValueError(f"{what}: expected a hub id or a local folder, got {pretrained!r}")
    name = os.fspath(pretrained).strip()
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            raise ValueError(
                f"{what}: {name} is a GGUF file; pass its folder as the model and the file name as gguf_file "
                f"(--model {path.parent} --gguf-file {path.name})"
            )
        raise ValueError(f"{what}: {name} is a file; pass a folder written by save_pretrained or a hub id")
    if path.is_dir():
        if gguf_file:
            gguf = path / gguf_file
            if not gguf.is_file():
                raise FileNotFoundError(f"{what}: GGUF file {gguf_file!r} not found in {name}")
        elif not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{what}: {name} has no config.json (a folder written by save_pretrained, or a folder holding a "
                "GGUF file given with gguf_file / --gguf-file)"
            )
        return "local"
    if _looks_like_path(name):
        raise FileNotFoundError(f"{what}: folder not found: {name}")
    if _in_hub_cache(name, gguf_file or "config.json", revision):
        return "cache"
    if hub_offline():
        raise OSError(f"{what}: {name!r} is not a local folder and HF_HUB_OFFLINE is set; {OFFLINE_HINT}")
    if not hub_reachable():
        raise OSError(f"{what}: {name!r} is not a local folder and the Hugging Face hub is unreachable; {OFFLINE_HINT}")
    return "hub"
