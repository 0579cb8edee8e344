"""A saved patch reloads as it was or not at all: a native export saved again by plain transformers stays native
(the patch is not applied twice), a hand-edited or damaged spec block is a PatchError naming the field, and an
adapter trained with other method options is refused."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import tiny_llama

import ctxext
from ctxext.core.errors import PatchError

IDS = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(0))


def _plain_load(folder):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("method, factor", [("yarn", 4), ("pi", 2), ("ntk", 4)])
def test_a_native_export_saved_again_by_plain_transformers_stays_native(tmp_path, method, factor):
    model = ctxext.patch(tiny_llama(), method, factor)
    model.save_pretrained(tmp_path / "native")
    _plain_load(tmp_path / "native").save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["model_type"] == "llama"  # not marked
    expected = model(IDS).logits
    torch.testing.assert_close(_plain_load(tmp_path / "again")(IDS).logits, expected, atol=1e-5, rtol=0)
    reloaded = ctxext.from_pretrained(tmp_path / "again")
    assert ctxext.describe(reloaded) == ctxext.describe(model)
    assert torch.equal(reloaded(IDS).logits, expected)


def _saved_marked(tmp_path):
    model = ctxext.patch(tiny_llama(), "self-extend", 4)  # no native form: saved marked
    model.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("edit, said", [
    (lambda b: b.pop("method"), "lacks method"),
    (lambda b: b.pop("original_length"), "lacks original_length"),
    (lambda b: b.clear(), "lacks method, factor, original_length"),
    (lambda b: b.update(options=None), "options=None"),
    (lambda b: b.update(options=[1]), "options=[1]"),
    (lambda b: b.update(original_length=0), "original_length=0"),
    (lambda b: b.update(original_length="64"), "original_length='64'"),
    (lambda b: b.update(factor="4"), "factor='4'"),
    (lambda b: b.update(replaced_on_save=[1]), "replaced_on_save=[1]"),
    (lambda b: b.update(replaced_on_save=None), "replaced_on_save=None"),
])
def test_a_damaged_spec_block_is_a_patch_error_naming_the_field(tmp_path, edit, said):
    config = _saved_marked(tmp_path)
    edit(config["ctxext"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PatchError, match=said.replace("[", r"\[").replace("]", r"\]")):
        ctxext.from_pretrained(tmp_path)


def test_an_adapter_trained_with_other_options_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = ctxext.patch(tiny_llama(), "yarn", 4, beta_fast=16)
    base.save_pretrained(tmp_path / "base")
    trained = get_peft_model(ctxext.patch(tiny_llama(), "yarn", 4), LoraConfig(r=2, target_modules=["q_proj"]))
    trained.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "ctxext_patch.json").write_text(json.dumps(ctxext.describe(trained)))
    with pytest.raises(PatchError, match="beta_fast=32"):
        ctxext.from_pretrained(tmp_path / "base", adapter=str(tmp_path / "adapter"))


@pytest.mark.parametrize("damage", [b"", b'{"method": "yarn", "fac', b"\xff\xfe not utf-8"])
def test_a_damaged_adapter_patch_record_is_a_patch_error_naming_the_file(tmp_path, damage):
    from peft import LoraConfig, get_peft_model

    tiny_llama().save_pretrained(tmp_path / "base")
    trained = get_peft_model(ctxext.patch(tiny_llama(), "yarn", 4), LoraConfig(r=2, target_modules=["q_proj"]))
    trained.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "ctxext_patch.json").write_bytes(damage)
    with pytest.raises(PatchError, match="ctxext_patch.json cannot be read"):
        ctxext.from_pretrained(tmp_path / "base", adapter=str(tmp_path / "adapter"))


def test_an_adapter_patch_record_with_a_byte_order_mark_loads(tmp_path):
    from peft import LoraConfig, get_peft_model

    tiny_llama().save_pretrained(tmp_path / "base")
    trained = get_peft_model(ctxext.patch(tiny_llama(), "yarn", 4), LoraConfig(r=2, target_modules=["q_proj"]))
    trained.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "ctxext_patch.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(
        {k: v for k, v in ctxext.describe(trained).items()}).encode())
    model = ctxext.from_pretrained(tmp_path / "base", adapter=str(tmp_path / "adapter"))
    assert ctxext.describe(model)["method"] == "yarn"
