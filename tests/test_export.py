"""Native export (ctxext.export, `ctxext export`): a patched model saved in its transformers-native form loads with
plain transformers as the same model; a patch with no native form makes a plain load fail, naming
ctxext.from_pretrained; ctxext.from_pretrained reports the patch either way and unpatch restores the original."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_bloom, tiny_gpt2, tiny_llama, tiny_neox
from refusals import assert_refused, tree_digest

import ctxext
from ctxext.cli import main
from ctxext.export import ORIGINAL_TENSORS, NoNativeForm, native_form

L0 = 64  # max_position_embeddings of the tiny rotary models
FAMILIES = {"llama": tiny_llama, "neox": tiny_neox, "gpt2": tiny_gpt2, "bloom": tiny_bloom}
ROTARY = ("llama", "neox")  # llama: GQA, head_dim != hidden/heads, rope_theta 500; neox: partial rotary, 10000

# (family, method, factor, options, what config.json must say: rope type (rotary) or None)
NATIVE_CELLS = [
    *[(f, "pi", 4.0, {}, "linear") for f in ROTARY],
    *[(f, "pi", 2.5, {}, "linear") for f in ROTARY],
    *[(f, "yarn", 4.0, {}, "yarn") for f in ROTARY],
    *[(f, "yarn", 8.0, {"beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3}, "yarn") for f in ROTARY],
    ("llama", "yarn", 4.0, {"mscale": 1.0, "mscale_all_dim": 0.5}, "yarn"),
    ("llama", "yarn", 4.0, {"truncate": False}, "yarn"),
    *[(f, "llama3", 4.0, {}, "llama3") for f in ROTARY],
    ("llama", "llama3", 8.0, {"low_freq_factor": 2.0, "high_freq_factor": 8.0}, "llama3"),
    *[(f, "dynamic-ntk", 4.0, {}, "dynamic") for f in ROTARY],
    *[(f, "ntk", 4.0, {}, "default") for f in ROTARY],
    *[(f, "extrapolate", 2.0, {}, "default") for f in ROTARY],
    ("gpt2", "pi", 2.0, {}, None),
    ("gpt2", "pi", 2.5, {}, None),
    ("gpt2", "extrapolate", 2.0, {}, None),
    ("bloom", "extrapolate", 2.0, {}, None),
]
NATIVE = {(f, m) for f, m, *_ in NATIVE_CELLS}


def _ids(family: str, factor: float, seed: int = 1) -> torch.Tensor:
    """Past the original length: rotary and BLOOM 200 tokens (> 3 x L0); GPT-2 up to its new table (32 rows x f)."""
    length = int(32 * factor) if family == "gpt2" else 200
    return torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(seed))


def _plain(load, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(folder)


def _rope(config_dict: dict) -> dict:
    """The saved RoPE settings, 5.x ``rope_parameters`` or 4.x ``rope_scaling`` + ``rope_theta``."""
    if isinstance(config_dict.get("rope_parameters"), dict):
        return config_dict["rope_parameters"]
    theta = config_dict.get("rope_theta", config_dict.get("rotary_emb_base"))
    return {"rope_type": "default", **(config_dict.get("rope_scaling") or {}), "rope_theta": theta}


def _cell_id(cell):
    family, method, factor, options, _ = cell
    return f"{family}-{method}-x{factor:g}" + "".join(f"-{k}={v}" for k, v in options.items())


@pytest.mark.parametrize("cell", NATIVE_CELLS, ids=[_cell_id(c) for c in NATIVE_CELLS])
def test_native_round_trip(tmp_path, cell):
    """save_pretrained of the patched model -> plain AutoModelForCausalLM / the model class / AutoConfig load it as
    the patched model (logits to 1e-5); ctxext.from_pretrained reports the patch, bit for bit, and unpatch gives
    the original model back."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, method, factor, options, rope_type = cell
    model = FAMILIES[family]()
    ids = _ids(family, factor)
    original_ids = ids[:, :32] if family == "gpt2" else ids
    unpatched = model(original_ids).logits
    model.save_pretrained(tmp_path / "warm")  # save_pretrained itself records dtype and architectures
    ctxext.patch(model, method, factor, **options)
    patched, patched_config = model(ids).logits, model.config.to_dict()
    model.save_pretrained(tmp_path)
    assert torch.equal(model(ids).logits, patched) and model.config.to_dict() == patched_config  # live: unchanged

    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == model.config.model_type  # not marked
    assert saved["ctxext"]["saved_as"] == "native" and saved["ctxext"]["method"] == method
    if rope_type is not None:
        rope = _rope(saved)
        assert rope["rope_type"] == rope_type
        if method in ("yarn", "llama3"):
            assert rope["original_max_position_embeddings"] == L0 and rope["factor"] == factor
        expected_length = L0 if method == "dynamic-ntk" else int(round(factor * L0))
        assert saved["max_position_embeddings"] == expected_length
    if family == "gpt2":
        assert saved["n_positions"] == int(round(factor * 32)) and (tmp_path / ORIGINAL_TENSORS).is_file()

    assert _plain(AutoConfig.from_pretrained, tmp_path).model_type == model.config.model_type
    for load in (AutoModelForCausalLM.from_pretrained, type(model).from_pretrained):
        plain = _plain(load, tmp_path).eval()
        got = plain(ids).logits
        torch.testing.assert_close(got, patched, atol=1e-5, rtol=0)
        assert ctxext.describe(plain) is None  # a plain model: the record of the patch is ctxext's
    print(f"\n{_cell_id(cell)}: max |logit diff| {float((got - patched).detach().abs().max()):.3g}", end="")

    loaded = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(loaded) == ctxext.describe(model)
    assert loaded.config.to_dict() == model.config.to_dict() | {"_name_or_path": str(tmp_path)}
    assert torch.equal(loaded(ids).logits, patched)
    ctxext.unpatch(loaded)
    assert torch.equal(loaded(original_ids).logits, unpatched)
    assert not any(m.training for m in loaded.modules())  # loaded in eval mode, the restored table too


