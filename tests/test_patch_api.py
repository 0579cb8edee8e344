"""The public API: patch / unpatch / patched / describe / available_methods / from_pretrained, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama

import ctxext
from ctxext import PatchError

L0 = 64
ROTARY_METHODS = ["pi", "ntk", "dynamic-ntk", "yarn", "llama3", "extrapolate"]


@pytest.fixture
def ids():
    return torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(3))


def _state(model, ids):
    return model(ids).logits, model.config.to_dict()


@pytest.mark.parametrize("method", ROTARY_METHODS)
def test_unpatch_restores_bit_exact(llama, ids, method):
    logits, config = _state(llama, ids)
    ctxext.patch(llama, method, 4)
    if method != "extrapolate":
        assert not torch.equal(llama(ids).logits, logits)
    ctxext.unpatch(llama)
    assert torch.equal(llama(ids).logits, logits)
    assert llama.config.to_dict() == config
    assert ctxext.describe(llama) is None


def test_patch_advertises_longer_length_and_records_spec(llama):
    assert ctxext.patch(llama, "yarn", 4, beta_fast=16) is llama
    assert llama.config.max_position_embeddings == 4 * L0
    spec = ctxext.describe(llama)
    assert spec["method"] == "yarn" and spec["factor"] == 4.0 and spec["family"] == "rotary"
    assert spec["original_length"] == L0 and spec["patched_length"] == 4 * L0
    assert spec["options"]["beta_fast"] == 16.0 and spec["options"]["beta_slow"] == 1.0
    assert llama.config.ctxext == spec
    spec["factor"] = 99  # describe returns a copy
    assert ctxext.describe(llama)["factor"] == 4.0


def test_aliases_resolve(llama):
    ctxext.patch(llama, "linear", 2)
    assert ctxext.describe(llama)["method"] == "pi"
    ctxext.patch(llama, "dynamic", 2, replace=True)
    assert ctxext.describe(llama)["method"] == "dynamic-ntk"


def test_patched_context_manager(llama, ids):
    logits, _ = _state(llama, ids)
    with ctxext.patched(llama, "ntk", 4) as m:
        assert m is llama and ctxext.describe(llama)["method"] == "ntk"
        assert not torch.equal(llama(ids).logits, logits)
    assert torch.equal(llama(ids).logits, logits) and ctxext.describe(llama) is None


def test_patched_restores_on_error(llama, ids):
    logits, _ = _state(llama, ids)
    with pytest.raises(RuntimeError):
        with ctxext.patched(llama, "pi", 4):
            raise RuntimeError("boom")
    assert torch.equal(llama(ids).logits, logits)


def test_available_methods(llama):
    table = ctxext.available_methods()
    assert "rotary" in table["yarn"] and "rotary" in table["pi"]
    assert set(ROTARY_METHODS) <= set(ctxext.available_methods(llama))


def test_replace(llama, ids):
    ctxext.patch(llama, "pi", 4)
    with pytest.raises(PatchError, match="already patched.*unpatch.*replace=True"):
        ctxext.patch(llama, "ntk", 4)
    ctxext.patch(llama, "ntk", 4, replace=True)
    expected = tiny_llama()
    ctxext.patch(expected, "ntk", 4)
    assert torch.equal(llama(ids).logits, expected(ids).logits)
    assert llama.config.max_position_embeddings == 4 * L0
    ctxext.unpatch(llama)
    assert llama.config.max_position_embeddings == L0


def test_failed_replace_keeps_the_active_patch(llama, ids):
    ctxext.patch(llama, "pi", 4)
    patched_logits = llama(ids).logits
    with pytest.raises(PatchError, match="unknown option"):
        ctxext.patch(llama, "yarn", 4, replace=True, beta=3)
    assert ctxext.describe(llama)["method"] == "pi"
    assert torch.equal(llama(ids).logits, patched_logits)


BAD_INPUTS = [
    (("bogus", 4), {}, r"unknown method 'bogus'; choose one of pi \(alias linear\), ntk"),
    (("pi",), {}, r"needs a factor"),
    (("pi", 0.5), {}, r"factor must be >= 1"),
    (("pi", -2), {}, r"factor must be >= 1"),
    (("pi", math.nan), {}, r"finite"),
    (("pi", math.inf), {}, r"finite"),
    (("pi", "four"), {}, r"factor must be a number"),
    (("pi", True), {}, r"factor must be a number"),
    (("yarn", 4), {"beta_fats": 3}, r"unknown option\(s\) beta_fats for method 'yarn'; accepted: beta_fast"),
    (("pi", 4), {"beta_fast": 3}, r"unknown option\(s\) beta_fast for method 'pi'; accepted: none"),
    (("yarn", 4), {"beta_fast": "fast"}, r"option 'beta_fast' of method 'yarn' must be a number"),
    ((None, 4), {}, r"method must be a string"),
    # ranges the formulas need (a log of a rotation count, a division by the factors' gap, a positive temperature)
    (("yarn", 4), {"beta_fast": -1}, r"beta_fast and beta_slow of method 'yarn' .* must be > 0"),
    (("yarn", 4), {"beta_fast": 0}, r"must be > 0"),
    (("yarn", 4), {"beta_fast": 1, "beta_slow": 32}, r"beta_fast of method 'yarn' must be greater than beta_slow"),
    (("yarn", 4), {"attention_factor": 0.0}, r"attention_factor of method 'yarn' must be > 0"),
    (("yarn", 4), {"mscale": -1}, r"mscale of method 'yarn' must be >= 0"),
    (("llama3", 4), {"low_freq_factor": 0}, r"0 < low_freq_factor < high_freq_factor"),
    (("llama3", 4), {"low_freq_factor": 4, "high_freq_factor": 1}, r"0 < low_freq_factor < high_freq_factor"),
]


@pytest.mark.parametrize("args,options,message", BAD_INPUTS)
def test_a_bad_replacement_keeps_the_patch_in_place(llama, ids, args, options, message):
    ctxext.patch(llama, "pi", 2)
    logits, config = _state(llama, ids)
    with pytest.raises(PatchError, match=message):
        ctxext.patch(llama, *args, replace=True, **options)
    assert torch.equal(llama(ids).logits, logits)
    assert llama.config.to_dict() == config
    assert ctxext.describe(llama)["method"] == "pi"


def test_a_replacement_that_fails_while_applied_puts_the_replaced_patch_back(llama, ids, monkeypatch):
    from ctxext.adapters import find_adapter

    ctxext.patch(llama, "pi", 2)
    logits, config = _state(llama, ids)
    adapter = type(find_adapter(llama))
    real = adapter.apply

    def fail_once(self, model, spec):  # an error inside apply, after the old patch came off
        monkeypatch.setattr(adapter, "apply", real)
        raise RuntimeError("apply failed")

    monkeypatch.setattr(adapter, "apply", fail_once)
    with pytest.raises(RuntimeError, match="apply failed"):
        ctxext.patch(llama, "yarn", 4, replace=True)
    assert ctxext.describe(llama)["method"] == "pi"
    assert torch.equal(llama(ids).logits, logits)
    assert llama.config.to_dict() == config


@pytest.mark.parametrize("args,options,message", BAD_INPUTS)
def test_bad_input_raises_clearly_and_leaves_model_untouched(llama, ids, args, options, message):
    logits, config = _state(llama, ids)
    with pytest.raises(PatchError, match=message):
        ctxext.patch(llama, *args, **options)
    assert torch.equal(llama(ids).logits, logits)
    assert llama.config.to_dict() == config
    assert ctxext.describe(llama) is None


def test_patch_error_is_a_value_error():
    assert issubclass(PatchError, ValueError)


def test_unpatch_unpatched_model_raises(llama):
    with pytest.raises(PatchError, match="not patched"):
        ctxext.unpatch(llama)


class _NoPositions(torch.nn.Module):
    """A transformers-style model (a real PretrainedConfig) with no positional surface."""

    def __init__(self):
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(max_position_embeddings=64)
        self.linear = torch.nn.Linear(4, 4)


def test_model_without_positional_surface():
    with pytest.raises(PatchError, match="no positional surface ctxext knows"):
        ctxext.patch(_NoPositions(), "pi", 2)


def test_a_rope_type_a_method_cannot_compose_on_is_refused(ids):
    """Methods compose on a shipped static scaled rope type (tests/test_scaled_rope.py); a dynamic one rescales
    itself in every forward, so NoPE's zero frequencies would be overwritten: refused, the model unchanged."""
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0})
    logits = model(ids).logits
    with pytest.raises(PatchError, match="rope_type 'dynamic', which recomputes its frequencies"):
        ctxext.patch(model, "nope")
    assert torch.equal(model(ids).logits, logits)


def test_failure_midway_leaves_nothing_behind(llama, ids, monkeypatch):
    """An adapter that fails after changing some modules undoes them before re-raising."""
    from ctxext.adapters import rotary

    logits, config = _state(llama, ids)
    calls = {"n": 0}
    real = rotary.STATIC_METHODS["pi"]

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated failure on the second rotary module")
        return real(*args, **kwargs)

    # two rotary modules: the model's and a second one, as in models with a rotary module per layer
    llama.model.layers[0].extra_rotary = type(llama.model.rotary_emb)(llama.config)
    monkeypatch.setitem(rotary.STATIC_METHODS, "pi", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        ctxext.patch(llama, "pi", 4)
    assert torch.equal(llama(ids).logits, logits)
    assert llama.config.to_dict() == config
    assert ctxext.describe(llama) is None
