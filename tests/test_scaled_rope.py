"""Models that ship scaled RoPE (transformers rope types linear, yarn, llama3, longrope): ctxext's methods compose on
the frequencies the model actually uses, with the advertised length (max_position_embeddings) as the original one;
methods that replace the rotation (NoPE, the ALiBi swap) or remap its positions keep the shipped rotation on the static
types (linear, yarn, llama3); dynamic rope types, and those methods on longrope, are refused before anything
changes."""

from __future__ import annotations

import math

import pytest
import torch
from checks import generate_equals_full_forward
from conftest import _takes_rope_parameters, rope_kwargs, tiny_llama

import ctxext
from ctxext.adapters.rotary_units import RotaryUnit, unit_inputs
from ctxext.core.errors import PatchError
from ctxext.methods import rope

L0 = 64  # the advertised length (max_position_embeddings) of every tiny model here
OMAX = 16  # original_max_position_embeddings of the yarn / llama3 presets (advertised = 4 x OMAX)
PHI_OMAX = 32  # original_max_position_embeddings of the longrope preset (switch point)

LLAMA_PRESETS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OMAX},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": OMAX},
}
PRESETS = (*LLAMA_PRESETS, "longrope")


def _longrope_reads_its_long_set() -> bool:
    """Whether this transformers' longrope forward reads the module's long_inv_freq (5.23 does) or recomputes the
    long set from the config in every forward (5.0-5.12), checked on the module itself."""
    if not LONGROPE_API:
        return False
    module = tiny_phi3().model.rotary_emb
    module.long_inv_freq = torch.zeros_like(module.inv_freq, dtype=torch.float32)
    cos, _ = module(torch.zeros(1, 1, 12), torch.tensor([[PHI_OMAX + 1]]))
    return bool((cos == module.attention_scaling).all())


def _longrope_api() -> bool:
    """longrope settings in rope_parameters (5.x); 4.x keeps them in rope_scaling, and ctxext refuses it there."""
    from transformers import Phi3Config

    return _takes_rope_parameters(Phi3Config)


LONGROPE_API = _longrope_api()
METHODS = ("pi", "ntk", "yarn", "llama3", "extrapolate", "dynamic-ntk")
CELLS = [(p, m) for p in PRESETS for m in METHODS if (p, m) != ("longrope", "dynamic-ntk")]
SHORT = [0.9, 1.0, 1.1, 1.2, 1.5, 2.0]  # longrope factors per frequency (head_dim 12: 6 frequencies)
LONG = [1.0, 1.5, 2.0, 3.0, 5.0, 8.0]


def _phi3_rope(config_class, rope: dict) -> dict:
    kw = rope_kwargs(config_class, rope)
    if not LONGROPE_API:  # 4.x Phi-3 wants rope_scaling with exactly type / short_factor / long_factor
        scaling = kw["rope_scaling"]
        kw["rope_scaling"] = {"type": scaling.pop("rope_type"), **scaling}
    return kw


