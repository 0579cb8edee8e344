"""RoPE scaling methods as pure functions.

Each function takes the model's original rotary frequencies (``RopeInputs``) and the method's options and
returns ``(inv_freq, attention_factor)``, like the functions in transformers' ``modeling_rope_utils``.

Every method is written as ``original_inv_freq * multiplier`` with the multiplier computed in float64. With
``factor == 1`` every multiplier is exactly 1.0, so a factor-1 patch reproduces the original model bit for bit.

Models that ship scaled RoPE (transformers rope types ``linear``, ``yarn``, ``llama3``, ``longrope``): the methods
compose on the frequencies the model actually uses. ``RopeInputs.inv_freq`` is then the shipped frequencies (for
``longrope`` its long set), ``original_length`` the length the model advertises (``max_position_embeddings``),
``preset`` the shipped rope type and ``attention_scaling`` the shipped attention factor; the returned attention
factor is the method's own, which the adapter multiplies by the shipped one. Every multiplier above is written per
frequency, so each method has one meaning on any starting set:

* ``pi``: every frequency divided by ``factor``;
* ``ntk``: frequency i multiplied by ``factor ** (-2i / (d - 2))``, which on plain RoPE is exactly the base change
  ``base * factor ** (d / (d - 2))`` (``ntk_scale``);
* ``yarn`` / ``llama3``: the ramp is decided by each frequency's wavelength against ``original_length`` (for
  ``yarn`` through the index a plain-RoPE frequency of that wavelength would have, see ``yarn``);
* ``extrapolate``: frequencies unchanged.

Each method is declared at the end of the module (its kind, options, rule in words and transformers-native form),
beside its function; ``ctxext.methods.registry`` collects the declarations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.errors import PatchError
from .declaration import Kind, Method, NativeRope, Option


@dataclass(frozen=True)
class RopeInputs:
    """What a rotary module had before the patch."""

    inv_freq: torch.Tensor  # (dim/2,), float32
    base: float  # rope_theta
    dim: int  # rotary dimension (head_dim * partial_rotary_factor)
    original_length: int  # context length the model was trained to (advertises)
    #: transformers rope type the frequencies come from ("default": plain RoPE, base ** (-2i/d))
    preset: str = "default"
    #: the attention factor the model ships with (1.0 for plain RoPE); the adapter multiplies the method's by it
    attention_scaling: float = 1.0


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

    base'^(-2i/d) = base^(-2i/d) * (factor^(d/(d-2)))^(-2i/d) = base^(-2i/d) * factor^(-2i/(d-2)), so the method is
    a per-frequency multiplier that needs no base: on shipped scaled frequencies it composes as that multiplier
    (the highest frequency, i = 0, is kept; the lowest, i = d/2 - 1, is divided by ``factor``).
    """
    return _scaled(r, factor ** (-_pair_index(r) / (r.dim - 2))), 1.0


def ntk_base(base: float, factor: float, dim: int) -> float:
    """The rope base static NTK-aware scaling amounts to on plain RoPE (its transformers-native form)."""
    return base * factor ** (dim / (dim - 2))


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


