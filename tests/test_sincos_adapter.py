"""GPT-J / CodeGen (rotary sin-cos table per attention layer): the methods against the table computed from its
definition, cached decoding, bit-exact unpatch, refusals that touch nothing, saving."""

from __future__ import annotations

import json
import math

import pytest
import torch
from checks import generate_equals_full_forward

import ctxext
from ctxext import PatchError
from ctxext.adapters.sincos_table import table_modules
from ctxext.core.native_form import NoNativeForm

N = 32  # the tiny models' n_positions
FACTOR = 4


def tiny_gptj(seed: int = 0):
    """GPT-J with partial rotary (rotary_dim 8 of head_dim 16)."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(seed)
    config = GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=96, rotary_dim=8, n_positions=N,
                        bos_token_id=0, eos_token_id=1)
    return GPTJForCausalLM(config).eval()


def tiny_codegen(seed: int = 0):
    """CodeGen with full rotary (rotary_dim = head_dim 16) and an n_ctx alias of n_positions."""
    from transformers import CodeGenConfig, CodeGenForCausalLM

    torch.manual_seed(seed)
    config = CodeGenConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=96, rotary_dim=16, n_positions=N,
                           n_ctx=N, bos_token_id=0, eos_token_id=1)
    return CodeGenForCausalLM(config).eval()


MODELS = {"gptj": tiny_gptj, "codegen": tiny_codegen}
SUPPORTED = ["pi", "ntk", "yarn", "llama3", "nope", "extrapolate"]
REFUSED = ["dynamic-ntk", "alibi", "self-extend", "dca", "rerope", "lm-infinite", "streaming-llm", "string"]


def _ids(length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def _tables(model) -> list[torch.Tensor]:
    return [module.embed_positions for _, module in table_modules(model)]


def _dense_table(rows: int, dim: int, base: float = 10000.0, factor: float = 1.0) -> torch.Tensor:
    """The definition, in float64: row p = cat(sin, cos) of (p / factor) * base^(-2i/d)."""
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = (torch.arange(rows, dtype=torch.float64) / factor)[:, None] * inv_freq
    return torch.cat((angles.sin(), angles.cos()), dim=1).float()


def _with_table(model, table: torch.Tensor):
    for _, module in table_modules(model):
        module.embed_positions = table.clone()
    return model


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", list(MODELS))
def test_is_detected_by_its_tables(family):
    model = MODELS[family]()
    assert len(table_modules(model)) == 2
    assert ctxext.available_methods(model) == {m: ["sincos"] for m in SUPPORTED}


# ---------------------------------------------------------------- parity with the definition


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("method", ["pi", "ntk"])
def test_patched_logits_equal_the_table_from_its_definition(family, method):
    """pi: positions / factor; ntk: base * factor^(d/(d-2)); checked over 4x the original length."""
    model = MODELS[family]()
    dim = _tables(model)[0].shape[1]
    if method == "pi":
        expected = _dense_table(FACTOR * N, dim, factor=FACTOR)
    else:
        expected = _dense_table(FACTOR * N, dim, base=10000.0 * FACTOR ** (dim / (dim - 2)))
    reference = _with_table(MODELS[family](), expected)
    ctxext.patch(model, method, FACTOR)
    assert model.config.n_positions == FACTOR * N and all(t.shape == (FACTOR * N, dim) for t in _tables(model))
    torch.testing.assert_close(_tables(model)[0], expected, atol=2e-6, rtol=0)
    ids = _ids(FACTOR * N)
    patched, ref = _logits(model, ids), _logits(reference, ids)
    torch.testing.assert_close(patched, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("family", list(MODELS))
def test_yarn_attention_factor_scales_sin_and_cos(family):
    """Every (sin, cos) pair of the yarn table has length mscale = 0.1 ln(factor) + 1, as transformers scales cos and
    sin by attention_scaling; nope's table is sin 0, cos 1."""
    model = MODELS[family]()
    ctxext.patch(model, "yarn", FACTOR)
    table = _tables(model)[0].double()
    half = table.shape[1] // 2
    radius = (table[:, :half] ** 2 + table[:, half:] ** 2).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, 0.1 * math.log(FACTOR) + 1), atol=1e-6, rtol=0)
    ctxext.unpatch(model)
    ctxext.patch(model, "nope")
    table = _tables(model)[0]
    assert table.shape[0] >= N and not table[:, :half].any() and bool((table[:, half:] == 1).all())


@pytest.mark.parametrize("family", list(MODELS))
def test_changes_the_logits_and_extrapolate_does_not(family):
    model = MODELS[family]()
    ids = _ids(N)
    base = _logits(model, ids)
    for method in ("pi", "ntk", "yarn", "llama3", "nope"):
        with ctxext.patched(model, method, FACTOR):
            assert (_logits(model, ids) - base).abs().max() > 1e-4, method
    with ctxext.patched(model, "extrapolate", FACTOR):
        assert torch.equal(_logits(model, ids), base)
        assert model.config.n_positions == FACTOR * N and _logits(model, _ids(FACTOR * N)).shape[1] == FACTOR * N


