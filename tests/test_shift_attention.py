"""LongLoRA's shifted sparse attention (S²-Attn, ``ctxext.attention.shifted_sparse``; issue 25): equal to a dense
reference of grouped plus half-shifted causal attention written here from the definition (no wrap-around), for the
function, a tiny Llama's training forward and its gradients, over a frequency patch too; full attention, bit-identical,
in evaluation and ``generate`` and after the undo; refusals that change nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama

import ctxext
from ctxext.attention import shifted_sparse as s2
from ctxext.compat import transformers as hf_compat

DENSE = "ctxext_test_s2_dense"


# -- the dense reference, from the definition -------------------------------------------------------------------------


def groups_of(length: int, group: int, shifted: bool) -> list[range]:
    """The groups as explicit ranges: [0, G), [G, 2G), ...; shifted: [0, G/2), [G/2, 3G/2), ..., [T - G/2, T)."""
    if not shifted:
        bounds = list(range(0, length + 1, group))
    else:
        bounds = [0] + list(range(group // 2, length, group)) + [length]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def reference_allowed(length: int, group: int, heads: int) -> torch.Tensor:
    """(heads, T, T) boolean: query i sees key j iff j <= i and both are in one group; the first heads // 2 heads
    use the plain groups, the others the shifted ones."""
    masks = []
    for shifted in (False, True):
        allowed = torch.zeros(length, length, dtype=torch.bool)
        for g in groups_of(length, group, shifted):
            for i in g:
                for j in g:
                    allowed[i, j] = j <= i
        masks.append(allowed)
    split = heads // 2
    return torch.stack([masks[0]] * split + [masks[1]] * (heads - split))


def reference_attention(q, k, v, group: int, scaling: float) -> torch.Tensor:
    """Dense masked softmax attention, (B, H, T, d) -> (B, T, H, d), GQA by repeating key/value heads."""
    heads, length = q.shape[1], q.shape[2]
    n_rep = heads // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~reference_allowed(length, group, heads).to(q.device), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_reference_groups_do_not_wrap_around():
    assert groups_of(16, 4, False) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    assert groups_of(16, 4, True) == [range(0, 2), range(2, 6), range(6, 10), range(10, 14), range(14, 16)]
    allowed = reference_allowed(16, 4, 2)
    assert not allowed[1].triu(1).any()  # causal: no future key in any head
    assert allowed[1, 15, 14] and not allowed[1, 15, 13] and allowed[1, 13, 10] and not allowed[1, 1, 15]


@pytest.fixture(scope="module")
def dense_attention():
    """A dense-reference attention function registered for a model in training (the same ShiftState ratio)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def dense(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        assert dropout == 0.0
        if attention_mask is not None:  # transformers 4.x builds the plain causal mask that 5.x leaves to is_causal
            causal = torch.ones(query.shape[2], query.shape[2], dtype=torch.bool).tril()
            assert torch.equal(attention_mask, causal.expand_as(attention_mask))
        group = module.test_group
        return reference_attention(query, key, value, group, scaling), None

    AttentionInterface.register(DENSE, dense)
    AttentionMaskInterface.register(DENSE, sdpa_mask)
    return DENSE


def use_dense(model, group: int):
    for layer in s2.attention_layers(model):
        layer.test_group = group
    model.set_attn_implementation(DENSE)
    return model


# -- the function ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (9, 3), (5, 5), (4, 4)])
@pytest.mark.parametrize("length,ratio", [(16, 0.25), (16, 0.5), (8, 1.0), (32, 0.125)])
def test_function_equals_dense_reference(heads, kv_heads, length, ratio):
    g = torch.Generator().manual_seed(heads * 100 + length)
    q = torch.randn(2, heads, length, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, length, 8, generator=g) for _ in range(2))
    group = s2.group_size(length, ratio)
    out = s2.shifted_sparse_attention(q, k, v, group, scaling=0.3)
    assert out.shape == (2, length, heads, 8)
    torch.testing.assert_close(out, reference_attention(q, k, v, group, 0.3), rtol=1e-5, atol=1e-5)


def test_function_gradient_equals_dense_reference():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 16, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    weights = torch.randn(1, 16, 4, 8, generator=g)
    (s2.shifted_sparse_attention(q, k, v, 4, scaling=0.25) * weights).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (reference_attention(q, k, v, 4, 0.25) * weights).sum().backward()
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)


