"""The error every recipe problem is reported as."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe that cannot run: unknown key, wrong type, missing data, a patch that does not fit.

    ``problems`` lists every problem found (each starting with its key path); the message joins them on one line."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems else [message]