def tiny_phi3(seed: int = 0, long_factor=None, **overrides):
    """Phi-3 with longrope (original_max_position_embeddings 32, advertised 64), GQA, rope_theta 500."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "longrope", "rope_theta": 500.0, "short_factor": list(SHORT),
            "long_factor": list(long_factor or LONG)}
    if LONGROPE_API:
        rope["factor"] = L0 / PHI_OMAX
    kw = dict(
        vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=L0, original_max_position_embeddings=PHI_OMAX,
        **_phi3_rope(Phi3Config, rope), attn_implementation="sdpa", pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )
    kw.update(overrides)
    return Phi3ForCausalLM(Phi3Config(**kw)).eval()


LONGROPE = _longrope_reads_its_long_set()
needs_longrope = pytest.mark.skipif(not LONGROPE, reason="this transformers' longrope does not read long_inv_freq "
                                    "(5.0-5.12) or keeps its settings in rope_scaling (4.x): ctxext refuses it")


def scaled(preset: str, seed: int = 0):
    if preset == "longrope":
        if not LONGROPE:
            pytest.skip("this transformers' longrope is refused (test_longrope_refused_where_it_cannot_compose)")
        return tiny_phi3(seed)
    return tiny_llama(seed, rope_parameters=LLAMA_PRESETS[preset])


def _ids(length: int = 150, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def _rotary_state(model) -> dict:
    """Everything a patch may touch on the rotary module, for bit-exact comparison."""
    module = model.model.rotary_emb
    long = vars(module).get("long_inv_freq")
    return {
        "inv_freq": module.inv_freq.clone(),
        "original_inv_freq": module.original_inv_freq.clone(),
        "attention_scaling": module.attention_scaling,
        "long_inv_freq": None if long is None else long.clone(),
        "has_long": "long_inv_freq" in vars(module),
        "length": model.config.max_position_embeddings,
    }


def _same_state(a: dict, b: dict) -> bool:
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) and isinstance(b[k], torch.Tensor) else a[k] == b[k]
        for k in a
    )


@pytest.mark.parametrize("preset,method", CELLS)
def test_factor_one_is_the_identity(preset, method):
    model = scaled(preset)
    ids, short = _ids(), _ids(20)  # past the advertised length; and (longrope) below its switch point
    before, before_short = model(ids).logits, model(short).logits
    with ctxext.patched(model, method, 1):
        torch.testing.assert_close(model(ids).logits, before, atol=1e-6, rtol=0)
        torch.testing.assert_close(model(short).logits, before_short, atol=1e-6, rtol=0)


@pytest.mark.parametrize("preset,method", CELLS)
def test_patch_changes_logits_past_the_advertised_length_and_unpatch_is_bit_exact(preset, method):
    model = scaled(preset)
    ids = _ids()
    model(ids)  # a longrope module sets its long_inv_freq in its first forward: unpatch must put back that state
    state, before = _rotary_state(model), model(ids).logits
    ctxext.patch(model, method, 3)
    assert model.config.max_position_embeddings == 3 * L0
    after = model(ids).logits
    if method == "extrapolate":  # it only advertises the longer length
        assert torch.equal(after, before)
    else:
        assert (after[0, L0:] - before[0, L0:]).abs().max() > 1e-4
    ctxext.unpatch(model)
    assert _same_state(_rotary_state(model), state)
    assert torch.equal(model(ids).logits, before)


@pytest.mark.skipif(LONGROPE, reason="this transformers' longrope composes")
def test_longrope_refused_where_it_cannot_compose():
    model = tiny_phi3()
    assert model.model.rotary_emb.rope_type == "longrope"
    reason = "recomputes its long frequencies" if LONGROPE_API else "the transformers 5.x surface its switch reads"
    _refused(model, "pi", 2, reason)


@needs_longrope
def test_unpatch_restores_a_longrope_module_that_never_ran():
    """long_inv_freq is absent until a longrope module's first forward: unpatch removes it again."""
    model = tiny_phi3()
    state = _rotary_state(model)
    assert model.model.rotary_emb.rope_type == "longrope" and not state["has_long"]
    ctxext.patch(model, "pi", 2)
    model(_ids(80))
    ctxext.unpatch(model)
    assert _same_state(_rotary_state(model), state)


@pytest.mark.parametrize("preset,method", [(p, m) for p, m in CELLS if m in ("pi", "yarn", "dynamic-ntk")])
def test_cached_decoding_equals_a_full_forward(preset, method):
    """Prompt past the advertised length (and, for longrope, past its switch point: the long set throughout)."""
    model = scaled(preset)
    ctxext.patch(model, method, 2)
    generate_equals_full_forward(model, prompt_len=70, new=6)


# -- parity where a closed form exists -----------------------------------------------------------------------------


@pytest.mark.parametrize("a,f", [(2.0, 3.0), (1.5, 2.5)])
def test_pi_on_linear_equals_transformers_linear_of_the_product(a, f):
    model = tiny_llama(rope_parameters={"rope_type": "linear", "factor": a})
    reference = tiny_llama(rope_parameters={"rope_type": "linear", "factor": a * f})
    ids = _ids(200)
    ctxext.patch(model, "pi", f)
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)


