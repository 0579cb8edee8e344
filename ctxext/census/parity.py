"""Parity with transformers' own rope types: the same weights configured with transformers' form of a method.

``pi`` ~ ``linear``, ``dynamic-ntk`` ~ ``dynamic``, ``yarn``, ``llama3``; ``ntk`` ~ a new ``rope_theta``. The census
compares a patched model's logits with such a reference where the model honours transformers' rope type: where its
positions come from rotary modules that read one (asked of the model's structure, not of a family name).
"""

from __future__ import annotations

import copy

import torch

from ..adapters.rotary import positions_not_rotary
from ..adapters.rotary_units import rotary_units
from .build import FACTOR, L0

#: Method -> transformers rope type with the same definition (the census checks parity where the model honours it).
ROPE_PARITY = {"pi": "linear", "dynamic-ntk": "dynamic", "yarn": "yarn", "llama3": "llama3", "ntk": "rope_theta"}


def honours_rope_type(model) -> bool:
    """Whether ``model`` rotates its positions with transformers rotary modules that read a rope type (``rope_type``):
    then transformers' own form of a frequency method exists to compare with. Falcon with ALiBi builds such a module
    and never applies it, hence the second question."""
    return bool(rotary_units(model)) and positions_not_rotary(model) is None


def _shipped_rope_type(config) -> str | None:
    """The scaled rope type a config ships (5.x rope_parameters or 4.x rope_scaling), if any."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" in params:
        return params["rope_type"]
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        return scaling.get("rope_type", scaling.get("type"))
    return None


def rope_reference(model, method: str):
    """The unpatched weights configured with transformers' own form of ``method``; None where this model has no
    such config surface."""
    config = copy.deepcopy(model.config)
    units = rotary_units(model)
    if not units:
        return None
    dim = 2 * units[0].original_inv_freq.numel()
    kind = ROPE_PARITY[method]
    if kind == "rope_theta":
        extra = {}
    else:
        extra = {"rope_type": kind, "factor": float(FACTOR)}
        if kind in ("yarn", "llama3"):
            extra["original_max_position_embeddings"] = L0
        if kind == "llama3":
            extra.update(low_freq_factor=1.0, high_freq_factor=4.0)

    def merged(params: dict) -> dict:
        new = {**params, **extra}
        if kind == "rope_theta":
            new["rope_theta"] = params["rope_theta"] * FACTOR ** (dim / (dim - 2))
        return new

    params = getattr(config, "rope_parameters", None)
    shipped = _shipped_rope_type(config)
    if shipped not in (None, "default"):
        # a composed patch has a transformers form only in closed form: pi x f on linear x a is linear x (a * f)
        if not (shipped == "linear" and kind == "linear"):
            raise LookupError(f"{method} on shipped rope type {shipped!r} has no transformers rope type")
        scaling = params if isinstance(params, dict) and "rope_type" in params else config.rope_scaling
        extra = {"factor": float(scaling["factor"]) * FACTOR}
        if isinstance(params, dict) and "rope_type" in params:
            config.rope_parameters = {**params, **extra}
        else:
            config.rope_scaling = {**config.rope_scaling, **extra}
    elif isinstance(params, dict) and params:
        if "rope_theta" in params:
            config.rope_parameters = merged(params)
        elif all(isinstance(v, dict) and "rope_theta" in v for v in params.values()):
            config.rope_parameters = {k: merged(v) for k, v in params.items()}
        else:
            return None
    else:  # 4.x: rope_theta (rotary_emb_base) + rope_scaling, which some 4.x configs (Mistral) do not declare
        if len(units) > 1:
            # e.g. 4.x Gemma 3 / OLMo 3: rope_scaling reaches the global rotary module only, ctxext scales every one
            raise LookupError("4.x rope_scaling scales one of the model's rotary modules, ctxext all of them")
        theta_attr = next((a for a in ("rope_theta", "rotary_emb_base") if isinstance(getattr(config, a, None),
                                                                                     (int, float))), None)
        if theta_attr is None:
            return None
        if kind == "rope_theta":
            setattr(config, theta_attr, getattr(config, theta_attr) * FACTOR ** (dim / (dim - 2)))
        else:
            config.rope_scaling = dict(extra)
    if kind in ("yarn", "llama3"):
        config.max_position_embeddings = FACTOR * L0
    reference = type(model)(config).eval()
    reference.load_state_dict(model.state_dict())
    return reference


def split_dynamic_scales(reference) -> str | None:
    """Whether transformers' ``dynamic`` rope type left the reference's rotary modules at different lengths after
    its full pass (e.g. DeepSeek-V4's compressors rotate entries at positions of their own)."""
    lengths = sorted({int(value) for m in reference.modules() for key, value in vars(m).items()
                      if key.endswith("max_seq_len_cached") and isinstance(value, (int, float, torch.Tensor))})
    return f"lengths {lengths}" if len(lengths) > 1 else None
