"""Architecture census (issue 11, items 3-4): every causal LM the installed transformers can build tiny, against
every method, is either patched correctly or refused with a reason; swapped-in attention honours what the model's
attention did (sliding windows) or refuses the model (soft-capping, sinks)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ctxext
from ctxext import census
from ctxext.core.errors import PatchError
from test_scaled_rope import LONGROPE

#: The models the census must cover without a failure row, with the methods each must patch ("ok").
REQUIRED = {
    "llama": "rotary",
    "mistral": "rotary",
    "qwen2": "rotary",
    "qwen3": "rotary",
    "gemma": "rotary",
    "gemma2": "rotary",
    "gemma3_text": "rotary",
    "phi3": "rotary",
    "gpt_neox": "rotary",
    "olmo2": "rotary",
    "stablelm": "rotary",
    "falcon": "rotary",
    "falcon+alibi": "alibi-bias",
    "bloom": "alibi-bias",
    "mpt": "alibi-bias",
    "gpt2": "learned",
    "gpt_neo": "learned-masked",
    "gptj": "sincos",
    "codegen": "sincos",
    "xglm": "refused",  # a fixed sinusoidal table, not a learned one
    "opt": "learned",
    "biogpt": "learned",
    # models that ship scaled RoPE (issue 11 item 5): the methods that scale frequencies compose on it
    "llama+linear": "scaled",
    "llama+yarn": "scaled",
    "llama+llama3": "scaled",
    "qwen2+yarn": "scaled",
    "phi3+longrope": "longrope",
}
# models that ship an attention temperature by position (issue 27), where this transformers has them: identity,
# cached decoding and unpatch then hold with the temperature acting (it is set to act from the first positions on)
_TYPES = __import__("transformers").CONFIG_MAPPING
REQUIRED.update({name: kind for name, kind in (("ministral3+temperature", "scaled"),
                                               ("llama4_text+temperature", "rotary"))
                 if name.split("+")[0] in _TYPES})
MUST_PATCH = {
    "rotary": ["pi", "ntk", "dynamic-ntk", "yarn", "llama3", "nope", "extrapolate"],
    "alibi-bias": ["pi", "nope", "extrapolate"],
    "learned": ["pi", "alibi", "nope", "extrapolate"],
    "learned-masked": ["pi", "nope", "extrapolate"],  # GPT-Neo: its own attention, no ALiBi swap
    "sincos": ["pi", "ntk", "yarn", "llama3", "nope", "extrapolate"],
    "refused": [],
    # static scaled rope types: the scaling methods compose on them, the rest keep the shipped rotation
    "scaled": ["pi", "ntk", "dynamic-ntk", "yarn", "llama3", "extrapolate", "alibi", "nope", "self-extend", "dca",
               "rerope", "lm-infinite", "streaming-llm", "string"],
    # longrope switches its own frequencies by length: no dynamic-ntk; 4.x / 5.0-5.12 recompute the long set
    # from the config in every forward, so every method is refused there
    "longrope": ["pi", "ntk", "yarn", "llama3", "extrapolate"] if LONGROPE else [],
}


@pytest.fixture(scope="module")
def required_rows():
    return census.run_census(list(REQUIRED))


def test_required_models_are_built_and_have_no_failure_row(required_rows):
    by_model = {}
    for row in required_rows:
        by_model.setdefault(row.model, {})[row.method] = row
    assert set(by_model) == set(REQUIRED)
    failures = [f"{r.model} x {r.method}: {r.reason}" for r in required_rows if r.status not in ("ok", "refused")]
    assert not failures, "\n".join(failures)
    for model, kind in REQUIRED.items():
        cells = by_model[model]
        for method in MUST_PATCH[kind]:
            assert cells[method].status == "ok", (model, method, cells[method].reason)
        if kind == "refused":  # no positional surface ctxext knows: one clear reason for every method
            assert all(r.status == "refused" and "no positional surface" in r.reason for r in cells.values())
        if kind == "sincos":  # a sin-cos table per layer: no per-sequence scale, attention not swappable
            assert all(cells[m].status == "refused" for m in ("dynamic-ntk", "alibi", "self-extend", "string"))
        if kind == "longrope":  # two frequency sets switched by length: no one rotation to replace or remap
            for method in ("alibi", "nope", "self-extend", "dca"):
                assert cells[method].status == "refused", (model, method)
                assert not LONGROPE or "switches between a short and a long" in cells[method].reason
        for row in cells.values():
            assert row.status == "ok" or row.reason, row


def test_ok_rows_ran_the_checks_that_apply(required_rows):
    rows = {(r.model, r.method): r for r in required_rows}
    llama_pi = rows["llama", "pi"].checks
    assert {"changed", "cache", "unpatch", "parity", "identity"} <= set(llama_pi)
    for model in ("mistral", "qwen3", "gpt_neox", "phi3", "falcon"):
        assert all("parity" in rows[model, m].checks for m in ("pi", "ntk", "dynamic-ntk", "yarn", "llama3")), model
    # per-layer-type rotary frequencies (5.x) / a local and a global rotary module (4.x)
    assert {"changed", "cache", "identity"} <= set(rows["gemma3_text", "yarn"].checks)
    if census.build_tiny("gemma3_text").model.rotary_emb.__dict__.get("layer_types"):  # one set per type (5.x)
        # Gemma 3's hybrid layers: the sliding ones kept as trained, the global ones remapped
        assert {"changed", "cache", "identity"} <= set(rows["gemma3_text", "self-extend"].checks)
    assert "extrapolated" in rows["llama", "extrapolate"].checks
    # composed on a shipped linear x 2: pi x 4 equals transformers' linear x 8 (the one closed form)
    assert "parity" in rows["llama+linear", "pi"].checks
    assert {"changed", "cache", "unpatch", "identity"} <= set(rows["llama+llama3", "yarn"].checks)
    assert "runs past L0" in rows["gpt2", "pi"].checks  # the unpatched table has L0 rows
    assert "changed" in rows["falcon+alibi", "pi"].checks and "cache" in rows["falcon+alibi", "pi"].checks


def test_structure_that_misleads_is_not_patched_into_silence(required_rows):
    """Falcon with ALiBi builds a rotary module it never applies: rotary methods are refused, ALiBi ones act."""
    rows = {(r.model, r.method): r for r in required_rows}
    assert rows["falcon+alibi", "yarn"].status == "refused" and "not rotary" in rows["falcon+alibi", "yarn"].reason
    model = census.build_tiny("falcon", {"alibi": True})
    assert ctxext.available_methods(model) == {"pi": ["falcon-alibi"], "nope": ["falcon-alibi"],
                                               "extrapolate": ["falcon-alibi"]}


def test_parity_is_asked_of_the_model_not_of_a_family_name():
    """The census compares with transformers' rope types where the model's positions come from rotary modules that
    read one: Falcon with ALiBi builds such a module and never applies it; GPT-J's sin-cos table reads none."""
    from pathlib import Path

    from ctxext.census.parity import honours_rope_type

    assert honours_rope_type(census.build_tiny("llama"))
    assert not honours_rope_type(census.build_tiny("falcon", {"alibi": True}))
    assert not honours_rope_type(census.build_tiny("gptj")) and not honours_rope_type(census.build_tiny("gpt2"))
    sources = "".join(p.read_text() for p in Path(census.__file__).parent.glob("*.py"))
    assert "family ==" not in sources


