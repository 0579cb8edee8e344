"""ALiBi (Press et al. 2022, "Train Short, Test Long") as pure functions.

Each head h adds ``-slope_h * (i - j)`` to the attention score of query position i on key position j (j <= i).
The slopes are a geometric sequence: for n heads, n a power of two, ``slope_k = 2 ** (-8k / n)``, k = 1..n. For
other head counts, the first ``2 ** floor(log2 n)`` slopes follow that rule and the remaining heads take every other
slope of the sequence for twice that power of two (the odd-numbered ones), as in the paper's reference code.

The slopes are computed exactly as transformers' BLOOM does (a float32 base raised to integer powers), so they are
bit-identical to BLOOM's own slopes for every head count.
"""

from __future__ import annotations

import math

import torch

from .declaration import Kind, Method


def _geometric(base_exponent: float, powers: torch.Tensor) -> torch.Tensor:
    base = torch.full((), 2.0 ** base_exponent, dtype=torch.float32)
    return torch.pow(base, powers)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi slope of each head, float32 tensor of shape (num_heads,)."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    closest = 2 ** math.floor(math.log2(num_heads))
    # 2 ** (-8 / closest) raised to 1..closest
    slopes = _geometric(-8.0 / closest, torch.arange(1, closest + 1, dtype=torch.int32))
    if closest != num_heads:
        # the odd-numbered slopes of the sequence for 2 * closest heads: 2 ** (-4 / closest) raised to 1, 3, 5, ...
        extra = num_heads - closest
        odd = torch.arange(1, 2 * extra, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, _geometric(-4.0 / closest, odd)])
    return slopes


def interpolated_slopes(slopes: torch.Tensor, factor: float) -> torch.Tensor:
    """Interpolated ALiBi: every relative distance divided by ``factor``, i.e. every slope divided by it.

    ``factor == 1`` returns the slopes bit for bit.
    """
    return slopes / float(factor)


def no_slopes(slopes: torch.Tensor) -> torch.Tensor:
    """NoPE on an ALiBi model: all slopes zero, so the bias vanishes and only the causal mask remains."""
    return torch.zeros_like(slopes)


def alibi_bias(slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """The additive bias ``-slope_h * (q - k)``, shape (heads, len(query_positions), len(key_positions)), float32.

    Entries with k > q (future keys) are positive and must be masked by the caller; softmax is invariant to adding
    a constant per query row, so only key-position differences matter.
    """
    distance = (query_positions[:, None] - key_positions[None, :]).to(torch.float32)
    return -slopes.to(torch.float32)[:, None, None] * distance


# -- declaration (collected by ctxext.methods.registry) ---------------------------------------------------------------

ALIBI = Method(
    "alibi",
    "ALiBi swap: the positional encoding replaced by ALiBi linear attention biases (factor optional: "
    "advertise factor x the length)",
    Kind.BIAS,
    needs_factor=False,
)
