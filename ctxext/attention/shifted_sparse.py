"""LongLoRA's shifted sparse attention (S²-Attn) as an attention function used only while training.

LongLoRA (Chen et al. 2023, "LongLoRA: Efficient Fine-tuning of Long-Context Large Language Models",
arXiv:2309.12307, section 3.2) fine-tunes at a long length with attention restricted to groups: a sequence of ``T``
tokens splits into ``T / G`` groups of ``G = T * group_ratio`` tokens (the paper's default ratio is 1/4), attention is
causal within each group, and in half of the heads the groups are shifted by half a group, so that information flows
between neighbouring groups. Inference keeps full attention.

Which tokens a query at position ``i`` sees (``j <= i`` always):

- the first ``H // 2`` heads: keys with ``j // G == i // G`` (groups ``[0, G)``, ``[G, 2G)``, ...);
- the other heads: keys with ``(j + G/2) // G == (i + G/2) // G`` (groups ``[0, G/2)``, ``[G/2, 3G/2)``, ...,
  ``[T - 3G/2, T - G/2)``, ``[T - G/2, T)``).

Where ctxext differs from LongLoRA. The paper's PyTorch-style pseudocode (its Algorithm 1) and LongLoRA's first
implementation (``llama_attn_replace.py``) shift with ``torch.roll``: the shifted heads' sequence is rolled left by
``G/2``, which puts the last half-group ``[T - G/2, T)`` and the first one ``[0, G/2)`` into one group. In a causal LM
the first tokens then attend to the last ones, a look at the future that the loss is computed against. The authors
acknowledge the leak (dvlab-research/LongLoRA issues #15 and #90), argue its effect is small, and say in #90 that their
later flash-attention path partitions the groups without rolling. ctxext never wraps around: the shifted heads' first
and last half-groups are two groups of ``G/2`` tokens each, causal within themselves, so no token sees a later one. The
other groups are LongLoRA's. The head split is LongLoRA's too: heads ``H // 2`` onwards are shifted (with an odd head
count the shifted half is the larger one).

How it runs. No ``T x T`` mask is built: the groups are folded into the batch dimension and each set of groups is one
call of torch's fused ``scaled_dot_product_attention`` with ``is_causal=True`` (at most three calls per layer: the
plain groups, the shifted full groups, the two shifted half-groups). ``scaling`` and dropout are passed through; grouped
query attention uses ``enable_gqa`` where a head half starts and ends on a key/value head boundary, and copies only the
key/value heads that half needs otherwise.

Only while training. The function is registered as ``ctxext_shift_sdpa`` / ``ctxext_shift_eager``: the name of the
implementation it replaced, whose mask function it is registered with, so the model builds the same mask as before.
When the attention module is not training (``model.eval()``, ``generate``, evaluation) every call goes to the function
that implementation would have run (``ctxext.compat.transformers.model_attention_function``), with the same
arguments: outputs are bit-identical to the model without S²-Attn. While training it refuses (``ValueError``) what it
cannot honour: a mask that is not plain causal (padding, packed sequences with restarting positions, a sliding window
shorter than the sequence: the data S²-Attn trains on is packed, full-length rows), a KV cache that holds more keys
than the queries, soft-capping or sinks, and a length that does not split into groups.

API: ``enable_shift_attention(model, group_ratio)`` installs it and returns the exact undo; ``shift_attention`` is the
same as a context manager; ``check_shift_attention(seq_length, group_ratio, method, model=)`` says, without touching
anything, why a training setup cannot use it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import transformers as hf_compat
from ..core.active import ACTIVE, base_model
from ..core.errors import PatchError
from ..core.undo import run_all, undone_on_failure
from ..methods.declaration import Kind
from ..methods.registry import resolve_method
from .features import attention_features, dropped_features
from .interface import MISSING_HOOK, SHIFT, use_attention

# ``SHIFT`` (``ctxext.attention.interface``): the prefix of the registered names, which end with the implementation
# they replaced (``BASES``); the swaps of other attention functions refuse a model that carries it.
#: The implementations S²-Attn can stand in for (and hand evaluation back to).
BASES = ("sdpa", "eager")
#: Attribute on each attention layer holding its ``ShiftState`` while S²-Attn is installed.
STATE_ATTR = "_ctxext_shift"
#: LongLoRA's default group size: a quarter of the sequence.
DEFAULT_GROUP_RATIO = 0.25
#: Method kinds whose patch computes attention itself (through its own registered function): S²-Attn would replace it.
OWNS_ATTENTION = (Kind.REMAP, Kind.BIAS)


@dataclass(frozen=True)
class ShiftState:
    """What the S²-Attn function needs of one attention layer: the group ratio and the implementation it replaced."""

    group_ratio: float
    base: str


def shift_name(base: str) -> str:
    """The registered name of S²-Attn standing in for ``base``."""
    return f"{SHIFT}_{base}"


def _groups(group_ratio) -> int:
    """The number of groups ``1 / group_ratio``; ValueError unless it is a whole number (ratio in (0, 1])."""
    if isinstance(group_ratio, bool) or not isinstance(group_ratio, numbers.Real) or not math.isfinite(group_ratio):
        raise PatchError(f"shift attention: group_ratio must be a number in (0, 1], got {group_ratio!r}")
    if not 0 < group_ratio <= 1:
        raise PatchError(f"shift attention: group_ratio must be in (0, 1] (the group's share of the sequence), "
                         f"got {group_ratio}")
    n = round(1 / group_ratio)
    if abs(1 / group_ratio - n) > 1e-9 * n:
        raise PatchError(f"shift attention: group_ratio {group_ratio} does not split a sequence into whole groups; "
                         "use 1/n (0.5, 0.25, 0.125, ...)")
    return n


def group_size(seq_length: int, group_ratio: float = DEFAULT_GROUP_RATIO) -> int:
    """The group size ``G = seq_length * group_ratio``; ValueError (``PatchError``) with the reason where ``seq_length``
    does not split into groups, or a group into halves (the shifted heads move by ``G / 2``)."""
    n = _groups(group_ratio)
    if isinstance(seq_length, bool) or not isinstance(seq_length, numbers.Integral) or seq_length < 2:
        raise PatchError(f"shift attention: the sequence length must be an integer of at least 2, got {seq_length!r}")
    if seq_length % (2 * n):
        raise PatchError(
            f"shift attention: {seq_length} tokens do not split into {n} groups of an even size (group_ratio "
            f"{group_ratio}; the shifted heads move by half a group): use a sequence length that is a multiple of "
            f"{2 * n}")
    return int(seq_length) // n


def _owner(model: nn.Module) -> str | None:
    """Why ``model``'s attention is already someone else's (a ctxext patch, S²-Attn itself), or None."""
    active = getattr(model, ACTIVE, None)
    spec = getattr(active, "spec", None)
    if spec is not None:
        method = resolve_method(spec.method)
        if method.kind in OWNS_ATTENTION:
            return (f"the model is patched with {method.name} (a {method.kind.value} method), whose attention "
                    "function computes the attention; shift attention would replace it")
    current = hf_compat.attn_implementation(model.config)
    if isinstance(current, str) and current.startswith(SHIFT):
        return "shift attention is already enabled on this model"
    if isinstance(current, str) and current.startswith("ctxext_"):
        return f"the model's attention is ctxext's {current!r}, which shift attention would replace"
    return None


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that call the registered attention function (``is_causal`` and ``layer_idx`` attributes, as
    transformers' attention classes have; the same test as ``ctxext.adapters.remap.attention_modules``)."""
    return [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "layer_idx")
            and not isinstance(m, nn.ModuleList)]


