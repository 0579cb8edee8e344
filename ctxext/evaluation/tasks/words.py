"""Random keys and values as RULER draws them: word keys ``adjective-noun`` from wonderwords' lists, 7-digit numbers,
version-4 UUIDs; and the plain word pool of the common-words task."""

from __future__ import annotations

import functools
import random
import uuid


@functools.lru_cache(maxsize=None)
def _wordlist(name: str) -> tuple[str, ...]:
    try:
        from importlib.resources import files

        text = (files("wonderwords") / "assets" / f"{name}list.txt").read_text(encoding="utf-8")
    except (ImportError, ModuleNotFoundError, FileNotFoundError):
        raise ImportError("the RULER-style tasks draw their words from wonderwords: pip install 'ctxext[eval]'") from None
    return tuple(sorted({w.strip() for w in text.splitlines() if w.strip() and w.strip().isalpha()}))


def check_available() -> None:
    """Raise ImportError (with the install hint) when the word lists are missing."""
    _wordlist("noun")


def word_key(rng: random.Random) -> str:
    return f"{rng.choice(_wordlist('adjective'))}-{rng.choice(_wordlist('noun'))}"


def number(rng: random.Random) -> str:
    return str(rng.randint(10**6, 10**7 - 1))


def uuid4(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


DRAW = {"words": word_key, "numbers": number, "uuids": uuid4}


@functools.lru_cache(maxsize=None)
def common_pool() -> tuple[str, ...]:
    """Nouns, adjectives and verbs, lower case, deduplicated and sorted (the common-words task's pool)."""
    return tuple(sorted({w.lower() for name in ("noun", "adjective", "verb") for w in _wordlist(name)}))
