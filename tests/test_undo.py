"""The undo list every patch builds: steps run newest first, all of them when the patch fails halfway (for any
exception, Ctrl-C included), none when it succeeds."""

from __future__ import annotations

import copy

import pytest
import torch

from ctxext.core.undo import run_all, undone_on_failure


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failing_block_runs_the_steps_collected_so_far_newest_first(failure):
    ran = []
    with pytest.raises(type(failure)):
        with undone_on_failure() as undo:
            undo.append(lambda: ran.append("first"))
            undo.append(lambda: ran.append("second"))
            raise failure
    assert ran == ["second", "first"]


def test_a_block_that_succeeds_leaves_the_steps_for_unpatch():
    ran = []
    with undone_on_failure([lambda: ran.append("given")]) as undo:
        undo.append(lambda: ran.append("added"))
    assert ran == []
    run_all(undo)
    assert ran == ["added", "given"]


def test_a_deep_copy_of_a_patched_model_undoes_itself_not_the_original():
    """Why the undo steps stay a plain list: the copy's unpatch must restore the copy (adapters.base.copy_restore)."""
    import ctxext
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 40))
    with torch.no_grad():
        before = model(ids).logits
    ctxext.patch(model, method="yarn", factor=4)
    twin = copy.deepcopy(model)
    ctxext.unpatch(twin)
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, before)  # the original stays patched
        assert torch.equal(twin(ids).logits, before)
    ctxext.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("method", ["yarn", "self-extend", "dynamic-ntk", "alibi"])
@pytest.mark.parametrize("replace", [False, True])
def test_a_patch_interrupted_after_the_adapter_applied_leaves_nothing_behind(monkeypatch, method, replace):
    """Ctrl-C between the adapter's work and the patch's record (the save hook, the config marks): the model is as it
    was (or keeps the patch a replace=True was replacing), never patched in a way unpatch cannot see."""
    import ctxext
    import ctxext.export

    model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 40))
    if replace:
        ctxext.patch(model, "pi", 2)
    with torch.no_grad():
        before = model(ids).logits
    config_before = model.config.to_dict()

    real = ctxext.export.install_save_hook
    calls = []

    def interrupted(model):  # once: putting the replaced patch back installs its hook again
        calls.append(model)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(model)

    monkeypatch.setattr(ctxext.export, "install_save_hook", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ctxext.patch(model, method, 4, replace=replace)
    monkeypatch.undo()
    assert (ctxext.describe(model) or {}).get("method") == ("pi" if replace else None)
    assert model.config.to_dict() == config_before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_unpatch_puts_back_the_users_own_instance_methods():
    """A save_pretrained / generate the user set on the instance is theirs: unpatch restores it, not the class's."""
    import types

    import ctxext

    model = _tiny_llama()
    model.save_pretrained = types.MethodType(lambda self, *a, **k: "mine", model)
    model.generate = types.MethodType(lambda self, *a, **k: "mine too", model)
    ctxext.patch(model, "dynamic-ntk", 4)  # wraps generate as well as save_pretrained
    assert model.generate.__class__.__name__ != "method"
    ctxext.unpatch(model)
    assert model.save_pretrained() == "mine" and model.generate() == "mine too"

