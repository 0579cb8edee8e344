"""Issue 57, cases 1 and 2: the KV caches a remap patch decodes with.

1. preallocated caches (transformers' ``StaticCache``, ``generate(cache_implementation="static")``, and the static
   and dynamic sliding-window layers of a hybrid model): every remap method's step logits equal a full forward pass
   (1e-4, float32), ``generate`` gives the text of a dynamic cache, and the kept rotated keys follow the cache (only
   new keys rotated per step; a reset cache reused for a prompt of the same length keeps no stale copies);
2. a cache carried across a patch boundary (filled under a remap patch and continued without it, the reverse, an
   ``unpatch`` or ``patch`` from a logits processor in the middle of ``generate``, another remap method or factor, a
   frequency patch) is refused with a ``PatchError`` naming the patch it was filled under; the same patch applied
   again (a chat's next turn in a new ``with ctxext.patched`` block) continues it exactly, and a reset cache is free.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache

from checks import VOCAB, no_eos
from conftest import rope_kwargs
from test_remap_decode_cache import CASES, IDS, L0, _CountKeyRotations, _full, _greedy, _llama, _prompt

import ctxext
from ctxext.adapters.remap import apply_remap
from ctxext.core.errors import PatchError


def _hybrid():
    """Qwen2 with a full-attention layer and a sliding-window layer (window 24, within the trained 64)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=L0, attn_implementation="sdpa", use_sliding_window=True,
              sliding_window=24, max_window_layers=1)
    kw.update(rope_kwargs(Qwen2Config, {"rope_type": "default", "rope_theta": 500.0}))
    model = no_eos(Qwen2ForCausalLM(Qwen2Config(**kw)).eval())
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    return model


def _static(model, length=160):
    return StaticCache(config=model.config, max_cache_len=length)


# -- 1. static and sliding caches ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,factor,options", CASES, ids=IDS)
def test_static_cache_steps_equal_a_full_forward_and_rotate_only_new_keys(monkeypatch, method, factor, options):
    """A ``StaticCache`` (160 slots, most unfilled): prompt 90 (past the trained 64), 12 greedy steps, one row and a
    left-padded batch of two: each step's logits == a full forward pass; after the first steps each call rotates
    at most one position (the kept copies follow the static buffer)."""
    model = _llama()
    restore = apply_remap(model, method, factor, options)
    try:
        with torch.no_grad():
            counter = _CountKeyRotations(monkeypatch)
            seq, logits, mask = _greedy(model, _prompt(90, seed=4), 12, cache=_static(model))
            assert max(counter.sizes[-10 * 4:]) == 1  # 10 later steps x 2 layers x (query + new key) at most
            torch.testing.assert_close(logits, _full(model, seq, mask, 90), atol=1e-4, rtol=0)

            prompt = _prompt(85, seed=6, batch=2)
            mask = torch.ones_like(prompt)
            mask[1, :30] = 0
            seq, logits, mask = _greedy(model, prompt, 12, cache=_static(model), mask=mask)
            torch.testing.assert_close(logits, _full(model, seq, mask, 85), atol=1e-4, rtol=0)
    finally:
        restore()


@pytest.mark.parametrize("method,factor,options", CASES, ids=IDS)
def test_generate_with_a_static_cache_gives_the_dynamic_text(method, factor, options):
    """``generate(cache_implementation="static")`` twice (the second prompt shorter): the tokens of the default
    dynamic cache, and each step's logits == a full forward pass."""
    model = _llama()
    restore = apply_remap(model, method, factor, options)
    try:
        with torch.no_grad():
            for length, seed in ((90, 4), (70, 5)):
                prompt = _prompt(length, seed=seed)
                kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
                dynamic = model.generate(prompt, **kw)
                out = model.generate(prompt, cache_implementation="static", output_logits=True,
                                     return_dict_in_generate=True, **kw)
                assert isinstance(out.past_key_values, StaticCache)
                assert torch.equal(out.sequences, dynamic)
                full = model(out.sequences).logits[0, length - 1:-1]
                torch.testing.assert_close(torch.cat(out.logits), full, atol=1e-4, rtol=0)
    finally:
        restore()


@pytest.mark.parametrize("method,factor,options", CASES, ids=IDS)
def test_a_reset_static_cache_keeps_no_stale_rotated_keys(method, factor, options):
    """One ``StaticCache`` object, reset between two different prompts of one length (same slots, same positions):
    the second decodes as a full forward pass, not with the first prompt's kept copies."""
    model = _llama()
    restore = apply_remap(model, method, factor, options)
    try:
        with torch.no_grad():
            cache = _static(model)
            _greedy(model, _prompt(90, seed=1), 10, cache=cache)
            cache.reset()
            seq, logits, mask = _greedy(model, _prompt(90, seed=2), 10, cache=cache)
            torch.testing.assert_close(logits, _full(model, seq, mask, 90), atol=1e-4, rtol=0)
    finally:
        restore()