def _no_native_cells():
    for family, make in FAMILIES.items():
        for method in ctxext.available_methods(make()):
            if (family, method) not in NATIVE:
                yield pytest.param(family, method, id=f"{family}-{method}")


@pytest.mark.parametrize("family,method", list(_no_native_cells()))
def test_no_native_form_fails_plain_loading_loudly(tmp_path, family, method):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = FAMILIES[family]()
    ctxext.patch(model, method, 2)
    with pytest.raises(NoNativeForm, match="no .*native form"):
        native_form(model)
    model.save_pretrained(tmp_path)
    assert "saved_as" not in json.loads((tmp_path / "config.json").read_text())["ctxext"]
    for load in (AutoModelForCausalLM.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(Exception, match=r"ctxext\.from_pretrained\(path\)"):
            _plain(load, tmp_path)
    assert ctxext.describe(ctxext.from_pretrained(tmp_path)) == ctxext.describe(model)


def test_a_native_form_that_does_not_verify_is_never_written(tmp_path, monkeypatch):
    """Each rotary candidate is checked against transformers' own rotary class: with no tolerance at all, ntk's
    new rope_theta (float32 rounding apart) is refused and the checkpoint saved marked, not silently different."""
    import ctxext.adapters.rotary_native as rotary_native

    model = tiny_llama()
    ctxext.patch(model, "ntk", 4)
    monkeypatch.setattr(rotary_native, "RTOL", 0.0)
    with pytest.raises(NoNativeForm, match="frequencies differ"):
        native_form(model)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    with pytest.raises(Exception, match=r"ctxext\.from_pretrained\(path\)"):
        _plain(AutoModelForCausalLM.from_pretrained, tmp_path)


def test_a_model_with_a_dynamic_rope_config_is_refused():
    """A model whose rope type recomputes its frequencies in every forward (dynamic): patching, hence exporting,
    refuses clearly (methods compose on linear / yarn / llama3 / longrope: tests/test_scaled_rope.py)."""
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ctxext.PatchError, match="rope_type 'dynamic', which recomputes its frequencies"):
        ctxext.patch(model, "yarn", 2)


