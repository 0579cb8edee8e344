"""The module that stands in for a patched learned position table (GPT-2's ``wpe``, OPT-style ``embed_positions``).

It holds the original ``weight`` parameter (so the state dict keeps its key and values) and a non-persistent
``table`` buffer: the method's table, derived from that weight. Whatever replaces or rewrites the weight while the
model is patched (``load_state_dict``, ``.half()``, ``.to(device)``) is followed: the table is derived again before
the next lookup, and ``unpatch`` puts the original module back holding the weight as it is then. A table turned into
a parameter for fine-tuning (``trainable_table``) is the trained state itself and is never derived again.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class StandInTable(nn.Module):
    def __init__(self, original: nn.Embedding, derive: Callable[[torch.Tensor], torch.Tensor] | None, method: str):
        super().__init__()
        self.weight = original.weight  # the original parameter, so the state dict is unchanged
        self.method = method
        self.embedding_dim = original.embedding_dim
        self._derive = derive
        self._derived_from = None
        self.register_buffer("table", self._derive_table(), persistent=False)
        self.train(original.training)

    def _weight_key(self) -> tuple:
        w = self.weight
        return id(w), w._version, w.device, w.dtype, (w.data_ptr() if w.device.type != "meta" else 0)

    def _derive_table(self) -> torch.Tensor | None:
        self._derived_from = self._weight_key()
        if self._derive is None:
            return None
        with torch.no_grad():
            return self._derive(self.weight.detach())

    def current_table(self) -> torch.Tensor | None:
        """The method's table for the weight as it is now (derived again if the weight was loaded, moved or cast)."""
        if self._derive is not None and not isinstance(self.table, nn.Parameter) \
                and self._weight_key() != self._derived_from:
            self.table = self._derive_table()
        return self.table


def put_back(owner: nn.Module, name: str, original: nn.Module) -> None:
    """``unpatch``: ``original`` back in ``owner.name``, holding the stand-in's weight as it is now (the same
    parameter unless it was replaced while patched) and its train / eval mode."""
    current = owner._modules.get(name)
    if isinstance(current, StandInTable):
        if current.weight is not original.weight:
            original.weight = current.weight
        original.train(current.training)
    setattr(owner, name, original)
