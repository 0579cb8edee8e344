"""Drop-in attention functions with the flex path forced where it applies, for registering with transformers'
``AttentionInterface`` by hand (tests, ``benchmarks/bench_flex.py``): ``ctxext_alibi`` and ``ctxext_remap``
themselves already take ``ctxext.attention.flex_paths`` on CUDA for long prefills. Each falls back to the plain function
where flex does not apply."""

from __future__ import annotations

import torch

from . import alibi as A
from . import remap as R
from .flex_paths import alibi_q_start, flex_alibi, flex_remap, use_flex


def alibi_attention_forward_flex(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                 is_causal=None, **kwargs):
    """``ctxext_alibi`` with the flex path: flex where it applies (flex available, several queries, no dropout, a
    causal layer, nothing dropped), else ``ctxext.attention.alibi_attention_forward``."""
    q_len = query.shape[2]
    causal = not getattr(module, "is_cross_attention", False) and (
        module.is_causal if isinstance(getattr(module, "is_causal", None), bool)
        else (is_causal if is_causal is not None else True))
    window = kwargs.get("sliding_window")
    if (not (causal and use_flex(query, dropout, key, value)) or A.dropped_features(kwargs)
            or (isinstance(window, int) and attention_mask is None and key.shape[2] > window)
            or query.shape[1] % key.shape[1] or (attention_mask is not None and attention_mask.dim() != 4)):
        return A.alibi_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, is_causal=is_causal, **kwargs)
    kv_len = key.shape[2]
    mask = None if attention_mask is None else attention_mask[..., -kv_len:][:, 0]
    q_start = alibi_q_start(attention_mask, q_len, kv_len)
    out = flex_alibi(query, key, value, A._slopes(query.shape[1], query.device), q_start, mask, scaling)
    if out is None:
        return A.alibi_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, is_causal=is_causal, **kwargs)
    return out, None


def remap_attention_forward_flex(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                 is_causal=None, **kwargs):
    """``ctxext_remap`` with the flex path replacing its chunk loop (same preamble and fast path as
    ``ctxext.attention.remap.remap_attention_forward``); falls back to that function where flex does not apply."""
    state = getattr(module, R.STATE_ATTR, None)
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (state is None or not (causal and use_flex(query, dropout, key, value))
            or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or query.shape[1] % key.shape[1]
            or (attention_mask is not None and attention_mask.dim() != 4)):
        return R.remap_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, is_causal=is_causal, **kwargs)
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    scaling = head_dim**-0.5 if scaling is None else scaling
    if attention_mask is not None:
        attention_mask = attention_mask[..., -kv_len:]
    pmap = state.map
    inv_freq = state.frequencies(query.device)
    att = state.attention_scaling
    slots, qpos, kpos, last = R._positions(query, attention_mask, q_len, kv_len, kwargs)
    if attention_mask is None:
        first_key = kpos[:, 0]
    else:
        seen = R._as_bool(attention_mask[:, 0]).expand(batch, q_len, kv_len)
        seen = seen[torch.arange(batch, device=query.device), last]
        first = torch.where(seen, torch.arange(kv_len, device=query.device), kv_len - 1).amin(-1)
        first_key = kpos.gather(1, first[:, None])[:, 0]
    farthest = int((qpos.amax(-1) - first_key).amax())
    if farthest < pmap.near or int(qpos.amax()) < pmap.plain_below:
        # the fast path (plain RoPE attention through sdpa): the existing function takes it
        return R.remap_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, is_causal=is_causal, **kwargs)
    if pmap.query_scale is not None:
        query = query * pmap.query_scale(qpos).to(query.dtype)[:, None, :, None]
    keys = [R.rotate(key, r.key(kpos), inv_freq, att, state.layout, state.start) for r in pmap.rotations]
    queries = [R.rotate(query, r.query(qpos), inv_freq, att, state.layout, state.start) for r in pmap.rotations]
    mask = None if attention_mask is None else attention_mask[:, 0]  # converted (> min / 2) in flex_remap
    return flex_remap(pmap, queries, keys, value, qpos, kpos, slots, mask, scaling), None