def test_a_plain_load_of_a_native_export_is_a_plain_model(tmp_path):
    """Loaded without ctxext, a native export is what its config says (rope type yarn): ctxext.patch does not put
    the original config back under it; a method patched on it composes on the shipped yarn frequencies, with the
    exported advertised length as the original one."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    ctxext.patch(model, "yarn", 4)
    model.save_pretrained(tmp_path)
    plain = _plain(AutoModelForCausalLM.from_pretrained, tmp_path)
    assert plain.config.max_position_embeddings == 4 * L0
    shipped = plain.model.rotary_emb.inv_freq.clone()
    ctxext.patch(plain, "pi", 2)
    assert ctxext.describe(plain)["original_length"] == 4 * L0
    assert plain.config.max_position_embeddings == 8 * L0
    torch.testing.assert_close(plain.model.rotary_emb.inv_freq, shipped / 2, rtol=1e-6, atol=0)
    ctxext.unpatch(plain)
    assert torch.equal(plain.model.rotary_emb.inv_freq, shipped)


@pytest.mark.parametrize("method", ["pi", "extrapolate"])
def test_a_gpt2_saved_with_its_own_state_dict_loads_patched(tmp_path, method):
    """Trainer saves with ``save_pretrained(dir, state_dict=...)``: the native form's resized table must replace the
    caller's original rows (config n_positions 2x with 32-row weights did not load, with or without ctxext)."""
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2()
    ctxext.patch(model, method, 2)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    model.save_pretrained(tmp_path, state_dict=model.state_dict())
    for load in (ctxext.from_pretrained, lambda d: _plain(AutoModelForCausalLM.from_pretrained, d)):
        torch.testing.assert_close(load(tmp_path).eval()(ids).logits, expected, rtol=0, atol=1e-5)


def test_a_native_export_changed_after_it_was_written_is_not_silently_repatched(tmp_path):
    """A GPT-2 export loaded plainly, its table changed (fine-tuned), saved back in place beside the old originals
    file: re-applying the patch from the originals would drop the new table. ctxext refuses, naming the plain load;
    the plain load gives the model as saved."""
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2()
    ctxext.patch(model, "pi", 2)
    model.save_pretrained(tmp_path)
    assert ctxext.describe(ctxext.from_pretrained(tmp_path))["method"] == "pi"  # untouched: reloads patched
    plain = _plain(AutoModelForCausalLM.from_pretrained, tmp_path)
    with torch.no_grad():
        plain.transformer.wpe.weight.mul_(0.5)
    plain.save_pretrained(tmp_path)
    with pytest.raises(OSError, match="changed after its export.*AutoModelForCausalLM.from_pretrained"):
        ctxext.from_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_plain(AutoModelForCausalLM.from_pretrained, tmp_path).eval()(ids).logits,
                               plain.eval()(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["yarn", "llama3"])
def test_a_native_export_whose_config_was_edited_is_not_silently_repatched(tmp_path, method):
    """config.json's rope parameters edited by hand after the export (yarn x4 -> x8): plain transformers loads the
    edited model, and re-applying the recorded patch would load another one. ctxext refuses, naming the plain load."""
    model = tiny_llama()
    ctxext.patch(model, method, 4)
    model.save_pretrained(tmp_path)
    assert ctxext.describe(ctxext.from_pretrained(tmp_path))["factor"] == 4.0  # untouched: reloads patched
    config = json.loads((tmp_path / "config.json").read_text())
    rope = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    config[rope]["factor"] = 8.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OSError, match=f"config.json's {rope}.*changed after its export.*AutoModelForCausalLM"):
        ctxext.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_gpt2_export_reloads_in_float32(tmp_path, dtype):
    """The saved table is rounded to the export's dtype: the check against the rebuilt one allows that rounding."""
    model = tiny_gpt2().to(dtype)
    ctxext.patch(model, "pi", 3)
    model.save_pretrained(tmp_path)
    reloaded = ctxext.from_pretrained(tmp_path, dtype=torch.float32)
    assert ctxext.describe(reloaded)["method"] == "pi"


def test_a_damaged_originals_file_is_one_clear_error(tmp_path):
    model = tiny_gpt2()
    ctxext.patch(model, "pi", 2)
    model.save_pretrained(tmp_path)
    originals = tmp_path / ORIGINAL_TENSORS
    originals.write_bytes(originals.read_bytes()[:-100])  # a copy cut short
    with pytest.raises(OSError, match=f"{ORIGINAL_TENSORS}, which holds the tensors the export replaced, is damaged"):
        ctxext.from_pretrained(tmp_path)


