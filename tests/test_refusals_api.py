"""Bad input to the Python API, table-driven: each call raises ``ctxext.PatchError`` (a ``ValueError``) with a clear
message and leaves the model exactly as it was (parameters and buffers bit for bit, ``config.to_dict()``, logits,
the active patch)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable

import numpy as np
import pytest
import torch
from conftest import tiny_bloom, tiny_gpt2, tiny_llama
from torch import nn

import ctxext
from ctxext import PatchError
from ctxext.api import build_spec, take_saved_spec
from ctxext.methods.registry import MAX_FACTOR

NOT_HF = r"needs a transformers model \(an nn\.Module with a transformers PretrainedConfig as \.config"


class _FakeConfigModel(nn.Module):
    """An nn.Module with a ``.config`` that is not a transformers config."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"max_position_embeddings": 64})()
        self.linear = nn.Linear(4, 4)


def _linear():
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def _patched_llama():
    return ctxext.patch(tiny_llama(), "pi", 4)


@dataclass
class Case:
    id: str
    make: Callable[[], Any]
    call: Callable[[Any], Any]
    message: str


CASES = [
    # -- not a transformers model: every entry point
    Case("patch-linear", _linear, lambda m: ctxext.patch(m, "pi", 2), NOT_HF + r".*got Linear with no \.config"),
    Case("patch-string", lambda: "a string", lambda m: ctxext.patch(m, "pi", 2), NOT_HF + r".*got 'a string'"),
    Case("patch-none", lambda: None, lambda m: ctxext.patch(m, "pi", 2), NOT_HF + r".*got None"),
    Case("factor-int-past-float", tiny_llama, lambda m: ctxext.patch(m, "yarn", 10**400),
         r"factor must be a finite number >= 1, got inf"),
    Case("patch-fake-config", _FakeConfigModel, lambda m: ctxext.patch(m, "pi", 2),
         r"ctxext.patch needs a transformers model.*got _FakeConfigModel with a \.config of type Config"),
    # a patch that runs inside ctxext's attention: another implementation set afterwards would silently drop it
    Case("set-attn-after-self-extend", lambda: ctxext.patch(tiny_llama(), "self-extend", 4),
         lambda m: m.set_attn_implementation("eager"), r"'self-extend' patch runs this model's attention as"),
    Case("set-attn-after-alibi-gpt2", lambda: ctxext.patch(tiny_gpt2(), "alibi", 4),
         lambda m: m.set_attn_implementation("sdpa"), r"'alibi' patch runs this model's attention as 'ctxext_alibi'"),
    Case("set-attn-after-temperature", lambda: ctxext.patch(tiny_llama(), "yarn", 4, temperature="logn"),
         lambda m: m.set_attn_implementation("sdpa"), r"call ctxext\.unpatch\(model\) first"),
    Case("unpatch-linear", _linear, ctxext.unpatch, r"ctxext\.unpatch " + NOT_HF),
    Case("describe-string", lambda: "a string", ctxext.describe, r"ctxext\.describe " + NOT_HF),
    Case("available-methods-linear", _linear, ctxext.available_methods, r"ctxext\.available_methods needs"),
    Case("build-spec-linear", _linear, lambda m: build_spec(m, "pi", 2), r"ctxext\.build_spec needs"),
    Case("take-saved-spec-linear", _linear, take_saved_spec, r"ctxext\.take_saved_spec needs"),
    Case("patched-linear", _linear, lambda m: ctxext.patched(m, "pi", 2).__enter__(), r"ctxext\.patch needs"),
    Case("dynamic-length-linear", _linear, lambda m: ctxext.dynamic_length(m, 100).__enter__(),
         r"ctxext\.dynamic_length needs"),
    # -- options: a whole-number option past 2**31 - 1 (it overflowed inside the position map)
    Case("self-extend-group-1e30", tiny_llama, lambda m: ctxext.patch(m, "self-extend", 4, group=10**30),
         r"option 'group' of method 'self-extend' must be between -2147483647 and 2147483647, got 10{30}$"),
    Case("self-extend-group-past-float", tiny_llama, lambda m: ctxext.patch(m, "self-extend", 4, group=10**400),
         r"option 'group' of method 'self-extend' is out of range"),
    # -- factors: numbers only, 1 <= factor <= MAX_FACTOR
    Case("factor-string", tiny_llama, lambda m: ctxext.patch(m, "pi", "4"),
         r"factor must be a number, not the string '4': pass factor=4$"),
    Case("factor-word", tiny_llama, lambda m: ctxext.patch(m, "yarn", "four"),
         r"factor must be a number, not the string 'four': pass e\.g\. factor=4"),
    Case("factor-bool", tiny_llama, lambda m: ctxext.patch(m, "pi", True), r"factor must be a number.*got True \(bool\)"),
    Case("factor-false-optional", tiny_gpt2, lambda m: ctxext.patch(m, "nope", False),
         r"factor must be a number.*got False"),
    Case("factor-numpy-bool", tiny_llama, lambda m: ctxext.patch(m, "pi", np.bool_(True)), r"factor must be a number"),
    Case("factor-list", tiny_llama, lambda m: ctxext.patch(m, "pi", [2]), r"factor must be a number.*\(list\)"),
    Case("factor-tensor-1d", tiny_llama, lambda m: ctxext.patch(m, "pi", torch.tensor([2.0])),
         r"factor must be a number.*\(Tensor\)"),
    Case("factor-1e9", tiny_llama, lambda m: ctxext.patch(m, "pi", 1e9),
         rf"factor 1e\+09 is above the maximum {MAX_FACTOR} for method 'pi'.*between 1 and {MAX_FACTOR}"),
    Case("factor-2000-gpt2", tiny_gpt2, lambda m: ctxext.patch(m, "extrapolate", 2000), r"above the maximum 1024"),
    Case("factor-2000-bloom-optional", tiny_bloom, lambda m: ctxext.patch(m, "nope", 2000), r"above the maximum"),
    Case("factor-nan", tiny_llama, lambda m: ctxext.patch(m, "ntk", math.nan), r"factor must be a finite number"),
    Case("factor-numpy-inf", tiny_llama, lambda m: ctxext.patch(m, "ntk", np.float64("inf")), r"finite"),
    Case("factor-below-1", tiny_bloom, lambda m: ctxext.patch(m, "pi", 0.5), r"factor must be >= 1 .*got 0\.5"),
    Case("factor-missing", tiny_gpt2, lambda m: ctxext.patch(m, "pi"), r"method 'pi' needs a factor"),
    # -- methods and options
    Case("unknown-method", tiny_llama, lambda m: ctxext.patch(m, "rope-magic", 2),
         r"unknown method 'rope-magic'; choose one of pi \(alias linear\), ntk"),
    Case("method-not-a-string", tiny_llama, lambda m: ctxext.patch(m, 4, 2), r"method must be a string, got int"),
    Case("method-unfit-gpt2", tiny_gpt2, lambda m: ctxext.patch(m, "yarn", 2),
         r"method 'yarn' does not fit GPT2LMHeadModel .*not rotary\. Methods that do: pi, alibi, nope, extrapolate"),
    Case("method-unfit-bloom", tiny_bloom, lambda m: ctxext.patch(m, "alibi"), r"already ALiBi"),
    Case("unknown-option", tiny_llama, lambda m: ctxext.patch(m, "yarn", 2, beta_fats=3),
         r"unknown option\(s\) beta_fats for method 'yarn'; accepted: beta_fast"),
    Case("option-for-optionless-method", tiny_gpt2, lambda m: ctxext.patch(m, "pi", 2, beta_fast=3),
         r"accepted: none"),
    Case("option-bad-type", tiny_llama, lambda m: ctxext.patch(m, "yarn", 2, beta_fast="fast"),
         r"option 'beta_fast' of method 'yarn' must be a number, got 'fast'"),
    Case("option-bool-for-number", tiny_llama, lambda m: ctxext.patch(m, "llama3", 2, low_freq_factor=True),
         r"option 'low_freq_factor' of method 'llama3' must be a number, got True"),
    Case("option-bad-bool", tiny_llama, lambda m: ctxext.patch(m, "yarn", 2, truncate="maybe"),
         r"option 'truncate' of method 'yarn' must be true or false"),
    Case("option-nan", tiny_llama, lambda m: ctxext.patch(m, "yarn", 2, attention_factor=math.nan), r"must be finite"),
    Case("replace-not-bool", tiny_llama, lambda m: ctxext.patch(m, "pi", 2, replace="yes"),
         r"replace must be True or False"),
    # -- state
    Case("patch-a-patched-model", _patched_llama, lambda m: ctxext.patch(m, "ntk", 2),
         r"model is already patched \(pi, factor 4\.0\); call ctxext\.unpatch\(model\) first or pass replace=True"),
    Case("bad-replace-keeps-patch", _patched_llama, lambda m: ctxext.patch(m, "ntk", 1e9, replace=True),
         r"above the maximum"),
    Case("unpatch-unpatched", tiny_gpt2, ctxext.unpatch, r"model is not patched by ctxext"),
    Case("dynamic-length-not-dynamic", _patched_llama, lambda m: ctxext.dynamic_length(m, 200).__enter__(),
         r"dynamic_length needs a model patched with method 'dynamic-ntk'"),
]


