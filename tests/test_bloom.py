"""BLOOM (ALiBi, 9 heads): the slope function is patched on every path; pi, nope, extrapolate; advertised length."""

from __future__ import annotations

import json

import pytest
import torch
from checks import (
    causal,
    generate_equals_full_forward,
    no_eos,
    padded_batch_equals_single_rows,
    patch_survives_save_and_reload,
)
from conftest import bloom_slopes, tiny_bloom

import ctxext
from ctxext import PatchError
from ctxext.adapters.bloom import BLOOM_TRAINING_LENGTH
from ctxext.methods.alibi import alibi_slopes

HEADS = 9


@pytest.fixture
def ids():
    return torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(3))


def _state(model, ids):
    return model(ids).logits, model.config.to_dict()


class AlibiSpy:
    """Records the ALiBi tensor BLOOM hands to its first block on every forward pass."""

    def __init__(self, model):
        self.seen = []
        model.transformer.h[0].register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.seen.append(kwargs["alibi"].detach().clone())


def expected_alibi(slopes, length):
    return (slopes[:, None, None] * torch.arange(length)).reshape(HEADS, 1, length)


def test_slopes_equal_bloom_for_9_heads():
    assert torch.equal(alibi_slopes(HEADS), bloom_slopes(HEADS))


def _has_slope_function() -> bool:
    from transformers.models.bloom import modeling_bloom

    return callable(getattr(modeling_bloom, "_get_alibi_slopes", None))


@pytest.mark.parametrize("method,factor,transform", [
    ("pi", 2, lambda s: s / 2),
    ("pi", 3.5, lambda s: s / 3.5),
    ("nope", None, torch.zeros_like),
    ("extrapolate", 4, lambda s: s),
])
def test_slopes_patched_on_every_path(bloom, method, factor, transform):
    """No mask (direct slope call), with a mask (build_alibi_tensor) and in generate (cached, with a mask)."""
    spy = AlibiSpy(bloom)
    ctxext.patch(bloom, method, factor)
    slopes = transform(alibi_slopes(HEADS))
    x = torch.randint(2, 128, (1, 40))

    bloom(x)  # no attention mask: BLOOM calls the slope function itself
    torch.testing.assert_close(spy.seen[-1], expected_alibi(slopes, 40), atol=0, rtol=0)

    bloom(x, attention_mask=torch.ones_like(x))  # with a mask: through build_alibi_tensor
    torch.testing.assert_close(spy.seen[-1], expected_alibi(slopes, 40), atol=0, rtol=0)

    spy.seen.clear()
    no_eos(bloom).generate(x, attention_mask=torch.ones_like(x), max_new_tokens=5, do_sample=False)
    assert len(spy.seen) == 5
    for step, alibi in enumerate(spy.seen):  # prefill, then one step per new token over the growing cache
        torch.testing.assert_close(alibi, expected_alibi(slopes, 40 + step), atol=0, rtol=0)


def test_unpatch_restores_build_alibi_tensor_where_there_is_no_slope_function(ids):
    """The hook point of transformers releases without ``modeling_bloom._get_alibi_slopes``: the patched model's own
    ``build_alibi_tensor``; other models keep theirs, unpatch takes the wrapper off."""
    if _has_slope_function():
        pytest.skip("this transformers has modeling_bloom._get_alibi_slopes: the slope function is the hook point")
    patched, other = tiny_bloom(), tiny_bloom()
    other_logits = other(ids).logits
    ctxext.patch(patched, "pi", 4)
    assert "build_alibi_tensor" in vars(patched.transformer)
    assert "build_alibi_tensor" not in vars(other.transformer)
    assert torch.equal(other(ids).logits, other_logits)
    ctxext.unpatch(patched)
    assert "build_alibi_tensor" not in vars(patched.transformer)


