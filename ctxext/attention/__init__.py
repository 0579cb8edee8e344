"""Attention functions ctxext registers with transformers, one module per job.

- ``interface``: registration with transformers' attention interfaces and the switch of a model to a registered
  function (``use_attention``, with its exact undo);
- ``features``: what a model's attention does that a swapped-in function must honour or refuse;
- ``alibi``: ``ctxext_alibi``, the ALiBi bias without a (heads x T x T) tensor;
- ``remap``: ``ctxext_remap``, the attention-side position remapping of the remap methods;
- ``lse``: the remap methods' key ranges on torch's fused CPU flash kernel, merged by log-sum-exp;
- ``flex_paths`` / ``flex_functions``: the flex-attention paths on CUDA;
- ``shifted_sparse``: LongLoRA's shifted sparse attention (S²-Attn) while training, full attention otherwise.
"""

from .alibi import ALIBI, alibi_attention_forward
from .features import DROPPED_FEATURES, attention_features, dropped_features
from .interface import MISSING_HOOK, can_use_attention, require_attention, use_attention
from .shifted_sparse import check_shift_attention, enable_shift_attention, shift_attention

__all__ = [
    "ALIBI",
    "DROPPED_FEATURES",
    "MISSING_HOOK",
    "alibi_attention_forward",
    "attention_features",
    "can_use_attention",
    "check_shift_attention",
    "dropped_features",
    "enable_shift_attention",
    "require_attention",
    "shift_attention",
    "use_attention",
]