def test_a_rotary_module_that_ignores_its_buffers_is_refused():
    """Some rotary modules recompute their frequencies from the config in every forward (Phimoe in 5.x): a patch of
    the buffers would change nothing, so it is refused, before anything is touched."""
    from ctxext.adapters.rotary_units import rotary_modules

    model = census.build_tiny("llama")
    (_, module), = rotary_modules(model)
    frozen = module.inv_freq.clone()
    original_forward = module.forward

    def forward(x, position_ids):  # reads a copy, never the buffer
        saved = module.inv_freq.clone()
        module.inv_freq.copy_(frozen)
        try:
            return original_forward(x, position_ids)
        finally:
            module.inv_freq.copy_(saved)

    module.forward = forward
    for method in ("pi", "yarn", "self-extend"):
        with pytest.raises(PatchError, match="does not read its inv_freq"):
            ctxext.patch(model, method, 4)
    assert torch.equal(module.inv_freq, frozen) and ctxext.describe(model) is None


def test_the_census_catches_a_patch_that_changes_nothing(monkeypatch):
    from ctxext.adapters import rotary

    monkeypatch.setitem(rotary.STATIC_METHODS, "pi", rotary.rope.identity)
    (row,) = census.run_census(["llama"], ["pi"])
    assert row.status == "FAILED" and "nothing changed" in row.reason