def _model_reason(model: nn.Module) -> str | None:
    """Why S²-Attn cannot be installed on ``model`` (a transformers model), or None."""
    name = type(model).__name__
    owner = _owner(model)
    if owner:
        return owner
    if MISSING_HOOK:
        return MISSING_HOOK
    can_set = hf_compat.can_set_attn_implementation(model)
    if not can_set:
        return f"{name} does not dispatch its attention through transformers' AttentionInterface"
    if getattr(model.config, "is_encoder_decoder", False) or getattr(model.config, "add_cross_attention", False):
        return f"{name} has cross-attention; shift attention is for causal self-attention"
    base = hf_compat.attn_implementation(model.config)
    if base not in BASES:
        return (f"{name} runs attention implementation {base!r}; shift attention stands in for "
                f"{' or '.join(BASES)} (switch first: model.set_attn_implementation('sdpa'))")
    features = attention_features(model)
    if features:
        return features
    layers = attention_layers(model)
    if not layers:
        return f"{name} has no attention layers that call transformers' attention interface"
    for layer in layers:
        if hf_compat.model_attention_function(layer, base) is None:
            return (f"cannot find the {base} function {type(layer).__name__} calls, which evaluation must keep "
                    "running")
    return None


def check_shift_attention(seq_length: int | None = None, group_ratio: float = DEFAULT_GROUP_RATIO,
                          method: str | None = None, *, model: nn.Module | None = None) -> int | None:
    """Why a training setup cannot use S²-Attn, raised as ``PatchError`` (a ``ValueError``) with the reason; touches
    nothing. Returns the group size for ``seq_length`` (None without one).

    ``seq_length``: the training length (checked to split into groups of an even size); ``group_ratio``: the group's
    share of the sequence, ``1/n``; ``method``: the ctxext method the model is (or will be) patched with: a
    position-remapping method (self-extend, dca, rerope, lm-infinite, streaming-llm, string) or the ALiBi swap computes
    the attention itself, so S²-Attn is refused; ``model``: also checked as ``enable_shift_attention`` would check
    it (its live patch, its attention implementation, what its attention does)."""
    _groups(group_ratio)
    size = group_size(seq_length, group_ratio) if seq_length is not None else None
    if method is not None:
        info = resolve_method(method)
        if info.kind in OWNS_ATTENTION:
            raise PatchError(f"shift attention: method {info.name} ({info.kind.value}) computes the attention in its "
                             "own attention function, which shift attention would replace: use one or the other")
    if model is not None:
        reason = _model_reason(base_model(model, "ctxext shift attention"))
        if reason:
            raise PatchError(f"shift attention: {reason}")
    return size


