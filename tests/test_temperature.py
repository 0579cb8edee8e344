"""Attention temperature by position (``temperature=logn|llama4|ssmax``) on every rotary method.

The references are written here from each form's source (Qwen 1's ``logn_list``, transformers' Ministral 3 formula,
the SSMax paper's ``s log n``) and a dense attention that scales each query's logits by it; the frequency methods are
compared with the same patch without a temperature under that dense attention, the remap methods with the dense
paper reference of ``test_remap.py`` under the same scaling.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from checks import generate_equals_full_forward, padded_batch_equals_single_rows
from conftest import tiny_gpt2, tiny_llama

import ctxext
from ctxext import PatchError
from ctxext.attention import use_attention
from ctxext.evaluation.requests import parse_methods
from ctxext.methods.temperature import Temperature

L0 = 64  # tiny_llama's trained length


# -- the forms, from their sources ------------------------------------------------------------------------------------


def qwen_logn(p: int, L: int) -> float:
    """Qwen 1 (modeling_qwen.py): logn_list[i] = log(i, seq_length) if i > seq_length else 1, i = 1 ... (the query at
    0-based position p reads entry p + 1)."""
    i = p + 1
    return math.log(i, L) if i > L else 1.0


def ministral_llama4(p: int, beta: float, floor: int) -> float:
    """transformers' get_llama_4_attn_scale: 1 + beta * log(1 + floor(pos / max_position_embeddings))."""
    return 1 + beta * math.log(1 + math.floor(p / floor))


def ssmax(p: int, s: float) -> float:
    """SSMax (arXiv 2501.19399): logits times s * log(n), n the keys attended (p + 1 under causal attention)."""
    return s * math.log(p + 1)


def reference_factor(options: dict, p: int) -> float:
    form = options["temperature"]
    if form == "logn":
        return qwen_logn(p, L0)
    if form == "llama4":
        return ministral_llama4(p, options.get("beta", 0.1), options.get("floor", L0))
    return ssmax(p, options.get("s", 1 / math.log(L0)))


@pytest.mark.parametrize("options", [
    {"temperature": "logn"},
    {"temperature": "llama4"},
    {"temperature": "llama4", "beta": 0.3, "floor": 16},
    {"temperature": "ssmax"},
    {"temperature": "ssmax", "s": 0.4},
])
def test_factors_follow_their_sources(options):
    temperature = Temperature.from_options(options, L0)
    p = torch.arange(0, 1000)
    expected = torch.tensor([reference_factor(options, int(i)) for i in p], dtype=torch.float64)
    torch.testing.assert_close(temperature(p).double(), expected, atol=1e-6, rtol=1e-6)


def test_the_llama4_form_is_transformers_own_where_it_ships():
    modeling = pytest.importorskip("transformers.models.ministral3.modeling_ministral3")
    # public from 5.x releases after 5.0.0, which names it _get_llama_4_attn_scale
    function = getattr(modeling, "get_llama_4_attn_scale", None) or getattr(modeling, "_get_llama_4_attn_scale")
    p = torch.arange(0, 700)[None]
    theirs = function(p, 0.25, 48).flatten()
    ours = Temperature.from_options({"temperature": "llama4", "beta": 0.25, "floor": 48}, L0)(p).flatten()
    torch.testing.assert_close(ours, theirs.float(), atol=1e-6, rtol=0)


# -- a dense reference attention ----------------------------------------------------------------------------------------