def test_census_cli_prints_the_table(capsys):
    from ctxext.cli import main

    assert main(["methods", "--census", "--models", "llama,mpt", "--only", "pi,yarn"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["model", "class", "pi", "yarn"]
    assert lines[2].split()[:4] == ["llama", "LlamaForCausalLM", "ok", "ok"]
    assert lines[3].split()[:3] == ["mpt", "MptForCausalLM", "ok"] and "refused" in lines[3]
    assert "not rotary" in out
    assert main(["methods", "--only", "pi"]) == 2  # census options without --census: one clear line
    assert "go with --census" in capsys.readouterr().err
    assert main(["methods", "--census", "--models", "llama,no_such_model"]) == 2
    assert "no_such_model" in capsys.readouterr().err


# -- item 4: attention features honoured or refused --------------------------------------------------------------------


def _alibi_logits(model_type: str, ids: torch.Tensor, **overrides) -> torch.Tensor:
    model = census.build_tiny(model_type, overrides, seed=0)
    ctxext.patch(model, "alibi", 4)
    with torch.no_grad():
        return model(ids).logits


def test_alibi_swap_honours_sliding_windows():
    """Same weights, window on and off: the ALiBi-patched logits differ past the window (the mask carries it)."""
    ids = torch.randint(3, 128, (1, census.SEQ), generator=torch.Generator().manual_seed(0))
    windowed = _alibi_logits("mistral", ids, sliding_window=census.WINDOW)
    full = _alibi_logits("mistral", ids, sliding_window=None)
    inside = census.WINDOW  # queries whose keys all lie in the window see the same keys
    torch.testing.assert_close(windowed[:, :inside], full[:, :inside], atol=1e-5, rtol=0)
    assert (windowed[:, inside:] - full[:, inside:]).abs().max() > 1e-4


def test_alibi_swap_refuses_soft_capping_and_leaves_the_model_alone():
    model = census.build_tiny("gemma2")
    before = model.config.to_dict()
    with pytest.raises(PatchError, match="soft-caps"):
        ctxext.patch(model, "alibi")
    assert model.config.to_dict() == before and ctxext.describe(model) is None
    # without soft-capping the same architecture is patched
    ctxext.patch(census.build_tiny("gemma2", {"attn_logit_softcapping": None}), "alibi")


def test_alibi_swap_refuses_sparse_indexed_attention():
    """DeepSeek V3.2's indexer passes the keys each query may see (``indices``): the ALiBi swap would drop them, so
    it is refused at patch time (it used to fail only in the forward pass)."""
    import importlib.util

    if importlib.util.find_spec("transformers.models.deepseek_v32") is None:
        pytest.skip("this transformers has no DeepSeek V3.2")
    model = census.build_tiny("deepseek_v32")
    with pytest.raises(PatchError, match="sparse indexed attention"):
        ctxext.patch(model, "alibi")
    assert ctxext.describe(model) is None


def test_alibi_swap_refuses_learned_sinks():
    pytest.importorskip("transformers.models.gpt_oss")
    from ctxext.attention import attention_features

    model = census.build_tiny("gpt_oss")
    assert "sinks" in attention_features(model)
    for _, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            module.sinks = None  # the same model without sinks: nothing to refuse
    assert attention_features(model) is None


def test_alibi_function_raises_instead_of_dropping_a_feature():
    from ctxext.attention import alibi_attention_forward

    q = torch.randn(1, 2, 4, 8)
    from ctxext.attention.alibi import ALIBI_MARK

    module = torch.nn.Module()
    module.is_causal = True
    vars(module)[ALIBI_MARK] = True  # a layer of a swapped model
    with pytest.raises(ValueError, match="softcap"):
        alibi_attention_forward(module, q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="s_aux"):
        alibi_attention_forward(module, q, q, q, None, s_aux=torch.zeros(2))
    out, _ = alibi_attention_forward(module, q, q, q, None, softcap=None)
    assert out.shape == (1, 4, 2, 8)


# -- new ALiBi adapters ----------------------------------------------------------------------------------------------


def test_mpt_reads_past_its_length_once_patched_and_unpatch_is_exact():
    model = census.build_tiny("mpt")
    ids = torch.randint(3, 128, (1, census.SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        short = model(ids[:, : census.L0]).logits
    with pytest.raises(Exception):
        model(ids)  # the bias is built for max_seq_len keys
    for method in ("extrapolate", "pi", "nope"):
        ctxext.patch(model, method, 4)
        assert model.config.max_seq_len == 4 * census.L0
        with torch.no_grad():
            long = model(ids).logits
        assert long.shape[1] == census.SEQ
        if method == "extrapolate":
            torch.testing.assert_close(long[:, : census.L0], short, atol=1e-5, rtol=0)
        ctxext.unpatch(model)
        assert model.config.max_seq_len == census.L0
        with torch.no_grad():
            assert torch.equal(model(ids[:, : census.L0]).logits, short)


def test_falcon_alibi_patch_does_not_leak_to_another_falcon():
    patched = census.build_tiny("falcon", {"alibi": True})
    other = census.build_tiny("falcon", {"alibi": True}, seed=1)
    ids = torch.randint(3, 128, (1, census.SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = other(ids).logits
        ctxext.patch(patched, "nope")
        patched(ids)
        assert torch.equal(other(ids).logits, before)
    ctxext.unpatch(patched)


# -- the full walk --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_full_census_has_no_failure_rows():
    rows = census.run_census()
    failures = sorted({f"{r.model} x {r.method}: {r.reason}" for r in rows if r.status == "FAILED"})
    print(census.format_census(rows))
    assert not failures, f"{len(failures)} failure rows:\n" + "\n".join(failures)
