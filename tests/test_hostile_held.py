"""Issue 57, cases 3, 4 and 8: a model object the caller holds, under ``ctxext.evaluate``.

3. two ``evaluate`` calls on one model object in two threads: the second is refused, naming the thread that holds
   the model, and the object comes back bit-identical; the rotation probe of a check holds the patch lock, so a
   ``patch`` in another thread waits for it;
4. ``resume=True`` compares every value of the object's weights and buffers: a pruned head or values scaled past
   the 64th of a weight are refused, the same object (after the evaluation's own patches) resumes;
8. a peft ``PeftModel`` is evaluated with the remap methods and ALiBi, as its base model with the adapter patched
   directly, and as the merged model."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from test_eval_fixtures import CORPUS, save_tiny_llama

import ctxext
import ctxext.api as api
from ctxext.reference import reference_model, reference_tokenizer

#: What differs between two runs of the same rows: the clock.
TIMING = ("seconds", "tokens_per_second")
PROBE = "ctxext_rotation_probe"


def _same_rows(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _logits(model, n=48):
    ids = torch.arange(3, 3 + n).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits


def _leftovers(model) -> list[str]:
    """Instance attributes a patch, a probe or the evaluator's capture head sets on a module (none once done)."""
    return [f"{name or '<root>'}.{key}" for name, module in model.named_modules() for key in vars(module)
            if key.startswith("_ctxext") or key in ("forward", "set_attn_implementation")]


def _state(model):
    return (_logits(model), model.config.to_json_string(), model.config._attn_implementation, ctxext.describe(model),
            model.training, {k: v.clone() for k, v in model.state_dict().items()})


def _assert_given_back(model, before):
    logits, config, attention, spec, training, tensors = _state(model)
    assert torch.equal(logits, before[0])  # bit-identical
    assert (config, attention, spec, training) == before[1:5]
    assert tensors.keys() == before[5].keys() and all(torch.equal(tensors[k], v) for k, v in before[5].items())
    assert _leftovers(model) == []