def test_ntk_on_linear_equals_linear_with_the_ntk_base():
    """ntk composes per frequency: on linear x a it is linear x a with rope_theta = base * f^(d/(d-2))."""
    d, f = 16, 4.0
    model = tiny_llama(rope_parameters={"rope_type": "linear", "factor": 2.0})
    reference = tiny_llama(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 500.0 * f ** (d / (d - 2))})
    ids = _ids(200)
    ctxext.patch(model, "ntk", f)
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("f", [2.0, 8.0])
def test_ntk_multiplier_equals_the_base_change_on_plain_rope(f):
    """f^(-2i/(d-2)) per frequency == base' = base * f^(d/(d-2)) (the closed form on plain RoPE)."""
    d, base = 16, 500.0
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ours, scale = rope.ntk_scale(rope.RopeInputs(inv.float(), base, d, L0), f)
    closed = 1.0 / ((base * f ** (d / (d - 2))) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    torch.testing.assert_close(ours.double(), closed, rtol=1e-6, atol=0)
    assert scale == 1.0


@needs_longrope
def test_pi_on_longrope_equals_longrope_with_the_long_factors_times_f():
    """pi composes on the long set (and keeps the short one and the switch): transformers' longrope with
    long_factor x f and the same attention factor."""
    f = 2.0
    model = tiny_phi3()
    reference = tiny_phi3(long_factor=[x * f for x in LONG])
    long_ids, short = _ids(200), _ids(20)
    short_before = model(short).logits
    ctxext.patch(model, "pi", f)
    assert reference.model.rotary_emb.attention_scaling == model.model.rotary_emb.attention_scaling
    torch.testing.assert_close(model(long_ids).logits, reference(long_ids).logits, atol=1e-5, rtol=0)
    assert torch.equal(model(short).logits, short_before)  # below the switch point: the short set, unchanged


@pytest.mark.parametrize("preset", ["llama3", "yarn"])
def test_pi_divides_the_shipped_frequencies(preset):
    """llama3 / yarn x pi has no transformers rope type; its formula: every shipped frequency divided by f, the
    shipped attention factor kept."""
    model = scaled(preset)
    module = model.model.rotary_emb
    shipped, scaling = module.original_inv_freq.clone(), module.attention_scaling
    ctxext.patch(model, "pi", 3)
    torch.testing.assert_close(module.inv_freq.double(), shipped.double() / 3, rtol=1e-7, atol=0)
    assert module.attention_scaling == scaling


def test_attention_scaling_composes_by_product():
    """yarn on a yarn model: the shipped mscale times yarn's for the new factor."""
    model = scaled("yarn")
    shipped = model.model.rotary_emb.attention_scaling
    assert shipped > 1
    ctxext.patch(model, "yarn", 2)
    assert math.isclose(model.model.rotary_emb.attention_scaling, shipped * rope.yarn_mscale(2.0), rel_tol=1e-12)


def test_yarn_ramps_by_wavelength_on_shipped_frequencies():
    """On plain RoPE the wavelength index equals the frequency index (the ramp transformers uses); on linear x a the
    frequencies that rotate fewer than beta_slow times over the advertised length are divided by f, those that
    rotate more than beta_fast times are kept, the ones between are ramped."""
    d, base = 16, 500.0
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    plain = rope.RopeInputs(inv.float(), base, d, L0)
    as_shipped = rope.RopeInputs(inv.float(), base, d, L0, preset="linear")
    torch.testing.assert_close(rope._yarn_index(as_shipped), rope._yarn_index(plain), atol=1e-5, rtol=0)
    for truncate in (True, False):
        torch.testing.assert_close(rope.yarn(as_shipped, 4.0, truncate=truncate)[0],
                                   rope.yarn(plain, 4.0, truncate=truncate)[0], atol=0, rtol=1e-6)

    model = scaled("linear")
    unit = RotaryUnit("model.rotary_emb", model.model.rotary_emb)
    inputs = unit_inputs(unit, L0, "yarn")
    new, _ = rope.yarn(inputs, 4.0, beta_fast=4.0, beta_slow=0.5, truncate=False)
    rotations = L0 * inputs.inv_freq.double() / (2 * math.pi)
    ratio = new.double() / inputs.inv_freq.double()
    assert (rotations < 0.5).any() and (rotations > 4).any()
    assert torch.allclose(ratio[rotations > 4], torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(ratio[rotations < 0.5], torch.tensor(0.25, dtype=torch.float64))
    between = (rotations > 0.5) & (rotations < 4)
    assert ((ratio[between] > 0.25) & (ratio[between] < 1)).all()


# -- refusals ------------------------------------------------------------------------------------------------------


def _refused(model, method, factor, match):
    ids = _ids(80)
    before = model(ids).logits  # first: transformers' own forward sets state (dynamic / longrope frequencies)
    state = _rotary_state(model)
    with pytest.raises(PatchError, match=match):
        ctxext.patch(model, method, factor)
    assert ctxext.describe(model) is None
    assert _same_state(_rotary_state(model), state)
    assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("method", ["pi", "yarn", "dynamic-ntk"])
def test_dynamic_rope_type_is_refused(method):
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    _refused(model, method, 2, "rope_type 'dynamic', which recomputes its frequencies")


@needs_longrope
def test_dynamic_ntk_on_longrope_is_refused():
    model = tiny_phi3()
    _refused(model, "dynamic-ntk", 2, "switches its frequencies by sequence length itself")


@needs_longrope
@pytest.mark.parametrize("method,factor", [("nope", None), ("alibi", None), ("self-extend", 2), ("rerope", 2)])
def test_methods_that_replace_the_rotation_are_refused_on_longrope(method, factor):
    """longrope switches between two frequency sets by length: there is no one rotation to keep."""
    _refused(tiny_phi3(), method, factor, "switches between a short and a long frequency set")


# -- methods that replace or remap the rotation, on static scaled types --------------------------------------------

ROTATION_CELLS = [(p, m, f) for p in LLAMA_PRESETS
                  for m, f in (("nope", None), ("alibi", None), ("self-extend", 3), ("dca", 3), ("rerope", 3))]


@pytest.mark.parametrize("preset,method,factor", ROTATION_CELLS)
def test_rotation_methods_change_logits_past_the_length_and_unpatch_is_bit_exact(preset, method, factor):
    model = scaled(preset)
    ids = _ids()
    state, before = _rotary_state(model), model(ids).logits
    ctxext.patch(model, method, factor)
    after = model(ids).logits
    assert (after[0, L0:] - before[0, L0:]).abs().max() > 1e-4
    ctxext.unpatch(model)
    assert _same_state(_rotary_state(model), state)
    assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("preset,method,factor", ROTATION_CELLS)
def test_rotation_methods_on_a_scaled_rope_decode_with_the_cache_as_a_full_forward(preset, method, factor):
    model = scaled(preset)
    ctxext.patch(model, method, factor)
    generate_equals_full_forward(model, prompt_len=70, new=6)


@pytest.mark.parametrize("preset", sorted(LLAMA_PRESETS))
@pytest.mark.parametrize("method", ["nope", "alibi"])
def test_nope_and_alibi_on_a_scaled_rope_drop_its_rotation_and_keep_its_attention_factor(preset, method):
    """With the rotation gone, a model that ships a scaled rope type is the same weights with plain RoPE, except
    for the shipped attention factor (YaRN's logit temperature), which stays: the plain model with q and k each
    multiplied by it."""
    model = scaled(preset)
    factor = model.model.rotary_emb.attention_scaling
    plain = tiny_llama(0)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in plain.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    ids = _ids()
    ctxext.patch(model, method)
    ctxext.patch(plain, method)
    torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset,method,factor", [("yarn", "self-extend", 3), ("llama3", "nope", None)])
def test_rotation_methods_on_a_scaled_rope_survive_save_and_refuse_a_plain_load(tmp_path, preset, method, factor):
    from checks import patch_survives_save_and_reload

    patch_survives_save_and_reload(scaled(preset), tmp_path, method, factor, _ids(100))


def test_a_rotary_module_that_does_not_match_its_rope_type_is_refused():
    model = scaled("llama3")
    with torch.no_grad():
        model.model.rotary_emb.original_inv_freq.mul_(1.5)
        model.model.rotary_emb.inv_freq.mul_(1.5)
    _refused(model, "pi", 2, "not what transformers' rope_type 'llama3' computes")


# -- saving --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,method,native", [
    ("linear", "pi", {"rope_type": "linear", "factor": 6.0}),
    ("linear", "ntk", {"rope_type": "linear", "factor": 2.0}),
    ("yarn", "extrapolate", {"rope_type": "yarn", "factor": 4.0}),
    ("longrope", "pi", {"rope_type": "longrope", "long_factor": [x * 3 for x in LONG]}),
    ("llama3", "pi", None),
    ("yarn", "yarn", None),
])
def test_save_writes_a_native_form_only_where_one_is_exact(tmp_path, preset, method, native):
    import json

    from checks import patch_survives_save_and_reload

    from ctxext.export import check_native

    model = scaled(preset)
    ids = _ids(200)
    loaded = patch_survives_save_and_reload(model, tmp_path, method, 3, ids)
    saved = json.loads((tmp_path / "config.json").read_text())
    rope_saved = saved.get("rope_parameters") or saved.get("rope_scaling")  # 5.x or 4.x settings
    assert loaded is not None
    if native is None:
        assert "replaced_on_save" in saved["ctxext"] and saved["ctxext"].get("saved_as") != "native"
        assert "no transformers-native form" in check_native(model)
    else:
        assert saved["ctxext"]["saved_as"] == "native"
        for key, value in native.items():
            assert rope_saved[key] == (value if isinstance(value, str) else pytest.approx(value))
        assert saved["max_position_embeddings"] == 3 * L0


def test_per_layer_type_presets_compose_per_set():
    """Gemma 3 keeps one set per layer type (here linear x8 on full attention, plain RoPE on sliding layers): pi x2
    composes on each set, equal to transformers' linear x16 / linear x2."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if not _takes_rope_parameters(Gemma3TextConfig):
        pytest.skip("per-layer-type rope_parameters are a transformers 5.x surface")

    def build(full, sliding):
        torch.manual_seed(0)
        config = Gemma3TextConfig(
            vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=L0, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_theta": 1000.0, **full},
                             "sliding_attention": {"rope_theta": 100.0, **sliding}},
            attn_implementation="sdpa")
        return Gemma3ForCausalLM(config).eval()

    model = build({"rope_type": "linear", "factor": 8.0}, {"rope_type": "default"})
    reference = build({"rope_type": "linear", "factor": 16.0}, {"rope_type": "linear", "factor": 2.0})
    ids = _ids(150)
    before = model(ids).logits
    ctxext.patch(model, "pi", 2)
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
    ctxext.unpatch(model)
    assert torch.equal(model(ids).logits, before)