def _snapshot(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, nn.Module):
        return {"object": obj}
    tensors = {n: t.detach().clone() for n, t in chain(obj.named_parameters(), obj.named_buffers())}
    snap: dict[str, Any] = {"tensors": tensors, "state_dict": {k: v.clone() for k, v in obj.state_dict().items()}}
    config = getattr(obj, "config", None)
    if hasattr(config, "to_dict"):
        snap["config"] = config.to_dict()
        snap["describe"] = ctxext.describe(obj)
        ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            snap["logits"] = obj(ids).logits
    return snap


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key in ("tensors", "state_dict"):
        if key in before:
            assert before[key].keys() == after[key].keys()
            for name, tensor in before[key].items():
                assert torch.equal(tensor, after[key][name]), f"{key}: {name} changed"
    for key in ("config", "describe", "object"):
        if key in before:
            assert before[key] == after[key], f"{key} changed"
    if "logits" in before:
        assert torch.equal(before["logits"], after["logits"])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_api_input_is_refused_and_changes_nothing(case: Case):
    obj = case.make()
    before = _snapshot(obj)
    with pytest.raises(PatchError, match=case.message) as info:
        case.call(obj)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400  # one clear line
    _assert_same(before, _snapshot(obj))


def test_at_least_ten_cases_and_unique_ids():
    assert len(CASES) >= 10 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    "factor",
    [2, 2.0, np.int64(2), np.float32(2.0), torch.tensor(2), torch.tensor(2.0, dtype=torch.float64), MAX_FACTOR],
    ids=["int", "float", "np.int64", "np.float32", "torch-int", "torch-float64", "max"],
)
def test_number_like_factors_are_accepted(factor):
    model = tiny_llama()
    ctxext.patch(model, "pi", factor)
    spec = ctxext.describe(model)
    assert type(spec["factor"]) is float and spec["factor"] == float(factor)
    assert model.config.max_position_embeddings == int(64 * float(factor))


