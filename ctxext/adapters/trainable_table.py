"""Fine-tuning a patched position table (GPT-2's ``wpe``, OPT-style ``embed_positions``): the patch keeps the method's
table as a non-persistent ``table`` buffer of a stand-in module that also holds the original ``weight``. These two
steps are what the learned-table adapters' ``make_trainable`` / ``after_lora`` do."""

from __future__ import annotations

import torch
from torch import nn


def make_tables_trainable(model: nn.Module, names: list[str], kind: type) -> list[str]:
    """Turn the ``table`` buffer of each ``kind`` module named in ``names`` (peft ``modules_to_save``, matched by
    name suffix) into a frozen parameter, which the trainable copy peft makes then trains and the adapter saves (a
    buffer would be neither trained nor saved). Loading such an adapter needs the same step before peft loads the
    weights (``ctxext.loading.prepare_for_adapter``). Returns the converted module names."""
    done = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, kind):
            continue
        if not any(name == t or name.endswith("." + t) for t in names):
            continue
        table = module._buffers.get("table")
        if isinstance(table, torch.Tensor) and table.is_floating_point() and not getattr(module, "zeros", False):
            del module._buffers["table"]
            module.table = nn.Parameter(table.detach().clone(), requires_grad=False)
            done.append(name)
    return done


def freeze_unused_weights(model: nn.Module, kind: type) -> None:
    """In a trainable table the original ``weight`` is unused by the forward pass: freeze it (an unused trainable
    parameter breaks DistributedDataParallel)."""
    for module in model.modules():
        if isinstance(module, kind) and isinstance(module.table, nn.Parameter) and module.table.requires_grad:
            module.weight.requires_grad_(False)
