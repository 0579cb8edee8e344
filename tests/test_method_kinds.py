"""One declaration per method, with a kind; adapters state support by kind (issue 26).

Adding a method of a known kind is one declaration: a made-up frequency method registered here is carried by the
rotary families and refused by the others with the same reason as every frequency method, without any adapter
naming it."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama

import ctxext
from ctxext.adapters import ADAPTERS, adapter_for_family
from ctxext.adapters.table import method_table
from ctxext.methods import registry, rope
from ctxext.methods.declaration import Kind, Method


def _third(r: rope.RopeInputs, factor: float) -> tuple[torch.Tensor, float]:
    """A made-up rule: every frequency divided by 3 x factor."""
    return rope.position_interpolation(r, 3 * factor)


MADE_UP = Method("made-up", "a frequency method declared by a test", Kind.FREQUENCY, rule="frequencies / 3f",
                 frequencies=_third)


@pytest.fixture
def made_up(monkeypatch):
    monkeypatch.setitem(registry.METHODS, MADE_UP.name, MADE_UP)
    return MADE_UP


def test_every_method_is_declared_with_a_kind_and_what_its_kind_needs():
    for name, method in registry.METHODS.items():
        assert method.name == name and isinstance(method.kind, Kind), name
        if method.kind is Kind.FREQUENCY:
            assert callable(method.frequencies) and method.rule, name
        if method.kind is Kind.REMAP:
            assert callable(method.position_map) and method.rule, name
    aliases = [a for m in registry.METHODS.values() for a in m.aliases]
    assert len(aliases) == len(set(aliases)) and not set(aliases) & set(registry.METHODS)


def test_methods_of_one_kind_get_one_answer_from_a_family_that_does_not_carry_the_kind():
    """The families without rotary frequencies refuse every frequency method (but an interpolating one) and every
    remap method alike: support follows the kind, not the name."""
    rows = {row["method"]: row for row in method_table()}
    for adapter in ADAPTERS:
        for kind in Kind:
            cells = {rows[m.name][adapter.family] for m in registry.METHODS.values()
                     if m.kind is kind and not m.interpolates and not m.per_sequence}
            refused = {c for c in cells if c.startswith("error: ")}
            assert len(refused) <= 1, (adapter.family, kind, refused)


def test_a_new_frequency_method_is_one_declaration(made_up):
    rows = {row["method"]: row for row in method_table()}
    assert rows["made-up"]["rotary"] == "yes: frequencies / 3f"
    assert rows["made-up"]["sincos"] == "yes: table of frequencies / 3f"
    for family in ("gpt2", "gpt-neo", "offset-table", "bloom", "mpt", "falcon-alibi"):
        assert rows["made-up"][family] == rows["ntk"][family], family  # the generic refusal of its kind
    assert adapter_for_family("gpt2").reason("made-up") == "not rotary"
    assert ctxext.available_methods()["made-up"] == ["rotary", "sincos"]


def test_a_new_frequency_method_patches_a_rotary_model_and_is_refused_elsewhere(made_up):
    model = tiny_llama()
    ids = torch.arange(12)[None]
    module = model.model.rotary_emb
    before = module.inv_freq.clone()
    logits = model(ids).logits
    ctxext.patch(model, "made-up", 2)
    assert torch.allclose(module.inv_freq, before / 6)
    assert ctxext.describe(model)["method"] == "made-up"
    ctxext.unpatch(model)
    assert torch.equal(module.inv_freq, before) and torch.equal(model(ids).logits, logits)

    with pytest.raises(ctxext.PatchError, match=r"method 'made-up' does not fit .*: not rotary\. Methods that do: "
                                                r"pi, alibi, nope, extrapolate"):
        ctxext.patch(tiny_gpt2(), "made-up", 2)
