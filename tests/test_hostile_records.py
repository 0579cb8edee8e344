"""Records that must not load silently different (issue 51, cases 4, 5, 8, 11 and 22): an adapter saved by peft
from a patched model records the patch, and a fine-tune output that lost its record is refused; the BLOOM
reference says the length it was trained at; a ctxext record from a newer ctxext, or a damaged one, is refused
naming the version or the key; ``ctxext.from_pretrained`` takes ``reference:NAME`` as the commands do, and an
adapter trained on it names that as its base."""

from __future__ import annotations

import json
import math
import shutil
import warnings

import pytest
import torch
from conftest import tiny_bloom, tiny_llama
from refusals import assert_refused
from test_eval_fixtures import CORPUS, save_tiny_llama

import ctxext
from ctxext.core.errors import PatchError

pytest.importorskip("peft")

IDS = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(0))


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **kw)


def _peft(model, **kw):
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, _lora(), **kw)


# -- case 4: an adapter saved by peft keeps the patch -------------------------------------------------------------


def test_an_adapter_saved_by_peft_from_a_patched_model_loads_patched(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    trained = _peft(ctxext.patch(tiny_llama(), "yarn", 4)).eval()
    trained.save_pretrained(tmp_path / "adapter")
    record = json.loads((tmp_path / "adapter" / "ctxext_patch.json").read_text())
    assert record == ctxext.describe(trained)
    loaded = ctxext.from_pretrained(tmp_path / "base", adapter=str(tmp_path / "adapter")).eval()
    assert ctxext.describe(loaded) == ctxext.describe(trained)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, trained(IDS).logits, atol=1e-5, rtol=0)


def test_a_named_adapter_gets_the_record_in_its_own_folder(tmp_path):
    trained = _peft(ctxext.patch(tiny_llama(), "pi", 2), adapter_name="long")
    trained.save_pretrained(tmp_path / "adapters")
    assert json.loads((tmp_path / "adapters" / "long" / "ctxext_patch.json").read_text())["method"] == "pi"
    assert not (tmp_path / "adapters" / "ctxext_patch.json").exists()


def test_an_unpatched_save_removes_a_stale_record(tmp_path):
    _peft(ctxext.patch(tiny_llama(), "yarn", 4)).save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "ctxext_patch.json").exists()
    _peft(tiny_llama()).save_pretrained(tmp_path / "adapter")  # the same folder, from an unpatched model
    assert not (tmp_path / "adapter" / "ctxext_patch.json").exists()


def test_transformers_own_adapter_save_records_the_patch(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    model = ctxext.patch(tiny_llama(), "yarn", 4).eval()
    model.add_adapter(_lora())
    model.save_pretrained(tmp_path / "adapter")  # the adapter alone: no config.json to carry the patch
    assert json.loads((tmp_path / "adapter" / "ctxext_patch.json").read_text())["method"] == "yarn"
    loaded = ctxext.from_pretrained(tmp_path / "base", adapter=str(tmp_path / "adapter")).eval()
    assert ctxext.describe(loaded)["method"] == "yarn"
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, atol=1e-5, rtol=0)


def _run_records(folder, method="pi", factor=2):
    """What a ctxext fine-tune writes beside its adapter that names the patch."""
    spec = {"method": method, "factor": float(factor), "options": {}, "family": "rotary", "original_length": 64,
            "patched_length": 64 * factor}
    return {
        "results.json": json.dumps({"finished": True, "patch": spec}),
        "log.jsonl": json.dumps({"event": "start", "patch": spec}) + "\n" + json.dumps({"event": "step", "step": 1}),
        "recipe.yaml": f"model:\n  name: x\npatch:\n  method: {method}\n  factor: {factor}\n",
    }


@pytest.fixture
def lost_record(tmp_path):
    """A fine-tune output (pi x2) whose ctxext_patch.json is gone, and the base it was trained on."""
    base = save_tiny_llama(tmp_path / "base")
    from transformers import AutoModelForCausalLM

    model = ctxext.patch(AutoModelForCausalLM.from_pretrained(base), "pi", 2)
    adapter = tmp_path / "adapter"
    _peft(model).save_pretrained(adapter)
    (adapter / "ctxext_patch.json").unlink(missing_ok=True)
    return base, adapter


