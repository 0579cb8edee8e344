"""Token-exact prompts: a task's text around a context of exactly the tokens left, in the model's own tokenizer.

A prompt is ``head + context + tail``: the head holds the tokenizer's leading special tokens (or the chat template's
opening) and the instruction, the tail the question, the chat template's turn change and the answer prefix. Pieces
are tokenized separately and their ids concatenated, so the context can be cut to the exact token; the decoded text
reads the same as the joined text.
"""

from __future__ import annotations

from typing import Sequence

from ..requests import FLAGS, Spelling

_MARK = "\u2063CTXEXT-CONTEXT\u2063"
_CACHED_CHARS = 2000


class Encoder:
    """Token ids of text pieces for one tokenizer, with or without its chat template; ``spelling``: how a message
    says to turn the template off (``--no-chat-template`` / ``chat_template=False``)."""

    def __init__(self, tokenizer, *, chat_template: bool = True, spelling: Spelling = FLAGS):
        self.tokenizer = tokenizer
        self._cache: dict[str, tuple[int, ...]] = {}
        template = getattr(tokenizer, "chat_template", None)
        self.chat = bool(chat_template and template)
        off = "--no-chat-template" if spelling.flags else "chat_template=False"
        if self.chat:
            try:
                rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                                         add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - a template may raise anything (raise_exception, a bad filter)
                raise ValueError(f"the tokenizer's chat template fails on a single user message ({type(exc).__name__}: "
                                 f"{exc}); use {off}") from None
            if rendered.count(_MARK) != 1:
                raise ValueError("the tokenizer's chat template does not keep the user's message as given; "
                                 f"use {off}")
            self.chat_open, self.chat_close = rendered.split(_MARK)
            self.special_head: list[int] = []
        else:
            self.chat_open = self.chat_close = ""
            self.special_head = _leading_specials(tokenizer)

    def ids(self, text: str) -> list[int]:
        cached = self._cache.get(text)
        if cached is None:
            cached = tuple(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
            if len(text) <= _CACHED_CHARS:  # templates, needles, units: not the long lists the fits try
                self._cache[text] = cached
        return list(cached)

    def many(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(x) for x in self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]]

    def head(self, instruction: str) -> list[int]:
        return self.special_head + self.ids(self.chat_open + instruction)

    def tail(self, question: str, answer_prefix: str) -> list[int]:
        return self.ids(question + self.chat_close + answer_prefix)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _leading_specials(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (e.g. BOS), as a plain ``tokenizer(text)`` adds them."""
    plain = tokenizer("a", add_special_tokens=False, verbose=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True, verbose=False)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


class Haystack:
    """Filler text as units (sentences) of token ids, taken in order from a start unit, wrapping around."""

    def __init__(self, units: list[list[int]], name: str):
        units = [u for u in units if u]
        if not units:
            raise ValueError(f"the {name} haystack has no text")
        self.units = units
        self.name = name

    def take(self, start: int, need: int) -> tuple[list[int], list[int]]:
        """Exactly ``need`` token ids from unit ``start`` on (the last unit cut), and the offsets where units begin."""
        ids: list[int] = []
        starts: list[int] = []
        i = start % len(self.units)
        while len(ids) < need:
            starts.append(len(ids))
            ids.extend(self.units[i][: need - len(ids)])
            i = (i + 1) % len(self.units)
        return ids, starts + [len(ids)]


def insert_at_depths(ids: list[int], boundaries: Sequence[int], pieces: Sequence[tuple[float, list[int]]]):
    """``ids`` with each piece inserted at the unit boundary nearest its depth (a fraction of ``ids``); returns the
    new ids and each piece's actual depth (tokens before it in the haystack / haystack tokens), in the given order.
    Pieces at the same boundary keep their order."""
    n = len(ids)
    where = []
    for depth, piece in pieces:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"a depth is a fraction between 0 and 1, got {depth}")
        at = min(boundaries, key=lambda b: (abs(b - depth * n), b)) if boundaries else 0
        where.append(at)
    out: list[int] = []
    order = sorted(range(len(pieces)), key=lambda k: (where[k], k))
    prev = 0
    for k in order:
        out.extend(ids[prev : where[k]])
        out.extend(pieces[k][1])
        prev = where[k]
    out.extend(ids[prev:])
    return out, [(where[k] / n if n else 0.0) for k in range(len(pieces))]
