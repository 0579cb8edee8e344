"""RULER's scores (NVIDIA/RULER, ``scripts/eval/synthetic/constants.py``), on one prediction.

A prediction is cleaned as RULER does (control characters become newlines, then stripped); an expected string counts
when it occurs in the prediction, compared in lower case.
"""

from __future__ import annotations

import re
from typing import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction).strip()


def match_all(prediction: str, expected: Sequence[str]) -> float:
    """The fraction of the expected strings found in the prediction (RULER's ``string_match_all``)."""
    if not expected:
        raise ValueError("no expected answers to score against")
    text = clean(prediction).lower()
    return sum(1.0 for e in expected if e.lower() in text) / len(expected)


def match_part(prediction: str, expected: Sequence[str]) -> float:
    """1 if any expected string is found in the prediction, else 0 (RULER's ``string_match_part``, used for QA)."""
    if not expected:
        raise ValueError("no expected answers to score against")
    text = clean(prediction).lower()
    return max(1.0 if e.lower() in text else 0.0 for e in expected)


METRICS = {"all": match_all, "part": match_part}
