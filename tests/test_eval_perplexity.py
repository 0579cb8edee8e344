"""Perplexity protocols on tiny models: coverage, context, agreement with a brute-force reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ctxext.evaluation.perplexity import last_quarter_start, perplexity, score_documents
from ctxext.evaluation.windows import plan_windows

from conftest import tiny_llama


def _targets(windows):
    out = []
    for w in windows:
        assert w.end - w.begin == w.length
        out.extend((t, t - w.begin) for t in range(w.first_target, w.end))
    return out


@pytest.mark.parametrize("n", [32, 33, 47, 100, 257])
@pytest.mark.parametrize("stride", [1, 5, 16, 31])
def test_sliding_scores_each_token_once_with_enough_context(n, stride):
    L = 32
    windows = plan_windows(n, L, "sliding", stride)
    targets = _targets(windows)
    positions = [t for t, _ in targets]
    assert positions == list(range(L - stride, n))  # each once, in order, none skipped after the first
    assert all(ctx >= L - stride for _, ctx in targets)  # context = in-window position
    assert all(0 <= w.begin and w.end <= n for w in windows)


@pytest.mark.parametrize("n", [32, 33, 62, 63, 64, 100])
def test_chunks_score_every_token(n):
    L = 32
    windows = plan_windows(n, L, "chunks")
    assert [t for t, _ in _targets(windows)] == list(range(1, n))
    assert all(w.end <= n for w in windows)


def test_plan_edge_cases():
    assert plan_windows(31, 32, "sliding", 8) == []
    assert len(plan_windows(1000, 32, "chunks", max_windows=3)) == 3
    with pytest.raises(ValueError, match="stride"):
        plan_windows(100, 32, "sliding", 32)
    with pytest.raises(ValueError, match="protocol"):
        plan_windows(100, 32, "bogus")


def _brute_force(model, ids, windows):
    """Full forward per window, labels masked to the scored targets; returns per-token NLLs with position."""
    nlls = []
    for w in windows:
        logits = model(ids[None, w.begin : w.end]).logits[0].float()
        for t in range(w.first_target, w.end):
            nll = F.cross_entropy(logits[t - w.begin - 1][None], ids[t][None]).item()
            nlls.append((nll, t - w.begin))
    return nlls


@pytest.mark.parametrize("protocol,stride", [("chunks", None), ("sliding", 8), ("sliding", 24)])
def test_perplexity_matches_brute_force(protocol, stride):
    model = tiny_llama()
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (150,))
    L = 32
    res = perplexity(model, ids, L, protocol=protocol, stride=stride, progress=False)
    nlls = _brute_force(model, ids, plan_windows(150, L, protocol, stride))
    assert res["tokens"] == len(nlls)
    assert res["nll_sum"] == pytest.approx(sum(n for n, _ in nlls), rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(sum(n for n, _ in nlls) / len(nlls)), rel=1e-5)
    q = [n for n, pos in nlls if pos >= last_quarter_start(L)]
    assert res["tokens_last_quarter"] == len(q)
    assert res["ppl_last_quarter"] == pytest.approx(math.exp(sum(q) / len(q)), rel=1e-5)
    assert res["windows"] == len(plan_windows(150, L, protocol, stride))


def test_one_chunk_equals_transformers_loss():
    model = tiny_llama()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3))
    res = perplexity(model, ids, 40, protocol="chunks", progress=False)
    loss = model(ids[None], labels=ids[None]).loss.item()
    assert res["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert res["tokens"] == 39 and res["windows"] == 1


def test_batching_does_not_change_results():
    model = tiny_llama()
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(4))
    one = perplexity(model, ids, 32, protocol="sliding", stride=12, progress=False)
    three = perplexity(model, ids, 32, protocol="sliding", stride=12, batch_size=3, progress=False)
    assert three["ppl"] == pytest.approx(one["ppl"], rel=1e-5)
    assert three["tokens"] == one["tokens"]


def test_max_windows_spreads_over_the_text():
    from ctxext.evaluation.perplexity import spread

    assert spread(10, 3) == [1, 5, 8] and spread(4, 10) == [0, 1, 2, 3] and spread(100, 1) == [50]
    model = tiny_llama()
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(7))
    full = plan_windows(400, 32, "sliding", 16)
    res = perplexity(model, ids, 32, protocol="sliding", stride=16, max_windows=3, progress=False)
    nlls = _brute_force(model, ids, [full[i] for i in spread(len(full), 3)])
    assert res["windows"] == 3 and res["tokens"] == len(nlls) == 48
    assert res["nll_sum"] == pytest.approx(sum(n for n, _ in nlls), rel=1e-5)


def test_short_documents_are_skipped_and_counted():
    model = tiny_llama()
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 128, (n,), generator=g) for n in (10, 80, 31, 64)]
    res = score_documents(model, docs, 32, protocol="chunks", progress=False)
    assert res["documents_skipped"] == 2 and res["documents_scored"] == 2
    assert res["tokens"] == 79 + 63
    capped = score_documents(model, docs, 32, protocol="chunks", max_windows=2, progress=False)
    assert capped["windows"] == 2 and capped["documents_unused"] == 0  # one window from each long document
    one = score_documents(model, docs, 32, protocol="chunks", max_windows=1, progress=False)
    assert one["windows"] == 1 and one["documents_scored"] == 1 and one["documents_unused"] == 1
    empty = perplexity(model, docs[0], 32, progress=False)
    assert empty["ppl"] is None and empty["windows"] == 0 and empty["documents_skipped"] == 1


def test_logits_after_the_output_layer_are_respected():
    """Models that change logits after the output layer (Gemma 2's soft-capping) are scored from the logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from ctxext.evaluation.perplexity import _head_path_ok

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5,
                       max_position_embeddings=64)
    model = Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(6))
    assert not _head_path_ok(model, ids[None])
    assert _head_path_ok(tiny_llama(), ids[None])
    res = perplexity(model, ids, 32, protocol="sliding", stride=8, progress=False)
    nlls = _brute_force(model, ids, plan_windows(70, 32, "sliding", 8))
    assert res["nll_sum"] == pytest.approx(sum(n for n, _ in nlls), rel=1e-5)


@pytest.mark.parametrize("text, key, right", [
    (" 12345.", 12345, True),
    ("The pass key is 12345", 12345, True),
    (" 012345", 12345, False),  # another number, though int() reads it as the key
    (" 123456", 12345, False),  # the key is a prefix of it
    (" 1234", 12345, False),
    (" no number", 12345, False),
])
def test_a_passkey_answer_is_right_only_when_it_writes_the_key(text, key, right):
    from ctxext.evaluation.passkey import first_number

    assert (first_number(text) == key) is right