def _overlapping(model, first, second, *, inside=lambda: True, wait: float = 60.0) -> dict:
    """Run ``first()`` in thread "first" and ``second()`` in thread "second", overlapping: the first waits in its
    first forward pass of layer 0 (one where ``inside()`` holds) until the second has returned, or ``wait`` s.
    {"first": result or exception, "second": ..., "overlapped": whether the first got inside}."""
    entered, done = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold(module, args):
        if threading.current_thread().name == "first" and not entered.is_set() and inside():
            entered.set()
            done.wait(timeout=wait)

    def run(name, call):
        if name == "second":
            entered.wait(timeout=60)
        try:
            outcome[name] = call()
        except Exception as exc:  # noqa: BLE001 - the caller asserts on it
            outcome[name] = exc
        finally:
            if name == "second":
                done.set()

    handle = model.model.layers[0].register_forward_pre_hook(hold)
    threads = [threading.Thread(target=run, args=(n, c), name=n) for n, c in (("first", first), ("second", second))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        handle.remove()
    outcome["overlapped"] = entered.is_set()
    return outcome


# -- 3. two threads on one model object ------------------------------------------------------------------------------


def test_a_second_evaluate_of_one_model_object_in_another_thread_is_refused():
    model, tok = reference_model("llama"), reference_tokenizer("llama")
    settings = dict(methods="none,self-extend", lengths=[128], max_tokens=128, progress=False)
    alone = ctxext.evaluate(copy.deepcopy(model), tokenizer=tok, **settings)
    before = _state(model)
    outcome = _overlapping(model, lambda: ctxext.evaluate(model, tokenizer=tok, **settings),
                           lambda: ctxext.evaluate(model, tokenizer=tok, **settings))
    assert outcome["overlapped"]  # the calls overlapped
    refused = outcome["second"]
    assert isinstance(refused, ValueError), refused
    assert "being evaluated by another ctxext.evaluate call (thread 'first')" in str(refused)
    assert "copy.deepcopy(model)" in str(refused)
    assert not isinstance(outcome["first"], Exception), outcome["first"]
    assert _same_rows(outcome["first"].rows) == _same_rows(alone.rows)  # the first call's numbers are untouched
    _assert_given_back(model, before)
    again = ctxext.evaluate(model, tokenizer=tok, **settings)  # held by no call once both returned
    assert _same_rows(again.rows) == _same_rows(alone.rows)
    _assert_given_back(model, before)


def test_a_model_object_is_held_by_no_call_after_an_error(monkeypatch):
    import ctxext.evaluation.runner as runner

    model, tok = reference_model("llama"), reference_tokenizer("llama")
    settings = dict(methods="none", lengths=[128], max_tokens=128, progress=False)
    real = runner.score_documents

    def fail(*args, **kwargs):
        raise RuntimeError("a row failed")

    monkeypatch.setattr(runner, "score_documents", fail)
    with pytest.raises(RuntimeError, match="a row failed"):
        ctxext.evaluate(model, tokenizer=tok, **settings)
    monkeypatch.setattr(runner, "score_documents", real)
    results = ctxext.evaluate(model, tokenizer=tok, **settings)
    assert [r["label"] for r in results.rows] == ["none"]


def test_a_patch_in_another_thread_waits_for_the_rotation_probe():
    """The probe (``rotating_layers``) switches the model to a recording attention for two forward passes; a patch
    that started inside it would record the probe as the model's own attention, and the probe's restore would
    switch the patched model back to sdpa with its rotation off."""
    model = reference_model("llama")
    reference = copy.deepcopy(model)
    ctxext.patch(reference, "self-extend", 2)
    expected = _logits(reference)
    before = _state(model)
    # the check's probe waits (at most a second) in its first forward pass for the patch to finish
    outcome = _overlapping(model, lambda: api.build_spec(model, "self-extend", 2),
                           lambda: ctxext.patch(model, "self-extend", 2),
                           inside=lambda: model.config._attn_implementation == PROBE, wait=1)
    assert outcome["overlapped"]
    assert outcome["second"] is model and not isinstance(outcome["first"], Exception), outcome
    assert ctxext.describe(model)["method"] == "self-extend"
    assert model.config._attn_implementation == "ctxext_remap"
    assert torch.equal(_logits(model), expected)  # the patch as a patch alone makes it
    ctxext.unpatch(model)
    _assert_given_back(model, before)


# -- 4. resume compares every value of the weights and buffers -------------------------------------------------------

RESUME = dict(methods="none,self-extend", lengths=[128], max_tokens=128, progress=False)


def _prune_a_head(model):
    """Zero the last head's columns of one o_proj: the first 64 values of the weight (its first row's) stay."""
    weight = model.model.layers[1].self_attn.o_proj.weight
    assert weight.shape[1] - model.config.head_dim >= 64
    weight[:, -model.config.head_dim:] = 0


def _scale_past_the_64th(model):
    model.model.layers[2].mlp.down_proj.weight.view(-1)[64:] *= 1.5


def _retune_rotary_buffer(model):
    model.model.rotary_emb.inv_freq.mul_(0.9)  # a buffer, no parameter: a hand-made rope change


# The hand-retuned rotary buffer runs unpatched only: transformers 4.x's rotary module lets ctxext's rotary check
# refuse yarn on it before the resume is compared (5.x reads the retuned buffer as the model's own frequencies).
@pytest.mark.parametrize("change,methods", [(_prune_a_head, "none,yarn"), (_scale_past_the_64th, "none,yarn"),
                                            (_retune_rotary_buffer, "none")])
def test_resume_refuses_a_changed_model_object(change, methods, tmp_path):
    model, tok = reference_model("llama"), reference_tokenizer("llama")
    out = tmp_path / "r.json"
    settings = dict(RESUME, methods=methods)
    first = ctxext.evaluate(model, tokenizer=tok, output=str(out), **settings)
    with torch.no_grad():
        change(model)
    with pytest.raises(ValueError, match=r"other settings \(models\[0\]\.weights_sha256\)"):
        ctxext.evaluate(model, tokenizer=tok, output=str(out), resume=True, **settings)
    changed = ctxext.evaluate(model, tokenizer=tok, output=str(tmp_path / "new.json"), **settings)
    assert [r["ppl"] for r in changed.rows] != [r["ppl"] for r in first.rows]  # the change changes the numbers


@pytest.mark.parametrize("patched", [None, "yarn", "dynamic-ntk"])
def test_resume_keeps_the_rows_of_the_same_model_object(patched, tmp_path, monkeypatch):
    """The same object resumes after the evaluation's own patch / unpatch cycles and the caller's, a copy of it
    too; a model that comes patched with dynamic NTK (frequencies the last forward pass set) as well."""
    import ctxext.evaluation.runner as runner

    model, tok = reference_model("llama"), reference_tokenizer("llama")
    settings = dict(RESUME, lengths=[128, 256], max_tokens=256)
    if patched is not None:
        ctxext.patch(model, patched, 2)
        settings.pop("methods")  # a patched object is evaluated as it is
    out = tmp_path / "r.json"
    first = ctxext.evaluate(model, tokenizer=tok, output=str(out), **settings)
    if patched is None:
        ctxext.patch(model, "yarn", 4)
        ctxext.unpatch(model)

    def no_new_rows(*args, **kwargs):
        raise AssertionError("a resumed row was recomputed")

    monkeypatch.setattr(runner, "score_documents", no_new_rows)
    for held in (model, copy.deepcopy(model)):
        resumed = ctxext.evaluate(held, tokenizer=tok, output=str(out), resume=True, **settings)
        assert _same_rows(resumed.rows) == _same_rows(first.rows)


def test_a_bfloat16_model_object_resumes_and_a_change_is_refused(tmp_path):
    model, tok = reference_model("llama").to(torch.bfloat16), reference_tokenizer("llama")
    out = tmp_path / "r.json"
    settings = dict(RESUME, methods="none")
    first = ctxext.evaluate(model, tokenizer=tok, output=str(out), **settings)
    assert _same_rows(ctxext.evaluate(model, tokenizer=tok, output=str(out), resume=True, **settings).rows) \
        == _same_rows(first.rows)
    with torch.no_grad():
        _scale_past_the_64th(model)
    with pytest.raises(ValueError, match="weights_sha256"):
        ctxext.evaluate(model, tokenizer=tok, output=str(out), resume=True, **settings)


# -- 8. a PeftModel ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


def _peft_model(directory):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(directory)
    torch.manual_seed(1)  # init_lora_weights=False: random A and B, so the adapter changes the logits
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             init_lora_weights=False)
    return peft.get_peft_model(base, config), AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("method", ["self-extend", "dca", "string", "alibi"])