# ---------------------------------------------------------------- cached decoding


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("method", SUPPORTED)
def test_token_by_token_decoding_with_a_cache_equals_the_full_pass(family, method):
    model = ctxext.patch(MODELS[family](), method, FACTOR)
    ids = _ids(3 * N, seed=5)  # past the original length
    full = _logits(model, ids)
    prefill = N // 2
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(MODELS))
def test_generate_past_the_original_length_equals_the_full_pass(family):
    model = ctxext.patch(MODELS[family](), "pi", FACTOR)
    generate_equals_full_forward(model, prompt_len=N + 8, new=N)  # ends at 2.25x the original length


# ---------------------------------------------------------------- unpatch, identity, refusals


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("method", SUPPORTED)
def test_unpatch_is_bit_exact(family, method):
    model = MODELS[family]()
    ids = _ids(N)
    logits, config = _logits(model, ids), model.config.to_dict()
    state = model.state_dict()
    tables = _tables(model)
    ctxext.patch(model, method, FACTOR)
    assert list(model.state_dict()) == list(state)  # the tables are not in the state dict
    assert ctxext.describe(model)["family"] == "sincos"
    ctxext.unpatch(model)
    assert all(a is b for a, b in zip(_tables(model), tables, strict=True))
    assert torch.equal(_logits(model, ids), logits) and model.config.to_dict() == config
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("method", ["pi", "ntk", "yarn", "llama3", "extrapolate"])
def test_factor_one_is_the_identity(family, method):
    model = MODELS[family]()
    ids = _ids(N)
    base, tables = _logits(model, ids), [t.clone() for t in _tables(model)]
    ctxext.patch(model, method, 1)
    assert all(torch.equal(a, b) for a, b in zip(_tables(model), tables))
    assert torch.equal(_logits(model, ids), base)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("method", REFUSED)
def test_refused_methods_leave_the_model_untouched(family, method):
    model = MODELS[family]()
    config, tables = model.config.to_dict(), _tables(model)
    with pytest.raises(PatchError, match="does not fit"):
        ctxext.patch(model, method, 2)
    assert model.config.to_dict() == config and ctxext.describe(model) is None
    assert all(a is b for a, b in zip(_tables(model), tables, strict=True))


def test_replace_starts_from_the_original_table():
    model = tiny_gptj()
    ids = _ids(3 * N)
    tables = _tables(model)
    ctxext.patch(model, "pi", 2)
    ctxext.patch(model, "ntk", 3, replace=True)
    assert ctxext.describe(model)["method"] == "ntk" and model.config.n_positions == 3 * N
    assert torch.equal(_logits(model, ids), _logits(ctxext.patch(tiny_gptj(), "ntk", 3), ids))
    ctxext.unpatch(model)
    assert all(a is b for a, b in zip(_tables(model), tables, strict=True)) and model.config.n_positions == N


def test_a_table_of_another_base_is_refused():
    """The methods start from GPT-J's frequencies (base 10000): a table built otherwise is not patched."""
    model = _with_table(tiny_gptj(), _dense_table(N, 8, base=500.0))
    config, tables = model.config.to_dict(), _tables(model)
    with pytest.raises(PatchError, match="not GPT-J's"):
        ctxext.patch(model, "pi", 2)
    assert model.config.to_dict() == config and all(a is b for a, b in zip(_tables(model), tables))


def test_codegen_n_ctx_is_kept_in_step():
    model = tiny_codegen()
    ctxext.patch(model, "pi", 2.5)
    assert model.config.n_positions == model.config.n_ctx == 80 and _tables(model)[0].shape[0] == 80
    ctxext.unpatch(model)
    assert model.config.n_positions == model.config.n_ctx == N


def test_position_limit_is_the_table_rows():
    from ctxext.adapters import adapter_for

    model = tiny_gptj()
    assert adapter_for(model).position_limit(model) == N
    ctxext.patch(model, "yarn", 3)
    assert adapter_for(model).position_limit(model) == 3 * N


# ---------------------------------------------------------------- saving


@pytest.mark.parametrize("family", list(MODELS))
def test_a_saved_patch_has_no_native_form_and_plain_loading_fails(tmp_path, family):
    from transformers import AutoModelForCausalLM

    from ctxext.export import native_form

    model = ctxext.patch(MODELS[family](), "pi", FACTOR)
    with pytest.raises(NoNativeForm, match="no transformers-native form"):
        native_form(model)
    ids = _ids(FACTOR * N)
    patched = _logits(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "ctxext.from_pretrained(path)" in saved["model_type"] and "saved_as" not in saved["ctxext"]
    with pytest.raises(Exception, match=r"ctxext\.from_pretrained\(path\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(loaded) == ctxext.describe(model)
    assert torch.equal(_logits(loaded, ids), patched)
    ctxext.unpatch(loaded)
    assert loaded.config.n_positions == N and _tables(loaded)[0].shape[0] == N


def test_extrapolate_saves_natively(tmp_path):
    from transformers import AutoModelForCausalLM

    model = ctxext.patch(tiny_gptj(), "extrapolate", FACTOR)
    ids = _ids(FACTOR * N)
    patched = _logits(model, ids)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["ctxext"]["saved_as"] == "native"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(_logits(plain, ids), patched) and plain.config.n_positions == FACTOR * N
