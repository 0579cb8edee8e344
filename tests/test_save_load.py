"""A patch survives save_pretrained -> ctxext.from_pretrained; unpatch after that restores the original."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import smollm2_gguf, tiny_bloom, tiny_gpt2, tiny_llama, tiny_neox

import ctxext

L0 = 64


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_neox])
@pytest.mark.parametrize("method,factor,options", [("yarn", 4, {"beta_fast": 16}), ("dynamic-ntk", 2, {}), ("ntk", 8, {})])
def test_patch_survives_save_and_reload(tmp_path, model_fn, method, factor, options):
    original = model_fn()
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(8))
    unpatched_logits = original(ids).logits
    ctxext.patch(original, method, factor, **options)
    patched_logits = original(ids).logits
    original.save_pretrained(tmp_path)

    saved = json.loads((tmp_path / "config.json").read_text())
    # written in its native form (ctxext.export): transformers' dynamic type reads max_position_embeddings as the
    # original length; the others advertise the extended one
    advertised = L0 if method == "dynamic-ntk" else int(factor * L0)
    assert saved["ctxext"]["method"] == method and saved["max_position_embeddings"] == advertised
    assert saved["ctxext"]["saved_as"] == "native"

    loaded = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(loaded) == ctxext.describe(original)
    assert loaded.config.max_position_embeddings == int(factor * L0)
    assert torch.equal(loaded(ids).logits, patched_logits)

    ctxext.unpatch(loaded)
    assert loaded.config.max_position_embeddings == L0
    assert not hasattr(loaded.config, "ctxext")
    assert torch.equal(loaded(ids).logits, unpatched_logits)


def test_unpatched_model_reloads_unpatched(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    loaded = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(loaded) is None


def test_missing_local_model_gives_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder not found"):
        ctxext.from_pretrained(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        ctxext.from_pretrained(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="GGUF file 'x.gguf' not found"):
        ctxext.from_pretrained(tmp_path / "empty", gguf_file="x.gguf")


def test_hub_id_offline_fails_at_once(monkeypatch):
    """No network retries: HF_HUB_OFFLINE and a hub id not in the cache fail before transformers is asked."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set; offline, pass a local folder"):
        ctxext.from_pretrained("ctxext-test/no-such-model")
    assert time.monotonic() - start < 2


def test_cli_methods_table_lists_rotary_methods():
    out = subprocess.run([sys.executable, "-m", "ctxext", "methods"], capture_output=True, text=True, check=True)
    for method in ["pi", "ntk", "dynamic-ntk", "yarn"]:
        assert method in out.stdout


@pytest.mark.slow
def test_smollm2_gguf_patch_save_reload(tmp_path):
    """The real SmolLM2 GGUF (trained to 8192): patch, save as safetensors, reload patched, unpatch."""
    path = smollm2_gguf()
    model = ctxext.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    assert model.config.max_position_embeddings == 8192
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        base = model(ids).logits
        ctxext.patch(model, "yarn", 2)
        patched = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = ctxext.from_pretrained(tmp_path).eval()
    assert ctxext.describe(loaded)["original_length"] == 8192
    assert loaded.config.max_position_embeddings == 16384
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, patched, atol=1e-4, rtol=0)
        ctxext.unpatch(loaded)
        torch.testing.assert_close(loaded(ids).logits, base, atol=1e-4, rtol=0)


def test_patching_a_skeleton_of_a_saved_patched_model_starts_from_the_original_length(tmp_path):
    """A saved patched model built from its config (as the evaluator's preflight does, no weights): the saved spec
    is taken off and patching again does not compound the factor."""
    from transformers import AutoModelForCausalLM

    from ctxext.loading import load_config

    model = tiny_llama()
    ctxext.patch(model, "pi", 4)
    model.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert config.model_type == "llama" and config.max_position_embeddings == L0 and config.ctxext["factor"] == 4.0
    skeleton = AutoModelForCausalLM.from_config(config)
    ctxext.patch(skeleton, "pi", 2)
    assert ctxext.describe(skeleton)["original_length"] == L0
    assert skeleton.config.max_position_embeddings == 2 * L0


