"""The error every recipe problem is reported as, and how a list of problems becomes its one line."""

from __future__ import annotations

from typing import Any


class RecipeError(ValueError):
    """A recipe that cannot run: unknown key, wrong type, missing data, a patch that does not fit.

    ``problems`` lists every problem found (each starting with its key path); the message joins them on one line."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


class WriteError(OSError):
    """A file of the run could not be written (a full disk): one line that names the folder and how to go on.
    ``errno`` is ENOSPC when the disk was found full, else the failed write's errno (or None)."""


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


def short(value: Any, limit: int = 40) -> str:
    """A value as a message quotes it: its repr on one line, cut at ``limit`` characters."""
    text = one_line(repr(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def raise_problems(problems: list[str], prefix: str = "") -> None:
    """One RecipeError for every problem found (none: nothing raised); the same message twice is said once."""
    items = list(dict.fromkeys(one_line(p) for p in problems))
    if items:
        head = f"{prefix}{len(items)} problems: " if len(items) > 1 else prefix
        raise RecipeError(head + "; ".join(items), items)
