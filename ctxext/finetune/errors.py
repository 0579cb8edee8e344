"""The error every recipe problem is reported as."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe that cannot run: unknown key, wrong type, missing data, a patch that does not fit.

    ``problems`` lists every problem found (each starting with its key path); the message joins them on one line."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


class WriteError(OSError):
    """A file of the run could not be written (a full disk): one line that names the folder and how to go on.
    ``errno`` is ENOSPC when the disk was found full, else the failed write's errno (or None)."""