def _yarn_index(r: RopeInputs) -> torch.Tensor:
    """The frequency index the yarn ramp runs over: i itself on plain RoPE; on shipped scaled frequencies the index
    a plain-RoPE frequency of the same wavelength has, -d * ln(inv_freq) / (2 ln base)."""
    if r.preset == "default":
        return torch.arange(r.dim // 2, dtype=torch.float64)
    inv = r.inv_freq.detach().to("cpu", torch.float64)
    return -r.dim * torch.log(inv) / (2 * math.log(r.base))


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

    On plain RoPE the ramp runs over the frequency index i, as transformers' ``yarn`` does. On shipped scaled
    frequencies (``r.preset != "default"``) each frequency takes the index a plain-RoPE frequency of the same
    wavelength would have, t = -d * ln(inv_freq) / (2 ln base) (t = i on plain RoPE), so the ramp is decided by its
    wavelength against ``r.original_length`` with the same thresholds (``truncate`` rounds the thresholds in that
    index space, as on plain RoPE).
    """
    low = _yarn_correction_dim(beta_fast, r)
    high = _yarn_correction_dim(beta_slow, r)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r.dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero, as the reference does
    ramp = ((_yarn_index(r) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep frequency), 0: interpolate (divide by factor)
    multiplier = 1.0 / factor + (1.0 - 1.0 / factor) * keep

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return _scaled(r, multiplier), float(attention_factor)


def check_yarn_options(options: dict) -> None:
    """Ranges the formulas need: rotation counts above 0 (their logarithm is taken) with beta_fast above beta_slow,
    and an attention factor and mscales that keep the attention temperature positive (0 = uniform attention)."""
    fast, slow = options["beta_fast"], options["beta_slow"]
    if fast <= 0 or slow <= 0:
        raise PatchError(f"options beta_fast and beta_slow of method 'yarn' are rotation counts over the original "
                         f"length and must be > 0, got beta_fast={fast}, beta_slow={slow}")
    if fast <= slow:
        raise PatchError(f"option beta_fast of method 'yarn' must be greater than beta_slow (dimensions rotating more "
                         f"than beta_fast times are kept, fewer than beta_slow interpolated), got beta_fast={fast}, "
                         f"beta_slow={slow}")
    factor = options["attention_factor"]
    if factor is not None and not 0 < factor <= MAX_ATTENTION_FACTOR:
        raise PatchError(f"option attention_factor of method 'yarn' must be > 0 and at most {MAX_ATTENTION_FACTOR:g} "
                         f"(it scales every attention logit; YaRN's own is about 1.0-1.5), got {factor}")
    for key in ("mscale", "mscale_all_dim"):
        if options[key] is not None and not 0 <= options[key] <= MAX_MSCALE:
            raise PatchError(f"option {key} of method 'yarn' must be >= 0 (0: off) and at most {MAX_MSCALE:g} "
                             f"(DeepSeek's configs use about 1), got {options[key]}")


#: Upper bounds of yarn's temperature options: far above any published value, low enough that the attention factor
#: stays finite (an unbounded one, e.g. 1e300, makes every logit non-finite).
MAX_ATTENTION_FACTOR = 10.0
MAX_MSCALE = 100.0


def check_llama3_options(options: dict) -> None:
    low, high = options["low_freq_factor"], options["high_freq_factor"]
    if low <= 0 or high <= low:
        raise PatchError(f"options of method 'llama3' must satisfy 0 < low_freq_factor < high_freq_factor "
                         f"(wavelengths above L/low are interpolated, below L/high kept), got low_freq_factor={low}, "
                         f"high_freq_factor={high}")


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


# -- declarations: one per method (collected by ctxext.methods.registry) ---------------------------------------------

PI = Method(
    "pi", "position interpolation: positions divided by the factor", Kind.FREQUENCY, aliases=("linear",),
    rule="frequencies / factor", interpolates=True, frequencies=position_interpolation,
    native=NativeRope("linear"),
)
NTK = Method(
    "ntk", "static NTK-aware scaling: rope base * factor^(d/(d-2))", Kind.FREQUENCY,
    rule="base * factor^(d/(d-2))", frequencies=ntk_scale, native=NativeRope(theta=ntk_base),
)
DYNAMIC_NTK = Method(
    "dynamic-ntk", "NTK scaling that grows with the sequence length past the original length", Kind.FREQUENCY,
    aliases=("dynamic",), rule="scale from sequence length", frequencies=dynamic_ntk_scale, per_sequence=True,
    native=NativeRope("dynamic", keeps_original_length=True),
)
YARN = Method(
    "yarn", "YaRN: NTK-by-parts interpolation with attention temperature", Kind.FREQUENCY,
    options={
        "beta_fast": Option(32.0, float, "rotations above which a dimension is kept"),
        "beta_slow": Option(1.0, float, "rotations below which a dimension is interpolated"),
        "attention_factor": Option(None, float, "mscale; default 0.1*ln(factor)+1", optional=True),
        "mscale": Option(None, float, "DeepSeek-style mscale numerator", optional=True),
        "mscale_all_dim": Option(None, float, "DeepSeek-style mscale denominator", optional=True),
        "truncate": Option(True, bool, "round the ramp bounds to whole dimensions"),
    },
    rule="NTK-by-parts + mscale", table_rule="NTK-by-parts, x mscale", frequencies=yarn, check_options=check_yarn_options,
    native=NativeRope("yarn", ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
                      names_original_length=True),
)
LLAMA3 = Method(
    "llama3", "Llama 3.1 frequency-dependent interpolation", Kind.FREQUENCY,
    options={
        "low_freq_factor": Option(1.0, float, "wavelengths above L0/low are interpolated"),
        "high_freq_factor": Option(4.0, float, "wavelengths below L0/high are kept"),
    },
    rule="Llama 3.1 by wavelength", table_rule="Llama 3.1 frequencies", frequencies=llama3,
    check_options=check_llama3_options,
    native=NativeRope("llama3", ("low_freq_factor", "high_freq_factor"), names_original_length=True),
)
EXTRAPOLATE = Method(
    "extrapolate", "advertise factor x the length, positions unchanged (GPT-2: table extended)", Kind.LENGTH,
)

#: The frequency methods, in the order of the method table.
FREQUENCY_METHODS = (PI, NTK, DYNAMIC_NTK, YARN, LLAMA3)
