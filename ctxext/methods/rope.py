"""RoPE scaling methods as pure functions.

Each function takes the model's original rotary frequencies (``RopeInputs``) and the method's options and
returns ``(inv_freq, attention_factor)``, like the functions in transformers' ``modeling_rope_utils``.

Every method is written as ``original_inv_freq * multiplier`` with the multiplier computed in float64. With
``factor == 1`` every multiplier is exactly 1.0, so a factor-1 patch reproduces the original model bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeInputs:
    """What a rotary module had before the patch."""

    inv_freq: torch.Tensor  # (dim/2,), float32
    base: float  # rope_theta
    dim: int  # rotary dimension (head_dim * partial_rotary_factor)
    original_length: int  # context length the model was trained to


def _scaled(r: RopeInputs, multiplier: torch.Tensor) -> torch.Tensor:
    inv = r.inv_freq.detach().to(device="cpu", dtype=torch.float64) * multiplier.to(torch.float64)
    return inv.to(dtype=r.inv_freq.dtype)


def _pair_index(r: RopeInputs) -> torch.Tensor:
    """2i for each frequency pair i, as float64."""
    return torch.arange(0, r.dim, 2, dtype=torch.float64)


def position_interpolation(r: RopeInputs, factor: float) -> tuple[torch.Tensor, float]:
    """PI (Chen et al. 2023): positions divided by ``factor``, i.e. every frequency divided by it."""
    return _scaled(r, torch.full((r.dim // 2,), 1.0 / factor, dtype=torch.float64)), 1.0


def ntk_scale(r: RopeInputs, factor: float) -> tuple[torch.Tensor, float]:
    """Static NTK-aware scaling: base' = base * factor ** (d / (d - 2)).

    base'^(-2i/d) = base^(-2i/d) * factor^(-2i/(d-2)), so the multiplier needs no base.
    """
    return _scaled(r, factor ** (-_pair_index(r) / (r.dim - 2))), 1.0


def dynamic_ntk_scale(r: RopeInputs, factor: float, seq_len: int) -> tuple[torch.Tensor, float]:
    """Dynamic NTK (as transformers' ``dynamic`` type): NTK with the scale growing with the sequence length.

    scale = factor * L / L0 - (factor - 1) for L > L0, else 1 (the original frequencies). The formula would still
    scale at factor 1 (scale = L / L0); ctxext defines factor 1 as "no extension" for every method, so it is the
    identity here too.
    """
    if factor == 1:
        return r.inv_freq.clone(), 1.0
    scale = max(1.0, factor * max(seq_len, r.original_length) / r.original_length - (factor - 1))
    return ntk_scale(r, scale)[0], 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_correction_dim(num_rotations: float, r: RopeInputs) -> float:
    """The rotary dimension whose wavelength fits ``num_rotations`` times into the original length."""
    return (r.dim * math.log(r.original_length / (num_rotations * 2 * math.pi))) / (2 * math.log(r.base))


def yarn(
    r: RopeInputs,
    factor: float,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    truncate: bool = True,
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): NTK-by-parts interpolation plus an attention temperature.

    Dimensions that rotate more than ``beta_fast`` times over the original length keep their frequency,
    those rotating fewer than ``beta_slow`` times are interpolated by ``factor``, a linear ramp in between.
    """
    low = _yarn_correction_dim(beta_fast, r)
    high = _yarn_correction_dim(beta_slow, r)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r.dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero, as the reference does
    ramp = ((torch.arange(r.dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep frequency), 0: interpolate (divide by factor)
    multiplier = 1.0 / factor + (1.0 - 1.0 / factor) * keep

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return _scaled(r, multiplier), float(attention_factor)


def llama3(
    r: RopeInputs, factor: float, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0
) -> tuple[torch.Tensor, float]:
    """Llama 3.1 scaling: long wavelengths interpolated by ``factor``, short ones kept, smooth in between."""
    wavelen = 2 * math.pi / r.inv_freq.detach().to("cpu", torch.float64)
    low_freq_wavelen = r.original_length / low_freq_factor
    high_freq_wavelen = r.original_length / high_freq_factor
    smooth = ((r.original_length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    smooth = torch.where(wavelen > low_freq_wavelen, 0.0, smooth)
    smooth = torch.where(wavelen < high_freq_wavelen, 1.0, smooth)
    return _scaled(r, 1.0 / factor + (1.0 - 1.0 / factor) * smooth), 1.0


def identity(r: RopeInputs, factor: float | None = None) -> tuple[torch.Tensor, float]:
    """Frequencies unchanged (``extrapolate``: only the advertised length grows)."""
    return r.inv_freq.clone(), 1.0
