"""A patch survives save_pretrained -> ctxext.from_pretrained; unpatch after that restores the original."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import smollm2_gguf, tiny_llama, tiny_neox

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
    assert saved["ctxext"]["method"] == method and saved["max_position_embeddings"] == int(factor * L0)

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
    with pytest.raises(OSError, match="cannot load model"):
        ctxext.from_pretrained(str(tmp_path / "nope"))


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


def test_patching_a_model_loaded_without_ctxext_starts_from_the_original_length(tmp_path):
    """A saved patched model loaded with plain transformers advertises the patched length; patching it again
    must not compound the factor."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    ctxext.patch(model, "pi", 4)
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert plain.config.max_position_embeddings == 4 * L0 and ctxext.describe(plain) is None
    ctxext.patch(plain, "pi", 2)
    assert ctxext.describe(plain)["original_length"] == L0
    assert plain.config.max_position_embeddings == 2 * L0