def test_no_token_sees_a_later_one():
    """Changing the last token changes no earlier output (LongLoRA's torch.roll would leak it into the first
    half-group of the shifted heads)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 5.0
    a = s2.shifted_sparse_attention(q, k, v, 4)
    b = s2.shifted_sparse_attention(q, k2, v2, 4)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


def test_dropout_is_honoured():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))
    plain = s2.shifted_sparse_attention(q, k, v, 4)
    torch.manual_seed(0)
    dropped = s2.shifted_sparse_attention(q, k, v, 4, dropout=0.5)
    torch.manual_seed(0)
    again = s2.shifted_sparse_attention(q, k, v, 4, dropout=0.5)
    assert torch.equal(dropped, again) and not torch.allclose(dropped, plain)


# -- a tiny Llama -------------------------------------------------------------------------------------------------


def _ids(batch=2, length=16, seed=1):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _train_pass(model, ids):
    model.train()
    model.zero_grad()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_same_training(a, b):
    (la, lossa, ga), (lb, lossb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lossa, lossb, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_training_forward_and_gradients_equal_dense_reference(dense_attention, base):
    model = tiny_llama(attn_implementation=base)
    reference = use_dense(copy.deepcopy(model), 4)
    s2.enable_shift_attention(model, 0.25)
    ids = _ids()
    _assert_same_training(_train_pass(model, ids), _train_pass(reference, ids))


def test_training_differs_from_full_attention():
    """The shift is not a no-op: the training forward differs from the model's full attention."""
    model = tiny_llama()
    full = copy.deepcopy(model).train()
    s2.enable_shift_attention(model)
    ids = _ids()
    with torch.no_grad():
        assert not torch.allclose(model.train()(ids).logits, full(ids).logits, atol=1e-3)


@pytest.mark.parametrize("method,factor", [("pi", 4), ("yarn", 4)])
def test_composes_with_a_frequency_patch(dense_attention, method, factor):
    model = tiny_llama()
    ctxext.patch(model, method=method, factor=factor)
    reference = use_dense(copy.deepcopy(model), 8)
    undo = s2.enable_shift_attention(model, 0.25)
    ids = _ids(length=32)
    _assert_same_training(_train_pass(model, ids), _train_pass(reference, ids))
    undo()
    assert ctxext.describe(model)["method"] == method
    ctxext.unpatch(model)
    assert hf_compat.attn_implementation(model.config) == "sdpa"


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_evaluation_generate_and_undo_are_bit_identical(base):
    model = tiny_llama(attn_implementation=base)
    ids = _ids(length=13)  # a length that does not split into groups: evaluation never groups
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: evaluation takes it as the model does
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    generated = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    stored = hf_compat.stored_attn_implementation(model.config)

    undo = s2.enable_shift_attention(model)
    assert hf_compat.attn_implementation(model.config) == f"ctxext_shift_{base}"
    model.train()
    model(_ids(), labels=_ids()).loss.backward()  # a training step's forward and backward in between
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, before)
    assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False), generated)

    undo()
    assert hf_compat.stored_attn_implementation(model.config) == stored
    assert not any(s2.STATE_ATTR in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, before)
    assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False), generated)


def test_context_manager_restores_after_an_error():
    model = tiny_llama()
    with pytest.raises(RuntimeError, match="inside"):
        with s2.shift_attention(model, 0.5):
            assert hf_compat.attn_implementation(model.config) == "ctxext_shift_sdpa"
            raise RuntimeError("inside")
    assert hf_compat.attn_implementation(model.config) == "sdpa"
    assert not any(s2.STATE_ATTR in vars(m) for m in model.modules())


def test_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    undo = s2.enable_shift_attention(wrapped)
    assert hf_compat.attn_implementation(model.config) == "ctxext_shift_sdpa"
    wrapped.train()
    wrapped(input_ids=_ids(), labels=_ids()).loss.backward()
    undo()
    assert hf_compat.attn_implementation(model.config) == "sdpa"


# -- refusals -----------------------------------------------------------------------------------------------------


def _snapshot(model):
    return (hf_compat.stored_attn_implementation(model.config),
            [sorted(k for k in vars(m) if k.startswith("_ctxext")) for m in model.modules()])


@pytest.mark.parametrize("length,ratio,reason", [
    (30, 0.25, r"30 tokens do not split into 4 groups.*multiple of 8"),
    (12, 0.25, r"12 tokens do not split into 4 groups of an even size"),
    (1, 1.0, r"at least 2"),
    (16, 0.0, r"in \(0, 1\]"),
    (16, 1.5, r"in \(0, 1\]"),
    (16, -0.25, r"in \(0, 1\]"),
    (16, 0.3, r"does not split a sequence into whole groups; use 1/n"),
    (16, float("nan"), r"a number in \(0, 1\]"),
    (16, True, r"a number in \(0, 1\]"),
    (16, "0.25", r"a number in \(0, 1\]"),
])
def test_check_refuses_lengths_and_ratios(length, ratio, reason):
    model = tiny_llama()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=reason):
        s2.check_shift_attention(length, ratio, model=model)
    assert _snapshot(model) == before


def test_check_accepts_and_gives_the_group_size():
    assert s2.check_shift_attention(32768, 0.25, "yarn", model=tiny_llama()) == 8192
    assert s2.check_shift_attention(16, 1.0) == 16
    assert s2.check_shift_attention(None, 0.125, "pi") is None


