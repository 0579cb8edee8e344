"""Tokenizing a long document a piece at a time, with the token ids of tokenizing it whole.

A fast tokenizer holds about 170 bytes per character while it encodes one string (the ids, offsets and token
strings of every token), so a whole 60 MB book took gigabytes. Here the document is cut into pieces of about
``piece_chars`` characters and each piece is tokenized alone, so memory is one piece's encoding plus the ids kept
(8 bytes a token). Small pieces are also faster to encode than one long string.

A cut is made only where the tokenizer splits the text anyway, and checked:

- the places tried are white space just before a word (a line start, a space before a word), so no word is cut;
- a piece is tokenized alone, or, for tokenizers that mark the start of a text (SentencePiece's leading ``▁``),
  after the word before it (its *anchor*), whose ids are then dropped;
- a place is used only where tokenizing ``SEAM_CONTEXT`` characters on both sides of it whole gives the ids of the
  two sides tokenized that way; the next place is tried otherwise.

Where no place passes in reach, the rest of the document is one piece; a tokenizer whose special tokens are more than
a prefix and a suffix (BOS, EOS), or whose anchor's ids do not lead a piece's, tokenizes the document whole.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

#: Characters tokenized at once (a piece); documents up to this size are tokenized whole.
PIECE_CHARS = 1 << 16
#: Characters on each side of a cut that are tokenized to check it.
SEAM_CONTEXT = 256
#: Places of each kind tried in one stretch of text before the next stretch is searched.
TRIES_PER_KIND = 16
#: Stretches of half a piece searched for a cut (the piece grows) before the rest of the document is one piece.
STRETCHES = 8
#: The longest anchor (the word before a piece), in characters.
ANCHOR_CHARS = 64

#: The places to cut, each the white space just before a word: a line start, a space before a word, any.
CUT_PLACES = (re.compile(r"\n(?=\S)"), re.compile(r" (?=\S)"), re.compile(r"\s(?=\S)"))
_LAST_WORD = re.compile(r"\S+\s*$")


class Cut(NamedTuple):
    #: Where the piece begins.
    at: int
    #: Where the text tokenized for it begins (``at``, or the start of the word before it).
    anchor: int


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    ids = tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)  # compared and joined as lists


def _anchor(text: str, at: int) -> int:
    """The start of the word (and white space) just before ``at``, at most ``ANCHOR_CHARS`` back."""
    lo = max(0, at - ANCHOR_CHARS)
    word = _LAST_WORD.search(text, lo, at)
    return word.start() if word else lo


def _piece_ids(tokenizer, text: str, cut: Cut, end: int) -> list[int] | None:
    """The ids of ``text[cut.at:end]`` tokenized after its anchor; None where the anchor's own ids do not lead."""
    if cut.anchor == cut.at:
        return _ids(tokenizer, text[cut.at:end], False)
    head = _ids(tokenizer, text[cut.anchor:cut.at], False)
    ids = _ids(tokenizer, text[cut.anchor:end], False)
    return ids[len(head):] if ids[: len(head)] == head else None


def _seam_holds(tokenizer, text: str, cut: Cut) -> bool:
    lo, hi = max(0, cut.at - SEAM_CONTEXT), cut.at + SEAM_CONTEXT
    right = _piece_ids(tokenizer, text, cut, hi)
    return right is not None and _ids(tokenizer, text[lo:hi], False) == _ids(tokenizer, text[lo:cut.at], False) + right


def _cut_in(tokenizer, text: str, lo: int, hi: int, kinds: list) -> Cut | None:
    """A checked cut in ``text[lo:hi]``: the last place of the first kind (place, anchored or not) that has one. The
    kind that worked moves to the front of ``kinds``: a tokenizer accepts the same kind all through a text."""
    for kind in list(kinds):
        place, anchored = kind
        for match in reversed(list(place.finditer(text, lo, hi))[-TRIES_PER_KIND:]):
            at = match.start()
            cut = Cut(at, _anchor(text, at) if anchored else at)
            if _seam_holds(tokenizer, text, cut):
                kinds.remove(kind)
                kinds.insert(0, kind)
                return cut
    return None


def find_cuts(tokenizer, text: str, piece_chars: int = PIECE_CHARS) -> list[Cut]:
    """Where to cut ``text`` into pieces of about ``piece_chars`` characters, each cut checked (see the module
    docstring): the last good place in the second half of a piece, else in the half piece after it, and so on."""
    cuts: list[Cut] = []
    kinds = [(place, anchored) for anchored in (False, True) for place in CUT_PLACES]
    half = max(1, piece_chars // 2)
    start = 0
    while len(text) - start > piece_chars:
        cut = None
        for stretch in range(1, STRETCHES + 1):
            cut = _cut_in(tokenizer, text, start + stretch * half, min(len(text), start + (stretch + 1) * half), kinds)
            if cut is not None:
                break
        if cut is None:
            break
        cuts.append(cut)
        start = cut.at
    return cuts


def _special_wrap(tokenizer, first: str, last: str) -> tuple[list[int], list[int]] | None:
    """(prefix, suffix): the special tokens the tokenizer puts around a text (BOS, EOS), found on the first piece and
    checked on the last; None where adding them changes more than the ends."""
    inner, outer = _ids(tokenizer, first, False), _ids(tokenizer, first, True)
    extra = len(outer) - len(inner)
    fits = [p for p in range(extra + 1) if outer[p : p + len(inner)] == inner]
    if len(fits) != 1:
        return None
    prefix, suffix = outer[: fits[0]], outer[fits[0] + len(inner) :]
    if _ids(tokenizer, last, True) != prefix + _ids(tokenizer, last, False) + suffix:
        return None
    return prefix, suffix


def _as_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def _pieces_ids(tokenizer, text: str, cuts: list[Cut]) -> list[torch.Tensor] | None:
    """The ids of every piece (no special tokens), or None where a piece's anchor does not lead its ids."""
    starts = [Cut(0, 0), *cuts]
    ends = [c.at for c in cuts] + [len(text)]
    parts = []
    for cut, end in zip(starts, ends):
        ids = _piece_ids(tokenizer, text, cut, end)
        if ids is None:
            return None
        parts.append(_as_tensor(ids))
    return parts


def tokenize_document(tokenizer, text: str, piece_chars: int | None = None) -> torch.Tensor:
    """The token ids of ``tokenizer(text, add_special_tokens=True)``, tokenized a piece of about ``piece_chars``
    characters (None: ``PIECE_CHARS``) at a time."""
    piece_chars = PIECE_CHARS if piece_chars is None else piece_chars
    cuts = find_cuts(tokenizer, text, piece_chars) if len(text) > piece_chars else []
    wrap = _special_wrap(tokenizer, text[: cuts[0].at], text[cuts[-1].at :]) if cuts else None
    parts = _pieces_ids(tokenizer, text, cuts) if wrap is not None else None
    if parts is None:  # short, or no checked cut: whole, as the tokenizer does it
        return _as_tensor(_ids(tokenizer, text, True))
    prefix, suffix = wrap
    return torch.cat([_as_tensor(prefix), *parts, _as_tensor(suffix)])
