"""NoPE ablation on the three families: rotary (identity rotation, sdpa kept), GPT-2 (no table), BLOOM (slopes 0)."""

from __future__ import annotations

import pytest
import torch
from checks import causal, generate_equals_full_forward, padded_batch_equals_single_rows
from conftest import tiny_bloom, tiny_gpt2, tiny_llama, tiny_neox

import ctxext

MODELS = {"llama": tiny_llama, "neox": tiny_neox, "gpt2": tiny_gpt2, "bloom": tiny_bloom}
SHORT = {"llama": 60, "neox": 60, "gpt2": 30, "bloom": 60}  # within each model's original length


@pytest.mark.parametrize("name", MODELS)
def test_nope_changes_logits_and_unpatch_restores_bit_exact(name):
    model = MODELS[name]()
    ids = torch.randint(0, 128, (1, SHORT[name]), generator=torch.Generator().manual_seed(1))
    logits, config = model(ids).logits, model.config.to_dict()
    attn = model.config._attn_implementation
    ctxext.patch(model, "nope")
    assert ctxext.describe(model)["method"] == "nope"
    assert model.config._attn_implementation == attn  # no attention change for NoPE
    assert not torch.allclose(model(ids).logits, logits)
    ctxext.unpatch(model)
    assert torch.equal(model(ids).logits, logits)
    assert model.config.to_dict() == config


@pytest.mark.parametrize("name", ["llama", "neox"])
def test_nope_on_rotary_is_identity_rotation_and_keeps_sdpa(name):
    model = MODELS[name]()
    ctxext.patch(model, "nope")
    rotary = [m for m in model.modules() if hasattr(m, "inv_freq")]
    assert rotary and all(torch.count_nonzero(m.inv_freq) == 0 for m in rotary)
    assert model.config._attn_implementation == "sdpa"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randint(0, 128, (1, 100)))
    assert "aten::scaled_dot_product_attention" in {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("name", ["llama", "neox", "gpt2"])
def test_nope_ignores_positions(name):
    """Without a positional encoding the logits do not depend on the position ids, even far past the table."""
    model = MODELS[name]()
    ctxext.patch(model, "nope")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    far = torch.arange(5000, 5040)[None]
    torch.testing.assert_close(model(ids, position_ids=far).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_nope_on_rotary_equals_zero_frequencies():
    """NoPE == the same weights with every rotary frequency set to zero by hand."""
    model, manual = tiny_llama(), tiny_llama()
    ctxext.patch(model, "nope")
    with torch.no_grad():
        manual.model.rotary_emb.inv_freq.zero_()
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model(ids).logits, manual(ids).logits)


def test_nope_on_bloom_removes_the_bias():
    """BLOOM NoPE == the same weights with a zero ALiBi tensor passed to every block."""
    model, manual = tiny_bloom(), tiny_bloom()
    ctxext.patch(model, "nope")

    def zero_alibi(module, args, kwargs):
        kwargs["alibi"] = torch.zeros_like(kwargs["alibi"])
        return args, kwargs

    for block in manual.transformer.h:
        block.register_forward_pre_hook(zero_alibi, with_kwargs=True)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(4))
    assert torch.equal(model(ids).logits, manual(ids).logits)


@pytest.mark.parametrize("name", MODELS)
def test_nope_generate_with_cache_equals_full_forward(name):
    model = MODELS[name]()
    ctxext.patch(model, "nope")
    generate_equals_full_forward(model, prompt_len=20, new=SHORT[name] + 10)  # past the original length


@pytest.mark.parametrize("name", MODELS)
def test_nope_padded_batch_equals_single_rows(name):
    model = MODELS[name]()
    ctxext.patch(model, "nope")
    padded_batch_equals_single_rows(model, lengths=(70, 33), position_ids=name != "bloom")


@pytest.mark.parametrize("name", MODELS)
def test_nope_keeps_causal_masking(name):
    model = MODELS[name]()
    ctxext.patch(model, "nope")
    causal(model, length=50, cut=20)


@pytest.mark.parametrize("name", MODELS)
def test_nope_factor_is_optional_and_advertises(name):
    model = MODELS[name]()
    before = ctxext.describe(model)
    assert before is None
    ctxext.patch(model, "nope", 3)
    spec = ctxext.describe(model)
    assert spec["factor"] == 3.0 and spec["patched_length"] == 3 * spec["original_length"]
    assert model.config.max_position_embeddings == spec["patched_length"]
    ctxext.unpatch(model)
    with pytest.raises(ctxext.PatchError, match="factor must be >= 1"):
        ctxext.patch(model, "nope", 0.5)
    assert ctxext.describe(model) is None
