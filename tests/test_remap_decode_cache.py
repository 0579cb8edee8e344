"""Decoding under the remap methods with kept rotated keys (``ctxext.attention.key_cache``): a cached step rotates only
its new keys, and still gives the logits of a full forward pass; the kept copies follow the cache (a new one, a
reset, a crop, a reorder) and go with the patch."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from transformers import DynamicCache

from checks import VOCAB, no_eos
from conftest import rope_kwargs

import ctxext.attention.remap as remap_attention
from ctxext.adapters.remap import apply_remap
from ctxext.attention import key_cache

L0 = 64
CASES = [
    ("self-extend", 8, {"group": 4, "window": 16}),
    ("dca", 8, {"chunk_size": 20, "local_window": 7}),
    ("rerope", 8, {"window": 16}),
    ("rerope", 8, {"window": 12, "leaky": 4.0, "log_scale": False}),
    ("string", 1.5, {"shift": 40, "local": 8}),
    ("lm-infinite", 8, {"global_tokens": 4, "window": 32}),
    ("streaming-llm", 8, {"sinks": 4, "window": 28}),
]
IDS = ["self-extend", "dca", "rerope", "leaky-rerope", "string", "lm-infinite", "streaming-llm"]


def _llama():
    """GQA (4 heads, 2 KV), head_dim 16, rope_theta 500, trained length 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=L0, attn_implementation="sdpa")
    kw.update(rope_kwargs(LlamaConfig, {"rope_type": "default", "rope_theta": 500.0}))
    return no_eos(LlamaForCausalLM(LlamaConfig(**kw)).eval())


