"""Fine-tune recipes: validation, a few-step CPU run whose adapter reloads patched and adapted, resume equality."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("peft")

import ctxext  # noqa: E402
from ctxext.finetune import RecipeError, load_recipe, recipe_from_dict, run  # noqa: E402
from ctxext.finetune.config import apply_overrides  # noqa: E402
from ctxext.finetune.data import PackedData  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to a in that it was her not be he his as had with for she you all which but at on have my "
         "so him by very said from this they no would been were could there an one what or Emma Harriet Mr Knightley "
         "Elton Weston Woodhouse father letter walk morning evening friend marriage young lady little much time").split()


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    sentences = []
    while n_words > 0:
        k = rng.randint(5, 14)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        n_words -= k
    return " ".join(sentences)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A tiny LLaMA (GQA, head_dim != hidden/heads) and a tiny GPT-2 saved with a small BPE tokenizer, plus data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import tiny_llama

    root = tmp_path_factory.mktemp("finetune")
    data = root / "data"
    data.mkdir()
    for i in range(3):
        (data / f"book{i}.txt").write_text(_text(i, 6000))
    (data / "heldout.txt").write_text(_text(99, 3000))
    with (data / "docs.jsonl").open("w") as fh:
        for i in range(20):
            fh.write(json.dumps({"text": _text(100 + i, 200)}) + "\n")

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([(data / "book0.txt").read_text()],
                            trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    vocab = tok.get_vocab_size()

    llama = root / "llama"
    tiny_llama(vocab_size=vocab).save_pretrained(llama)
    fast.save_pretrained(llama)

    gpt2 = root / "gpt2"
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=48, n_layer=2, n_head=4, attn_implementation="sdpa",
                     bos_token_id=1, eos_token_id=1, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    GPT2LMHeadModel(cfg).save_pretrained(gpt2)
    fast.save_pretrained(gpt2)
    return {"root": root, "data": data, "llama": llama, "gpt2": gpt2}


def recipe_dict(bases, out, **sections):
    d = {
        "model": {"name": str(bases["llama"])},
        "patch": {"method": "pi", "factor": 2},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"files": [str(bases["data"])], "exclude": ["heldout.txt"]},
        "train": {"steps": 6, "batch_size": 4, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 1,
                  "save_every": 2, "gradient_checkpointing": True},
        "eval": {"data": [str(bases["data"] / "heldout.txt")], "max_windows": 4, "unpatched": True},
        "output": {"dir": str(out)},
    }
    for key, value in sections.items():
        d[key] = {**d.get(key, {}), **value}
    return d


def make(bases, out, **sections):
    return recipe_from_dict(recipe_dict(bases, out, **sections))


# ------------------------------------------------------------------------------------------- validation


def test_shipped_recipes_parse():
    files = sorted((REPO / "recipes").rglob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        text = f.read_text()
        assert text.startswith("#"), f"{f} must open with a comment: what it is for, what it costs"
        data = yaml.safe_load(text)
        assert {"model", "patch", "lora", "data", "train", "output"} <= set(data)
    methods = {yaml.safe_load(f.read_text())["patch"].get("method") for f in files}
    assert {"pi", "yarn", "alibi", "nope"} <= methods


@pytest.mark.parametrize(
    "change, message",
    [
        ({"extra": {"x": 1}}, "unknown section(s) extra"),
        ({"train": {"stepz": 5}}, "unknown key(s) train.stepz; train accepts: steps"),
        ({"train": {"steps": "many"}}, "train.steps: input should be a valid integer, unable to parse string as an integer"),
        ({"train": {"steps": 0}}, "train.steps: input should be greater than or equal to 1, got 0"),
        ({"train": {"batch_size": 5, "micro_batch_size": 2}}, "must be a multiple of train.micro_batch_size"),
        ({"train": {"scheduler": "sawtooth"}}, "train.scheduler must be one of"),
        ({"model": {"name": ""}}, "model.name is required"),
        ({"output": {"dir": ""}}, "output.dir is required"),
        ({"data": {"files": [], "exclude": []}}, "give data.files"),
        ({"data": {"files": ["/nonexistent/corpus.txt"]}}, "data.files: '/nonexistent/corpus.txt' not found"),
        ({"patch": {"method": "warp"}}, "unknown method 'warp'"),
        ({"patch": {"method": "pi", "factor": 0.5}}, "factor must be >= 1"),
        ({"patch": {"method": "pi", "factor": None}}, "needs a factor"),
        ({"patch": {"method": "yarn", "factor": 2, "options": {"beta": 3}}}, "unknown option(s) beta"),
        ({"lora": {"dropout": 1.5}}, "lora.dropout: input should be less than 1, got 1.5"),
        ({"eval": {"data": ["/nonexistent/eval.txt"]}}, "eval.data"),
    ],
)
def test_recipe_errors(bases, tmp_path, change, message):
    d = recipe_dict(bases, tmp_path / "out")
    for key, value in change.items():
        d[key] = {**d.get(key, {}), **value} if key in d else value
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(d)
    assert message in str(err.value)


def test_every_problem_is_reported_at_once(bases, tmp_path):
    d = recipe_dict(bases, tmp_path / "out")
    d["train"].update(steps="abc", lr="fast", stepz=1)
    d["lora"].update(r=0, dropout=2)
    d["data"]["files"] = ["/nonexistent/a.txt"]
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(d)
    problems = err.value.problems
    assert len(problems) == 6, problems
    for key in ("train.stepz", "train.steps:", "train.lr:", "lora.r: input should be greater than or equal to 1", "lora.dropout", "data.files:"):
        assert any(key in p for p in problems), (key, problems)
    message = str(err.value)
    assert message.startswith("6 problems: ") and "\n" not in message
    assert message.count("; ") >= 5


@pytest.mark.parametrize("change, message", [
    ({"train": {"steps": True}}, "train.steps: input should be a number, not true / false, got True"),  # not read as 1
    ({"train": {"lr": float("inf")}}, "train.lr: input should be a finite number, got inf"),
    ({"train": {"mixed_precision": "fp8"}}, "train.mixed_precision: input should be 'no', 'bf16' or 'fp16', got 'fp8'"),
    ({"lora": {"bias": "some"}}, "lora.bias: input should be 'none', 'all' or 'lora_only', got 'some'"),
    ({"eval": {"lengths": [128, 1]}}, "eval.lengths[1]: input should be greater than or equal to 2, got 1"),
    ({"eval": {"stride": 0}}, "eval.stride: input should be greater than or equal to 1, got 0"),
    ({"train": {"max_grad_norm": 0}}, "train.max_grad_norm: input should be greater than 0, got 0"),
    ({"lora": {"target_modules": {"q": 1}}}, "lora.target_modules: input should be a valid "),  # (union order is typing's)
])
def test_types_bounds_and_choices_name_their_key(bases, tmp_path, change, message):
    d = recipe_dict(bases, tmp_path / "out")
    for key, value in change.items():
        d[key] = {**d[key], **value}
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(d)
    assert [p for p in err.value.problems if message in p], err.value.problems
    assert len(err.value.problems) == 1, err.value.problems  # one message per key, no follow-on noise


def test_types_are_coerced(bases, tmp_path):
    r = make(bases, tmp_path, train={"lr": "2e-4", "steps": 10.0}, patch={"method": "none", "factor": None})
    assert r.train.lr == pytest.approx(2e-4) and r.train.steps == 10 and r.patch.method is None


def test_overrides(bases, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(bases, tmp_path / "out")))
    r = load_recipe(path, ["train.steps=3", "lora.target_modules=[q_proj, k_proj]", "patch.options.beta_fast=16",
                           "patch.method=yarn", "eval.max_windows=null"])
    assert r.train.steps == 3 and r.lora.target_modules == ["q_proj", "k_proj"]
    assert r.patch.options == {"beta_fast": 16} and r.eval.max_windows is None
    with pytest.raises(RecipeError, match="unknown key.*train.stepz"):
        load_recipe(path, ["train.stepz=3"])
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        load_recipe(path, ["train.steps"])
    assert apply_overrides({"train": {"steps": 1}}, ["train.x.y=1"]) == {"train": {"steps": 1, "x": {"y": 1}}}


def test_patch_that_does_not_fit_fails_before_training(bases, tmp_path):
    out = tmp_path / "out"
    r = make(bases, out, model={"name": str(bases["gpt2"])}, patch={"method": "ntk", "factor": 2},
             lora={"target_modules": ["c_attn"]})
    with pytest.raises(RecipeError, match="patch does not fit model.*ntk"):
        run(r, progress=False)
    assert not (out / "log.jsonl").exists()  # nothing started
    r = make(bases, out, lora={"target_modules": ["query_key_value"]})
    with pytest.raises(RecipeError, match="no module named 'query_key_value'.*q_proj"):
        run(r, progress=False)


def test_cli_reports_bad_recipe_in_one_line(bases, tmp_path):
    path = tmp_path / "bad.yaml"
    d = recipe_dict(bases, tmp_path / "out")
    d["train"]["warmup"] = 3
    path.write_text(yaml.safe_dump(d))
    proc = subprocess.run([sys.executable, "-m", "ctxext", "finetune", str(path)], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 2
    assert "ctxext finetune: error:" in proc.stderr and "train.warmup" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ctxext", "finetune", str(path), "--set", "train.warmup=null",
                           "--check"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2  # still an unknown key


def test_check_validates_architecture_without_weights(bases, tmp_path):
    from ctxext.finetune import check

    result = check(make(bases, tmp_path, patch={"method": "pi", "factor": 4}))
    assert result["checked_architecture"] and result["seq_length"] == 256
    assert result["patch"]["method"] == "pi"


# ------------------------------------------------------------------------------------------------ data


def test_packing_is_deterministic_and_the_run_reads_it_in_order():
    from ctxext.finetune.data import RunSamples

    seqs = torch.arange(7 * 5).view(7, 5)
    a, b = PackedData(seqs, seed=3), PackedData(seqs, seed=3)
    assert torch.equal(a.samples(0, 20), b.samples(0, 20))
    # every sequence once per epoch, a fresh order in the next
    assert sorted(a.samples(0, 7)[:, 0].tolist()) == sorted(seqs[:, 0].tolist())
    assert not torch.equal(a.samples(0, 7), a.samples(7, 7))
    # the run's item i is global sample i (Trainer reads it in order; processes take alternate micro-batches)
    run_samples = RunSamples(a, 20)
    assert len(run_samples) == 20
    for i in range(20):
        item = run_samples[i]
        assert torch.equal(item["input_ids"], a.samples(i, 1)[0]) and torch.equal(item["labels"], item["input_ids"])
        assert set(item) == {"input_ids", "labels"}  # no PoSE: the model's own positions


def test_jsonl_and_max_documents(bases, tmp_path):
    from ctxext.finetune.data import build_packed_data
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bases["llama"])
    r = make(bases, tmp_path, data={"files": [str(bases["data"] / "docs.jsonl")], "exclude": []})
    full = build_packed_data(r, tok, 32)
    r = make(bases, tmp_path, data={"files": [str(bases["data"] / "docs.jsonl")], "exclude": [], "max_documents": 5})
    few = build_packed_data(r, tok, 32)
    assert 0 < len(few) < len(full)
    assert torch.equal(few.sequences[0], full.sequences[0])


# ----------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained(bases):
    out = bases["root"] / "run-straight"
    summary = run(make(bases, out, output={"merged": True}), progress=False)
    return out, summary


def test_run_writes_adapter_patch_log_and_perplexities(trained):
    out, summary = trained
    assert summary["finished"] and summary["steps"] == 6 and len(summary["losses"]) == 6
    for name in ("adapter_config.json", "adapter_model.safetensors", "ctxext_patch.json", "log.jsonl",
                 "results.json", "recipe.yaml"):
        assert (out / name).exists(), name
    spec = json.loads((out / "ctxext_patch.json").read_text())
    assert spec["method"] == "pi" and spec["factor"] == 2 and spec["patched_length"] == 128
    events = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 7))
    assert all(e["tokens_per_s"] > 0 and "lr" in e for e in steps)
    assert summary["before"]["128"]["ppl"] > 0 and summary["after"]["128"]["ppl"] > 0
    assert summary["after"]["128"]["ppl"] < summary["before"]["128"]["ppl"]


def test_adapter_reloads_patched_and_adapted(bases, trained):
    from ctxext.evaluation.perplexity import perplexity
    from ctxext.finetune.data import read_eval_tokens
    from transformers import AutoTokenizer

    out, summary = trained
    model = ctxext.from_pretrained(str(bases["llama"]), adapter=str(out)).eval()
    assert ctxext.describe(model)["method"] == "pi"
    assert type(model).__name__.startswith("Peft")
    recipe = load_recipe(out / "recipe.yaml")
    ids, _ = read_eval_tokens(recipe, AutoTokenizer.from_pretrained(bases["llama"]))
    # same numbers as the model at the end of training
    after = perplexity(model, ids, 128, max_windows=4, progress=False)
    assert after["nll_sum"] == pytest.approx(summary["after"]["128"]["nll_sum"], rel=1e-6)
    # same logits as the merged model, and different from the patched base (the adapter did something)
    merged = ctxext.from_pretrained(str(out / "merged")).eval()
    assert ctxext.describe(merged)["method"] == "pi"
    base = ctxext.patch(ctxext.from_pretrained(str(bases["llama"])), "pi", 2).eval()
    x = ids[:120].unsqueeze(0)
    with torch.no_grad():
        a, b, c = model(x).logits, merged(x).logits, base(x).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (a - c).abs().max() > 1e-4


def test_resume_reaches_the_same_result(bases, trained):
    from safetensors.torch import load_file

    straight, summary = trained
    out = bases["root"] / "run-resumed"
    recipe = make(bases, out, output={"merged": True})
    part = run(recipe, stop_after=3, progress=False)
    assert not part["finished"] and part["step"] == 3
    with pytest.raises(RecipeError, match="--resume"):
        run(recipe, progress=False)  # would silently start over
    changed = make(bases, out, train={"lr": 1e-2})
    with pytest.raises(RecipeError, match="recipe changed.*train.lr"):
        run(changed, resume=True, progress=False)
    resumed = run(recipe, resume=True, progress=False)
    assert resumed["finished"] and resumed["steps"] == 6
    assert resumed["losses"] == pytest.approx(summary["losses"], abs=1e-6)
    a = load_file(str(straight / "adapter_model.safetensors"))
    b = load_file(str(out / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)
    assert resumed["after"]["128"]["ppl"] == pytest.approx(summary["after"]["128"]["ppl"], rel=1e-5)
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["event"] == "step"] == list(range(1, 7))


def test_resume_with_dropout_is_bit_identical(bases, tmp_path):
    """With LoRA dropout the random state matters: a run stopped and resumed (Trainer's checkpoint with its random
    states) draws the same dropout masks as an uninterrupted one. Checkpoints hold only the trainable weights."""
    from safetensors.torch import load_file

    extra = dict(lora={"dropout": 0.3}, train={"steps": 4}, eval={"enabled": False})
    straight = run(make(bases, tmp_path / "straight", **extra), progress=False)
    recipe = make(bases, tmp_path / "resumed", **extra)
    run(recipe, stop_after=2, progress=False)
    ckpt = tmp_path / "resumed" / "checkpoint-2"  # Trainer's layout
    assert (ckpt / "ctxext_state.json").exists() and (ckpt / "rng_state.pth").exists()
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    assert saved and all("lora_" in name for name in saved), sorted(saved)[:3]  # no frozen base weights
    resumed = run(recipe, resume=True, progress=False)
    assert resumed["losses"] == straight["losses"]  # exact: same masks, same optimizer state
    a = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gpt2_pi_trains_and_saves_the_interpolated_table(bases, tmp_path):
    from peft import PeftModel

    from ctxext.loading import prepare_for_adapter

    out = tmp_path / "gpt2"
    r = make(bases, out, model={"name": str(bases["gpt2"])}, patch={"method": "pi", "factor": 2},
             lora={"target_modules": ["c_attn"], "trainable": ["wpe"]}, output={"merged": True},
             train={"lr": 1e-2})
    summary = run(r, progress=False)
    assert summary["finished"]
    from safetensors.torch import load_file

    saved = load_file(str(out / "adapter_model.safetensors"))
    tables = [k for k in saved if "wpe" in k and k.endswith("table")]
    assert tables and saved[tables[0]].shape[0] == 128  # the interpolated table, 2 x 64 rows
    base = ctxext.from_pretrained(str(bases["gpt2"]))
    ctxext.patch(base, "pi", 2)
    model = PeftModel.from_pretrained(prepare_for_adapter(base, out), str(out)).eval()
    merged = ctxext.from_pretrained(str(out / "merged")).eval()
    assert merged.config.n_positions == 128 and ctxext.describe(merged) is None  # baked: a plain longer table
    x = (torch.arange(120) * 7 % 100).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, merged(x).logits, atol=1e-5, rtol=1e-5)
        reloaded = ctxext.from_pretrained(str(bases["gpt2"]), adapter=str(out)).eval()
        torch.testing.assert_close(reloaded(x).logits, merged(x).logits, atol=1e-5, rtol=1e-5)


def test_gpt_neo_pi_trains_and_bakes_the_interpolated_table(bases, tmp_path):
    """GPT-Neo: LoRA on its nn.Linear projections (not GPT-2's transposed Conv1D) and the patched wpe trained; the
    merged model is a plain GPT-Neo of the longer length (transformers builds the longer masks from the config)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM, PreTrainedTokenizerFast

    base_dir = tmp_path / "neo"
    tokenizer = PreTrainedTokenizerFast.from_pretrained(bases["gpt2"])
    torch.manual_seed(0)
    cfg = GPTNeoConfig(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                       max_position_embeddings=64, attention_types=[[["global", "local"], 1]], window_size=16,
                       bos_token_id=1, eos_token_id=1)
    GPTNeoForCausalLM(cfg).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    out = tmp_path / "neo-run"
    r = make(bases, out, model={"name": str(base_dir)}, patch={"method": "pi", "factor": 2},
             lora={"target_modules": ["q_proj", "v_proj"], "trainable": ["wpe"]}, output={"merged": True},
             train={"lr": 1e-2})
    summary = run(r, progress=False)
    assert summary["finished"] and summary["seq_length"] == 128
    assert summary["after"]["128"]["ppl"] < summary["before"]["128"]["ppl"]
    merged = ctxext.from_pretrained(str(out / "merged")).eval()
    assert merged.config.max_position_embeddings == 128 and ctxext.describe(merged) is None
    x = (torch.arange(120) * 7 % 100).unsqueeze(0)
    with torch.no_grad():
        reloaded = ctxext.from_pretrained(str(base_dir), adapter=str(out)).eval()
        torch.testing.assert_close(reloaded(x).logits, merged(x).logits, atol=1e-5, rtol=1e-5)


def test_opt_pi_trains_and_bakes_the_interpolated_table(bases, tmp_path):
    """The OPT-style table (offset rows first) trains under pi like GPT-2's, and the merged model bakes it."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    from ctxext.loading import prepare_for_adapter

    tok = AutoTokenizer.from_pretrained(bases["gpt2"])
    folder = tmp_path / "opt-base"
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=len(tok), max_position_embeddings=64, hidden_size=48, ffn_dim=96, num_hidden_layers=2,
                    num_attention_heads=4, word_embed_proj_dim=48, dropout=0.0, attention_dropout=0.0,
                    pad_token_id=0, bos_token_id=1, eos_token_id=1)
    OPTForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "opt"
    r = make(bases, out, model={"name": str(folder)}, patch={"method": "pi", "factor": 2},
             lora={"target_modules": ["q_proj", "v_proj"], "trainable": ["embed_positions"]},
             output={"merged": True}, train={"lr": 1e-2, "gradient_checkpointing": False})
    assert run(r, progress=False)["finished"]
    saved = load_file(str(out / "adapter_model.safetensors"))
    tables = [k for k in saved if "embed_positions" in k and k.endswith("table")]
    assert tables and saved[tables[0]].shape[0] == 2 + 128  # offset rows + the interpolated 2 x 64 rows
    base = ctxext.from_pretrained(str(folder))
    ctxext.patch(base, "pi", 2)
    model = PeftModel.from_pretrained(prepare_for_adapter(base, out), str(out)).eval()
    merged = ctxext.from_pretrained(str(out / "merged")).eval()
    assert merged.config.max_position_embeddings == 128 and ctxext.describe(merged) is None
    x = (torch.arange(120) * 7 % 100 + 2).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, merged(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["alibi", "nope"])
def test_swap_recipes_run(bases, tmp_path, method):
    out = tmp_path / method
    r = make(bases, out, patch={"method": method, "factor": None}, train={"steps": 2, "save_every": 0},
             lora={"target_modules": "all-linear", "trainable": ["norm"]})
    summary = run(r, progress=False)
    assert summary["finished"] and summary["seq_length"] == 64
    model = ctxext.from_pretrained(str(bases["llama"]), adapter=str(out))
    assert ctxext.describe(model)["method"] == method


@pytest.mark.slow
def test_two_processes_train_like_one(bases, trained, tmp_path):
    """torchrun --nproc_per_node 2 (gloo, CPU) with the same global batch follows the single-process loss curve."""
    _, summary = trained
    out = tmp_path / "two"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(bases, out)))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "ctxext", "finetune", str(path), "--no-progress"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((out / "results.json").read_text())
    assert two["world_size"] == 2
    assert two["losses"] == pytest.approx(summary["losses"], rel=1e-4)
    assert two["after"]["128"]["ppl"] == pytest.approx(summary["after"]["128"]["ppl"], rel=1e-4)


@pytest.mark.slow
def test_two_processes_stopped_and_resumed_train_like_one(bases, trained, tmp_path):
    """torchrun x2 stopped after 3 steps and resumed (accelerate's load_state into the DDP-wrapped model, each
    process's random state) follows the uninterrupted single-process run."""
    _, summary = trained
    out = tmp_path / "two-resumed"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(bases, out)))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "-m", "ctxext", "finetune", str(path), "--no-progress"]
    for extra in (["--stop-after", "3"], ["--resume"]):
        proc = subprocess.run(launch + extra, capture_output=True, text=True, cwd=REPO, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((out / "results.json").read_text())
    assert two["world_size"] == 2 and two["steps"] == 6
    assert two["losses"] == pytest.approx(summary["losses"], rel=1e-4)
    assert two["after"]["128"]["ppl"] == pytest.approx(summary["after"]["128"]["ppl"], rel=1e-4)