def _cache_layers(cache) -> list[str]:
    """"sliding" or "full" per layer (the classes' names differ between transformers releases)."""
    return ["sliding" if "Sliding" in type(layer).__name__ else "full" for layer in cache.layers]


@pytest.mark.parametrize("method,factor,options", CASES, ids=IDS)
def test_sliding_window_caches_of_a_hybrid_model_decode_as_a_full_forward(method, factor, options):
    """A hybrid model (full layer + sliding layer, window 24): its static cache (a static sliding layer) and its
    dynamic cache (a dynamic sliding layer), a prompt shorter than the window (12, then 20 steps across the window)
    and one past the trained length (90, 10 steps): each step == a full forward pass; ``generate`` with the static
    cache gives the dynamic text."""
    model = _hybrid()
    restore = apply_remap(model, method, factor, options)
    try:
        with torch.no_grad():
            static, dynamic = _static(model), DynamicCache(config=model.config)
            assert _cache_layers(static) == _cache_layers(dynamic) == ["full", "sliding"]
            for cache, length, steps in ((static, 12, 20), (dynamic, 12, 20), (_static(model), 90, 10),
                                         (DynamicCache(config=model.config), 90, 10)):
                seq, logits, mask = _greedy(model, _prompt(length, seed=length), steps, cache=cache)
                torch.testing.assert_close(logits, _full(model, seq, mask, length), atol=1e-4, rtol=0)
            prompt = _prompt(90, seed=3)
            kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
            static_text = model.generate(prompt, cache_implementation="static", **kw)
            assert torch.equal(static_text, model.generate(prompt, **kw))
    finally:
        restore()


# -- 2. a cache carried across a patch boundary ----------------------------------------------------------------------

#: how a test's cache is made: generate's default (dynamic), a DynamicCache passed in, generate's static cache (sized
#: for that call), a StaticCache passed in (room for more turns)
CACHES = {
    "generate": {},
    "dynamic": {"past_key_values": DynamicCache},
    "static": {"cache_implementation": "static"},
    "static-object": {"past_key_values": lambda model: _static(model)},
}


def _generate(model, prompt, cache: str, new: int = 4):
    """Greedy ``generate``; returns (sequences, the cache it filled)."""
    kw = dict(CACHES[cache])
    if cache == "dynamic":
        kw["past_key_values"] = DynamicCache()
    elif cache == "static-object":
        kw["past_key_values"] = _static(model)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True, **kw)
    return out.sequences, out.past_key_values


def _continue(model, seq, past):
    """The next turn: ``generate`` on the sequence and one more token, with the cache of the last turn."""
    more = torch.cat([seq, _prompt(1, seed=99)], 1)
    return model.generate(more, attention_mask=torch.ones_like(more), past_key_values=past, max_new_tokens=3,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("cache", list(CACHES))
def test_a_cache_filled_under_a_remap_patch_is_refused_after_the_block(cache):
    """Generated inside ``with ctxext.patched(m, "self-extend", 4)``, continued after the block (a forward step, and
    ``generate(past_key_values=...)``): refused, naming the patch and what to do; the cache is left as it was and
    the model is the original, bit for bit."""
    model = no_eos(_llama())
    prompt = _prompt(80, seed=3)
    before = _logits(model, prompt)
    with torch.no_grad():
        with ctxext.patched(model, "self-extend", 4):
            seq, past = _generate(model, prompt, cache)
        held = int(past.get_seq_length())
        with pytest.raises(PatchError, match=r"filled under the position-remapping patch self-extend x4.*new cache"):
            model(seq[:, -1:], past_key_values=past, use_cache=True)
        with pytest.raises(PatchError, match="self-extend x4"):
            _continue(model, seq, past)
    assert int(past.get_seq_length()) == held
    assert torch.equal(_logits(model, prompt), before)


@pytest.mark.parametrize("cache", list(CACHES))
def test_a_cache_filled_by_the_plain_model_is_refused_under_a_remap_patch(cache):
    model = no_eos(_llama())
    prompt = _prompt(80, seed=3)
    with torch.no_grad():
        seq, past = _generate(model, prompt, cache)
        with ctxext.patched(model, "self-extend", 4):
            with pytest.raises(PatchError, match=r"filled without a position-remapping patch.*now runs self-extend x4"):
                _continue(model, seq, past)


class _AtStep(LogitsProcessor):
    """Calls ``action`` once, when the logits of step ``step`` come in."""

    def __init__(self, step, action):
        self.step, self.action, self.seen = step, action, 0

    def __call__(self, input_ids, scores):
        self.seen += 1
        if self.seen == self.step:
            self.action()
        return scores


@pytest.mark.parametrize("cache", ["generate", "static"])
def test_unpatch_or_patch_in_the_middle_of_generate_is_refused_at_the_next_step(cache):
    """A logits processor that unpatches (or patches) the model at step 3: the next step refuses the cache, and the
    model after the unpatch is the original, bit for bit."""
    model = no_eos(_llama())
    prompt = _prompt(80, seed=3)
    before = _logits(model, prompt)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, **CACHES[cache])
    with torch.no_grad():
        ctxext.patch(model, "self-extend", 4)
        unpatch = LogitsProcessorList([_AtStep(3, lambda: ctxext.unpatch(model))])
        with pytest.raises(PatchError, match="self-extend x4.*no longer runs that patch"):
            model.generate(prompt, logits_processor=unpatch, **kw)
        assert ctxext.describe(model) is None  # the unpatch the processor made stands
        assert torch.equal(_logits(model, prompt), before)

        patch = LogitsProcessorList([_AtStep(3, lambda: ctxext.patch(model, "self-extend", 4))])
        try:
            with pytest.raises(PatchError, match="filled without a position-remapping patch"):
                model.generate(prompt, logits_processor=patch, **kw)
        finally:
            ctxext.unpatch(model)
    assert torch.equal(_logits(model, prompt), before)


