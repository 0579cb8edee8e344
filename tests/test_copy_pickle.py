"""Deep copies and pickles of patched models (issue 28).

``copy.deepcopy`` of a patched model is an independent patched model: the same logits, ``describe`` reports the patch
on both, ``unpatch`` of either (in any order) leaves the other patched and restores the unpatched one bit-exactly,
and both still save their patch. Module-level state shared by patched models (the dispatchers BLOOM and Falcon-ALiBi
install in their modeling modules) counts a copy as one more user. Pickling a patched model (``pickle.dumps``,
``torch.save``) raises ``PatchError`` naming the way to save one; an unpatched model pickles as before.

One case per method family: LLaMA-like rotary (frequency methods, remap methods, ALiBi swap, NoPE), GPT-2, BLOOM,
OPT-style, GPT-J, GPT-Neo, Falcon with ALiBi, MPT."""

from __future__ import annotations

import copy
import gc
import io
import json
import pickle

import pytest
import torch
from conftest import tiny_bloom, tiny_gpt2, tiny_llama

import ctxext
from ctxext import PatchError
from ctxext.census import build_tiny

L0 = 16  # trained length of the rotary and census tiny models below


def _llama():
    return tiny_llama(max_position_embeddings=L0)


def _census(model_type, overrides=None):
    return lambda: build_tiny(model_type, overrides)


#: case -> (builder, method, factor, input length). The input is past L0 where the plain model runs past its trained
#: length (rotary, ALiBi) so that every patch changes the logits; within the table for learned-table models.
CASES = {
    "llama-yarn": (_llama, "yarn", 4, 24),
    "llama-dynamic-ntk": (_llama, "dynamic-ntk", 4, 24),
    "llama-self-extend": (_llama, "self-extend", 4, 24),
    "llama-streaming-llm": (_llama, "streaming-llm", 4, 24),
    "llama-alibi": (_llama, "alibi", 4, 24),
    "llama-nope": (_llama, "nope", None, 24),
    "gpt2-pi": (tiny_gpt2, "pi", 2, 20),
    "gpt2-alibi": (tiny_gpt2, "alibi", 2, 20),
    "bloom-pi": (tiny_bloom, "pi", 4, 20),
    "bloom-nope": (tiny_bloom, "nope", None, 20),
    "opt-pi": (_census("opt"), "pi", 2, 12),
    "gptj-yarn": (_census("gptj"), "yarn", 2, 12),
    "gpt-neo-pi": (_census("gpt_neo"), "pi", 2, 12),
    "falcon-alibi-pi": (_census("falcon", {"alibi": True}), "pi", 2, 12),
    "mpt-pi": (_census("mpt"), "pi", 2, 12),
}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _config(model):
    """The config as a dict, less what ``save_pretrained`` itself records in it."""
    return {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "dtype", "torch_dtype")}


class Case:
    """A never-patched model and its logits, a patched twin and its logits, config and spec."""

    def __init__(self, name):
        build, self.method, self.factor, length = CASES[name]
        self.ids = torch.randint(3, 100, (1, length), generator=torch.Generator().manual_seed(1))
        self.build = build
        self.functions = _module_functions()  # as they are with no patched model of those modules alive
        plain = build()
        self.plain_logits = _logits(plain, self.ids)
        self.plain_config = _config(plain)
        self.model = ctxext.patch(build(), self.method, self.factor)
        self.logits = _logits(self.model, self.ids)
        self.config = _config(self.model)
        self.spec = ctxext.describe(self.model)
        assert self.spec is not None and not torch.equal(self.logits, self.plain_logits)  # the patch changes logits

    def assert_patched(self, model):
        assert ctxext.describe(model) == self.spec
        assert torch.equal(_logits(model, self.ids), self.logits)
        assert _config(model) == self.config

    def assert_unpatched(self, model):
        assert ctxext.describe(model) is None
        assert torch.equal(_logits(model, self.ids), self.plain_logits)
        assert _config(model) == self.plain_config

    def assert_saves_patched(self, model, folder):
        """``save_pretrained`` of a patched model writes what a never-copied patched twin writes (the native form
        where the patch has one, else the marked checkpoint), and ``ctxext.from_pretrained`` gives the patch back."""
        model.save_pretrained(folder / "model")
        ctxext.patch(self.build(), self.method, self.factor).save_pretrained(folder / "twin")
        assert _saved(folder / "model") == _saved(folder / "twin")
        loaded = ctxext.from_pretrained(folder / "model").eval()
        assert ctxext.describe(loaded) == self.spec
        assert torch.equal(_logits(loaded, self.ids), self.logits)
        ctxext.unpatch(loaded)


def _saved(folder):
    """The files of a saved model and its config.json."""
    return sorted(p.name for p in folder.iterdir()), json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is fastest, and does not stall when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=list(CASES))
def case(request):
    gc.collect()  # patched models dropped by earlier tests release the module functions they hold
    return Case(request.param)


def test_unpatching_the_copy_leaves_the_original_patched(case, tmp_path):
    clone = copy.deepcopy(case.model)
    case.assert_patched(clone)
    case.assert_patched(case.model)
    ctxext.unpatch(clone)
    case.assert_unpatched(clone)
    case.assert_patched(case.model)
    case.assert_saves_patched(case.model, tmp_path / "original")
    ctxext.unpatch(case.model)
    case.assert_unpatched(case.model)
    case.assert_unpatched(clone)


def test_unpatching_the_original_leaves_the_copy_patched(case, tmp_path):
    clone = copy.deepcopy(case.model)
    ctxext.unpatch(case.model)
    case.assert_unpatched(case.model)
    case.assert_patched(clone)
    case.assert_saves_patched(clone, tmp_path / "copy")
    ctxext.unpatch(clone)
    case.assert_unpatched(clone)
    case.assert_unpatched(case.model)