def test_unpatch_then_save_is_an_ordinary_checkpoint(tmp_path):
    model = tiny_llama()
    ctxext.patch(model, "yarn", 4)
    ctxext.unpatch(model)
    assert "save_pretrained" not in vars(model)  # the save hook goes with the patch
    model.save_pretrained(tmp_path)
    assert "ctxext" not in json.loads((tmp_path / "config.json").read_text())


# -- GGUF ----------------------------------------------------------------------------------------------------------


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> None:
    """A tiny LLaMA GGUF (float32 tensors, no tokenizer) from a model built from a config. Its weights need not be
    the model's as transformers reads them (q/k are permuted on load): only the GGUF path matters here."""
    gguf = pytest.importorskip("gguf")
    model = tiny_llama(seed=seed, head_dim=12)
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(500.0)
    writer.add_rope_dimension_count(12)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    state = model.state_dict()
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        for ours, theirs in names.items():
            writer.add_tensor(f"blk.{i}.{theirs}.weight", state[f"model.layers.{i}.{ours}.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def gguf_dir(tmp_path):
    folder = tmp_path / "gguf"
    folder.mkdir()
    write_tiny_llama_gguf(folder / "tiny.gguf")
    return folder


@pytest.mark.parametrize("method,factor", [("yarn", 4.0), ("pi", 2.0)])
def test_gguf_model_exported_to_a_plain_folder(tmp_path, gguf_dir, capsys, method, factor):
    """`ctxext export DIR --gguf-file F`: safetensors + a native config, loadable by plain transformers."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert main(["export", str(gguf_dir), "--gguf-file", "tiny.gguf", "--method", method, "--factor", str(factor),
                 "--out", str(out)]) == 0
    assert "exported" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.gguf"))
    saved = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in saved and _rope(saved)["rope_type"] == {"pi": "linear"}.get(method, method)
    reference = ctxext.from_pretrained(str(gguf_dir), gguf_file="tiny.gguf")
    ctxext.patch(reference, method, factor)
    ids = _ids("llama", factor)
    plain = _plain(AutoModelForCausalLM.from_pretrained, out)
    torch.testing.assert_close(plain(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
    loaded = ctxext.from_pretrained(out)
    assert ctxext.describe(loaded) == ctxext.describe(reference)


# -- the CLI -------------------------------------------------------------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path):
    folder = tmp_path / "llama"
    tiny_llama().save_pretrained(folder)
    return folder


def test_cli_export_and_overwrite(tmp_path, llama_dir, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    argv = ["export", str(llama_dir), "--method", "yarn", "--factor", "4", "--option", "beta_fast=16", "--out",
            str(out)]
    assert main(argv) == 0
    patched = ctxext.from_pretrained(llama_dir)
    ctxext.patch(patched, "yarn", 4, beta_fast=16)
    ids = _ids("llama", 4)
    torch.testing.assert_close(_plain(AutoModelForCausalLM.from_pretrained, out)(ids).logits, patched(ids).logits,
                               atol=1e-5, rtol=0)
    assert ctxext.describe(ctxext.from_pretrained(out)) == ctxext.describe(patched)
    assert main(["export", str(llama_dir), "--method", "pi", "--factor", "2", "--out", str(out), "--overwrite"]) == 0
    assert _rope(json.loads((out / "config.json").read_text()))["rope_type"] == "linear"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask  # as mkdir makes it (not the temporary folder's 0700)


def test_cli_export_of_an_export_says_it_replaces_the_patch(tmp_path, llama_dir, capsys):
    from transformers import AutoModelForCausalLM

    first, second = tmp_path / "yarn", tmp_path / "pi"
    assert main(["export", str(llama_dir), "--method", "yarn", "--factor", "4", "--out", str(first)]) == 0
    capsys.readouterr()
    assert main(["export", str(first), "--method", "pi", "--factor", "2", "--out", str(second)]) == 0
    assert "was saved patched (yarn x4" in capsys.readouterr().err
    expected = ctxext.patch(_plain(AutoModelForCausalLM.from_pretrained, llama_dir), "pi", 2)
    ids = _ids("llama", 2)
    torch.testing.assert_close(_plain(AutoModelForCausalLM.from_pretrained, second)(ids).logits,
                               expected(ids).logits, atol=1e-5, rtol=0)


def test_cli_export_gpt2_keeps_the_original_table(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    source = tmp_path / "gpt2"
    tiny_gpt2().save_pretrained(source)
    out = tmp_path / "out"
    assert main(["export", str(source), "--method", "pi", "--factor", "2", "--out", str(out)]) == 0
    plain = _plain(AutoModelForCausalLM.from_pretrained, out)
    assert plain.config.n_positions == 64 and plain.transformer.wpe.num_embeddings == 64
    loaded = ctxext.from_pretrained(out)
    ctxext.unpatch(loaded)
    original = AutoModelForCausalLM.from_pretrained(source)
    assert torch.equal(loaded.transformer.wpe.weight, original.transformer.wpe.weight)


REFUSALS = [
    ("unknown method", ["--method", "warp", "--factor", "2"], "unknown method 'warp'"),
    ("factor below 1", ["--method", "pi", "--factor", "0.5"], "between 1 and"),
    ("factor not a number", ["--method", "pi", "--factor", "four"], "factor must be a number"),
    ("factor missing", ["--method", "yarn"], "needs a factor"),
    ("unknown option", ["--method", "yarn", "--factor", "2", "--option", "beta=3"], "unknown option(s) beta"),
    ("option of another method", ["--method", "pi", "--factor", "2", "--option", "yarn.beta_fast=3"],
     "--option for method 'yarn'"),
    ("no native form", ["--method", "nope"], "no transformers-native form"),
    ("remap method", ["--method", "self-extend", "--factor", "2"], "no transformers-native form"),
    ("bad dtype", ["--method", "pi", "--factor", "2", "--dtype", "float8"], "--dtype must be one of"),
]


@pytest.mark.parametrize("argv,expect", [pytest.param(a, e, id=i) for i, a, e in REFUSALS])
def test_cli_export_refuses_before_writing(tmp_path, llama_dir, capsys, argv, expect):
    assert_refused(["export", llama_dir, *argv, "--out", tmp_path / "out"], capsys, tmp_path, expect)


def test_cli_export_refuses_sources_and_outputs(tmp_path, llama_dir, capsys):
    out = tmp_path / "out"
    ok = ["--method", "pi", "--factor", "2"]
    assert_refused(["export", tmp_path / "missing", *ok, "--out", out], capsys, tmp_path, "folder not found")
    assert_refused(["export", llama_dir, "--gguf-file", "x.gguf", *ok, "--out", out], capsys, tmp_path,
                   "GGUF file 'x.gguf' not found")
    assert_refused(["export", "reference:nope", *ok, "--out", out], capsys, tmp_path, "unknown reference model")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_refused(["export", llama_dir, *ok, "--out", out], capsys, tmp_path, "exists; pass --overwrite")
    assert_refused(["export", llama_dir, *ok, "--out", out / "keep.txt", "--overwrite"], capsys, tmp_path,
                   "is a file")
    assert_refused(["export", llama_dir, *ok, "--out", llama_dir, "--overwrite"], capsys, tmp_path,
                   "would overwrite the model")
    gpt2 = tmp_path / "gpt2"
    tiny_gpt2().save_pretrained(gpt2)
    assert_refused(["export", gpt2, "--method", "yarn", "--factor", "2", "--out", tmp_path / "o2"], capsys, tmp_path,
                   "does not fit")
    scaled = tmp_path / "scaled"
    tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0}).save_pretrained(scaled)
    assert_refused(["export", scaled, *ok, "--out", tmp_path / "o3"], capsys, tmp_path,
                   "rope_type 'dynamic', which recomputes its frequencies")
    assert tree_digest(out) == {"keep.txt": tree_digest(out)["keep.txt"]}
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "to_out").symlink_to(out)
    for link in ("dangling", "to_out"):
        for extra in ([], ["--overwrite"]):
            assert_refused(["export", llama_dir, *ok, "--out", tmp_path / link, *extra], capsys, tmp_path,
                           "is a link")
    assert_refused(["export", llama_dir, *ok, "--out", out / "keep.txt" / "x"], capsys, tmp_path,
                   "keep.txt is a file, not a folder")
    assert not (tmp_path / "nowhere").exists()