def enable_shift_attention(model: nn.Module, group_ratio: float = DEFAULT_GROUP_RATIO) -> Callable[[], None]:
    """Install S²-Attn on ``model`` (a transformers model, or a peft wrapper of one); returns the function that
    restores the previous attention exactly. Refused with a reason (``PatchError``, nothing changed) where
    ``check_shift_attention(group_ratio=group_ratio, model=model)`` refuses."""
    check_shift_attention(group_ratio=group_ratio, model=model)
    model = base_model(model, "ctxext shift attention")
    state = ShiftState(float(group_ratio), hf_compat.attn_implementation(model.config))
    with undone_on_failure() as undo:
        for layer in attention_layers(model):
            setattr(layer, STATE_ATTR, state)
            undo.append(functools.partial(_drop_state, layer))
        undo.append(use_attention(model, shift_name(state.base)))
    return functools.partial(run_all, undo)


@contextlib.contextmanager
def shift_attention(model: nn.Module, group_ratio: float = DEFAULT_GROUP_RATIO) -> Iterator[nn.Module]:
    """``with shift_attention(model):`` S²-Attn installed inside the block, the previous attention restored after."""
    undo = enable_shift_attention(model, group_ratio)
    try:
        yield model
    finally:
        undo()


def _drop_state(layer: nn.Module) -> None:
    layer.__dict__.pop(STATE_ATTR, None)


# -- the attention ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sdpa_takes_gqa() -> bool:
    """Whether this torch's sdpa has ``enable_gqa`` (torch 2.5 on); probed, not read from the version."""
    one = torch.zeros(1, 1, 1, 1)
    try:
        F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 1), one, one, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


def _heads(key: torch.Tensor, value: torch.Tensor, lo: int, hi: int, n_rep: int):
    """The key/value heads that query heads ``[lo, hi)`` read, and sdpa's extra argument for them."""
    if n_rep == 1:
        return key[:, lo:hi], value[:, lo:hi], {}
    if lo % n_rep == 0 and hi % n_rep == 0 and _sdpa_takes_gqa():
        return key[:, lo // n_rep:hi // n_rep], value[:, lo // n_rep:hi // n_rep], {"enable_gqa": True}
    index = torch.arange(lo, hi, device=key.device) // n_rep
    return key.index_select(1, index), value.index_select(1, index), {}


def _causal_blocks(q, k, v, size: int, scaling, dropout: float, extra: dict) -> torch.Tensor:
    """Causal attention within consecutive blocks of ``size`` tokens of (B, h, L, d) inputs, the blocks folded into
    the batch; returns (B, L, h, d_v)."""
    batch, heads, length, _ = q.shape
    blocks = length // size

    def fold(x):
        return x.unflatten(2, (blocks, size)).transpose(1, 2).reshape(batch * blocks, x.shape[1], size, x.shape[-1])

    out = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), dropout_p=dropout, is_causal=True, scale=scaling,
                                         **extra)
    return out.reshape(batch, blocks, heads, size, -1).permute(0, 1, 3, 2, 4).reshape(batch, length, heads, -1)


