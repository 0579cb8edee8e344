"""What a patch is written as when saved natively (``ctxext.export``): each family's adapter builds one, or says
why there is none."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import PatchError


@dataclass
class NativeForm:
    """How a patched model is written natively: top-level config values to write, and (GPT-2) weights."""

    changes: dict[str, Any]
    #: context manager factory: while open, the model's state dict holds the native weights
    weights: Callable[[], Any] | None = None
    #: tensors the native weights replaced, written to ``ORIGINAL_TENSORS`` ({name: tensor})
    originals: Callable[[], dict[str, torch.Tensor]] | None = None
    summary: str = ""
    notes: list[str] = field(default_factory=list)


class NoNativeForm(PatchError):
    """The patch has no exact transformers-native form on this model (the reason is the message)."""


def no_form_reason(method: str, title: str) -> str:
    return (f"method {method!r} on {title} has no transformers-native form (transformers has no rope type, "
            "config field or weight layout that computes it)")
