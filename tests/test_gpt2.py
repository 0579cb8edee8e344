"""GPT-2 (learned absolute positions): the wpe table rules, the advertised length, decoding, unpatch, bad input."""

from __future__ import annotations

import pytest
import torch
from checks import causal, generate_equals_full_forward, padded_batch_equals_single_rows, patch_survives_save_and_reload
from conftest import tiny_gpt2

import ctxext
from ctxext import PatchError
from ctxext.adapters.gpt2 import PositionTable
from ctxext.methods.positions import extend_table, interpolate_table

N = 32  # the tiny model's n_positions


@pytest.fixture
def ids():
    return torch.randint(0, 128, (1, N), generator=torch.Generator().manual_seed(3))


def _state(model, ids):
    return model(ids).logits, model.config.to_dict()


# ---------------------------------------------------------------- the table rules (pure functions)


def test_interpolation_rule():
    w = torch.randn(N, 6)
    t = interpolate_table(w, 2.5)
    assert t.shape == (80, 6) and t.dtype == w.dtype
    for j in range(80):
        p = min(j / 2.5, N - 1)
        lo = int(p)
        hi = min(lo + 1, N - 1)
        expected = w[lo].double() * (1 - (p - lo)) + w[hi].double() * (p - lo)
        torch.testing.assert_close(t[j].double(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("factor", [2, 3, 4])
def test_interpolation_with_integer_factor_keeps_original_rows(factor):
    w = torch.randn(N, 6)
    t = interpolate_table(w, factor)
    assert t.shape[0] == factor * N
    assert torch.equal(t[::factor], w)
    torch.testing.assert_close(t[1:-factor:factor], w[:-1] + (w[1:] - w[:-1]) / factor)
    assert torch.equal(t[-factor:], w[-1].expand(factor, -1))  # past position n - 1: the last row


def test_extension_rule():
    w = torch.randn(N, 6)
    t = extend_table(w, 2.5)
    assert t.shape == (80, 6)
    assert torch.equal(t[:N], w) and torch.equal(t[N:], w[-1].expand(80 - N, -1))


@pytest.mark.parametrize("rule", [interpolate_table, extend_table])
def test_factor_one_table_is_bit_exact(rule):
    w = torch.randn(N, 6)
    assert torch.equal(rule(w, 1.0), w)


# ---------------------------------------------------------------- the adapter


@pytest.mark.parametrize("method", ["pi", "extrapolate"])
def test_factor_one_patch_equals_original_exactly(gpt2, ids, method):
    logits, _ = _state(gpt2, ids)
    ctxext.patch(gpt2, method, 1)
    assert torch.equal(gpt2(ids).logits, logits)


def test_pi_uses_the_interpolated_table(gpt2, ids):
    original = gpt2.transformer.wpe.weight.detach().clone()
    ctxext.patch(gpt2, "pi", 2)
    wpe = gpt2.transformer.wpe
    assert isinstance(wpe, PositionTable) and wpe.table.shape == (2 * N, original.shape[1])
    assert torch.equal(wpe.table, interpolate_table(original, 2))
    # position 2i of the patched model is position i of the original
    positions = torch.arange(N)[None]
    assert torch.equal(wpe(2 * positions), original[positions])


def test_extrapolate_is_exact_within_the_original_length(gpt2, ids):
    logits, _ = _state(gpt2, ids)
    ctxext.patch(gpt2, "extrapolate", 4)
    assert gpt2.config.n_positions == 4 * N
    assert torch.equal(gpt2(ids).logits, logits)
    long = torch.randint(0, 128, (1, 3 * N))
    assert torch.isfinite(gpt2(long).logits).all()


@pytest.mark.parametrize("method,factor", [("pi", 4), ("pi", 2.5), ("extrapolate", 4), ("alibi", 2), ("nope", 2)])
def test_unpatch_restores_table_config_and_logits_bit_exact(gpt2, ids, method, factor):
    logits, config = _state(gpt2, ids)
    wpe = gpt2.transformer.wpe
    keys = list(gpt2.state_dict())
    ctxext.patch(gpt2, method, factor)
    assert gpt2.config.n_positions == gpt2.config.max_position_embeddings == int(round(factor * N))
    assert list(gpt2.state_dict()) == keys  # the checkpoint layout does not change while patched
    assert torch.equal(gpt2.state_dict()["transformer.wpe.weight"], wpe.weight)
    ctxext.unpatch(gpt2)
    assert gpt2.transformer.wpe is wpe and wpe.weight.shape == (N, 48)
    assert torch.equal(gpt2(ids).logits, logits)
    assert gpt2.config.to_dict() == config


@pytest.mark.parametrize("method,factor", [("pi", 4), ("pi", 2.5), ("extrapolate", 4)])
def test_generate_past_old_n_positions_equals_full_forward(method, factor):
    model = tiny_gpt2()
    with pytest.raises(IndexError):  # the unpatched model cannot read position 32
        model(torch.zeros(1, N + 1, dtype=torch.long))
    ctxext.patch(model, method, factor)
    sequence = generate_equals_full_forward(model, prompt_len=20, new=2 * N)
    assert sequence.shape[1] == 20 + 2 * N > N


def test_generate_runs_past_the_advertised_length():
    """Positions past the patched table are clamped to its last row instead of raising."""
    model = tiny_gpt2()
    ctxext.patch(model, "pi", 2)
    generate_equals_full_forward(model, prompt_len=20, new=3 * N)


def test_lm_eval_reads_the_patched_length(gpt2):
    utils = pytest.importorskip("lm_eval.models.utils")
    assert utils.resolve_max_length(gpt2.config) == N
    ctxext.patch(gpt2, "pi", 4)
    assert utils.resolve_max_length(gpt2.config) == 4 * N
    ctxext.unpatch(gpt2)
    assert utils.resolve_max_length(gpt2.config) == N


def test_n_ctx_of_older_configs_kept_in_step():
    model = tiny_gpt2()
    model.config.n_ctx = N
    ctxext.patch(model, "pi", 2)
    assert model.config.n_ctx == 2 * N
    ctxext.unpatch(model)
    assert model.config.n_ctx == N


@pytest.mark.parametrize("method,factor", [("pi", 4), ("extrapolate", 2)])
def test_padded_batch_equals_single_rows(method, factor):
    model = tiny_gpt2()
    ctxext.patch(model, method, factor)
    padded_batch_equals_single_rows(model, lengths=(70, 41, 5))


def test_causal_masking_intact():
    model = tiny_gpt2()
    ctxext.patch(model, "pi", 4)
    causal(model, length=90, cut=40)


@pytest.mark.parametrize("method,factor", [("pi", 2.5), ("extrapolate", 3), ("nope", None)])
def test_patch_survives_save_and_reload(tmp_path, method, factor):
    model = tiny_gpt2()
    short = torch.randint(0, 128, (1, N), generator=torch.Generator().manual_seed(8))
    long = torch.randint(0, 128, (1, 2 * N), generator=torch.Generator().manual_seed(8))
    loaded = patch_survives_save_and_reload(model, tmp_path, method, factor, long, unpatched_ids=short)
    assert loaded.config.n_positions == N and loaded.transformer.wpe.weight.shape[0] == N


def test_replace_switches_methods(gpt2, ids):
    logits, config = _state(gpt2, ids)
    ctxext.patch(gpt2, "pi", 4)
    ctxext.patch(gpt2, "alibi", 2, replace=True)
    assert gpt2.config.n_positions == 2 * N and gpt2.config._attn_implementation == "ctxext_alibi"
    ctxext.unpatch(gpt2)
    assert torch.equal(gpt2(ids).logits, logits) and gpt2.config.to_dict() == config


BAD = [
    (("ntk", 4), {}, r"method 'ntk' does not fit GPT2LMHeadModel \(GPT-2 \(learned absolute\)\): not rotary\. "
     r"Methods that do: pi, alibi, nope, extrapolate"),
    (("yarn", 4), {}, r"not rotary"),
    (("dynamic-ntk", 4), {}, r"not rotary"),
    (("pi",), {}, r"needs a factor"),
    (("pi", 0.5), {}, r"factor must be >= 1"),
    (("pi", float("nan")), {}, r"finite"),
    (("extrapolate", "x"), {}, r"factor must be a number"),
    (("pi", 2), {"beta_fast": 3}, r"unknown option\(s\) beta_fast for method 'pi'"),
    (("alibi",), {"slope": 1}, r"unknown option\(s\) slope for method 'alibi'; accepted: none"),
]


@pytest.mark.parametrize("args,options,message", BAD)
def test_bad_input_raises_clearly_and_leaves_model_untouched(gpt2, ids, args, options, message):
    logits, config = _state(gpt2, ids)
    wpe = gpt2.transformer.wpe
    with pytest.raises(PatchError, match=message):
        ctxext.patch(gpt2, *args, **options)
    assert gpt2.transformer.wpe is wpe
    assert torch.equal(gpt2(ids).logits, logits)
    assert gpt2.config.to_dict() == config and ctxext.describe(gpt2) is None


def test_failure_midway_leaves_nothing_behind(gpt2, ids, monkeypatch):
    from ctxext.adapters import gpt2 as adapter

    logits, config = _state(gpt2, ids)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure after the table swap")

    monkeypatch.setattr(adapter, "use_attention", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        ctxext.patch(gpt2, "alibi", 2)
    assert type(gpt2.transformer.wpe) is torch.nn.Embedding
    assert torch.equal(gpt2(ids).logits, logits)
    assert gpt2.config.to_dict() == config and ctxext.describe(gpt2) is None


def test_available_methods_for_gpt2(gpt2):
    assert set(ctxext.available_methods(gpt2)) == {"pi", "alibi", "nope", "extrapolate"}