class DenseTemperature:
    """Causal attention written out (float64) with each query's logits times the reference factor of its position;
    q and k arrive rotated (frequency methods rotate in the rotary module)."""

    name = "ctxext_test_dense_temperature"
    options: dict = {}

    @classmethod
    def forward(cls, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        b, h, t, _ = query.shape
        assert key.shape[2] == t and attention_mask is None  # full passes without padding only
        key = key.repeat_interleave(h // key.shape[1], dim=1).double()
        value = value.repeat_interleave(h // value.shape[1], dim=1).double()
        factor = torch.tensor([reference_factor(cls.options, p) for p in range(t)], dtype=torch.float64)
        scores = query.double() @ key.transpose(-1, -2) * scaling * factor[:, None]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        return (scores.softmax(-1) @ value).transpose(1, 2).to(query.dtype).contiguous(), None


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DenseTemperature.name, DenseTemperature.forward)
    AttentionMaskInterface.register(DenseTemperature.name, sdpa_mask)


_register()


def _ids(length, seed=1, batch=1):
    return torch.randint(2, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


FREQUENCY_CASES = [
    ("yarn", 4, {"temperature": "logn"}),
    ("pi", 4, {"temperature": "llama4", "floor": 16}),
    ("ntk", 4, {"temperature": "ssmax"}),
    ("extrapolate", 4, {"temperature": "llama4", "beta": 0.5, "floor": 32}),
    ("dynamic-ntk", 4, {"temperature": "logn"}),
]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("method,factor,options", FREQUENCY_CASES)
def test_frequency_methods_match_the_dense_reference(method, factor, options, implementation):
    model = tiny_llama(attn_implementation=implementation)
    ids = _ids(200)
    ctxext.patch(model, method, factor, **options)
    with torch.no_grad():
        ours = model(ids).logits
    ctxext.unpatch(model)
    ctxext.patch(model, method, factor)  # the same frequencies, no temperature: the dense attention adds it
    DenseTemperature.options = options
    back = use_attention(model, DenseTemperature.name)
    with torch.no_grad():
        reference = model(ids).logits
    back()
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    # the temperature changes the model past the trained length, by far more than the tolerance above
    assert (ours - model(ids).logits).abs().max() > 1e-4


REMAP_CASES = [
    ("self-extend", None, {"temperature": "logn"}),
    ("dca", None, {"temperature": "ssmax", "s": 0.3}),
    ("rerope", 4, {"temperature": "llama4", "floor": 16}),  # stacked on ReRoPE's own log scaling
    ("streaming-llm", None, {"temperature": "logn"}),
]


def _dense_remap_with_temperature(model, method, factor, options, ids):
    """test_remap's dense reference of the map (from the papers), its queries scaled by the reference factor."""
    import test_remap

    own = {k: v for k, v in options.items() if k not in ("temperature", "beta", "floor", "s")}
    name = "ctxext_test_dense_remap_temperature"

    def forward(module, query, key, value, attention_mask, **kw):
        t = query.shape[2]
        factor_ = torch.tensor([reference_factor(options, p) for p in range(t)], dtype=query.dtype)
        return test_remap.Dense.forward(module, query * factor_[None, None, :, None], key, value, attention_mask, **kw)

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    restore, back = test_remap._with_dense(model, method, factor, own)
    back()
    back = use_attention(model, name)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        back()
        restore()


@pytest.mark.parametrize("method,factor,options", REMAP_CASES)
def test_remap_methods_match_the_dense_reference(method, factor, options):
    model = tiny_llama()
    ids = _ids(200)
    reference = _dense_remap_with_temperature(model, method, factor, options, ids)
    ctxext.patch(model, method, factor, **options)
    with torch.no_grad():
        ours = model(ids).logits
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    ctxext.unpatch(model)
    ctxext.patch(model, method, factor)
    with torch.no_grad():
        assert (ours - model(ids).logits).abs().max() > 1e-4


# -- identity settings, decoding, padding, undo --------------------------------------------------------------------------


def test_logn_within_the_trained_length_is_the_unpatched_model():
    model = tiny_llama()
    ids = _ids(L0)
    with torch.no_grad():
        before = model(ids).logits
        ctxext.patch(model, "extrapolate", 1, temperature="logn")
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("method,factor", [("yarn", 4), ("self-extend", None)])
def test_llama4_with_beta_zero_is_the_method_alone(method, factor):
    model = tiny_llama()
    ids = _ids(200)
    with torch.no_grad():
        ctxext.patch(model, method, factor)
        alone = model(ids).logits
        ctxext.patch(model, method, factor, replace=True, temperature="llama4", beta=0.0)
        torch.testing.assert_close(model(ids).logits, alone, atol=1e-6, rtol=0)


DECODE_CASES = [
    ("yarn", 4, {"temperature": "logn"}),
    ("extrapolate", 4, {"temperature": "llama4", "floor": 8, "beta": 0.5}),
    ("self-extend", None, {"temperature": "ssmax"}),
]


@pytest.mark.parametrize("method,factor,options", DECODE_CASES)
def test_cached_generate_equals_a_full_forward(method, factor, options):
    model = ctxext.patch(tiny_llama(), method, factor, **options)
    with torch.no_grad():
        generate_equals_full_forward(model, prompt_len=70, new=12)  # the factor grows at every new position


@pytest.mark.parametrize("method,factor,options", DECODE_CASES)
def test_padded_batch_equals_single_rows(method, factor, options):
    model = ctxext.patch(tiny_llama(), method, factor, **options)
    with torch.no_grad():
        padded_batch_equals_single_rows(model, lengths=(150, 90))


@pytest.mark.parametrize("method,factor,options", FREQUENCY_CASES[:2] + REMAP_CASES[:2])
def test_unpatch_is_bit_exact(method, factor, options):
    model = tiny_llama()
    ids = _ids(150)
    implementation = model.config._attn_implementation
    with torch.no_grad():
        before = model(ids).logits
        ctxext.patch(model, method, factor, **options)
        ctxext.unpatch(model)
        assert torch.equal(model(ids).logits, before)
    assert model.config._attn_implementation == implementation
    assert not any(hasattr(m, "_ctxext_temperature") for m in model.modules())


def test_a_copy_carries_its_own_temperature():
    model = ctxext.patch(tiny_llama(), "yarn", 4, temperature="logn")
    ids = _ids(150)
    with torch.no_grad():
        patched = model(ids).logits
        twin = copy.deepcopy(model)
        ctxext.unpatch(twin)
        assert torch.equal(model(ids).logits, patched)
        assert not torch.equal(twin(ids).logits, patched)


def test_describe_and_save_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    model = ctxext.patch(tiny_llama(), "yarn", 4, temperature="llama4", floor=16)
    assert ctxext.describe(model)["options"]["temperature"] == "llama4"
    ids = _ids(150)
    with torch.no_grad():
        patched = model(ids).logits
    model.save_pretrained(tmp_path)
    # yarn alone would save as transformers' own rope type; the temperature has no native form: refused, not dropped
    with pytest.raises(ValueError, match=r"ctxext\.from_pretrained\(path\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(loaded) == ctxext.describe(model)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, patched)


# -- refusals: a clear error, nothing changed ----------------------------------------------------------------------------


@pytest.mark.parametrize("build,method,factor,options,match", [
    (tiny_gpt2, "pi", 2, {"temperature": "logn"}, "rotary family"),
    (tiny_llama, "alibi", None, {"temperature": "logn"}, "takes no temperature"),
    (tiny_llama, "nope", None, {"temperature": "ssmax"}, "takes no temperature"),
    (tiny_llama, "yarn", 4, {"temperature": "cold"}, "choose one of logn, llama4, ssmax"),
    (tiny_llama, "yarn", 4, {"beta": 0.2}, "unknown option.*give temperature="),
    (tiny_llama, "yarn", 4, {"temperature": "logn", "s": 0.2}, "does not apply to temperature=logn"),
    (tiny_llama, "yarn", 4, {"temperature": "llama4", "beta": -1}, "must be >= 0"),
    (tiny_llama, "yarn", 4, {"temperature": "llama4", "floor": 0.5}, "whole number"),
    (tiny_llama, "yarn", 4, {"temperature": "ssmax", "s": 0}, "must be > 0"),
    (tiny_llama, "yarn", 4, {"temperature": "ssmax", "s": "x"}, "must be a number"),
])
def test_bad_temperatures_are_refused_with_nothing_changed(build, method, factor, options, match):
    model = build()
    ids = _ids(20)
    implementation = model.config._attn_implementation
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(PatchError, match=match):
        ctxext.patch(model, method, factor, **options)
    assert ctxext.describe(model) is None
    assert model.config._attn_implementation == implementation
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_eval_takes_a_temperature_as_an_option_and_labels_it():
    requests = parse_methods("none,yarn:4,self-extend", factor=None, options=["temperature=logn"])
    assert [r.label for r in requests] == ["none", "yarn x4 +logn", "self-extend +logn"]
    with pytest.raises(ValueError, match="apply to none"):
        parse_methods("none,alibi", factor=None, options=["temperature=logn"])


def test_eval_none_takes_a_temperature_by_name_only():
    """``none.temperature=...`` gives the unpatched model a temperature; a global ``temperature=`` leaves the
    baseline as loaded; ``none`` takes nothing else."""
    requests = parse_methods("none,yarn:4", factor=None, options=["none.temperature=logn", "temperature=ssmax"])
    assert [r.label for r in requests] == ["none +logn", "yarn x4 +ssmax"]
    assert requests[0].patch_call() == ("extrapolate", 1.0, {"temperature": "logn"})
    assert parse_methods("none", factor=None, options=[])[0].patch_call() is None
    with pytest.raises(ValueError, match="apply to none of the methods"):
        parse_methods("none", factor=None, options=["temperature=logn"])
    with pytest.raises(ValueError, match="takes only an attention temperature.*not beta_fast"):
        parse_methods("none", factor=None, options=["none.beta_fast=3"])
    with pytest.raises(ValueError, match="not among --methods"):
        parse_methods("yarn:4", factor=None, options=["none.temperature=logn"])
    with pytest.raises(ValueError, match="none.beta: parameters of an attention temperature; give none.temperature"):
        parse_methods("none", factor=None, options=["none.beta=0.3"])


def test_eval_none_with_a_temperature_scores_the_model_as_loaded_plus_the_temperature(tmp_path):
    """Rows of ``none +logn``: equal to the unpatched model up to the trained length (logn is 1 there), different
    past it, with the temperature recorded in the row's spec (on the model's own frequencies and length)."""
    import json

    from test_eval_fixtures import CORPUS, save_tiny_llama

    from ctxext.cli import main

    model_dir = save_tiny_llama(tmp_path / "llama")
    rows = {}
    for name, option in (("plain", []), ("logn", ["--option", "none.temperature=logn"])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--no-progress", "--device", "cpu", "--model", str(model_dir), "--data", str(CORPUS),
                     "--lengths", f"{L0},{2 * L0}", "--methods", "none", *option, "--max-windows", "2",
                     "--output", str(out)]) == 0
        rows[name] = {r["length"]: r for r in json.loads(out.read_text())["results"]}
    assert {r["label"] for r in rows["logn"].values()} == {"none +logn"}
    assert rows["logn"][L0]["nll_sum"] == rows["plain"][L0]["nll_sum"]  # logn is exactly 1 up to the trained length
    far_plain, far_logn = rows["plain"][2 * L0]["nll_sum"], rows["logn"][2 * L0]["nll_sum"]
    assert far_logn != far_plain  # (the tiny random model's attention is near uniform: a small but real change)
    # the same numbers as extrapolate x1 (the model's own frequencies and length) with the temperature
    out = tmp_path / "extrapolate.json"
    assert main(["eval", "--no-progress", "--device", "cpu", "--model", str(model_dir), "--data", str(CORPUS),
                 "--lengths", f"{L0},{2 * L0}", "--methods", "extrapolate:1", "--option", "temperature=logn",
                 "--max-windows", "2", "--output", str(out)]) == 0
    by_hand = {r["length"]: r["nll_sum"] for r in json.loads(out.read_text())["results"]}
    assert by_hand == {n: r["nll_sum"] for n, r in rows["logn"].items()}
    spec = rows["logn"][2 * L0]["spec"]
    assert spec["options"] == {"temperature": "logn"} and spec["factor"] == 1 and spec["patched_length"] == L0


def test_eval_none_with_a_temperature_is_refused_before_loading_where_the_family_takes_none(tmp_path, capsys):
    from test_eval_fixtures import CORPUS, save_tiny_gpt2

    from ctxext.cli import main

    model_dir = save_tiny_gpt2(tmp_path / "gpt2")
    out = tmp_path / "r.json"
    assert main(["eval", "--no-progress", "--device", "cpu", "--model", str(model_dir), "--data", str(CORPUS),
                 "--lengths", "64", "--methods", "none", "--option", "none.temperature=logn", "--output",
                 str(out)]) != 0
    err = capsys.readouterr().err
    assert "temperature=logn does not fit GPT2LMHeadModel" in err and "Traceback" not in err
    assert not out.exists()


# -- models that ship a temperature keep it -------------------------------------------------------------------------------


def _ministral3(beta: float):
    """A tiny Ministral 3 as the checkpoints ship it (YaRN over an original length, llama_4_scaling_beta), the
    temperature acting from position 64 on."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Ministral3ForCausalLM"):
        pytest.skip("this transformers has no Ministral 3")
    torch.manual_seed(0)
    config = transformers.Ministral3Config(
        vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4 * L0, attn_implementation="sdpa",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": L0, "llama_4_scaling_beta": beta})
    return transformers.Ministral3ForCausalLM(config).eval()


SHIPPED_CASES = [("pi", 4), ("ntk", 4), ("dynamic-ntk", 4), ("yarn", 4), ("llama3", 4), ("extrapolate", 4),
                 ("self-extend", None), ("dca", None), ("rerope", 4), ("lm-infinite", None), ("streaming-llm", None),
                 ("string", None)]


@pytest.mark.parametrize("method,factor", SHIPPED_CASES)
def test_a_shipped_llama4_temperature_is_kept_as_transformers_computes_it(method, factor):
    """Ministral 3 scales its queries by transformers' get_llama_4_attn_scale over the shipped original length,
    inside its attention module. Under every method that patches it, the model equals the same weights with the
    shipped temperature off (beta 0) and the same temperature given to ctxext (whose factors equal transformers'
    function, tested above): the patch neither drops it nor moves the length it divides by."""
    ids = _ids(5 * L0)
    shipped = ctxext.patch(_ministral3(0.3), method, factor)
    rope_before = dict(_ministral3(0.3).config.rope_parameters)
    assert {k: shipped.config.rope_parameters[k] for k in rope_before} == rope_before
    reference = ctxext.patch(_ministral3(0.0), method, factor, temperature="llama4", beta=0.3, floor=L0)
    with torch.no_grad():
        ours = shipped(ids).logits
        torch.testing.assert_close(ours, reference(ids).logits, atol=1e-5, rtol=0)
        # and the temperature acts here: without it the logits differ
        assert (ours - ctxext.patch(_ministral3(0.0), method, factor)(ids).logits).abs().max() > 1e-4


def test_a_native_export_of_a_model_with_a_shipped_temperature_keeps_it(tmp_path):
    from transformers import AutoModelForCausalLM

    model = ctxext.patch(_ministral3(0.3), "extrapolate", 4)  # written natively: the longer length alone
    ids = _ids(5 * L0)
    with torch.no_grad():
        patched = model(ids).logits
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert plain.config.rope_parameters["llama_4_scaling_beta"] == 0.3
    assert plain.config.rope_parameters["original_max_position_embeddings"] == L0
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, patched, atol=1e-5, rtol=0)


def test_a_llama4_temperature_exports_natively_where_the_model_reads_its_beta(tmp_path):
    """On a model whose attention reads llama_4_scaling_beta (Ministral 3) shipped with beta 0, temperature=llama4
    floored at its original length saves as that beta: plain transformers gives the patched logits, ctxext reloads
    the patch (the temperature applied once), and unpatch gives the model as shipped."""
    from transformers import AutoModelForCausalLM

    from ctxext.export import check_native

    model = ctxext.patch(_ministral3(0.0), "extrapolate", 4, temperature="llama4", beta=0.3, floor=L0)
    assert check_native(model) is None
    ids = _ids(5 * L0)
    with torch.no_grad():
        patched = model(ids).logits
        shipped = _ministral3(0.0)(ids).logits
    assert (patched - shipped).abs().max() > 1e-4  # the temperature acts past the floor
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert plain.config.rope_parameters["llama_4_scaling_beta"] == 0.3
    loaded = ctxext.from_pretrained(tmp_path).eval()
    assert ctxext.describe(loaded)["options"] == {"temperature": "llama4", "beta": 0.3, "floor": L0}
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, patched, atol=1e-5, rtol=0)
        torch.testing.assert_close(loaded(ids).logits, patched, atol=1e-5, rtol=0)
        ctxext.unpatch(loaded)
        assert loaded.config.rope_parameters["llama_4_scaling_beta"] == 0.0
        torch.testing.assert_close(loaded(ids).logits, shipped, atol=1e-6, rtol=0)


@pytest.mark.parametrize("beta,options,match", [
    (0.2, {"temperature": "llama4", "beta": 0.3, "floor": L0}, "ships llama_4_scaling_beta=0.2"),
    (0.0, {"temperature": "logn"}, "temperature=logn .* no transformers-native form here"),
    (0.0, {"temperature": "llama4", "beta": 0.3, "floor": 2 * L0}, "transformers floors llama_4_scaling_beta at"),
])
def test_a_temperature_without_its_native_form_saves_marked(tmp_path, beta, options, match):
    from transformers import AutoModelForCausalLM

    from ctxext.export import check_native

    model = ctxext.patch(_ministral3(beta), "extrapolate", 4, **options)
    assert re.search(match, check_native(model)), check_native(model)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"ctxext\.from_pretrained\(path\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_qwen25_1m_dual_chunk_settings_are_not_silently_replaced_by_dca_defaults():
    """Qwen2.5-1M ships dual_chunk_attention_config (vLLM's parametrisation); ctxext's dca defaults would ignore it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=L0,
                         attn_implementation="sdpa")
    config.dual_chunk_attention_config = {"chunk_size": 48, "local_size": 8, "original_max_position_embeddings": L0}
    model = Qwen2ForCausalLM(config).eval()
    ids = _ids(100)
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(PatchError, match=r"dual_chunk_attention_config: chunk_size=48, local_size=8"):
        ctxext.patch(model, "dca", 4)
    assert ctxext.describe(model) is None and model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    ctxext.patch(model, "dca", 4, chunk_size=40, local_window=8)  # the user's own settings: ctxext's dca
    ctxext.unpatch(model)
    ctxext.patch(model, "yarn", 4)  # the other methods are unaffected
