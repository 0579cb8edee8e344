"""A patched model's state is its own and follows what is done to the model while patched: a config shared with
another model is not written through, weights loaded / moved / cast while patched are the ones used and the ones
unpatch leaves, and a float64 model runs the ALiBi swap."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama, tiny_llama_config

import ctxext
from ctxext.core.errors import PatchError


@pytest.mark.parametrize("method, factor", [("alibi", 4), ("self-extend", 4), ("yarn", 4), ("pi", 2)])
def test_a_config_shared_with_another_model_is_not_written_through(method, factor):
    """transformers does not copy the config a model is built from: two models built from one config share it."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    torch.manual_seed(0)
    a, b = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    assert a.config is b.config
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    before, a_logits, b_logits = config.to_dict(), a(ids).logits, b(ids).logits
    ctxext.patch(a, method, factor)
    assert config.to_dict() == before and ctxext.describe(b) is None
    assert torch.equal(b(ids).logits, b_logits)
    assert all(m.config is a.config for m in a.modules() if "config" in vars(m))  # every layer reads the same one
    patched = a(ids).logits
    ctxext.patch(b, "pi", 2)
    ctxext.unpatch(b)  # the sibling's patch and unpatch leave a's record and behaviour alone
    assert ctxext.describe(a)["method"] == method and a.config.ctxext["method"] == method
    assert torch.equal(a(ids).logits, patched)
    ctxext.unpatch(a)
    assert torch.equal(a(ids).logits, a_logits) and a.config.to_dict() == before


def test_a_refused_patch_leaves_the_config_object_alone():
    model = tiny_llama()
    config = model.config
    with pytest.raises(PatchError):
        ctxext.patch(model, "yarn", 4, beta_fast=0)
    assert model.config is config and all(m.config is config for m in model.modules() if "config" in vars(m))


def _opt(seed: int):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32,
                                    bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()


LEARNED = {"gpt2": tiny_gpt2, "opt": _opt}


@pytest.mark.parametrize("family", LEARNED)
@pytest.mark.parametrize("method", ["pi", "extrapolate"])
def test_weights_loaded_into_a_patched_learned_table_are_used(family, method):
    """load_state_dict into a patched model = load first, then patch (the table is the new weights')."""
    make = LEARNED[family]
    ids = torch.randint(2, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    expected = ctxext.patch(make(1), method, 2)(ids).logits
    model = ctxext.patch(make(0), method, 2)
    model.load_state_dict(make(1).state_dict())
    assert torch.equal(model(ids).logits, expected)


@pytest.mark.parametrize("family", LEARNED)
def test_unpatch_keeps_weights_replaced_while_patched(family):
    make = LEARNED[family]
    other = make(1)
    model = ctxext.patch(make(0), "pi", 2)
    model.load_state_dict(other.state_dict(), assign=True)  # new parameter objects, not copies into the old ones
    ctxext.unpatch(model)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())
    ids = torch.randint(2, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(ids).logits, other(ids).logits)


@pytest.mark.parametrize("family", LEARNED)
def test_a_move_or_cast_while_patched_is_kept_by_unpatch(family):
    model = ctxext.patch(LEARNED[family](0), "pi", 2)
    model.to("meta")
    ctxext.unpatch(model)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    model = ctxext.patch(LEARNED[family](0), "pi", 2)
    model.train()
    ctxext.unpatch(model)
    assert all(m.training for m in model.modules())  # the position table too
    model = ctxext.patch(LEARNED[family](0), "pi", 2).double()
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    cast_first = ctxext.patch(LEARNED[family](0).double(), "pi", 2)
    assert torch.equal(model(ids).logits, cast_first(ids).logits)  # the table follows the cast weights
    ctxext.unpatch(model)
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_gpt_neo_masks_follow_a_move_while_patched():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                          attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=32,
                          bos_token_id=0, eos_token_id=0)
    model = ctxext.patch(GPTNeoForCausalLM(config).eval(), "pi", 2)
    model.to("meta")
    ctxext.unpatch(model)
    assert {b.device.type for _, b in model.named_buffers()} == {"meta"}


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_the_alibi_swap_runs_in_float64(make):
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    single = ctxext.patch(make(), "alibi", 2)(ids).logits
    double = ctxext.patch(make().double(), "alibi", 2)(ids).logits
    assert double.dtype == torch.float64
    torch.testing.assert_close(double.float(), single, atol=1e-5, rtol=1e-5)


def test_a_deep_copy_of_a_patched_learned_table_follows_its_own_weights():
    model = ctxext.patch(tiny_gpt2(0), "pi", 2)
    twin = copy.deepcopy(model)
    twin.load_state_dict(tiny_gpt2(1).state_dict())
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    assert torch.equal(model(ids).logits, ctxext.patch(tiny_gpt2(0), "pi", 2)(ids).logits)
    assert torch.equal(twin(ids).logits, ctxext.patch(tiny_gpt2(1), "pi", 2)(ids).logits)


@pytest.mark.parametrize("method, options", [("self-extend", {}), ("alibi", {}), ("yarn", {"temperature": "logn"})])
def test_the_attention_implementation_can_be_set_again_after_unpatch_and_on_a_copy(method, options):
    """While patched, another attention implementation is refused (it would run the model without the patch); after
    unpatch it is the user's again, on the model and on a deep copy unpatched on its own."""
    model = tiny_llama().eval()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    ctxext.patch(model, method, 4, **options)
    twin = copy.deepcopy(model)
    ctxext.unpatch(model)
    with pytest.raises(PatchError, match="runs this model's attention"):  # the copy keeps its own patch and guard
        twin.set_attn_implementation("eager")
    with pytest.raises(PatchError, match="runs this model's attention"):  # the transformers model inside it too
        twin.model.set_attn_implementation("eager")
    with pytest.raises(PatchError, match="cannot be pickled"):  # a pickle of the inner model loaded without its guard
        pickle.dumps(twin.model)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    ctxext.unpatch(twin)
    twin.set_attn_implementation("eager")
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
