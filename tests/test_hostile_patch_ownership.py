"""Issue 51, cases 1, 2, 3 and 9: a patch never silently differs from what ``describe`` says.

1. two threads patching one model: check and apply are one step, and ``unpatch`` restores the original bit-exactly;
2. two models sharing a module object: patching a module another patched model owns is refused, naming that model;
3. patching the inner base model (``patch(m.model, ...)``): ``describe``, ``patch`` and ``unpatch`` of the outer
   model see that patch;
9. temperature parameters are bounded (``beta``, ``s``, ``floor``), and a non-finite factor is refused."""

from __future__ import annotations

import copy
import gc
import threading
import time

import pytest
import torch
from conftest import tiny_llama

import ctxext
import ctxext.api as api
from ctxext.core.errors import PatchError
from ctxext.methods import temperature

IDS = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _state(model) -> dict:
    """What unpatch must put back: every tensor and the config's values."""
    return {"tensors": {k: v.clone() for k, v in model.state_dict().items()}, "config": model.config.to_dict()}


def _same_state(model, state: dict) -> bool:
    now = model.state_dict()
    return (now.keys() == state["tensors"].keys() and all(torch.equal(now[k], v) for k, v in state["tensors"].items())
            and model.config.to_dict() == state["config"])


# -- 1. two threads patch one model ----------------------------------------------------------------------------------


def _slow_build_spec(monkeypatch):
    """Widen the window between the check and the apply, so that without a lock both threads pass the check."""
    original = api.build_spec

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return original(*args, **kwargs)

    monkeypatch.setattr(api, "build_spec", slow)