def shifted_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: int, *,
                             scaling: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """S²-Attn of (batch, heads, T, d) queries over (batch, kv_heads, T, d) keys and values, groups of ``group``
    tokens (``T`` a multiple of it, ``group`` even), without wrap-around (see the module's docstring); returns
    (batch, T, heads, d_v), the layout transformers' attention functions return."""
    batch, heads, length, _ = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"shift attention: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    if key.shape[2] != length or value.shape[2] != length:
        raise ValueError(f"shift attention needs as many keys as queries ({key.shape[2]} keys, {length} queries)")
    if group < 2 or group % 2 or length % group:
        raise ValueError(f"shift attention: groups of {group} tokens do not split {length} tokens into halves")
    n_rep, split, half = heads // kv_heads, heads // 2, group // 2
    outs = []
    if split:
        k, v, extra = _heads(key, value, 0, split, n_rep)
        outs.append(_causal_blocks(query[:, :split], k, v, group, scaling, dropout, extra))
    q = query[:, split:]
    k, v, extra = _heads(key, value, split, heads, n_rep)
    # the first and the last half-group, as two groups of their own (no wrap-around), then the full groups between
    ends = [torch.cat((x[:, :, :half], x[:, :, length - half:])) for x in (q, k, v)]
    out_ends = _causal_blocks(*ends, half, scaling, dropout, extra)
    pieces = [out_ends[:batch]]
    if length > group:
        pieces.append(_causal_blocks(q[:, :, half:length - half], k[:, :, half:length - half],
                                     v[:, :, half:length - half], group, scaling, dropout, extra))
    pieces.append(out_ends[batch:])
    outs.append(torch.cat(pieces, dim=1))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


#: The last mask found plain causal: a model passes one mask object to all its layers, checked once per forward.
_LAST_PLAIN: list = [None]


def _plain_causal(mask, length: int) -> bool:
    """Whether the mask a model built (None, a (B, T) padding mask, or a 4D boolean / additive mask) is plain causal
    attention over ``length`` tokens, with no padding, packing or window. (transformers 5.x passes None for a plain
    causal pass; 4.x builds the (B, 1, T, T) mask when no cache is used.)"""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor):
        return False
    last = _LAST_PLAIN[0]
    if last is not None and last() is mask:
        return True
    plain = _is_plain_causal(mask, length)
    if plain:
        _LAST_PLAIN[0] = weakref.ref(mask)
    return plain


def _is_plain_causal(mask: torch.Tensor, length: int) -> bool:
    if mask.dim() == 2:
        return bool(mask.all())
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (length, length):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())


def shift_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered S²-Attn function: grouped, half-shifted attention while ``module`` is training; otherwise the
    function of the implementation it replaced, called with the same arguments."""
    state = getattr(module, STATE_ATTR, None)
    if not isinstance(state, ShiftState):
        raise ValueError(f"{SHIFT}: {type(module).__name__} carries no shift state; select this attention only "
                         "through ctxext.attention.shifted_sparse.enable_shift_attention")
    if not module.training:
        base = hf_compat.model_attention_function(module, state.base)
        return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    dropped = dropped_features(kwargs)
    if dropped:
        raise ValueError(f"{SHIFT} would drop what this attention call asks for ({dropped})")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError(f"{SHIFT} applies to causal self-attention only")
    length = query.shape[2]
    if key.shape[2] != length:
        raise ValueError(f"{SHIFT}: a training pass with {key.shape[2] - length} cached keys before its {length} "
                         "queries; shift attention trains on full passes (call model.eval() before generating)")
    if not _plain_causal(attention_mask, length):
        raise ValueError(f"{SHIFT}: the attention mask is not plain causal (padding, packed sequences or a sliding "
                         "window); shift attention trains on full-length rows without padding")
    group = group_size(length, state.group_ratio)
    out = shifted_sparse_attention(query, key, value, group, scaling=scaling, dropout=dropout)
    return out, None


def _register() -> None:
    if MISSING_HOOK:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    masks = AttentionMaskInterface()
    for base in BASES:
        AttentionInterface.register(shift_name(base), shift_attention_forward)
        AttentionMaskInterface.register(shift_name(base), masks[base])


_register()

__all__ = [
    "BASES",
    "DEFAULT_GROUP_RATIO",
    "SHIFT",
    "STATE_ATTR",
    "ShiftState",
    "check_shift_attention",
    "enable_shift_attention",
    "group_size",
    "shift_attention",
    "shift_attention_forward",
    "shifted_sparse_attention",
]
