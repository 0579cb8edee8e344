"""GPT-Neo adapter: GPT-2's learned ``wpe`` table plus causal-mask buffers sized by the trained length.

GPT-Neo's attention (its own eager ``_attn``, not AttentionInterface) slices a boolean ``bias`` buffer of
``max_position_embeddings`` x ``max_position_embeddings`` in every layer: lower-triangular in "global" layers, and in
"local" layers also limited to the last ``window_size`` keys. A longer input needs both a position table (the
GPT-2 adapter's, ``ctxext.adapters.gpt2``: ``pi``, ``extrapolate``, ``nope``) and masks of the new length, which are
rebuilt by the same rule at the patched length (one tensor shared by the layers of each kind). ``unpatch`` puts
each layer's own buffer back (the same tensor). The ALiBi swap is refused: the attention cannot be switched.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..core.spec import PatchSpec
from ..methods.declaration import Kind
from .base import Restore, run_all, undone_on_failure
from .gpt2 import GPT2Adapter, position_owner


def mask_layers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module holding the square boolean (1, 1, L, L) causal-mask buffer ``bias``, its layer's ``attention_type``)
    per attention layer. The type sits on the layer's ``GPTNeoAttention`` (5.x also copies it onto the inner module
    holding the buffer; 4.x does not)."""
    found = []
    for layer in model.modules():
        kind = getattr(layer, "attention_type", None)
        holder = layer if "bias" in layer._buffers else layer._modules.get("attention")
        bias = holder._buffers.get("bias") if holder is not None else None
        if (isinstance(kind, str) and isinstance(bias, torch.Tensor) and bias.dtype == torch.bool and bias.dim() == 4
                and bias.shape[-1] == bias.shape[-2] and all(h is not holder for h, _ in found)):
            found.append((holder, kind))
    return found


def causal_mask(length: int, attention_type: str, window: int, device) -> torch.Tensor:
    """GPT-Neo's mask rule at ``length``: key j visible from query i if j <= i (and, in a local layer, i - j <
    ``window``)."""
    mask = torch.tril(torch.ones((length, length), dtype=torch.bool, device=device))
    if attention_type == "local":
        mask = torch.bitwise_xor(mask, torch.tril(mask, -window))
    return mask.view(1, 1, length, length)


class GPTNeoAdapter(GPT2Adapter):
    family = "gpt-neo"
    title = "GPT-Neo (learned absolute + causal-mask buffers)"
    length_attr = "max_position_embeddings"
    interpolation = "wpe interpolated to f x rows, masks rebuilt"
    kinds = {Kind.LENGTH: "wpe extended (last row repeated), masks rebuilt",
             Kind.NONE: "wpe bypassed, masks rebuilt to f x length"}
    refusals = {**GPT2Adapter.refusals,
                Kind.BIAS: "GPT-Neo's attention is its own eager code, not AttentionInterface: no ALiBi swap"}

    def detect(self, model: nn.Module) -> bool:
        return position_owner(model) is not None and bool(mask_layers(model))

    def lora_settings(self, model: nn.Module) -> dict:
        return {}  # nn.Linear layers (GPT-2's transposed Conv1D setting does not apply)

    def check(self, model: nn.Module, spec: PatchSpec) -> None:
        """Every method this adapter lists applies; nothing to check against the model."""

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        with undone_on_failure([super().apply(model, spec)]) as undo:
            set_masks(model, spec.patched_length or spec.original_length, undo)
        return functools.partial(run_all, undo)

    def position_limit(self, model: nn.Module) -> int | None:
        """The shorter of the position table (none while ``nope`` bypasses it) and the masks."""
        limits = [holder.bias.shape[-1] for holder, _ in mask_layers(model)]
        table = super().position_limit(model)
        return min(limits + ([table] if table is not None else []), default=None)

    def restore_exported(self, model: nn.Module, tensors: dict[str, torch.Tensor], spec: PatchSpec) -> None:
        super().restore_exported(model, tensors, spec)
        set_masks(model, getattr(model.config, self.length_attr), [])  # loaded at the exported length


def set_masks(model: nn.Module, length: int, undo: list[Restore]) -> None:
    """Give every mask layer GPT-Neo's mask at ``length`` (shared per kind), recording how to put each back."""
    window = int(getattr(model.config, "window_size", 0) or 0)
    shared: dict[str, torch.Tensor] = {}
    for holder, kind in mask_layers(model):
        if kind not in shared:
            shared[kind] = causal_mask(length, kind, window, holder.bias.device)
        undo.append(functools.partial(_put_back_mask, holder, holder.bias))
        holder.bias = shared[kind]


def _put_back_mask(holder: nn.Module, original: torch.Tensor) -> None:
    """The original mask, on the device the model was moved to while patched."""
    holder.bias = original.to(holder.bias.device)