def test_copies_of_copies_unpatch_in_any_order(case):
    """Three live patches of one module-level dispatcher (BLOOM, Falcon-ALiBi) or none: each unpatch leaves the
    others patched, and the last one puts every module function back."""
    from ctxext.adapters import alibi_bias, bloom

    first = copy.deepcopy(case.model)
    second = copy.deepcopy(first)
    models = [first, case.model, second]
    for i, model in enumerate(models):
        ctxext.unpatch(model)
        case.assert_unpatched(model)
        for other in models[i + 1:]:
            case.assert_patched(other)
    assert _module_functions() == case.functions
    assert not bloom._dispatchers and not alibi_bias._dispatchers


def test_a_dropped_copy_releases_what_it_holds(case):
    """A patched copy garbage-collected without unpatch gives back its use of a module-level dispatcher, as a
    dropped patched model does; the copies still alive keep theirs."""
    kept, dropped = copy.deepcopy(case.model), copy.deepcopy(case.model)
    del dropped
    gc.collect()
    case.assert_patched(case.model)
    ctxext.unpatch(case.model)
    case.assert_unpatched(case.model)
    case.assert_patched(kept)
    ctxext.unpatch(kept)
    case.assert_unpatched(kept)
    assert _module_functions() == case.functions


def _module_functions():
    """The module-level functions the ALiBi-family adapters replace with dispatchers while a model is patched, as they
    are when no patched model of those modules is alive."""
    from transformers.models.bloom import modeling_bloom
    from transformers.models.falcon import modeling_falcon

    return {"bloom": getattr(modeling_bloom, "_get_alibi_slopes", None),
            "falcon": modeling_falcon.build_alibi_tensor}


def test_pickle_and_torch_save_of_a_patched_model_raise_patch_error(case):
    message = r"patched by ctxext.*save_pretrained.*ctxext\.from_pretrained"
    with pytest.raises(PatchError, match=message):
        pickle.dumps(case.model)
    with pytest.raises(PatchError, match=message):
        torch.save(case.model, io.BytesIO())
    clone = copy.deepcopy(case.model)  # the failed pickles left the model as it was
    case.assert_patched(case.model)
    with pytest.raises(PatchError, match=message):
        pickle.dumps(clone)
    ctxext.unpatch(clone)
    ctxext.unpatch(case.model)
    for model in (case.model, clone):  # unpatched: pickles as a never-patched model does
        loaded = pickle.loads(pickle.dumps(model))
        case.assert_unpatched(loaded)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        case.assert_unpatched(torch.load(buffer, weights_only=False))


def test_dynamic_ntk_copy_generates_with_itself():
    """The generate wrapper of a dynamic-NTK patch belongs to the copy: it plans the copy's length and runs the
    copy, also once the original is unpatched."""
    model = ctxext.patch(_llama(), "dynamic-ntk", 4)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    expected = model.generate(prompt, **kwargs)
    clone = copy.deepcopy(model)
    ctxext.unpatch(model)
    got = clone.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert torch.equal(torch.cat(got.logits), torch.cat(expected.logits))


def test_a_module_function_user_copies_as_one_more_user():
    """``acquire_module_function``: a deep copy of a user's release is one more user of the same dispatcher; the
    original function comes back after the last release."""
    import types

    from ctxext.adapters.base import acquire_module_function

    class Dispatcher:
        def __init__(self, original):
            self.original, self.users = original, 0

        def __call__(self, *args):
            return self.original(*args)

    def function():
        return "original"

    modeling = types.ModuleType("ctxext_test_modeling")
    modeling.function = function
    registry = {}
    release = acquire_module_function(modeling, "function", Dispatcher, registry)
    dispatcher = modeling.function
    assert isinstance(dispatcher, Dispatcher) and dispatcher.users == 1
    copies = [copy.deepcopy(release), copy.deepcopy([release])[0]]
    assert dispatcher.users == 3
    release()
    release()  # a second call releases nothing
    copies[0]()
    assert modeling.function is dispatcher and registry == {"ctxext_test_modeling": dispatcher}
    copies[1]()
    assert modeling.function is function and registry == {}
    assert copy.deepcopy(release)() is None and dispatcher.users == 0  # a copy of a released user holds nothing


def test_copy_restore_rebinds_closures_partials_and_methods():
    """The undo-tree copier: closures (one referring to itself, two sharing a cell), partials, bound methods and
    containers of them act on the copies of what they captured, as the memo of the enclosing deep copy maps it."""
    import functools

    from ctxext.adapters.base import copy_restore

    class Box:
        def __init__(self):
            self.value = 0

        def set(self, value):
            self.value = value

    box = Box()
    counter = []

    def make():
        def step(n=1):
            counter.append(n)
            box.set(len(counter))
            return step  # refers to itself

        def read():
            return counter

        return step, read

    step, read = make()
    tree = [step, read, functools.partial(setattr, box, "value", 7), box.set, counter.append, (len, print)]
    memo = {}
    box_copy = copy.deepcopy(box, memo)
    new = copy_restore(tree, memo)
    assert new[0] is not step and new[0]() is new[0]  # the copy of a closure that returns itself returns the copy
    assert new[1]() is memo[id(counter)] == [1]  # the cell shared by the two closures is one copied cell
    assert box_copy.value == 1 and box.value == 0 and counter == []
    new[2]()
    assert box_copy.value == 7 and box.value == 0
    new[3](5)
    new[4](9)
    assert box_copy.value == 5 and box.value == 0 and new[1]() == [1, 9] and counter == []
    assert new[5] == (len, print)  # builtins bound to a module: as they are