def _prompt(length, seed, batch=1):
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy(model, prompt, new, cache=None, mask=None):
    """Step-by-step greedy decoding with a cache; returns (sequence, per-step logits (B, new, V))."""
    cache = DynamicCache() if cache is None else cache
    mask = torch.ones_like(prompt) if mask is None else mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(prompt, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    seq, logits = prompt, []
    for _ in range(new):
        step = out.logits[:, -1]
        logits.append(step)
        token = step.argmax(-1, keepdim=True)
        seq, mask = torch.cat([seq, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
        out = model(token, attention_mask=mask, position_ids=positions[:, -1:] + 1 + len(logits) - 1,
                    past_key_values=cache, use_cache=True)
    return seq, torch.stack(logits, 1), mask


def _full(model, seq, mask, prompt_len):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(seq, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, prompt_len - 1 : -1]


def _last(model, seq, mask):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(seq, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, -1]


class _CountKeyRotations:
    """Counts the key positions ``rotate`` is asked for per call (queries have q_len positions; keys kv_len)."""

    def __init__(self, monkeypatch):
        self.sizes = []
        real = remap_attention.rotate

        def counting(x, positions, *args, **kw):
            self.sizes.append(x.shape[2])
            return real(x, positions, *args, **kw)

        monkeypatch.setattr(remap_attention, "rotate", counting)


@pytest.mark.parametrize("method,factor,options", CASES, ids=IDS)
def test_cached_decoding_equals_a_full_pass_and_rotates_only_new_keys(monkeypatch, method, factor, options):
    """Prompt 90 (past the trained 64 and every window), 30 steps: each step's logits == a full forward pass; in
    the steps after the first, no call rotates more than one position (the new key, the query)."""
    model = _llama()
    restore = apply_remap(model, method, factor, options)
    try:
        counter = _CountKeyRotations(monkeypatch)
        with torch.no_grad():
            prompt = _prompt(90, seed=4)
            cache = DynamicCache()
            seq, logits, mask = _greedy(model, prompt, 2, cache=cache)
            counter.sizes.clear()
            more, more_logits, mask = _greedy(model, seq, 28, cache=None)  # a second generate, a fresh cache
            assert max(counter.sizes[-27 * 4:]) == 1  # 27 later steps x 2 layers x (query + new key) at most
            full = _full(model, more, mask, seq.shape[1])
            torch.testing.assert_close(more_logits, full, atol=1e-4, rtol=0)
            torch.testing.assert_close(logits, _full(model, seq, torch.ones_like(seq), 90), atol=1e-4, rtol=0)
    finally:
        restore()


@pytest.mark.parametrize("method,factor,options", CASES, ids=IDS)
def test_generate_twice_on_one_model_and_a_padded_batch(method, factor, options):
    """``generate`` on two prompts back to back (the second shorter: the kept copies must not leak into it), then a
    left-padded batch of two rows decoded step by step: every step == a full forward pass."""
    from checks import generate_equals_full_forward

    model = _llama()
    restore = apply_remap(model, method, factor, options)
    try:
        with torch.no_grad():
            generate_equals_full_forward(model, prompt_len=90, new=20, seed=4)
            generate_equals_full_forward(model, prompt_len=70, new=20, seed=5)
            prompt = _prompt(85, seed=6, batch=2)
            mask = torch.ones_like(prompt)
            mask[1, :30] = 0
            seq, logits, mask = _greedy(model, prompt, 20, mask=mask)
            torch.testing.assert_close(logits, _full(model, seq, mask, 85), atol=1e-4, rtol=0)
    finally:
        restore()


@pytest.mark.parametrize("method,factor,options", [CASES[0], CASES[1], CASES[6]], ids=[IDS[0], IDS[1], IDS[6]])
def test_a_reset_cropped_or_reordered_cache_is_not_trusted(method, factor, options):
    """Two different prompts of one length back to back on one cache object (reset between them) give what a fresh
    model gives; a crop followed by other tokens, and a reorder of the batch rows (beam search), decode as a full
    pass over what the cache now holds."""
    model = _llama()
    fresh = copy.deepcopy(model)
    restore = apply_remap(model, method, factor, options)
    apply_remap(fresh, method, factor, options)
    with torch.no_grad():
        cache = DynamicCache()
        _greedy(model, _prompt(90, seed=1), 10, cache=cache)
        cache.reset()
        emptied = cache.get_seq_length() == 0  # some releases' reset (4.x, 5.0) zeroes the keys and keeps them
        got = _greedy(model, _prompt(90, seed=2), 10, cache=cache)[1]
        if emptied:
            want = _greedy(fresh, _prompt(90, seed=2), 10)[1]
        else:  # the same steps on the fresh model, every step rotating every key (no kept copies)
            saved, key_cache.KEEP = key_cache.KEEP, False
            try:
                ref = DynamicCache()
                _greedy(fresh, _prompt(90, seed=1), 10, cache=ref)
                ref.reset()
                want = _greedy(fresh, _prompt(90, seed=2), 10, cache=ref)[1]
            finally:
                key_cache.KEEP = saved
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

        cache = DynamicCache()  # crop 5 tokens, then feed others one by one
        seq, _, mask = _greedy(model, _prompt(90, seed=3), 10, cache=cache)
        cache.crop(-5)
        seq, mask = seq[:, :-5], mask[:, :-5]
        for token in _prompt(4, seed=9)[0]:
            token = token.view(1, 1)
            seq, mask = torch.cat([seq, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
            step = model(token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                         past_key_values=cache, use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, _last(model, seq, mask), atol=1e-4, rtol=0)

        cache = DynamicCache()  # two rows, swapped after some steps
        seq, _, mask = _greedy(model, _prompt(90, seed=11, batch=2), 6, cache=cache)
        order = torch.tensor([1, 0])
        cache.reorder_cache(order)
        seq, mask = seq[order], mask[order]
        token = seq[:, -1:]  # the last token again, at the next position
        seq, mask = torch.cat([seq, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
        step = model(token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1, past_key_values=cache,
                     use_cache=True).logits[:, -1]
        torch.testing.assert_close(step, _last(model, seq, mask), atol=1e-4, rtol=0)
    restore()


def test_copies_are_dropped_with_the_cache_and_on_unpatch_which_stays_bit_exact():
    model = _llama()
    ids = _prompt(100, seed=2)
    with torch.no_grad():
        before = model(ids).logits
    restore = apply_remap(model, *CASES[0])
    attention = [m for m in model.modules() if hasattr(m, remap_attention.STATE_ATTR)]
    with torch.no_grad():
        model(ids, use_cache=False)  # a plain pass keeps nothing
        assert not any(key_cache.entry(m).buffers for m in attention)
        cache = DynamicCache()
        _greedy(model, ids, 3, cache=cache)
        assert all(key_cache.entry(m).buffers for m in attention)  # decoding keeps copies ...
        del cache
        gc.collect()
        assert not any(key_cache.entry(m).buffers for m in attention)  # ... for as long as the cache lives
        cache = DynamicCache()
        _greedy(model, ids, 3, cache=cache)
    restore()
    assert not any(key_cache.ATTR in vars(m) or m._forward_pre_hooks for m in attention)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
