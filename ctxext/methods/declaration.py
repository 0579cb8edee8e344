"""How a method is declared: its name, summary, options (typed, with defaults) and whether it needs a factor.

Kept apart from :mod:`ctxext.methods.registry` so that a method module can declare itself beside its functions (see
``ctxext.methods.remap``) without importing the registry that collects the declarations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    default: Any
    kind: type  # float, int or bool
    help: str = ""
    optional: bool = False  # default None is allowed


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    needs_factor: bool = True
    #: The factor is optional but shapes the method (its derived defaults), so the evaluator hands a method without
    #: ``:F`` its run's ``--factor`` (or the one derived from ``--lengths``), as for methods that need one.
    scales_with_factor: bool = False
    aliases: tuple[str, ...] = ()
    options: dict[str, Option] = field(default_factory=dict)
