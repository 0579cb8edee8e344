"""Every recipe under recipes/ is a valid recipe, checked offline, so that a broken recipe fails CI.

- Schema level, for every recipe: it loads and validates (unknown keys, types, ranges, method names, data, PoSE and
  S²-Attn settings) without the hub.
- As far as ``ctxext finetune --check`` goes without the hub: the recipes that name a hub model are checked against a
  local folder holding only that model's config.json (the fields of the published file that shape the
  architecture), so the patch, the LoRA targets, the PoSE span, the S²-Attn groups and the TrainingArguments are
  checked as ``--check`` checks them, with no weights and no network.
- The header states what a recipe costs: memory and time, marked as estimates unless measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("peft")
pytest.importorskip("pydantic")

from ctxext.cli import main  # noqa: E402
from ctxext.finetune import load_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
HUB_RECIPES = [p for p in RECIPES if p.parent.name != "tiny"]

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
          "hidden_act": "silu", "torch_dtype": "bfloat16"}

#: config.json of each hub model a recipe names: the fields that decide the architecture and its positions, as the
#: published files give them (Llama 3.1 ships llama3-scaled RoPE; Qwen2.5-7B-Instruct and SmolLM2 ship none).
CONFIGS = {
    "meta-llama/Llama-3.1-8B": {
        **_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
        "bos_token_id": 128000, "eos_token_id": 128001,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 152064,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "HuggingFaceTB/SmolLM2-1.7B": {
        **_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05, "rope_theta": 130000, "tie_word_embeddings": True, "vocab_size": 49152,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "openai-community/gpt2": {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_positions": 1024, "n_ctx": 1024,
        "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "activation_function": "gelu_new",
        "bos_token_id": 50256, "eos_token_id": 50256,
    },
}

#: What --check must report for each model: (original length, patched length) for the recipe's patch.
LENGTHS = {
    "meta-llama/Llama-3.1-8B": {"yarn": (131072, 524288), "pi": (131072, 524288)},
    "Qwen/Qwen2.5-7B-Instruct": {"yarn": (32768, 131072)},
    "HuggingFaceTB/SmolLM2-1.7B": {"yarn": (8192, 32768), "alibi": (8192, 8192), "nope": (8192, 8192)},
    "openai-community/gpt2": {"pi": (1024, 4096)},
}


def _data(recipe: Path) -> dict:
    return yaml.safe_load(recipe.read_text(encoding="utf-8"))


def _header(recipe: Path) -> str:
    lines = []
    for line in recipe.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_the_recipes_are_there():
    names = {p.name for p in RECIPES}
    assert len(RECIPES) >= 10
    assert {"tiny"} == {p.parent.name for p in RECIPES if p.parent != REPO / "recipes"}
    models = {_data(p)["model"]["name"] for p in HUB_RECIPES}
    assert {"meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B-Instruct", "HuggingFaceTB/SmolLM2-1.7B"} <= models
    llama = [_data(REPO / "recipes" / n) for n in sorted(names) if n.startswith("llama31_8b_")]
    grid = {(d["patch"]["method"], bool(d["train"].get("shift_attention"))) for d in llama}
    assert grid == {("yarn", False), ("yarn", True), ("pi", False), ("pi", True)}


@pytest.mark.parametrize("recipe", RECIPES, ids=[str(p.relative_to(REPO / "recipes")) for p in RECIPES])
def test_every_recipe_loads_and_validates(recipe, tmp_path, monkeypatch):
    """Schema level, offline: the whole recipe as `ctxext finetune` reads it (no model, no hub)."""
    monkeypatch.chdir(tmp_path)  # output.dir is relative to the working directory
    text = recipe.read_text(encoding="utf-8")
    assert text.startswith("#"), f"{recipe.name} must open with a comment: what it is for, what it costs"
    r = load_recipe(recipe)
    assert r.patch.method is not None
    assert r.output.dir and not Path(r.output.dir).is_absolute()


@pytest.mark.parametrize("recipe", HUB_RECIPES, ids=[p.name for p in HUB_RECIPES])
def test_a_gpu_recipe_states_its_cost(recipe):
    header = _header(recipe)
    assert "Memory" in header and "Time" in header, f"{recipe.name}: the header states memory and time"
    assert "estimate" in header or "measured" in header, f"{recipe.name}: an estimate says it is one"
    assert "hub dataset" in header and "data.files" in header, f"{recipe.name}: say the data is on the hub, " \
                                                               "and how to use local files"


@pytest.mark.parametrize("recipe", HUB_RECIPES, ids=[p.name for p in HUB_RECIPES])
def test_a_hub_recipe_checks_against_its_models_config(recipe, tmp_path, monkeypatch, capsys):
    """`--check` as far as it goes without the hub: the architecture from a folder holding the model's config.json."""
    name = _data(recipe)["model"]["name"]
    assert name in CONFIGS, f"{recipe.name} names {name!r}: add its config.json fields to CONFIGS"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    capsys.readouterr()
    assert main(["finetune", str(recipe), "--check", "--set", f"model.name={folder}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["checked_architecture"], out
    data = _data(recipe)
    method = data["patch"]["method"]
    original, patched = LENGTHS[name][method]
    assert (out["patch"]["original_length"], out["patch"]["patched_length"]) == (original, patched)
    if data["train"].get("pose"):
        assert out["pose_target"] == patched
        assert out["seq_length"] == data["data"]["seq_length"] < patched
    assert list(work.iterdir()) == []  # --check writes nothing


@pytest.mark.slow
def test_hub_recipes_check_offline_from_the_command_line(tmp_path):
    """With HF_HUB_OFFLINE=1 and no cache, `ctxext finetune HUB_RECIPE --check` still validates the recipe (exit 0,
    ok) and says it could not check the architecture (checked_architecture: false)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = ("import json, sys\nfrom ctxext.cli import main\nfor r in sys.argv[1:]:\n"
            "    assert main(['finetune', r, '--check']) == 0, r\n")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, HUB_RECIPES)], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads("[" + proc.stdout.replace("}\n{", "},\n{") + "]")
    assert len(results) == len(HUB_RECIPES)
    assert all(r["ok"] and r["checked_architecture"] is False for r in results), results