def test_cli_style_validate_factor_keeps_its_signature():
    """The CLI converts its strings to floats and calls registry.validate_factor(method_info, value)."""
    from ctxext.methods.registry import METHODS, validate_factor

    assert validate_factor(METHODS["yarn"], 4.0) == 4.0
    assert validate_factor(METHODS["nope"], None) is None
    with pytest.raises(PatchError, match="above the maximum 1024"):
        validate_factor(METHODS["yarn"], float(MAX_FACTOR) + 1)


def test_peft_wrapped_non_hf_model_is_refused():
    """Unwrapping a peft-like wrapper still needs a transformers model inside."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def get_base_model(self):
            return self.inner

    with pytest.raises(PatchError, match=r"got Linear with no \.config"):
        ctxext.patch(Wrapper(), "pi", 2)


@pytest.mark.parametrize("make, method", [(tiny_llama, "yarn"), (tiny_llama, "self-extend"), (tiny_gpt2, "pi")])
def test_a_model_on_the_meta_device_is_refused_where_the_patch_reads_values(make, method):
    """A bare NotImplementedError ("Cannot copy out of meta tensor") before; now a PatchError that says why, with
    the model and its config unchanged."""
    with torch.device("meta"):
        model = make()
    config = model.config.to_dict()
    with pytest.raises(PatchError, match="meta device .*load the weights first"):
        ctxext.patch(model, method, 4)
    assert model.config.to_dict() == config and ctxext.describe(model) is None


def test_peft_modules_to_save_over_the_position_table_is_named_and_changes_nothing():
    """peft's modules_to_save=["wpe"] wraps GPT-2's position table: the refusal says so (it said "no positional
    surface ctxext knows"), and the model, wrapper included, is left as it was."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["wpe"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PatchError, match=r"modules_to_save wraps .*transformer\.wpe.*patch the model before get_peft_model"):
        ctxext.patch(model, "pi", 2)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert type(model.base_model.model.transformer.wpe).__name__ == "ModulesToSaveWrapper"