def test_unpatch_restores_the_slope_function_and_other_models_are_unaffected(ids):
    import gc

    if not _has_slope_function():
        pytest.skip("this transformers has no modeling_bloom._get_alibi_slopes (BLOOM builds its ALiBi tensor only "
                    "through build_alibi_tensor, the hook point used there)")

    from transformers.models.bloom import modeling_bloom

    gc.collect()  # models patched by earlier tests and dropped release the function when collected
    original_function = modeling_bloom._get_alibi_slopes
    assert original_function.__module__ == modeling_bloom.__name__
    patched, other = tiny_bloom(), tiny_bloom()
    other_logits = other(ids).logits
    ctxext.patch(patched, "pi", 4)
    assert modeling_bloom._get_alibi_slopes is not original_function
    assert torch.equal(other(ids).logits, other_logits)  # an unpatched BLOOM in the same process
    second = tiny_bloom()
    ctxext.patch(second, "nope")
    ctxext.unpatch(patched)
    assert modeling_bloom._get_alibi_slopes is not original_function  # still in use by `second`
    ctxext.unpatch(second)
    assert modeling_bloom._get_alibi_slopes is original_function
    dropped = tiny_bloom()
    ctxext.patch(dropped, "pi", 2)  # patched, never unpatched, then garbage-collected
    assert modeling_bloom._get_alibi_slopes is not original_function
    del dropped
    gc.collect()
    assert modeling_bloom._get_alibi_slopes is original_function


@pytest.mark.parametrize("method,factor", [("pi", 4), ("pi", 2.5), ("nope", None), ("extrapolate", 2)])
def test_unpatch_bit_exact_and_length_attribute_removed(bloom, ids, method, factor):
    logits, config = _state(bloom, ids)
    assert not hasattr(bloom.config, "max_position_embeddings")
    ctxext.patch(bloom, method, factor)
    spec = ctxext.describe(bloom)
    assert spec["original_length"] == BLOOM_TRAINING_LENGTH
    assert bloom.config.max_position_embeddings == spec["patched_length"]
    ctxext.unpatch(bloom)
    assert not hasattr(bloom.config, "max_position_embeddings")
    assert torch.equal(bloom(ids).logits, logits)
    assert bloom.config.to_dict() == config


def test_pi_factor_one_equals_original_exactly(bloom, ids):
    logits, _ = _state(bloom, ids)
    ctxext.patch(bloom, "pi", 1)
    assert torch.equal(bloom(ids).logits, logits)
    assert torch.equal(bloom(ids, attention_mask=torch.ones_like(ids)).logits, logits)


def test_extrapolate_advertises_only(bloom, ids):
    logits, _ = _state(bloom, ids)
    ctxext.patch(bloom, "extrapolate", 4)
    assert bloom.config.max_position_embeddings == 4 * BLOOM_TRAINING_LENGTH
    assert torch.equal(bloom(ids).logits, logits)


def test_original_length_from_config_when_present():
    model = tiny_bloom(max_position_embeddings=32)
    ctxext.patch(model, "pi", 2)
    assert ctxext.describe(model)["original_length"] == 32 and model.config.max_position_embeddings == 64
    ctxext.unpatch(model)
    assert model.config.max_position_embeddings == 32


def test_lm_eval_reads_the_patched_length(bloom):
    utils = pytest.importorskip("lm_eval.models.utils")
    ctxext.patch(bloom, "pi", 2)
    assert utils.resolve_max_length(bloom.config) == 2 * BLOOM_TRAINING_LENGTH


@pytest.mark.parametrize("method,factor", [("pi", 2), ("nope", None), ("extrapolate", 2), (None, None)])
def test_generate_with_cache_equals_full_forward_past_original_length(method, factor):
    model = tiny_bloom(max_position_embeddings=32)
    if method:
        ctxext.patch(model, method, factor)
    generate_equals_full_forward(model, prompt_len=20, new=50)  # 70 > 32; full pass without a mask, generate with


@pytest.mark.parametrize("method,factor", [("pi", 4), ("nope", None)])
def test_padded_batch_equals_single_rows(method, factor):
    model = tiny_bloom()
    ctxext.patch(model, method, factor)
    padded_batch_equals_single_rows(model, lengths=(60, 23), position_ids=False)


def test_causal_masking_intact():
    model = tiny_bloom()
    ctxext.patch(model, "pi", 4)
    causal(model)


