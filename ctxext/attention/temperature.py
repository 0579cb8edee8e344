"""An attention temperature by query position (``ctxext.methods.temperature``) in front of a model's own attention.

``ctxext_temperature_<base>`` is registered with ``AttentionInterface`` for each implementation ``base`` that
transformers' ``AttentionMaskInterface`` knows (sdpa, eager, flash attention, flex), with ``base``'s mask function, so
the model builds the same mask as before. The function multiplies each query by its factor and hands the call, with
every argument, to the function the layer ran before (``compat.transformers.model_attention_function``): the fused
kernels, sliding windows, soft-capping and sinks stay exactly as the model had them. The remap methods compute
their attention themselves and take the factor in their position map (``PositionMap.query_scale``) instead.

Query positions come from the ``position_ids`` transformers passes in the attention kwargs (true positions: a cached
decode and a left-padded row get the factor a full pass over the unpadded row gives); without them, the queries are
the last ``q_len`` of the keys.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ..compat import transformers as hf_compat
from ..core.errors import PatchError
from ..core.undo import run_all, undone_on_failure
from .interface import MISSING_HOOK, use_attention
from .shifted_sparse import attention_layers

PREFIX = "ctxext_temperature"
#: Attribute on each attention layer holding its ``TemperatureState`` while the temperature is installed.
STATE_ATTR = "_ctxext_temperature"


class TemperatureState:
    """What the function needs of one layer: the per-position query factors and the implementation it stands in
    for. A plain object (not a closure) so that a deep copy of a patched model carries its own."""

    def __init__(self, factors: Callable[[torch.Tensor], torch.Tensor], base: str):
        self.factors = factors
        self.base = base


def temperature_name(base: str) -> str:
    return f"{PREFIX}_{base}"


def _bases() -> tuple[str, ...]:
    if MISSING_HOOK:
        return ()
    from transformers.masking_utils import AttentionMaskInterface

    return tuple(name for name in AttentionMaskInterface() if not name.startswith("ctxext_"))


def query_positions(query: torch.Tensor, kv_len: int, kwargs: dict) -> torch.Tensor:
    """(batch or 1, q_len) positions of the queries: ``position_ids`` when given in this shape, else the last q_len
    key slots."""
    q_len = query.shape[2]
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[-1] == q_len:
        return position_ids.to(query.device)
    return torch.arange(kv_len - q_len, kv_len, device=query.device)[None]


def scale_queries(query: torch.Tensor, factors, positions: torch.Tensor) -> torch.Tensor:
    """``query`` (batch, heads, q_len, dim) times each query's factor, cast to the query's dtype (as Ministral 3 and
    Llama 4 scale theirs)."""
    return query * factors(positions).to(device=query.device, dtype=query.dtype)[:, None, :, None]


def temperature_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: torch.Tensor | None, **kwargs):
    state = getattr(module, STATE_ATTR, None)
    if not isinstance(state, TemperatureState):
        raise ValueError(f"{PREFIX}: {type(module).__name__} carries no temperature; select this attention only "
                         "through ctxext.patch(..., temperature=...)")
    base = hf_compat.model_attention_function(module, state.base)
    query = scale_queries(query, state.factors, query_positions(query, key.shape[2], kwargs))
    return base(module, query, key, value, attention_mask, **kwargs)


def check_temperature(model: nn.Module) -> str:
    """The implementation the temperature would stand in for; ``PatchError`` where it cannot, nothing changed."""
    base = hf_compat.attn_implementation(model.config)
    name = type(model).__name__
    if not isinstance(base, str) or base not in _bases():
        raise PatchError(f"cannot add an attention temperature to {name}: it runs attention implementation {base!r}, "
                         f"and the temperature stands in for one of {', '.join(_bases()) or 'none (no hook point)'}")
    layers = attention_layers(model)
    if not layers:
        raise PatchError(f"cannot add an attention temperature to {name}: no attention layer calls transformers' "
                         "attention interface")
    for layer in layers:
        if hf_compat.model_attention_function(layer, base) is None:
            raise PatchError(f"cannot add an attention temperature to {name}: cannot find the {base} function "
                             f"{type(layer).__name__} calls")
    return base


def use_temperature(model: nn.Module, factors: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    """Scale every attention layer's queries of ``model`` by ``factors(positions)``; returns the exact undo."""
    base = check_temperature(model)
    state = TemperatureState(factors, base)
    with undone_on_failure() as undo:
        for layer in attention_layers(model):
            setattr(layer, STATE_ATTR, state)
            undo.append(functools.partial(_drop_state, layer))
        undo.append(use_attention(model, temperature_name(base)))
    return functools.partial(run_all, undo)


def _drop_state(layer: nn.Module) -> None:
    layer.__dict__.pop(STATE_ATTR, None)


def _register() -> None:
    if MISSING_HOOK:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    masks = AttentionMaskInterface()
    for base in _bases():
        AttentionInterface.register(temperature_name(base), temperature_attention_forward)
        AttentionMaskInterface.register(temperature_name(base), masks[base])


_register()

__all__ = ["PREFIX", "STATE_ATTR", "TemperatureState", "check_temperature", "query_positions", "scale_queries",
           "temperature_attention_forward", "use_temperature"]