@pytest.mark.parametrize("method", ["self-extend", "dca", "rerope", "lm-infinite", "streaming-llm", "string",
                                    "alibi"])
def test_check_refuses_a_method_that_owns_the_attention(method):
    with pytest.raises(ValueError, match=rf"method {method} \((remap|bias)\) computes the attention"):
        s2.check_shift_attention(64, 0.25, method)


@pytest.mark.parametrize("method,factor", [("self-extend", 4), ("dca", 4), ("alibi", 4)])
def test_enable_refuses_a_model_whose_patch_owns_the_attention(method, factor):
    model = tiny_llama()
    ctxext.patch(model, method, factor)
    before = _snapshot(model)
    ids = _ids(length=16)
    with torch.no_grad():
        logits = model(ids).logits
    with pytest.raises(ValueError, match=rf"patched with {method} .* shift attention would replace it"):
        s2.enable_shift_attention(model)
    with pytest.raises(ValueError, match=rf"patched with {method}"):
        s2.check_shift_attention(16, 0.25, model=model)
    assert _snapshot(model) == before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_enable_refuses_twice_a_bad_ratio_and_other_implementations():
    model = tiny_llama()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="use 1/n"):
        s2.enable_shift_attention(model, 0.3)
    assert _snapshot(model) == before
    undo = s2.enable_shift_attention(model)
    enabled = _snapshot(model)
    with pytest.raises(ValueError, match="already enabled"):
        s2.enable_shift_attention(model)
    assert _snapshot(model) == enabled
    undo()
    flex = tiny_llama(attn_implementation="flex_attention")
    before = _snapshot(flex)
    with pytest.raises(ValueError, match=r"implementation 'flex_attention'.*sdpa or eager"):
        s2.enable_shift_attention(flex)
    assert _snapshot(flex) == before
    with pytest.raises(ValueError, match="needs a transformers model"):
        s2.enable_shift_attention(torch.nn.Linear(2, 2))


def test_training_refuses_what_it_cannot_honour():
    model = tiny_llama()
    s2.enable_shift_attention(model)
    model.train()
    with pytest.raises(ValueError, match="30 tokens do not split into 4 groups"):
        model(_ids(length=30))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="not plain causal"):
        model(_ids(), attention_mask=mask)
    model(_ids(), attention_mask=torch.ones(2, 16, dtype=torch.long))  # an all-ones mask is plain causal
    causal = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 1, 16, 16)
    model(_ids(), attention_mask=causal)  # a ready 4D boolean mask (transformers 4.x builds one)
    with pytest.raises(ValueError, match="not plain causal"):
        model(_ids(), attention_mask=causal & (torch.arange(16) > 0))  # the first key masked
    eager = tiny_llama(attn_implementation="eager")
    s2.enable_shift_attention(eager)
    eager.train()
    eager(_ids(), attention_mask=torch.ones(2, 16, dtype=torch.long))  # eager's full causal float mask
    with pytest.raises(ValueError, match="not plain causal"):
        eager(_ids(), attention_mask=mask)
    packed = torch.cat([torch.arange(8), torch.arange(8)])[None].expand(2, -1)  # two packed sequences per row
    with pytest.raises(ValueError, match="not plain causal"):
        model(_ids(), position_ids=packed, use_cache=False)  # transformers builds packing into the mask without a cache


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_llama()
    checkpointed = copy.deepcopy(model)
    enable = getattr(checkpointed, "activation_checkpointing_enable", None)  # the 5.x name; 4.x has the older one
    (enable or checkpointed.gradient_checkpointing_enable)()
    s2.enable_shift_attention(model)
    s2.enable_shift_attention(checkpointed)
    ids = _ids()
    _assert_same_training(_train_pass(checkpointed, ids), _train_pass(model, ids))


def test_a_save_while_enabled_loads_as_the_plain_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    s2.enable_shift_attention(model)
    model.save_pretrained(tmp_path)
    assert "ctxext_shift" not in (tmp_path / "config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf_compat.attn_implementation(loaded.config) == "sdpa"


@pytest.mark.parametrize("method,factor", [("self-extend", 4), ("alibi", 4)])
def test_an_attention_patch_is_refused_while_enabled(method, factor):
    """Else the patch would replace the shift attention, and the shift attention's undo would then put back sdpa
    over the patch's attention."""
    model = tiny_llama()
    undo = s2.enable_shift_attention(model)
    enabled = _snapshot(model)
    with pytest.raises(ValueError, match="shift attention .* is enabled on this model; undo it"):
        ctxext.patch(model, method, factor)
    assert _snapshot(model) == enabled and ctxext.describe(model) is None
    undo()
    ctxext.patch(model, method, factor)
