"""The shipped reference checkpoints (ctxext/assets/reference): they load offline, their tokenizer is
lossless, they are language models, and they show what context extension is for.

Perplexity here is a tiny local function (non-overlapping windows over the first tokens of the held-out
book); the evaluator in ``ctxext.evaluation`` is tested elsewhere. Thresholds come from measurements
recorded in ``benchmarks/reference_training.md``, with margin.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import ctxext
from ctxext.reference import (
    REFERENCE_NAMES,
    reference_model,
    reference_path,
    reference_text,
    reference_tokenizer,
    train_length,
)

#: Tokens of the held-out book scored in every perplexity below (32 windows of 128 ... 4 of 1024).
SPAN = 4096
#: Held-out perplexity at the training length that a language model stays under (see the report).
PPL_1X_MAX = {"llama": 200.0, "gpt2": 200.0, "bloom": 200.0}  # measured 82 / 142 / 121


def perplexity(model, ids: torch.Tensor, length: int, span: int = SPAN, last_quarter: bool = False) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of ``length`` tokens in ``ids[:span]``; with
    ``last_quarter``, only the targets in each window's last quarter (the ones with the most context)."""
    windows = ids[: (span // length) * length].view(-1, length)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for window in windows.split(max(1, 2048 // length)):
            logits = model(input_ids=window).logits.float()
            token_nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), window[:, 1:], reduction="none")
            if last_quarter:
                token_nll = token_nll[:, -(length // 4):]
            nll += token_nll.sum().item()
            count += token_nll.numel()
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def held_out_ids() -> torch.Tensor:
    text = reference_text()[:60_000]  # about 16k tokens, more than SPAN
    ids = torch.tensor(reference_tokenizer()(text)["input_ids"])
    assert len(ids) >= SPAN
    return ids


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {name: reference_model(name) for name in REFERENCE_NAMES}


@pytest.fixture(scope="module")
def ppl_1x(models, held_out_ids) -> dict[str, float]:
    return {name: perplexity(model, held_out_ids, train_length(name)) for name, model in models.items()}


# ---------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize(
    "name, cls, length_attr",
    [("llama", "LlamaForCausalLM", "max_position_embeddings"), ("gpt2", "GPT2LMHeadModel", "n_positions"), ("bloom", "BloomForCausalLM", None)],
)
def test_loads_by_name(models, name, cls, length_attr):
    model = models[name]
    assert type(model).__name__ == cls
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 10e6
    assert model.config.vocab_size == len(reference_tokenizer(name)) == 4096
    if length_attr:
        assert getattr(model.config, length_attr) == train_length(name)
    assert ctxext.describe(model) is None  # shipped unpatched


def test_checkpoints_are_small_16bit_safetensors():
    for name in REFERENCE_NAMES:
        folder = reference_path(name)
        assert (folder / "model.safetensors").exists() and not list(folder.glob("*.bin"))
        assert (folder / "tokenizer.json").exists()
        size = sum(f.stat().st_size for f in folder.iterdir())
        assert size < 12e6, f"{name}: {size / 1e6:.1f} MB"


def test_assets_ship_inside_the_package():
    # Package data (pyproject: ctxext = ["assets/**/*"]), so an installed wheel needs neither network nor ../shared.
    package = Path(ctxext.__file__).resolve().parent
    for name in REFERENCE_NAMES:
        assert package in reference_path(name).parents
    assert (package / "assets" / "reference" / "emma.txt.xz").exists()


def test_dtype_is_honoured():
    model = reference_model("llama", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_unknown_name_lists_the_names():
    with pytest.raises(ValueError, match="llama, gpt2, bloom"):
        reference_path("mistral")
    with pytest.raises(ValueError, match="unknown reference model"):
        reference_model("gpt-2")


def test_reference_text_is_the_held_out_book():
    text = reference_text()
    assert text.startswith("EMMA")
    assert 800_000 < len(text) < 1_000_000
    assert "Emma Woodhouse, handsome, clever, and rich" in text


# -------------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_tokenizer_round_trips(name):
    tok = reference_tokenizer(name)
    samples = [
        reference_text()[:3000],
        "  Mr. Knightley's  \"reply\"\n\n\tcafé — naïve 日本語 🙂 <tag> 1,234.5%",
        "",
    ]
    for text in samples:
        ids = tok(text)["input_ids"]
        assert all(0 <= i < 4096 for i in ids)
        assert tok.decode(ids) == text
    # Austen's English compresses well: about 3.5 characters per token.
    assert len(tok(samples[0])["input_ids"]) < len(samples[0]) / 3
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")


def test_tokenizers_are_identical():
    vocabs = [reference_tokenizer(name).get_vocab() for name in REFERENCE_NAMES]
    assert vocabs[0] == vocabs[1] == vocabs[2]


# ------------------------------------------------------------------------------------------- perplexity


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_language_model_at_training_length(ppl_1x, name):
    # A uniform guess over 4096 tokens scores 4096, a unigram model of the training books about 630.
    assert ppl_1x[name] < PPL_1X_MAX[name]


#: Issue 13's targets for the LLaMA reference, as last-quarter perplexity at 4x over 1x on the held-out book.
#: Measured with this function on 2026-11-27 for the reference shipped then (trained at 128 to copy by content and
#: to retrieve a passkey, benchmarks/reference_training.md, attempt passkey): unpatched 9.74x; at factor 4: llama3
#: 1.26x, yarn 1.38x, dynamic-ntk 1.92x, pi 2.70x, ntk 3.88x.
DEGRADES_AT_4X = 2.0
BEST_METHOD_AT_4X = 1.3


def _last_quarter_ratio(model, ids) -> float:
    length = train_length("llama")
    one = perplexity(model, ids, length, last_quarter=True)
    return perplexity(model, ids, 4 * length, last_quarter=True) / one


def test_llama_unpatched_degrades_past_training_length(models, held_out_ids):
    ratio = _last_quarter_ratio(models["llama"], held_out_ids)
    assert ratio >= DEGRADES_AT_4X, ratio  # measured 9.74


def test_llama_best_training_free_method_holds_at_4x(models, held_out_ids):
    model, length = models["llama"], train_length("llama")
    one = perplexity(model, held_out_ids, length, last_quarter=True)
    ratios = {}
    for method in ("pi", "ntk", "yarn", "llama3", "dynamic-ntk"):
        with ctxext.patched(model, method, 4):
            ratios[method] = perplexity(model, held_out_ids, 4 * length, last_quarter=True) / one
    assert min(ratios.values()) <= BEST_METHOD_AT_4X, ratios  # measured llama3 1.26
    assert ctxext.describe(model) is None


#: Whole-window perplexity at 4x over 1x that YaRN and Llama 3 scaling stay within (measured 1.35 and 1.21; the
#: unpatched model 3.21). NTK-aware scaling keeps every frequency of the copying heads but moves the slow ones by a
#: factor the model never saw: on this reference it recovers about half of the loss (1.76, i.e. 0.55 of the
#: unpatched perplexity), which the next test states. (On the earlier reference, which did not copy by content,
#: ntk measured 1.38 and sat in this test.)
PATCHED_MAX_RATIO = 1.5
NTK_OF_UNPATCHED_MAX = 0.7


@pytest.mark.parametrize("method", ["yarn", "llama3"])
def test_llama_patched_holds_at_4x(models, held_out_ids, ppl_1x, method):
    model = models["llama"]
    with ctxext.patched(model, method, 4):
        ppl_4x = perplexity(model, held_out_ids, 4 * train_length("llama"))
    assert ppl_4x <= PATCHED_MAX_RATIO * ppl_1x["llama"], (method, ppl_1x["llama"], ppl_4x)
    assert ctxext.describe(model) is None


def test_llama_ntk_recovers_part_of_the_loss_at_4x(models, held_out_ids):
    model, length = models["llama"], 4 * train_length("llama")
    unpatched = perplexity(model, held_out_ids, length)
    with ctxext.patched(model, "ntk", 4):
        ntk = perplexity(model, held_out_ids, length)
    assert ntk <= NTK_OF_UNPATCHED_MAX * unpatched, (ntk, unpatched)  # measured 0.55
    assert ctxext.describe(model) is None


#: Issue 24's targets for the default run, on ctxext's own passkey task (10 prompts: 5 depths x 2 trials, seed 0, as
#: `ctxext demo`), every method at factor 8 as the demo applies them. Measured 2026-11-27: 100% at 1x; at 4x
#: unpatched 0%, rerope 100%, dca 80%, self-extend 70%, yarn 60%; streaming-llm 20% (only the needle inside its
#: window).
RETRIEVES_AT_1X = 0.9
UNPATCHED_AT_4X_MAX = 0.2
BEST_REMAP_AT_4X = 0.7


def _passkey(model, length: int) -> float:
    from ctxext.evaluation.passkey import passkey_accuracy

    return passkey_accuracy(model, reference_tokenizer("llama"), length, trials=2, seed=0, progress=False)["accuracy"]


def test_llama_retrieves_at_its_trained_length_and_not_unpatched_at_4x(models):
    model, length = models["llama"], train_length("llama")
    assert _passkey(model, length) >= RETRIEVES_AT_1X
    assert _passkey(model, 4 * length) <= UNPATCHED_AT_4X_MAX


def test_llama_a_remap_method_still_retrieves_at_4x(models):
    model, length = models["llama"], train_length("llama")
    scores = {}
    for method in ("self-extend", "dca", "rerope"):
        with ctxext.patched(model, method, 8):
            scores[method] = _passkey(model, 4 * length)
    assert max(scores.values()) >= BEST_REMAP_AT_4X, scores
    assert ctxext.describe(model) is None


def test_gpt2_unpatched_cannot_read_past_training_length(models, held_out_ids, ppl_1x):
    # 256 rows of learned positions: the sharpest possible degradation is no prediction at all. The GPT-2
    # adapter's table extension is what makes 4x readable (its numbers are in the report).
    model, length = models["gpt2"], train_length("gpt2")
    with pytest.raises((IndexError, RuntimeError)):
        perplexity(model, held_out_ids, 4 * length)
    with ctxext.patched(model, "extrapolate", 4):
        ppl_4x = perplexity(model, held_out_ids, 4 * length)
    assert math.isfinite(ppl_4x) and ppl_4x <= 2.0 * ppl_1x["gpt2"], (ppl_1x["gpt2"], ppl_4x)


def test_bloom_alibi_degrades_gracefully_unpatched(models, held_out_ids, ppl_1x):
    ppl_4x = perplexity(models["bloom"], held_out_ids, 4 * train_length("bloom"))
    assert ppl_4x <= 1.5 * ppl_1x["bloom"], (ppl_1x["bloom"], ppl_4x)