@pytest.mark.parametrize("record", ["results.json", "log.jsonl", "recipe.yaml"])
def test_a_fine_tune_output_without_its_patch_record_is_refused(lost_record, record):
    base, adapter = lost_record
    (adapter / record).write_text(_run_records(adapter)[record])
    with pytest.raises(PatchError, match=rf"{record} says it was trained with pi x2, but ctxext_patch.json.*missing"):
        ctxext.from_pretrained(base, adapter=str(adapter))
    # a model that already has that patch takes the adapter as it was trained
    from ctxext.loading import load_adapter

    model = load_adapter(ctxext.patch(ctxext.from_pretrained(base), "pi", 2), str(adapter))
    assert ctxext.describe(model)["method"] == "pi"
    with pytest.raises(PatchError, match="patched with yarn x2"):
        load_adapter(ctxext.patch(ctxext.from_pretrained(base), "yarn", 2), str(adapter))


def test_eval_refuses_a_fine_tune_output_without_its_patch_record(lost_record, tmp_path, capsys, monkeypatch):
    base, adapter = lost_record

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded: the refusal comes before the load")

    monkeypatch.setattr("ctxext.loading.from_pretrained", no_load)
    for name, text in _run_records(adapter).items():
        if name != "results.json":
            (adapter / name).write_text(text)
    assert_refused(["eval", "--no-progress", "--device", "cpu", "--model", base, "--adapter", adapter, "--data",
                    CORPUS, "--lengths", "64", "--max-windows", "1", "--output", tmp_path / "out" / "r.json"],
                   capsys, tmp_path, "log.jsonl says it was trained with pi x2")


def test_a_run_record_without_a_patch_is_no_evidence(lost_record):
    base, adapter = lost_record
    (adapter / "recipe.yaml").write_text("model:\n  name: x\npatch:\n  method: null\n")
    (adapter / "log.jsonl").write_text("not json\n" + json.dumps({"event": "start", "patch": None}) + "\n")
    assert ctxext.describe(ctxext.from_pretrained(base, adapter=str(adapter))) is None


# -- case 5: the BLOOM reference's length ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2", "bloom"])
def test_each_reference_advertises_the_length_it_was_trained_at(name):
    from ctxext.adapters import find_adapter
    from ctxext.loading import model_skeleton
    from ctxext.reference import reference_path, train_length

    skeleton = model_skeleton(str(reference_path(name)))
    assert find_adapter(skeleton).original_length(skeleton) == train_length(name)
    if name == "bloom":
        assert train_length("bloom") == 256
        assert json.loads((reference_path("bloom") / "config.json").read_text())["max_position_embeddings"] == 256


def test_an_explicit_bloom_length_wins_over_the_family_default():
    from ctxext.adapters.bloom import BLOOM_TRAINING_LENGTH

    for attr, value in [("max_position_embeddings", 300), ("seq_length", 300), ("max_position_embeddings", 300.0)]:
        model = tiny_bloom()
        setattr(model.config, attr, value)
        ctxext.patch(model, "pi", 2)
        assert ctxext.describe(model)["original_length"] == 300 and model.config.max_position_embeddings == 600
        ctxext.unpatch(model)
    assert ctxext.describe(ctxext.patch(tiny_bloom(), "pi", 2))["original_length"] == BLOOM_TRAINING_LENGTH


def test_eval_reads_the_bloom_reference_as_trained_to_256(tmp_path, capsys):
    from ctxext.cli import main

    out = tmp_path / "r.json"
    assert main(["eval", "--no-progress", "--device", "cpu", "--model", "reference:bloom", "--methods", "none",
                 "--lengths", "256", "--max-windows", "1", "--output", str(out)]) == 0
    assert "trained to 256 tokens" in capsys.readouterr().out
    assert json.loads(out.read_text())["model"]["original_length"] == 256