# -- a saved patch never silently differs (principle 9) ------------------------------------------------------------

FAMILIES = {"llama": tiny_llama, "neox": tiny_neox, "gpt2": tiny_gpt2, "bloom": tiny_bloom}
NO_FACTOR = {"alibi", "nope"}  # methods whose factor is optional: saved once without one


def _cases():
    for family, make in FAMILIES.items():
        for method in ctxext.available_methods(make()):
            yield pytest.param(family, method, None if method in NO_FACTOR else 2, id=f"{family}-{method}")
    yield pytest.param("gpt2", "alibi", 2, id="gpt2-alibi-x2")
    yield pytest.param("llama", "yarn", 1, id="llama-yarn-x1")


def _plain_load(cls, folder):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(folder)


#: The cells saved in their transformers-native form (ctxext.export): plain loading gives the patched model.
NATIVE = {(f, m) for f in ("llama", "neox") for m in ("pi", "ntk", "dynamic-ntk", "yarn", "llama3", "extrapolate")}
NATIVE |= {("gpt2", "pi"), ("gpt2", "extrapolate"), ("bloom", "extrapolate")}


@pytest.mark.parametrize("family,method,factor", list(_cases()))
def test_plain_transformers_load_of_a_saved_patch_fails_loudly(tmp_path, family, method, factor):
    """model.save_pretrained of a patched model, then plain AutoModelForCausalLM.from_pretrained / AutoConfig: the
    patched model (a native form: the same logits to 1e-5, tests/test_export.py measures each cell) or an error that
    names ctxext.from_pretrained, never a silently different model; ctxext.from_pretrained reloads it bit for bit,
    and the live model and its config are unchanged by the save."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = FAMILIES[family]()
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(11))  # GPT-2 reads 32
    model.save_pretrained(tmp_path / "warm")  # save_pretrained itself records dtype and architectures
    unpatched, config_before = model(ids).logits, model.config.to_dict()
    ctxext.patch(model, method, factor)
    patched, patched_config = model(ids).logits, model.config.to_dict()
    model.save_pretrained(tmp_path / "saved")
    assert model.config.to_dict() == patched_config and torch.equal(model(ids).logits, patched)

    for load in (AutoModelForCausalLM.from_pretrained, AutoConfig.from_pretrained):
        try:
            plain = load(tmp_path / "saved")
        except Exception as exc:  # noqa: BLE001 - any loud failure is fine, as long as it says what to do
            assert (family, method) not in NATIVE, f"a native form failed to load: {exc}"
            assert "ctxext.from_pretrained(path)" in str(exc), str(exc)
        else:
            assert (family, method) in NATIVE, f"{load.__qualname__} accepted a saved patched config"
            if load is AutoModelForCausalLM.from_pretrained:
                torch.testing.assert_close(plain(ids).logits, patched, atol=1e-5, rtol=0)

    loaded = ctxext.from_pretrained(tmp_path / "saved")
    assert ctxext.describe(loaded) == ctxext.describe(model)
    assert loaded.config.to_dict() == patched_config | {"_name_or_path": str(tmp_path / "saved")}
    assert torch.equal(loaded(ids).logits, patched)
    ctxext.unpatch(loaded)
    ctxext.unpatch(model)
    assert torch.equal(loaded(ids).logits, unpatched) and torch.equal(model(ids).logits, unpatched)
    assert model.config.to_dict() == config_before


@pytest.mark.parametrize("family", list(FAMILIES))
def test_class_specific_load_of_a_saved_patch_is_not_silent(tmp_path, family):
    """LlamaForCausalLM.from_pretrained & co. bypass the model type: rotary models fail on the marked rope type,
    GPT-2 on its position table size (a factor) and every family logs transformers' model-type warning, which
    names ctxext.from_pretrained."""
    model = FAMILIES[family]()
    ctxext.patch(model, "nope", 2)  # no native form on any family (native forms: tests/test_export.py)
    model.save_pretrained(tmp_path)
    import logging

    from transformers.utils import logging as hf_logging

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    try:
        plain = _plain_load(type(model), tmp_path)
    except Exception as exc:  # noqa: BLE001
        assert family in ("llama", "neox", "gpt2"), f"{family}: {exc}"
        if family != "gpt2":
            assert "ctxext.from_pretrained(path)" in str(exc)
        return
    finally:
        hf_logger.removeHandler(handler)
    assert family == "bloom"
    assert any("ctxext.from_pretrained(path)" in r for r in records)
    # what such a load gives is an unpatched model carrying the saved spec: ctxext.patch takes it off first
    assert ctxext.describe(plain) is None
    ctxext.patch(plain, "nope", 2)
    assert plain.config.model_type == "bloom" and ctxext.describe(plain) == ctxext.describe(model)


def test_the_mark_lives_only_in_the_saved_json(tmp_path):
    model = tiny_llama()
    ctxext.patch(model, "self-extend", 4)  # no native form: marked
    live = model.config.to_dict()
    rope_key = "rope_parameters" if "rope_parameters" in live else "rope_scaling"  # transformers 5.x / 4.x API
    assert live["model_type"] == "llama" and (live[rope_key] or {"rope_type": "default"})["rope_type"] == "default"
    assert "replaced_on_save" not in live["ctxext"]
    saved = json.loads(model.config.to_json_string())
    assert saved["model_type"] == "llama patched by ctxext: load it with ctxext.from_pretrained(path)"
    assert saved["ctxext"]["replaced_on_save"] == {"model_type": "llama", rope_key: live[rope_key]}
    assert "ctxext.from_pretrained(path)" in saved[rope_key]["rope_type"]
    model.config.save_pretrained(tmp_path)  # the config alone is marked too
    assert json.loads((tmp_path / "config.json").read_text()) == saved
    ctxext.unpatch(model)
    assert json.loads(model.config.to_json_string())["model_type"] == "llama"  # unpatched: an ordinary config


def test_an_unpatched_model_saves_an_ordinary_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2()
    with ctxext.patched(model, "pi", 2):
        pass
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, model(ids).logits)


def test_saved_patch_reloads_with_kwargs(tmp_path):
    """from_pretrained kwargs reach the config and the model as with AutoModelForCausalLM (dtype, a config
    override, attn_implementation)."""
    model = tiny_llama()
    ctxext.patch(model, "ntk", 2)
    model.save_pretrained(tmp_path)
    loaded = ctxext.from_pretrained(tmp_path, dtype=torch.bfloat16, use_cache=False, attn_implementation="eager",
                                    local_files_only=True)
    assert loaded.dtype == torch.bfloat16 and loaded.config.use_cache is False
    assert loaded.config._attn_implementation == "eager"
    assert ctxext.describe(loaded)["method"] == "ntk" and loaded.config.max_position_embeddings == 2 * L0


def test_saved_patch_round_trips_through_a_peft_adapter(tmp_path):
    """A LoRA adapter over a reloaded saved patched model: saved, then loaded back onto ctxext.from_pretrained."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    model = tiny_llama()
    ctxext.patch(model, "yarn", 2)
    model.save_pretrained(tmp_path / "base")
    base = ctxext.from_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    adapted = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "ctxext_patch.json").write_text(json.dumps(ctxext.describe(peft_model)))
    reloaded = ctxext.from_pretrained(tmp_path / "base", adapter=str(tmp_path / "adapter"))
    assert ctxext.describe(reloaded)["method"] == "yarn"
    assert torch.equal(reloaded(ids).logits, adapted)