@pytest.mark.parametrize("then", [("dca", 4, {}), ("self-extend", 8, {}), ("self-extend", 4, {"window": 8}),
                                  ("yarn", 4, {})], ids=["dca", "other-factor", "other-options", "yarn"])
def test_a_cache_continued_under_another_patch_is_refused(then):
    """Self-extend x4's cache continued under another remap method, factor or option, or a frequency patch."""
    model = no_eos(_llama())
    prompt = _prompt(80, seed=3)
    method, factor, options = then
    with torch.no_grad():
        with ctxext.patched(model, "self-extend", 4):
            seq, past = _generate(model, prompt, "generate")
        with ctxext.patched(model, method, factor, **options):
            want = "now runs" if method != "yarn" else "no longer runs that patch"
            with pytest.raises(PatchError, match=f"filled under .*self-extend x4.*{want}"):
                _continue(model, seq, past)


def test_a_frequency_patch_cache_is_refused_under_a_remap_patch():
    model = no_eos(_llama())
    prompt = _prompt(80, seed=3)
    with torch.no_grad():
        with ctxext.patched(model, "yarn", 4):
            seq, past = _generate(model, prompt, "generate")
        with ctxext.patched(model, "dca", 4):
            with pytest.raises(PatchError, match="frequency patch such as yarn.*now runs dca x4"):
                _continue(model, seq, past)


@pytest.mark.parametrize("cache", ["generate", "dynamic", "static-object"])
def test_the_same_patch_again_continues_exactly_and_a_reset_cache_is_free(cache):
    """A chat: each turn in its own ``with ctxext.patched(m, "self-extend", 4)`` block, the cache carried over: the
    second turn's logits == a full forward pass under the patch. The cache, reset (where that empties it), then
    serves the plain model exactly."""
    model = no_eos(_llama())
    prompt = _prompt(80, seed=3)
    with torch.no_grad():
        with ctxext.patched(model, "self-extend", 4):
            seq, past = _generate(model, prompt, cache)
        with ctxext.patched(model, "self-extend", 4):
            out = _continue(model, seq, past)
            start = seq.shape[1] + 1
            full = model(out.sequences).logits[0, start - 1:-1]
            torch.testing.assert_close(torch.cat(out.logits), full, atol=1e-4, rtol=0)
        past.reset()
        if past.get_seq_length() == 0:  # some releases' reset (4.x) zeroes a dynamic cache's keys and keeps them
            seq, logits, mask = _greedy(model, prompt, 5, cache=past)
            torch.testing.assert_close(logits, _full(model, seq, mask, 80), atol=1e-4, rtol=0)


@pytest.mark.parametrize("cache", ["dynamic", "static-object"])
def test_a_copied_or_pickled_cache_keeps_the_patch_it_was_filled_under(cache):
    """A deep copy and a pickle round trip of a cache filled under self-extend x4: under the patch each continues as
    the cache itself does (bit for bit); without it each is refused."""
    import copy
    import pickle

    model = no_eos(_llama())
    prompt = _prompt(80, seed=3)
    with torch.no_grad():
        with ctxext.patched(model, "self-extend", 4):
            seq, past = _generate(model, prompt, cache)
            copies = [copy.deepcopy(past), pickle.loads(pickle.dumps(past))]
            step = seq[:, -1:]
            want = model(step, past_key_values=copy.deepcopy(past)).logits
            for copied in copies:
                assert torch.equal(model(step, past_key_values=copied).logits, want)
        for copied in (copy.deepcopy(past), pickle.loads(pickle.dumps(past))):
            with pytest.raises(PatchError, match="self-extend x4"):
                model(step, past_key_values=copied)
