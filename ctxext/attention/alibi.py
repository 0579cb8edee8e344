"""The ALiBi attention function.

``ctxext_alibi`` is an attention function registered with ``AttentionInterface`` *and* a mask function of the same
name registered with ``AttentionMaskInterface`` (transformers' sdpa mask: without a mask entry, models would give
the function no padding mask; ``ctxext.attention.interface`` registers both). A model uses it when its
``config._attn_implementation`` is ``ctxext_alibi``; ``use_attention`` switches a model to it and returns the undo
step.

The function adds the ALiBi bias ``-slope_h * (i - j)`` to the attention scores and runs
``torch.nn.functional.scaled_dot_product_attention``. It never builds a (heads x T x T) float bias for a long
sequence: the bias depends only on key - query, so a chunk of queries sees it as a strided view of one vector per
head (no copy); each chunk only sees the keys up to its last query (the rest are causally masked anyway), so the work
stays close to that of causal attention. Only when a padding mask must be merged in (or on a GPU, whose kernels
may copy a strided mask) is a chunk's bias materialised, at most ``CHUNK_BYTES`` at a time. On CUDA in half precision,
where flash-attn is installed, a call without padding is one ``flash_attn_func(alibi_slopes=)`` call instead
(``ctxext.attention.optional_kernels``).

Positions are indices in the key/value sequence: with a dynamic cache (and without one) the queries are the last
``q_len`` of the ``kv_len`` keys. Only key-position differences matter (softmax ignores a constant per query row),
so left padding and cached decoding give the same biases as a full pass over the unpadded sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import transformers as hf_compat
from ..methods.alibi import alibi_slopes
from .features import dropped_features
from . import optional_kernels
from .alibi_plan import alibi_plan
from .flex_paths import flex_alibi, use_flex

ALIBI = "ctxext_alibi"
#: Set on every module of a model the ALiBi swap switched (``interface.use_attention``): a model built from a swapped
#: model's config (which names this function) has rotary positions and no mark, and is refused rather than run
#: with both.
ALIBI_MARK = "_ctxext_alibi_swapped"

#: Upper bound on the size of one chunk's materialised bias (built when a padding mask must be merged in, and on
#: non-CPU devices, whose kernels may copy a strided mask).
CHUNK_BYTES = 32 * 2**20
#: Without a padding mask, the queries are split into this many chunks (of at least MIN_ROWS rows) so that each
#: chunk skips the keys after its last query: the work stays close to that of causal attention.
CAUSAL_CHUNKS = 8
MIN_ROWS = 256

_slope_cache: dict[tuple[int, str], torch.Tensor] = {}


def _slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    key = (num_heads, str(device))
    if key not in _slope_cache:
        _slope_cache[key] = alibi_slopes(num_heads).to(device)
    return _slope_cache[key]


def _diagonal_bias(slopes: torch.Tensor, last_query: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """One row per head from which every (query, key) bias is a strided view (a Toeplitz matrix).

    Entry ``u`` of head h is the bias of the query ``r`` positions before the last one (``last_query - r``) on key
    ``j = u - r``: ``-slope_h * (last_query - u)`` for ``u <= last_query``, the dtype's minimum beyond (a future
    key, masked).
    """
    u = torch.arange(length, device=slopes.device)
    work = torch.promote_types(torch.float32, dtype)  # float32, or float64 for a float64 model (its min fits)
    row = -slopes[:, None].to(work) * (last_query - u).to(work)[None, :]
    row = row.masked_fill(u[None, :] > last_query, torch.finfo(dtype).min)
    return row.clamp(min=torch.finfo(dtype).min).to(dtype).contiguous()


def alibi_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal self-attention with ALiBi biases; same signature and output layout as transformers' sdpa function.

    query: (batch, heads, q_len, head_dim); key/value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads.
    attention_mask: None (causal, no padding), a boolean (batch or 1, 1, q_len, kv_len) mask (True = attend) as
    transformers' sdpa mask function builds it, or an additive float mask of that shape.
    Returns (batch, q_len, heads, head_dim) and no attention weights.

    How the bias reaches sdpa without a (heads x T x T) tensor: the bias only depends on key - query, so with the
    queries in reverse order it is a strided view (row stride 1, column stride 1) of one vector per head
    (``_diagonal_bias``), causal mask included. Without a padding mask that view goes to sdpa as is, one chunk of
    queries at a time, each chunk seeing only the keys up to its last query; with a padding mask, a chunk's bias is
    materialised (at most ``CHUNK_BYTES``) to merge the mask in.
    """
    if not vars(module).get(ALIBI_MARK):
        raise RuntimeError(
            f"{ALIBI}: {type(module).__name__} is not in a model the ALiBi swap patched (a model built from a patched "
            "model's config names this attention but keeps its own positions); patch it with ctxext.patch(model, "
            "'alibi', ...), or build it from a config of the unpatched model")
    dropped = dropped_features(kwargs)
    if dropped:
        raise ValueError(f"ctxext_alibi cannot honour what this attention layer passes: {dropped}")
    window = kwargs.get("sliding_window")
    if isinstance(window, int) and attention_mask is None and key.shape[2] > window:
        raise ValueError(f"ctxext_alibi got sliding_window={window} without the window mask for {key.shape[2]} keys")
    # Causality is the layer's (``module.is_causal``, or not cross-attention), not the call's ``is_causal`` flag: some
    # releases (transformers 4.57's GPT-2) pass is_causal=False for a one-token decoding step of a causal layer.
    if getattr(module, "is_cross_attention", False):
        causal = False
    elif isinstance(getattr(module, "is_causal", None), bool):
        causal = module.is_causal
    else:
        causal = is_causal if is_causal is not None else True
    if not causal:
        # cross-attention / bidirectional layers have no relative positions to bias: plain sdpa
        return hf_compat.sdpa_attention()(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
        )

    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"ctxext_alibi: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    rows = max(MIN_ROWS, -(-q_len // CAUSAL_CHUNKS))
    if attention_mask is None:
        # transformers drops the mask when sdpa's own causal flag would do: a full pass (q_len == kv_len), one
        # decoding step (q_len == 1: every cached key is visible), or the prefill of a preallocated static cache
        # (queries at the start of the key slots)
        q_start = kv_len - 1 if q_len == 1 else 0
    else:
        if attention_mask.dim() != 4:
            raise ValueError(f"ctxext_alibi expects a 4D attention mask, got shape {tuple(attention_mask.shape)}")
        # the first kv_len columns, as transformers' sdpa function slices it: some models' own (4.x) masks carry
        # a column more than the keys
        attention_mask = attention_mask[..., :kv_len]
        # with a mask (padding, or a cache), the queries are the last q_len keys; a static cache's unused slots
        # are masked, and the resulting per-row offset of the bias does not change the softmax
        q_start = kv_len - q_len
    if attention_mask is None and q_start == kv_len - q_len and optional_kernels.usable(query, key, value):
        # flash-attn, where installed: its bottom-right ALiBi is this bias with the queries as the last keys
        return optional_kernels.alibi_attention(query, key, value, _slopes(heads, query.device), scaling, dropout), None
    if q_len == kv_len:  # a full pass on CUDA without flash-attn: about T/4096 biased kernel calls (alibi_plan.py)
        out = alibi_plan(query, key, value, _slopes(heads, query.device), scaling, attention_mask, dropout)
        if out is not None:
            return out, None
    if use_flex(query, dropout, key, value):  # opt-in (CTXEXT_FLEX=1): one block-sparse flex call
        mask = None if attention_mask is None else attention_mask[:, 0]
        out = flex_alibi(query, key, value, _slopes(heads, query.device), q_start, mask, scaling)
        if out is not None:  # None: an additive mask carrying a bias, which only the sdpa loop below adds
            return out, None
    gqa = {}
    if kv_heads != heads:
        if query.device.type == "cpu":
            gqa = {"enable_gqa": True}  # the CPU flash kernel takes GQA with a mask
        else:  # other backends fall back to the math kernel for GQA with a mask: repeat instead
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
    if attention_mask is not None or query.device.type != "cpu":
        # the chunk's bias is materialised: merged with the mask here, or copied by GPU kernels that need an
        # aligned mask layout
        mask_batch = 1 if attention_mask is None else attention_mask.shape[0]
        rows = min(rows, max(1, CHUNK_BYTES // (mask_batch * heads * kv_len * 4)))

    last_query = q_start + q_len - 1
    diagonal = _diagonal_bias(_slopes(heads, query.device), last_query, q_len + kv_len, query.dtype)
    minimum = torch.finfo(query.dtype).min

    # reversed order: row r is query q_len - 1 - r (position last_query - r); its bias on key j is diagonal[h, r + j]
    reversed_query = query.flip(2) if q_len > 1 else query
    out = query.new_empty(batch, q_len, heads, value.shape[-1])
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        chunk = end - start
        k_end = min(kv_len, last_query - start + 1)  # keys after the chunk's latest query are masked for all rows
        bias = diagonal.as_strided(
            (1, heads, chunk, k_end), (0, diagonal.stride(0), 1, 1), diagonal.storage_offset() + start
        )
        if attention_mask is not None:
            if attention_mask.shape[2] > 1:
                part = attention_mask[:, :, q_len - end : q_len - start, :k_end].flip(2)
            else:
                part = attention_mask[..., :k_end]
            if part.dtype == torch.bool:
                bias = torch.where(part, bias, minimum)
            else:
                bias = (bias + part.to(bias.dtype)).clamp(min=minimum)
        o = F.scaled_dot_product_attention(
            reversed_query[:, :, start:end],
            key[:, :, :k_end],
            value[:, :, :k_end],
            attn_mask=bias,
            dropout_p=dropout,
            scale=scaling,
            **gqa,
        )
        out[:, start:end] = o.transpose(1, 2)
    return (out.flip(1) if q_len > 1 else out), None


__all__ = ["ALIBI", "ALIBI_MARK", "CHUNK_BYTES", "alibi_attention_forward"]
