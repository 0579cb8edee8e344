"""ALiBi: slopes, the chunked attention function, and the ALiBi swap on rotary (GQA LLaMA) and GPT-2 models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from checks import causal, generate_equals_full_forward, padded_batch_equals_single_rows
from conftest import tiny_gpt2, tiny_llama

import ctxext
from ctxext import PatchError
from ctxext.attention import alibi as attention
from ctxext.methods.alibi import alibi_bias, alibi_slopes, interpolated_slopes


def press_slopes(n: int) -> list[float]:
    """The reference code of Press et al. (float64)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + press_slopes(2 * closest)[0::2][: n - closest]


# ---------------------------------------------------------------- slopes


@pytest.mark.parametrize("heads", [8, 12, 9, 1, 2, 3, 5, 16, 24, 32, 40, 64, 96, 112])
def test_slopes_equal_bloom_and_press(heads):
    from conftest import bloom_slopes

    ours = alibi_slopes(heads)
    assert ours.dtype == torch.float32 and ours.shape == (heads,)
    assert torch.equal(ours, bloom_slopes(heads))  # bit-identical to BLOOM's
    press = torch.tensor(press_slopes(heads), dtype=torch.float64)
    torch.testing.assert_close(ours.double(), press, rtol=1e-6, atol=0)  # float32 powers of a float32 base


def test_slopes_known_values():
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    # 12 heads: 8 slopes of the 8-head sequence, then slopes 1, 3, 5, 7 of the 16-head sequence
    expected = [2.0**-k for k in range(1, 9)] + [2.0 ** (-k / 2) for k in (1, 3, 5, 7)]
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(alibi_slopes(12).double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_slopes_reject_bad_head_counts(bad):
    with pytest.raises(ValueError, match="positive integer"):
        alibi_slopes(bad)


def test_interpolated_slopes_divide_distances():
    s = alibi_slopes(9)
    assert torch.equal(interpolated_slopes(s, 1.0), s)
    q, k = torch.arange(10, 20), torch.arange(20)
    torch.testing.assert_close(alibi_bias(interpolated_slopes(s, 4), q, k), alibi_bias(s, q / 4, k / 4))


# ---------------------------------------------------------------- the attention function


class _Layer(torch.nn.Module):
    """An attention layer of a model the ALiBi swap patched (the function refuses any other)."""

    is_causal = True

    def __init__(self):
        super().__init__()
        vars(self)[attention.ALIBI_MARK] = True


def reference_attention(q, k, v, mask=None, q_start=None):
    """Eager ALiBi attention with the full (heads x q x k) bias."""
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], 1)
    v = v.repeat_interleave(heads // v.shape[1], 1)
    q_len, kv_len = q.shape[2], k.shape[2]
    q_pos = torch.arange(q_len) + (kv_len - q_len if q_start is None else q_start)
    k_pos = torch.arange(kv_len)
    bias = alibi_bias(alibi_slopes(heads), q_pos, k_pos)
    allowed = (k_pos[None] <= q_pos[:, None])[None, None]
    if mask is not None:
        allowed = allowed & mask
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


SHAPES = [(8, 4, 300, 300), (12, 12, 200, 200), (9, 3, 1, 50), (8, 2, 7, 57), (4, 4, 600, 600)]


@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", SHAPES)
def test_attention_matches_eager_reference(heads, kv_heads, q_len, kv_len):
    torch.manual_seed(0)
    q = torch.randn(2, heads, q_len, 8)
    k, v = torch.randn(2, kv_heads, kv_len, 8), torch.randn(2, kv_heads, kv_len, 8)
    q_pos, k_pos = torch.arange(q_len) + kv_len - q_len, torch.arange(kv_len)
    padding = torch.ones(2, kv_len, dtype=torch.bool)
    padding[1, :5] = False  # left padding in row 1
    mask = (k_pos[None] <= q_pos[:, None])[None, None] & padding[:, None, None, :]
    real = slice(max(0, 5 - (kv_len - q_len)), None)  # row 1's query rows that are not padding

    out, weights = attention.alibi_attention_forward(_Layer(), q, k, v, mask)
    assert weights is None and out.shape == (2, q_len, heads, 8) and torch.isfinite(out).all()
    ref = reference_attention(q, k, v, mask)
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1, real], ref[1, real], atol=1e-5, rtol=0)
    # an additive float mask gives the same
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    out_f, _ = attention.alibi_attention_forward(_Layer(), q, k, v, additive)
    torch.testing.assert_close(out_f[0], out[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out_f[1, real], out[1, real], atol=1e-6, rtol=0)
    if q_len == kv_len:  # no mask: causal from the positions
        out_none, _ = attention.alibi_attention_forward(_Layer(), q, k, v, None)
        torch.testing.assert_close(out_none, reference_attention(q, k, v), atol=1e-5, rtol=0)


def test_chunking_does_not_change_results(monkeypatch):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 8, 700, 8), torch.randn(2, 4, 700, 8), torch.randn(2, 4, 700, 8)
    pos = torch.arange(700)
    mask = (pos[None] <= pos[:, None])[None, None].expand(2, 1, 700, 700)
    whole_none, _ = attention.alibi_attention_forward(_Layer(), q, k, v, None)
    whole_mask, _ = attention.alibi_attention_forward(_Layer(), q, k, v, mask)
    monkeypatch.setattr(attention, "MIN_ROWS", 16)
    monkeypatch.setattr(attention, "CHUNK_BYTES", 8 * 700 * 4 * 2 * 10)  # 10 rows per chunk with a mask
    chunked_none, _ = attention.alibi_attention_forward(_Layer(), q, k, v, None)
    chunked_mask, _ = attention.alibi_attention_forward(_Layer(), q, k, v, mask)
    torch.testing.assert_close(chunked_none, whole_none, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked_mask, whole_mask, atol=1e-6, rtol=0)
    torch.testing.assert_close(whole_none, whole_mask, atol=1e-6, rtol=0)


