"""Learned absolute position tables (GPT-2's ``wpe``) as pure functions.

Both rules return a new table and leave rows that map to an original position unchanged, so ``factor == 1``
returns the original table bit for bit.

``interpolate_table`` (method ``pi``): a table of ``round(factor * n)`` rows where row j holds the original table
at the fractional position p = j / factor, linearly interpolated between rows floor(p) and floor(p) + 1
(rows j with p > n - 1, the last ``factor - 1`` rows, repeat row n - 1). With an integer factor, row ``factor * i``
is exactly original row i.

``extend_table`` (method ``extrapolate``): rows 0..n-1 are the original rows; rows n..round(factor * n) - 1 repeat
the last learned row (position n - 1). Inputs up to the original length see exactly the original model; positions
past it saturate at the last position the model learned instead of raising an IndexError.

Positions past the end of either table (longer than the advertised length) are clamped to its last row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .declaration import Kind, Method


def table_rows(n: int, factor: float) -> int:
    return max(n, int(round(n * float(factor))))


def interpolate_table(weight: torch.Tensor, factor: float) -> torch.Tensor:
    """PI for a learned table: row j = original table at position j / factor (linear interpolation)."""
    n = weight.shape[0]
    rows = table_rows(n, factor)
    source = weight.detach().to(device="cpu", dtype=torch.float64)  # a small table; float64 is not on every device
    position = torch.arange(rows, dtype=torch.float64) / float(factor)
    position = position.clamp(max=n - 1)
    low = position.floor().long()
    high = (low + 1).clamp(max=n - 1)
    frac = (position - low.to(torch.float64))[:, None]
    table = source[low] * (1.0 - frac) + source[high] * frac
    # rows at an original position (frac == 0) are copied, not recomputed, so they are exact
    table = torch.where(frac == 0, source[low], table)
    return table.to(dtype=weight.dtype, device=weight.device)


def extend_table(weight: torch.Tensor, factor: float) -> torch.Tensor:
    """Extrapolation for a learned table: original rows, then the last row repeated up to round(factor * n) rows."""
    n = weight.shape[0]
    rows = table_rows(n, factor)
    index = torch.arange(rows, device=weight.device).clamp(max=n - 1)
    return weight.detach()[index].clone()


def table_rule(method: Method) -> Callable[[torch.Tensor, float], torch.Tensor] | None:
    """How a learned position table carries ``method``: interpolated where it divides positions by the factor,
    extended where only the length grows, None where the method keeps no table (the positional signal removed or
    replaced by a bias)."""
    if method.interpolates:
        return interpolate_table
    return extend_table if method.kind is Kind.LENGTH else None
