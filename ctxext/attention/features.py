"""What a model's attention does beyond scores and a mask (soft-capping, sinks, position biases, sparse indices),
read from the model before anything is swapped in, and from each attention call's arguments."""

from __future__ import annotations

import torch
from torch import nn


def _configs(model: nn.Module) -> list:
    """Every config whose ``_attn_implementation`` a switch may change: the model's, its submodels', sub-configs."""
    from transformers import PreTrainedModel

    seen: dict[int, object] = {}
    stack = [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while stack:
        config = stack.pop()
        if id(config) in seen:
            continue
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None:
                stack.append(sub)
    return list(seen.values())


#: Attention-function arguments through which a model's attention does something a swapped-in function would have to
#: reproduce (logit soft-capping, learned sink logits, a T5-style position bias, sparse attention indices). The
#: ctxext functions reproduce none of them: a model whose attention passes one is refused (``attention_features``)
#: and, should one still arrive, the function raises instead of silently dropping it. Sliding windows are honoured:
#: they reach the function in the attention mask that transformers builds with the mask function registered under
#: the same name.
DROPPED_FEATURES = ("softcap", "s_aux", "sinks", "position_bias", "indices", "block_indices")


def dropped_features(kwargs: dict) -> str:
    """The features in an attention call's ``kwargs`` that the ctxext functions would drop ('' if none)."""
    return ", ".join(f"{k}" for k in DROPPED_FEATURES if kwargs.get(k) is not None)


def attention_features(model: nn.Module) -> str | None:
    """Why a swapped-in attention function would change what ``model``'s attention does, or None.

    Read from the model's structure and configs before anything is touched: attention logit soft-capping
    (``attn_logit_softcapping``, Gemma 2), learned attention sinks (a ``sinks`` tensor on an attention module, GPT-OSS),
    attention modules that pass a position bias of their own. Sliding windows are not in the list: transformers
    builds them into the attention mask the function receives (the mask function is registered under the same
    name), so they are honoured."""
    name = type(model).__name__
    for module_name, module in model.named_modules():  # by structure: the layer type's name differs by release
        if hasattr(module, "layer_idx") and isinstance(getattr(module, "indexer", None), nn.Module):
            return (f"{name} has sparse indexed attention ({module_name}.indexer picks the keys each query sees, "
                    "passed as `indices`), which the swapped-in attention does not follow")
    for config in _configs(model):
        cap = getattr(config, "attn_logit_softcapping", None)
        if cap:
            return (f"{name} soft-caps its attention logits (attn_logit_softcapping={cap}), which the swapped-in "
                    "attention does not")
    for module_name, module in model.named_modules():
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.Tensor):
            return (f"{name} has learned attention sinks ({module_name}.sinks), which the swapped-in attention "
                    "does not add")
    return None


__all__ = ["DROPPED_FEATURES", "attention_features", "dropped_features"]
