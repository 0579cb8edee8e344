"""Undo lists: the steps that put a model back as it was, run newest first, and a context that runs them when a
patch fails halfway, so that a refused or broken patch leaves nothing behind.

The steps stay a plain list (not a ``contextlib.ExitStack``) because a patched model's deep copy rebuilds its undo
steps through ``adapters.base.copy_restore``, which walks lists, partials and closures; an ExitStack keeps its
callbacks in a private deque that a deep copy would copy as shared functions, so the copy would undo the original.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Restore = Callable[[], None]


def run_all(undo: list[Restore]) -> None:
    """Run undo steps in reverse order."""
    for step in reversed(undo):
        step()


@contextlib.contextmanager
def undone_on_failure(undo: list[Restore] | None = None) -> Iterator[list[Restore]]:
    """``with undone_on_failure() as undo:`` collects undo steps; if the block raises (anything, KeyboardInterrupt
    included), the steps collected so far run before the exception goes on."""
    undo = [] if undo is None else undo
    try:
        yield undo
    except BaseException:
        run_all(undo)
        raise


def set_on_instance(obj, name: str, value) -> Restore:
    """Set ``obj.<name>`` on this instance only; the undo puts back what the instance itself held (an attribute the
    user set stays theirs) or, where it held none, removes it so that the class's shows through again. (A flag, not
    a sentinel object: a patched model's deep copy copies the undo's cells, and a copied sentinel is another object.)"""
    had, held = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, value)

    def undo() -> None:
        if had:
            vars(obj)[name] = held
        else:
            vars(obj).pop(name, None)

    return undo