def test_a_peft_model_is_evaluated_as_its_base_model_with_the_adapter(method, tiny_llama_dir):
    wrapped, tok = _peft_model(tiny_llama_dir)
    base_logits = _logits(wrapped.get_base_model(), 32)
    with wrapped.disable_adapter():
        assert not torch.allclose(_logits(wrapped, 32), base_logits)  # the adapter is in the logits
    settings = dict(lengths=[128], max_tokens=256, data=str(CORPUS), progress=False)
    before = _state(wrapped)
    held = ctxext.evaluate(wrapped, tokenizer=tok, methods=f"none,{method}", **settings)
    assert held.errors == []
    assert len(held.rows) == 2 and all(r["ppl"] is not None for r in held.rows)
    _assert_given_back(wrapped, before)

    patched = copy.deepcopy(wrapped)  # the adapter model, patched directly, evaluated as it is
    ctxext.patch(patched, method, None if method == "alibi" else 2)
    direct = ctxext.evaluate(patched, tokenizer=tok, **settings)
    assert direct.rows[0]["ppl"] == held.rows[1]["ppl"]

    merged = copy.deepcopy(wrapped).merge_and_unload()  # a plain LlamaForCausalLM with the adapter in its weights
    plain = ctxext.evaluate(merged, tokenizer=tok, methods=f"none,{method}", **settings)
    assert [r["ppl"] for r in plain.rows] == pytest.approx([r["ppl"] for r in held.rows], rel=1e-5)
