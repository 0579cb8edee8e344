"""OPT-style learned tables (``embed_positions`` with an offset: OPT, BioGPT, BART-family decoders): each method
against a dense reference written here from its definition, cached decoding equal to a full pass, unpatch
bit-exact, refusals that leave the model untouched, and the native export round trip."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import ctxext
from ctxext.census import build_tiny
from ctxext.core.errors import PatchError

sys.path.insert(0, str(Path(__file__).parent))
from checks import pi_table_reference  # noqa: E402

N = 16  # max_position_embeddings of the census' tiny models (checked below)
MODELS = ("opt", "biogpt", "bart")


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    m = build_tiny(request.param).eval()
    yield m
    if ctxext.describe(m) is not None:
        ctxext.unpatch(m)


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 120, (2, length), generator=torch.Generator().manual_seed(seed))


def _table(m):
    return next(mod for name, mod in m.named_modules() if name.endswith("embed_positions"))


def _logits_with_table(m, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The unpatched model with its position table's weight replaced by ``table`` (the reference)."""
    emb = _table(m)
    original = emb.weight
    try:
        emb.weight = torch.nn.Parameter(table, requires_grad=False)
        with torch.no_grad():
            return m(ids).logits
    finally:
        emb.weight = original


def _pi_reference(weight: torch.Tensor, offset: int, factor: int) -> torch.Tensor:
    """PI from its definition on the position rows (the ``offset`` rows in front kept as they are)."""
    rows = pi_table_reference(weight[offset:], factor)
    return torch.cat([weight[:offset].double(), rows]).to(weight.dtype)


def test_detected_as_offset_table(model):
    assert ctxext.adapters.find_adapter(model).family == "offset-table"
    assert int(getattr(_table(model), "offset", 0)) == 2
    assert model.config.max_position_embeddings == N


def test_pi_matches_dense_definition_past_the_original_length(model):
    ids = _ids(3 * N)
    weight = _table(model).weight.detach().clone()
    expected = _logits_with_table(model, _pi_reference(weight, 2, 4), ids)
    ctxext.patch(model, "pi", 4)
    try:
        assert model.config.max_position_embeddings == 4 * N
        with torch.no_grad():
            got = model(ids).logits
    finally:
        ctxext.unpatch(model)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_extrapolate_is_the_original_model_inside_its_length(model):
    ids = _ids(N - 4)
    with torch.no_grad():
        before = model(ids).logits
    ctxext.patch(model, "extrapolate", 2)
    try:
        with torch.no_grad():
            inside = model(ids).logits
            model(_ids(2 * N))  # runs to the new length
    finally:
        ctxext.unpatch(model)
    assert torch.equal(inside, before)


def test_nope_equals_a_zero_table_and_runs_at_any_length(model):
    ids = _ids(N)
    weight = _table(model).weight
    expected = _logits_with_table(model, torch.zeros_like(weight), ids)
    ctxext.patch(model, "nope")
    try:
        with torch.no_grad():
            got = model(ids).logits
            assert model(_ids(5 * N)).logits.shape[1] == 5 * N
        assert ctxext.adapters.adapter_for(model).position_limit(model) is None
    finally:
        ctxext.unpatch(model)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method, factor", [("pi", 4), ("extrapolate", 4), ("nope", None), ("alibi", 4)])
def test_cached_decode_equals_full_pass_and_unpatch_is_bit_exact(model, method, factor):
    ids = _ids(N // 2)
    with torch.no_grad():
        before = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    table = _table(model)
    ctxext.patch(model, method, factor)
    try:
        long = _ids(2 * N, seed=3)
        with torch.no_grad():
            full = model(long).logits
            out = model(long[:, :-6], use_cache=True)
            cache, steps = out.past_key_values, []
            for i in range(6):
                out = model(long[:, -6 + i: long.shape[1] - 5 + i], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                steps.append(out.logits[:, -1])
        torch.testing.assert_close(torch.stack(steps, 1), full[:, -6:], atol=2e-5, rtol=1e-4)
        assert set(model.state_dict()) == set(state)  # the patch adds no saved tensor
    finally:
        ctxext.unpatch(model)
    assert _table(model) is table
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert model.config.max_position_embeddings == N


@pytest.mark.parametrize("method", ["ntk", "yarn", "self-extend"])
def test_rotary_methods_refused_with_nothing_changed(model, method):
    table = _table(model)
    with pytest.raises(PatchError, match="not rotary"):
        ctxext.patch(model, method, 4)
    assert _table(model) is table and ctxext.describe(model) is None
    assert model.config.max_position_embeddings == N


def test_limit_is_reported_and_exceeding_it_raises(model):
    ctxext.patch(model, "pi", 2)
    try:
        assert ctxext.adapters.adapter_for(model).position_limit(model) == 2 * N
        with pytest.raises(IndexError), torch.no_grad():
            model(_ids(2 * N + 1))
    finally:
        ctxext.unpatch(model)


@pytest.mark.parametrize("method", ["pi", "extrapolate"])
def test_native_export_loads_plainly_as_the_patched_model(model, method, tmp_path):
    ids = _ids(3 * N)
    ctxext.patch(model, method, 4)
    try:
        with torch.no_grad():
            patched = model(ids).logits
        model.save_pretrained(tmp_path)
    finally:
        ctxext.unpatch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert plain.config.max_position_embeddings == 4 * N
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, patched, atol=1e-5, rtol=0)
    again = ctxext.from_pretrained(tmp_path).eval()
    assert ctxext.describe(again)["method"] == method
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, patched, atol=1e-5, rtol=0)
    ctxext.unpatch(again)
    assert again.config.max_position_embeddings == N
    torch.testing.assert_close(_table(again).weight, _table(model).weight, atol=0, rtol=0)


def test_nope_export_refuses_a_plain_load(model, tmp_path):
    ctxext.patch(model, "nope")
    try:
        model.save_pretrained(tmp_path)
    finally:
        ctxext.unpatch(model)
    with pytest.raises(Exception, match="ctxext.from_pretrained"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_pretrained(tmp_path)
    again = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(again)["method"] == "nope"
