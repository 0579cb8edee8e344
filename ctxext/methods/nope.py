"""NoPE (no positional encoding) as pure functions: the positional signal of a family set to the identity."""

from __future__ import annotations

import torch

from .declaration import Kind, Method
from .rope import RopeInputs


def identity_rotation(r: RopeInputs, factor: float | None = None) -> tuple[torch.Tensor, float]:
    """Rotary frequencies all zero: cos = 1 and sin = 0 at every position, so queries and keys are not rotated.

    The rotary module and the attention kernel (sdpa, flash) stay as they are; only the angles vanish.
    """
    return torch.zeros_like(r.inv_freq), 1.0


# -- declaration (collected by ctxext.methods.registry) ---------------------------------------------------------------

NOPE = Method(
    "nope",
    "NoPE ablation: the positional encoding removed, only the causal mask orders tokens (factor optional: "
    "advertise factor x the length)",
    Kind.NONE,
    needs_factor=False,
)