def _race(calls):
    """Run the calls in threads started together; returns each one's result or exception, in order."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def run(i, call):
        barrier.wait()
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_two_threads_patching_one_model_one_is_refused_and_unpatch_restores(monkeypatch):
    model = tiny_llama()
    original, before = _logits(model), _state(model)
    _slow_build_spec(monkeypatch)
    results = _race([lambda: ctxext.patch(model, "yarn", 4), lambda: ctxext.patch(model, "pi", 4)])
    refused = [r for r in results if isinstance(r, Exception)]
    won = [m for m, r in zip(("yarn", "pi"), results) if r is model]
    assert len(won) == 1 and len(refused) == 1, results
    assert isinstance(refused[0], PatchError) and "already patched" in str(refused[0])
    assert ctxext.describe(model)["method"] == won[0]
    monkeypatch.undo()
    expected = _logits(ctxext.patch(tiny_llama(), won[0], 4))
    assert torch.equal(_logits(model), expected)  # the winner's patch alone, nothing stacked
    ctxext.unpatch(model)
    assert ctxext.describe(model) is None
    assert torch.equal(_logits(model), original) and _same_state(model, before)


def test_two_threads_replacing_take_turns_and_unpatch_restores(monkeypatch):
    model = tiny_llama()
    original, before = _logits(model), _state(model)
    _slow_build_spec(monkeypatch)
    results = _race([lambda: ctxext.patch(model, "yarn", 4, replace=True),
                     lambda: ctxext.patch(model, "pi", 4, replace=True)])
    assert results == [model, model]
    last = ctxext.describe(model)["method"]
    monkeypatch.undo()
    assert torch.equal(_logits(model), _logits(ctxext.patch(tiny_llama(), last, 4)))
    ctxext.unpatch(model)
    assert torch.equal(_logits(model), original) and _same_state(model, before)


def test_two_threads_unpatching_one_model_one_is_told_it_is_not_patched():
    model = tiny_llama()
    original, before = _logits(model), _state(model)
    ctxext.patch(model, "yarn", 4)
    results = _race([lambda: ctxext.unpatch(model), lambda: ctxext.unpatch(model)])
    assert sum(r is model for r in results) == 1
    assert any(isinstance(r, PatchError) and "not patched" in str(r) for r in results)
    assert torch.equal(_logits(model), original) and _same_state(model, before)


# -- 2. two models share a module object ------------------------------------------------------------------------------


def _sharing():
    a, b = tiny_llama(0), tiny_llama(1)
    b.model.rotary_emb = a.model.rotary_emb
    return a, b


@pytest.mark.parametrize("first", ["a", "b"])
def test_patching_a_module_another_patched_model_owns_is_refused_naming_it(first):
    a, b = _sharing()
    owner, other = (a, b) if first == "a" else (b, a)
    owner_before, other_before = _logits(owner), _logits(other)
    ctxext.patch(owner, "yarn", 4)
    owner_patched, other_now = _logits(owner), _logits(other)
    with pytest.raises(PatchError) as info:
        ctxext.patch(other, "pi", 4)
    message = str(info.value)
    assert f"{id(owner):#x}" in message and "LlamaForCausalLM" in message and "'model.rotary_emb'" in message
    assert "yarn" in message and "\n" not in message
    # the refusal changed nothing: neither model's logits, nor describe
    assert ctxext.describe(other) is None and ctxext.describe(owner)["method"] == "yarn"
    assert torch.equal(_logits(owner), owner_patched) and torch.equal(_logits(other), other_now)
    ctxext.unpatch(owner)  # restores both, bit-exactly
    assert torch.equal(_logits(owner), owner_before) and torch.equal(_logits(other), other_before)
    ctxext.patch(other, "pi", 4)  # the module is free again: now ``other`` owns it
    with pytest.raises(PatchError, match=f"{id(other):#x}"):
        ctxext.patch(owner, "yarn", 4)
    ctxext.unpatch(other)
    assert torch.equal(_logits(owner), owner_before) and torch.equal(_logits(other), other_before)


def test_a_module_shared_after_the_patch_is_refused_too():
    a, b = tiny_llama(0), tiny_llama(1)
    ctxext.patch(a, "yarn", 4)
    b.model.layers[0].self_attn = a.model.layers[0].self_attn
    with pytest.raises(PatchError, match=r"'model\.layers\.0\.self_attn'.*LlamaForCausalLM at 0x"):
        ctxext.patch(b, "self-extend", 4)
    assert ctxext.describe(b) is None


def test_a_deep_copy_of_a_patched_model_owns_its_own_modules():
    a = ctxext.patch(tiny_llama(0), "yarn", 4)
    twin = copy.deepcopy(a)
    ctxext.patch(a, "pi", 2, replace=True)  # the copy's modules are not a's
    b = tiny_llama(1)
    b.model.rotary_emb = twin.model.rotary_emb
    with pytest.raises(PatchError, match=f"{id(twin):#x}"):
        ctxext.patch(b, "pi", 4)
    ctxext.unpatch(twin)
    ctxext.patch(b, "pi", 4)


def test_a_patched_model_dropped_frees_the_module():
    a, b = _sharing()
    ctxext.patch(a, "yarn", 4)
    del a
    gc.collect()
    ctxext.patch(b, "pi", 4)
    assert ctxext.describe(b)["method"] == "pi"


# -- 3. the inner base model patched --------------------------------------------------------------------------------


def test_a_patch_of_the_inner_model_is_seen_by_the_outer_one():
    model = tiny_llama()
    original, before = _logits(model), _state(model)
    ctxext.patch(model.model, "yarn", 4)
    inner = _logits(model)
    assert not torch.equal(inner, original)
    assert ctxext.describe(model) == ctxext.describe(model.model) and ctxext.describe(model)["method"] == "yarn"
    with pytest.raises(PatchError, match=r"already patched: its sub-model 'model' \(LlamaModel at 0x.*yarn"):
        ctxext.patch(model, "pi", 4)  # no stacking
    assert torch.equal(_logits(model), inner)
    ctxext.unpatch(model)  # removes the inner patch
    assert ctxext.describe(model) is None and ctxext.describe(model.model) is None
    assert torch.equal(_logits(model), original) and _same_state(model, before)
    with pytest.raises(PatchError, match="not patched"):
        ctxext.unpatch(model)


def test_replace_on_the_outer_model_replaces_the_inner_patch():
    model = tiny_llama()
    original = _logits(model)
    ctxext.patch(model.model, "yarn", 4)
    inner = _logits(model)
    with pytest.raises(PatchError, match="unknown method"):  # bad input: the inner patch stays as it was
        ctxext.patch(model, "no-such-method", 4, replace=True)
    assert ctxext.describe(model.model)["method"] == "yarn" and torch.equal(_logits(model), inner)
    ctxext.patch(model, "pi", 4, replace=True)
    assert ctxext.describe(model.model) is None and ctxext.describe(model)["method"] == "pi"
    assert torch.equal(_logits(model), _logits(ctxext.patch(tiny_llama(), "pi", 4)))
    ctxext.unpatch(model)
    assert torch.equal(_logits(model), original)


def test_patching_the_inner_model_of_a_patched_model_is_refused_naming_it():
    model = ctxext.patch(tiny_llama(), "yarn", 4)
    patched = _logits(model)
    with pytest.raises(PatchError, match=rf"it is module 'model' of LlamaForCausalLM at {id(model):#x}.*yarn"):
        ctxext.patch(model.model, "pi", 4)
    assert torch.equal(_logits(model), patched) and ctxext.describe(model)["method"] == "yarn"


@pytest.mark.parametrize("method", ["dynamic-ntk", "self-extend"])
def test_the_inner_model_patched_with_any_method_unpatches_from_the_outer(method):
    model = tiny_llama()
    original = _logits(model)
    ctxext.patch(model.model, method, 4)
    assert torch.equal(_logits(model), _logits(ctxext.patch(tiny_llama(), method, 4)))
    ctxext.unpatch(model)
    assert torch.equal(_logits(model), original)


# -- 9. temperature parameters without an upper bound --------------------------------------------------------------


@pytest.mark.parametrize("options, match", [
    ({"temperature": "llama4", "beta": 1e308}, r"'beta' of temperature=llama4 is 1e\+308, above the maximum 10"),
    ({"temperature": "llama4", "beta": 10**400}, r"'beta' of temperature=llama4 must be finite"),
    ({"temperature": "ssmax", "s": 1e6}, r"'s' of temperature=ssmax is 1000000.0, above the maximum 10"),
    ({"temperature": "llama4", "floor": 10**12}, r"'floor' of temperature=llama4 is 1000000000000, above the maximum"),
])
def test_temperature_parameters_are_bounded(options, match):
    model = tiny_llama()
    original = _logits(model)
    with pytest.raises(PatchError, match=match):
        ctxext.patch(model, "yarn", 4, **options)
    assert ctxext.describe(model) is None and torch.equal(_logits(model), original)


def test_temperature_parameters_at_the_bound_are_accepted_and_finite():
    at_bound = ({"temperature": "llama4", "beta": temperature.MAX_BETA},
                {"temperature": "ssmax", "s": temperature.MAX_S})
    for options in at_bound:
        model = ctxext.patch(tiny_llama(), "yarn", 4, **options)
        assert torch.isfinite(_logits(model)).all()


def test_a_non_finite_temperature_factor_is_refused():
    with pytest.raises(PatchError, match="non-finite attention factor"):
        temperature.Temperature("llama4", 64, beta=1e308).check_finite()
    temperature.Temperature("llama4", 64, beta=temperature.MAX_BETA).check_finite()


def test_the_temperature_horizon_is_the_largest_factor():
    from ctxext.methods.registry import MAX_FACTOR

    assert temperature.HORIZON == MAX_FACTOR


@pytest.mark.parametrize("options", [{"attention_factor": 1e300}, {"attention_factor": 11.0},
                                     {"mscale": 1e300, "mscale_all_dim": 1e-300}, {"mscale_all_dim": 1e300}])
def test_yarn_temperature_options_are_bounded(options):
    """Like the temperature's beta: an unbounded yarn attention factor (or mscale) made every logit non-finite."""
    model = tiny_llama()
    with pytest.raises(ctxext.PatchError, match=f"option {next(iter(options))} of method 'yarn'"):
        ctxext.patch(model, "yarn", 4, **options)
    assert ctxext.describe(model) is None
    ctxext.patch(model, "yarn", 4, attention_factor=1.2, mscale=1.0, mscale_all_dim=0.707)  # published values stay
    assert torch.isfinite(model(torch.arange(1, 20)[None]).logits).all()
