"""GPT-Neo (learned ``wpe`` + per-layer causal-mask buffers, global and local): each method against a reference
GPT-Neo that transformers builds at the longer length (its own masks) with the method's table written here from the
method's definition, cached decoding equal to a full pass, unpatch bit-exact (the same buffers back), refusals that
leave the model untouched, and the native export round trip."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoConfig, GPTNeoForCausalLM

import ctxext
from ctxext.adapters import find_adapter
from ctxext.core.errors import PatchError

sys.path.insert(0, str(Path(__file__).parent))
from checks import pi_table_reference  # noqa: E402

N, FACTOR, WINDOW = 16, 2, 6  # trained length, patch factor, local-attention window (< N: the local layer bites)


def _config(length: int) -> GPTNeoConfig:
    return GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                        attention_types=[[["global", "local"], 1]], window_size=WINDOW, max_position_embeddings=length,
                        bos_token_id=0, eos_token_id=0)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPTNeoForCausalLM(_config(N)).eval()


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(seed))


def _masks(m) -> list[torch.Tensor]:
    return [mod._buffers["bias"] for mod in m.modules() if "bias" in getattr(mod, "_buffers", {})]


REFERENCE_TABLES = {
    "pi": lambda w: pi_table_reference(w, FACTOR).float(),
    "extrapolate": lambda w: torch.cat([w, w[-1:].expand(N * (FACTOR - 1), -1)]),
    "nope": lambda w: torch.zeros(N * FACTOR, w.shape[1]),
}


def _reference(m, method: str) -> GPTNeoForCausalLM:
    """The same weights in a GPT-Neo built for N x FACTOR positions by transformers, ``wpe`` the method's table."""
    state = dict(m.state_dict())
    state["transformer.wpe.weight"] = REFERENCE_TABLES[method](state["transformer.wpe.weight"].detach())
    ref = GPTNeoForCausalLM(_config(N * FACTOR)).eval()
    ref.load_state_dict(state)
    return ref


def test_detected_as_its_own_family_and_unpatched_stops_at_its_length(model):
    adapter = find_adapter(model)
    assert adapter.family == "gpt-neo" and adapter.position_limit(model) == N
    with pytest.raises(IndexError):
        model(_ids(N + 1))


@pytest.mark.parametrize("method", sorted(REFERENCE_TABLES))
def test_each_method_equals_a_gpt_neo_built_at_the_longer_length(model, method):
    ids = _ids(N * FACTOR)
    ctxext.patch(model, method, factor=FACTOR)
    assert find_adapter(model).position_limit(model) == N * FACTOR
    assert model.config.max_position_embeddings == N * FACTOR
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, _reference(model, method)(ids).logits, atol=1e-5, rtol=1e-5)


def test_extrapolate_is_the_unpatched_model_inside_its_length(model):
    ids = _ids(N)
    with torch.no_grad():
        before = model(ids).logits
        ctxext.patch(model, "extrapolate", factor=FACTOR)
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("method", ["pi", "nope"])
def test_cached_decoding_equals_the_full_pass(model, method):
    ids = _ids(N * FACTOR)
    ctxext.patch(model, method, factor=FACTOR)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, : N + 2], use_cache=True)
        past, steps = out.past_key_values, []
        for i in range(N + 2, N * FACTOR):
            out = model(ids[:, i : i + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, N + 2 :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", sorted(REFERENCE_TABLES))
def test_unpatch_restores_the_model_bit_for_bit(model, method):
    ids = _ids(N)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    masks, wpe = _masks(model), model.transformer.wpe
    with torch.no_grad():
        before = model(ids).logits
        ctxext.patch(model, method, factor=FACTOR)
        assert all(a is not b for a, b in zip(masks, _masks(model)))
        ctxext.unpatch(model)
        after = model(ids).logits
    assert torch.equal(before, after)
    assert model.transformer.wpe is wpe and all(a is b for a, b in zip(masks, _masks(model)))
    assert model.config.max_position_embeddings == N and state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("method, reason", [("alibi", "not AttentionInterface"), ("ntk", "not rotary"),
                                            ("yarn", "not rotary"), ("self-extend", "not rotary")])
def test_refusals_leave_the_model_untouched(model, method, reason):
    masks, wpe, config = _masks(model), model.transformer.wpe, model.config.to_dict()
    with pytest.raises(PatchError, match=reason):
        ctxext.patch(model, method, factor=FACTOR)
    assert model.transformer.wpe is wpe and all(a is b for a, b in zip(masks, _masks(model)))
    assert model.config.to_dict() == config and ctxext.describe(model) is None


@pytest.mark.parametrize("method", ["pi", "extrapolate"])
def test_native_export_loads_plainly_as_the_patched_model(model, method, tmp_path):
    ids = _ids(N * FACTOR)
    ctxext.patch(model, method, factor=FACTOR)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        again = ctxext.from_pretrained(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again(ids).logits, want, atol=1e-5, rtol=1e-5)
    assert ctxext.describe(again)["method"] == method
    ctxext.unpatch(again)
    assert again.config.max_position_embeddings == N
    assert [m.shape[-1] for m in _masks(again)] == [N, N]  # the masks of the original length again
    with torch.no_grad():
        ctxext.unpatch(model)
        torch.testing.assert_close(again(ids[:, :N]).logits, model(ids[:, :N]).logits, atol=0, rtol=0)


def test_nope_export_refuses_a_plain_load(model, tmp_path):
    ctxext.patch(model, "nope", factor=FACTOR)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="ctxext.from_pretrained"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