def test_export_of_the_bloom_reference_advertises_twice_its_length(tmp_path, capsys):
    from ctxext.cli import main

    out = tmp_path / "bloom-x2"
    assert main(["export", "reference:bloom", "--method", "extrapolate", "--factor", "2", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 512
    model = ctxext.from_pretrained(out)
    assert ctxext.describe(model)["original_length"] == 256
    ctxext.unpatch(model)
    assert model.config.max_position_embeddings == 256


# -- case 8 and 22: a record from a newer ctxext, or damaged ------------------------------------------------------


def _saved(tmp_path, native: bool):
    """A patched tiny LLaMA saved natively (yarn) or marked (self-extend has no native form)."""
    folder = tmp_path / ("native" if native else "marked")
    ctxext.patch(tiny_llama(), "yarn" if native else "self-extend", 4).save_pretrained(folder)
    return folder


def _edit(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("native", [False, True], ids=["marked", "native"])
def test_a_saved_record_carries_its_version_and_round_trips(tmp_path, native):
    folder = _saved(tmp_path, native)
    assert json.loads((folder / "config.json").read_text())["ctxext"]["version"] == 1
    assert ctxext.describe(ctxext.from_pretrained(folder))["method"] == ("yarn" if native else "self-extend")
    _edit(folder, lambda c: c["ctxext"].pop("version"))  # a record written before the version was
    assert ctxext.describe(ctxext.from_pretrained(folder)) is not None


@pytest.mark.parametrize("native", [False, True], ids=["marked", "native"])
@pytest.mark.parametrize("change, said", [
    (lambda b: b.update(version=99, sliding_window_fn="x"),
     "written by a newer ctxext (record version 99; this ctxext reads version 1, with keys it does not know: "
     "sliding_window_fn)"),
    (lambda b: b.update(sliding_window_fn="x"), "keys this ctxext does not know: sliding_window_fn"),
    (lambda b: b.update(saved_as="native-v2"), "saved_as='native-v2', which this ctxext does not know"),
    (lambda b: b.update(version="1"), "damaged: version='1'"),
    (lambda b: b.update(version=0), "damaged: version=0"),
])
def test_a_record_from_a_newer_ctxext_is_refused_naming_it(tmp_path, native, change, said):
    folder = _edit(_saved(tmp_path, native), lambda c: change(c["ctxext"]))
    with pytest.raises(PatchError, match=f"the ctxext record in {folder / 'config.json'}"):
        ctxext.from_pretrained(folder)
    with pytest.raises(PatchError) as refused:
        ctxext.from_pretrained(folder)
    assert said in str(refused.value)


def test_an_adapter_record_from_a_newer_ctxext_is_refused(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    _peft(ctxext.patch(tiny_llama(), "yarn", 4)).save_pretrained(tmp_path / "adapter")
    record = tmp_path / "adapter" / "ctxext_patch.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "version": 99}))
    with pytest.raises(PatchError, match=rf"ctxext_patch.json was written by a newer ctxext \(record version 99"):
        ctxext.from_pretrained(tmp_path / "base", adapter=str(tmp_path / "adapter"))


@pytest.mark.parametrize("native", [False, True], ids=["marked", "native"])
@pytest.mark.parametrize("record, said", [([1, 2], "it is [1, 2], not a mapping"), (None, "it is null, not a mapping"),
                                          ("yarn", 'it is "yarn", not a mapping')])
def test_a_record_that_is_not_a_mapping_is_damaged(tmp_path, native, record, said):
    folder = _edit(_saved(tmp_path, native), lambda c: c.update(ctxext=record))
    with pytest.raises(PatchError) as refused:
        ctxext.from_pretrained(folder)
    message = str(refused.value)
    assert "ctxext record" in message and "is damaged" in message and said in message
    assert "out of date" not in message


@pytest.mark.parametrize("native", [False, True], ids=["marked", "native"])
def test_a_record_without_replaced_on_save_is_damaged_once(tmp_path, native):
    folder = _edit(_saved(tmp_path, native), lambda c: c["ctxext"].pop("replaced_on_save"))
    with pytest.raises(PatchError) as refused:
        ctxext.from_pretrained(folder)
    message = str(refused.value)
    assert "is damaged: it lacks replaced_on_save" in message and "cannot load model" not in message
    from ctxext.loading import model_skeleton

    with pytest.raises(OSError, match="lacks replaced_on_save"):  # the checks before a command loads
        model_skeleton(str(folder))


def test_a_saved_model_type_transformers_does_not_know_is_said_once(tmp_path):
    folder = _edit(_saved(tmp_path, False), lambda c: c["ctxext"]["replaced_on_save"].update(model_type="llama9"))
    with pytest.raises(OSError) as refused:
        ctxext.from_pretrained(folder)
    assert str(refused.value).count("cannot load model") == 1 and "'llama9'" in str(refused.value)


@pytest.mark.parametrize("native", [False, True], ids=["marked", "native"])
def test_a_non_finite_number_in_the_record_is_damaged_naming_the_key(tmp_path, native):
    folder = _saved(tmp_path, native)
    replaced = json.loads((folder / "config.json").read_text())["ctxext"]["replaced_on_save"]
    if isinstance(replaced.get("rope_parameters"), dict):  # transformers 5.x: the record holds the rope settings
        _edit(folder, lambda c: c["ctxext"]["replaced_on_save"]["rope_parameters"].update(rope_theta=math.nan))
        with pytest.raises(PatchError, match=r"damaged: replaced_on_save\.rope_parameters\.rope_theta is not a "
                                             "finite number"):
            ctxext.from_pretrained(folder)
    folder = _edit(_saved(tmp_path / "again", native), lambda c: c["ctxext"].update(factor=math.inf))
    with pytest.raises(PatchError, match="damaged: factor=inf"):
        ctxext.from_pretrained(folder)


def test_eval_says_which_record_is_damaged(tmp_path, capsys):
    folder = save_tiny_llama(tmp_path / "m")
    model = ctxext.from_pretrained(folder)
    ctxext.patch(model, "self-extend", 2).save_pretrained(folder)
    _edit(folder, lambda c: c.update(ctxext=[1, 2]))
    assert_refused(["eval", "--no-progress", "--device", "cpu", "--model", folder, "--data", CORPUS, "--lengths",
                    "64", "--max-windows", "1", "--output", tmp_path / "out" / "r.json"], capsys, tmp_path,
                   "ctxext record")


# -- case 11: reference:NAME from Python, and the adapter's base ---------------------------------------------------


def test_from_pretrained_takes_a_reference_name_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = ctxext.from_pretrained("reference:llama")
    assert type(model).__name__ == "LlamaForCausalLM" and ctxext.describe(model) is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # stored in 16 bits, loaded as reference_model
    assert model.name_or_path == "reference:llama" and model.config.name_or_path == "reference:llama"
    assert ctxext.from_pretrained("ctxext.reference:bloom", dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="unknown reference model 'mistral'; choose one of llama, gpt2, bloom"):
        ctxext.from_pretrained("reference:mistral")


def test_an_adapter_of_a_reference_names_it_as_its_base(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trained = _peft(ctxext.patch(ctxext.from_pretrained("reference:llama"), "yarn", 2)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trained.save_pretrained(tmp_path / "adapter")
    assert not [w for w in caught if "reference:llama" in str(w.message)]  # peft finds no config.json under it
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "reference:llama"
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "base_model: reference:llama" in card and "/assets/reference/" not in card
    loaded = ctxext.from_pretrained("reference:llama", adapter=str(tmp_path / "adapter")).eval()
    assert ctxext.describe(loaded)["method"] == "yarn"
    ids = torch.randint(0, 4096, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, atol=1e-4, rtol=0)


def test_a_fine_tune_of_a_reference_records_the_portable_name(tmp_path, monkeypatch):
    from ctxext.finetune.config import recipe_from_dict
    from ctxext.finetune.train import run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "t.txt").write_text("It is a truth universally acknowledged, that a single man in possession of a "
                                    "good fortune, must be in want of a wife. " * 200)
    out = tmp_path / "out"
    recipe = recipe_from_dict({
        "model": {"name": "reference:llama"}, "patch": {"method": "pi", "factor": 2},
        "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj"]},
        "data": {"files": [str(tmp_path / "t.txt")], "seq_length": 64},
        "train": {"steps": 1, "batch_size": 1, "micro_batch_size": 1, "warmup_steps": 0},
        "eval": {"enabled": False}, "output": {"dir": str(out)},
    })
    assert run(recipe, progress=False)["finished"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "reference:llama"
    card = (out / "README.md").read_text()
    assert "base_model: reference:llama" in card and str(tmp_path) not in card and "/assets/" not in card
    model = ctxext.from_pretrained("reference:llama", adapter=str(out))
    assert ctxext.describe(model)["method"] == "pi"
    # the same output with its record lost: refused, naming what the run recorded
    lost = tmp_path / "lost"
    shutil.copytree(out, lost)
    (lost / "ctxext_patch.json").unlink()
    with pytest.raises(PatchError, match="results.json says it was trained with pi x2"):
        ctxext.from_pretrained("reference:llama", adapter=str(lost))