def test_no_full_bias_is_materialised(monkeypatch):
    """Without padding the bias reaches sdpa as a view of (heads x ~3T) values; with padding at most CHUNK_BYTES."""
    heads, T = 8, 2048
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((tuple(attn_mask.shape), attn_mask.untyped_storage().nbytes()))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    q, k, v = torch.randn(1, heads, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    attention.alibi_attention_forward(_Layer(), q, k, v, None)
    full = heads * T * T * 4
    assert len(seen) == attention.CAUSAL_CHUNKS
    assert all(nbytes <= heads * 3 * T * 4 for _, nbytes in seen)
    assert sum(s[2] * s[3] for s, _ in seen) < 0.6 * T * T  # causal: each chunk skips the keys after it

    seen.clear()
    monkeypatch.setattr(attention, "CHUNK_BYTES", full // 64)
    pos = torch.arange(T)
    mask = (pos[None] <= pos[:, None])[None, None]
    attention.alibi_attention_forward(_Layer(), q, k, v, mask)
    assert len(seen) >= 64 and all(nbytes <= full // 64 for _, nbytes in seen)


# ---------------------------------------------------------------- the swap on models

MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
ORIGINAL = {"llama": 64, "gpt2": 32}


@pytest.mark.parametrize("name", MODELS)
def test_swap_sets_attention_and_unpatch_restores_bit_exact(name):
    model = MODELS[name]()
    ids = torch.randint(0, 128, (1, ORIGINAL[name]), generator=torch.Generator().manual_seed(2))
    logits, config = model(ids).logits, model.config.to_dict()
    ctxext.patch(model, "alibi")
    assert model.config._attn_implementation == attention.ALIBI
    assert ctxext.describe(model)["method"] == "alibi" and ctxext.describe(model)["factor"] is None
    assert not torch.allclose(model(ids).logits, logits)
    ctxext.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model(ids).logits, logits)
    assert model.config.to_dict() == config


@pytest.mark.parametrize("name", MODELS)
def test_swap_with_factor_advertises_longer_length(name):
    model = MODELS[name]()
    ctxext.patch(model, "alibi", 4)
    assert model.config.max_position_embeddings == 4 * ORIGINAL[name]
    ctxext.unpatch(model)
    assert model.config.max_position_embeddings == ORIGINAL[name]


def test_swap_on_rotary_disables_rotation_and_keeps_sdpa_kernel():
    model = tiny_llama()
    ctxext.patch(model, "alibi")
    rotary = model.model.rotary_emb
    assert torch.count_nonzero(rotary.inv_freq) == 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randint(0, 128, (1, 100)))
    assert "aten::scaled_dot_product_attention" in {e.key for e in prof.key_averages()}


def test_swap_on_rotary_equals_manual_alibi_model():
    """Rotary off + ALiBi attention == the same weights with inv_freq = 0 run through the eager reference."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    ctxext.patch(model, "alibi")
    ours = model(ids).logits

    def eager_alibi(module, q, k, v, mask, dropout=0.0, scaling=None, **kw):
        assert mask is None
        return reference_attention(q, k, v), None

    from transformers import AttentionInterface

    AttentionInterface.register("test_eager_alibi", eager_alibi)
    model.config._attn_implementation_internal = "test_eager_alibi"
    try:
        ref = model(ids).logits
    finally:
        model.config._attn_implementation_internal = attention.ALIBI
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_swap_generate_with_cache_equals_full_forward_past_original_length(name):
    model = MODELS[name]()
    ctxext.patch(model, "alibi")
    generate_equals_full_forward(model, prompt_len=40, new=2 * ORIGINAL[name] - 30)


@pytest.mark.parametrize("name", MODELS)
def test_swap_padded_batch_equals_single_rows(name):
    model = MODELS[name]()
    ctxext.patch(model, "alibi")
    padded_batch_equals_single_rows(model, lengths=(90, 61, 7))
    padded_batch_equals_single_rows(model, lengths=(90, 61), position_ids=False)  # ALiBi needs no position ids


@pytest.mark.parametrize("name", MODELS)
def test_swap_keeps_causal_masking(name):
    model = MODELS[name]()
    ctxext.patch(model, "alibi")
    causal(model, length=80, cut=30)


def test_swap_is_translation_invariant():
    """ALiBi sees only relative distances: GPT-2 (table bypassed) gives the same logits at any position offset."""
    model = tiny_gpt2()
    ctxext.patch(model, "alibi")
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    shifted = torch.arange(1000, 1050)[None]
    torch.testing.assert_close(model(ids, position_ids=shifted).logits, model(ids).logits, atol=1e-6, rtol=0)


def test_swap_survives_save_and_reload(tmp_path):
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(6))
    ctxext.patch(model, "alibi", 2)
    logits = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(loaded) == ctxext.describe(model)
    assert loaded.config._attn_implementation == attention.ALIBI
    assert torch.equal(loaded(ids).logits, logits)


def test_swap_refused_where_attention_is_not_pluggable(bloom):
    with pytest.raises(PatchError, match=r"already ALiBi\. Methods that do: pi, nope, extrapolate"):
        ctxext.patch(bloom, "alibi")


def test_swap_refused_for_cross_attention():
    model = tiny_gpt2(add_cross_attention=True)
    config = model.config.to_dict()
    with pytest.raises(PatchError, match="cross-attention"):
        ctxext.patch(model, "alibi")
    assert model.config.to_dict() == config and ctxext.describe(model) is None
    assert type(model.transformer.wpe) is torch.nn.Embedding


def test_failed_attention_switch_leaves_nothing_behind(monkeypatch):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40))
    logits, config = model(ids).logits, model.config.to_dict()

    def refuse(self, name, *a, **k):
        raise RuntimeError("simulated refusal")

    monkeypatch.setattr(type(model), "set_attn_implementation", refuse)
    with pytest.raises(RuntimeError, match="simulated"):
        ctxext.patch(model, "alibi")
    assert torch.equal(model(ids).logits, logits)
    assert model.config.to_dict() == config and model.config._attn_implementation == "sdpa"
    assert ctxext.describe(model) is None


def test_swap_refused_clearly_where_transformers_lacks_the_attention_hook_point(llama, monkeypatch):
    """A transformers without AttentionInterface / AttentionMaskInterface: a PatchError naming the version that has
    them, before the model is touched (not an ImportError or AttributeError)."""
    import ctxext.attention.interface as interface

    monkeypatch.setattr(interface, "MISSING_HOOK", interface.MISSING_HOOK_MESSAGE)
    before = llama.config._attn_implementation
    with pytest.raises(ctxext.PatchError, match=r"AttentionInterface.*transformers 4\.53"):
        ctxext.patch(llama, "alibi")
    assert llama.config._attn_implementation == before and ctxext.describe(llama) is None


def test_a_model_built_from_a_swapped_models_config_is_refused_not_run_with_both_encodings():
    """The swapped model's config names ``ctxext_alibi``; a model built from it keeps its rotary positions. Run with
    the ALiBi bias on top, it matches neither model: it is refused. The swapped model itself runs on."""
    from transformers import LlamaForCausalLM

    swapped = tiny_llama()
    ctxext.patch(swapped, "alibi", 4)
    ids = torch.randint(0, 100, (1, 12))
    built = LlamaForCausalLM(swapped.config).eval()
    with pytest.raises(RuntimeError, match="not in a model the ALiBi swap patched"):
        built(ids)
    swapped(ids)
    ctxext.unpatch(swapped)
    assert not any(attention.ALIBI_MARK in vars(m) for m in swapped.modules())