def test_pi_interpolates_distances():
    """pi with factor f: the bias a query puts on a key d tokens back is what the original put on one d / f back."""
    model = tiny_bloom()
    spy = AlibiSpy(model)
    model(torch.randint(2, 128, (1, 16)))
    ctxext.patch(model, "pi", 4)
    model(torch.randint(2, 128, (1, 64)))
    original, patched = spy.seen
    torch.testing.assert_close(patched[:, :, ::4], original, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method,factor", [("pi", 2.5), ("nope", None)])
def test_patch_survives_save_and_reload(tmp_path, ids, method, factor):
    patch_survives_save_and_reload(tiny_bloom(), tmp_path, method, factor, ids)


BAD = [
    (("alibi",), {}, r"method 'alibi' does not fit BloomForCausalLM \(BLOOM \(ALiBi\)\): already ALiBi\. "
     r"Methods that do: pi, nope, extrapolate"),
    (("ntk", 2), {}, r"not rotary\. Methods that do: pi, nope, extrapolate"),
    (("yarn", 2), {}, r"not rotary"),
    (("llama3", 2), {}, r"not rotary"),
    (("pi",), {}, r"needs a factor"),
    (("pi", -1), {}, r"factor must be >= 1"),
    (("pi", float("inf")), {}, r"finite"),
    (("nope",), {"beta_fast": 2}, r"unknown option\(s\) beta_fast for method 'nope'; accepted: none"),
    (("bogus", 2), {}, r"unknown method 'bogus'"),
]


@pytest.mark.parametrize("args,options,message", BAD)
def test_bad_input_raises_clearly_and_leaves_model_untouched(bloom, ids, args, options, message):
    from transformers.models.bloom import modeling_bloom

    function = getattr(modeling_bloom, "_get_alibi_slopes", None)
    logits, config = _state(bloom, ids)
    with pytest.raises(PatchError, match=message):
        ctxext.patch(bloom, *args, **options)
    assert getattr(modeling_bloom, "_get_alibi_slopes", None) is function
    assert "build_alibi_tensor" not in vars(bloom.transformer)
    assert torch.equal(bloom(ids).logits, logits)
    assert bloom.config.to_dict() == config and ctxext.describe(bloom) is None


def test_already_patched_needs_replace(bloom, ids):
    logits, config = _state(bloom, ids)
    ctxext.patch(bloom, "pi", 2)
    with pytest.raises(PatchError, match="already patched"):
        ctxext.patch(bloom, "nope")
    ctxext.patch(bloom, "nope", replace=True)
    assert ctxext.describe(bloom)["method"] == "nope"
    ctxext.unpatch(bloom)
    assert torch.equal(bloom(ids).logits, logits) and bloom.config.to_dict() == config


def test_available_methods_for_bloom(bloom):
    assert set(ctxext.available_methods(bloom)) == {"pi", "nope", "extrapolate"}


#: what any save and reload changes in a config, patched or not (transformers' own bookkeeping)
SAVE_ADDS = ("_name_or_path", "dtype", "torch_dtype", "architectures")


@pytest.mark.parametrize("method,factor", [("pi", 2.5), ("nope", None)])
def test_unpatch_after_save_and_reload_gives_the_config_without_a_length(tmp_path, ids, method, factor):
    """BLOOM configs have no max_position_embeddings; the patch advertises one. A reloaded patched model unpatched
    gives the original config again (it kept max_position_embeddings=2048), and saves it without one."""
    original = tiny_bloom()
    assert "max_position_embeddings" not in vars(original.config)
    config = original.config.to_dict()
    ctxext.patch(original, method, factor).save_pretrained(tmp_path / "patched")
    reloaded = ctxext.unpatch(ctxext.from_pretrained(tmp_path / "patched"))
    assert "max_position_embeddings" not in vars(reloaded.config)
    assert {k: v for k, v in reloaded.config.to_dict().items() if k not in SAVE_ADDS} \
        == {k: v for k, v in config.items() if k not in SAVE_ADDS}
    reloaded.save_pretrained(tmp_path / "plain")
    assert "max_position_embeddings" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "max_position_embeddings" not in vars(ctxext.loading.load_config(str(tmp_path / "patched")))
