"""Key-token perplexity (ctxext.evaluation.keytokens): the paper's rule, and key tokens found on a constructed text
where they are known: a span repeated from far back is key, everything else is not."""

from __future__ import annotations

import math

import pytest
import torch

from ctxext.evaluation.keytokens import is_key, key_masks, needed_ranges
from ctxext.evaluation.perplexity import plan_documents, score_documents

V = 1000


class Induction(torch.nn.Module):
    """A stand-in LM with a known dependence on context: after token t it predicts, with probability 0.98, the
    token that followed the latest earlier t in its window, and is uniform when t has not been seen."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def get_output_embeddings(self):
        return None

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0, **kwargs):
        b, n = input_ids.shape
        logits = torch.zeros(b, n, V)
        for i in range(b):
            seen: dict[int, int] = {}
            row = input_ids[i].tolist()
            for t in range(n):
                if row[t] in seen:
                    logits[i, t] = math.log(0.02 / (V - 1))
                    logits[i, t, row[seen[row[t]] + 1]] = math.log(0.98)
                seen[row[t]] = t
        keep = logits_to_keep or n
        return type("Out", (), {"logits": logits[:, n - keep :]})()


def _document(seed=0):
    """400 distinct tokens, except that positions 300..339 repeat positions 100..139 (200 tokens back)."""
    g = torch.Generator().manual_seed(seed)
    unique = torch.randperm(V, generator=g)[:360]
    return torch.cat([unique[:300], unique[100:140], unique[300:360]])


#: The targets a copy predicts: after the repeat's first token, through its last (the cue for 340 points elsewhere).
COPIED = set(range(301, 340))


def test_rule_is_the_papers():
    long = torch.tensor([0.1, 0.1, 3.0, 0.1, float("nan")])
    short = torch.tensor([5.0, 1.0, 6.0, 2.2, 5.0])
    assert is_key(long, short).tolist() == [True, False, False, True, False]
    assert is_key(long, short, alpha=3.0).tolist() == [True, False, False, False, False]


def test_far_repeat_is_key_near_context_is_not():
    doc = _document()
    masks, info = key_masks(Induction(), [doc], [[(1, 400)]], context=512, short=32, progress=False)
    assert set(torch.nonzero(masks[0]).flatten().tolist()) == COPIED
    assert info["key_tokens"] == len(COPIED) and info["short"] == 32 and info["context"] == 512
    # only the positions asked about are marked
    masks, _ = key_masks(Induction(), [doc], [[(320, 400)]], context=512, short=32, progress=False)
    assert set(torch.nonzero(masks[0]).flatten().tolist()) == set(range(320, 340))


def test_a_near_repeat_is_not_key():
    """The same copy read from 20 tokens back: the short context already holds it."""
    g = torch.Generator().manual_seed(1)
    unique = torch.randperm(V, generator=g)[:380]
    doc = torch.cat([unique[:300], unique[280:300], unique[300:380]])
    masks, _ = key_masks(Induction(), [doc], [[(1, 400)]], context=512, short=32, progress=False)
    assert not masks[0].any()


def test_no_key_token_when_the_long_context_does_not_reach_the_repeat():
    doc = _document()
    masks, _ = key_masks(Induction(), [doc], [[(300, 340)]], context=128, short=16, progress=False)
    assert not masks[0].any()  # 200 tokens back is past a 128-token long context (windows of 128, stride 64)


def test_key_token_perplexity_is_the_mean_over_marked_targets():
    doc = _document()
    model = Induction()
    plan, _, _ = plan_documents([doc], 400, protocol="chunks")
    ranges = needed_ranges([plan], 1)
    assert ranges == [[(1, 400)]]
    masks, _ = key_masks(model, [doc], ranges, context=512, short=32, progress=False)
    row = score_documents(model, [doc], 400, protocol="chunks", key_masks=masks, progress=False)
    assert row["key_tokens"] == int(masks[0].sum()) > 0
    assert row["ppl_key"] == pytest.approx(1 / 0.98, rel=1e-5)  # every key token a confident copy (float32 logits)
    assert row["ppl"] > 10 * row["ppl_key"]
    # a window too short to hold the far repeat cannot copy it: its key-token perplexity jumps
    short = score_documents(model, [doc], 100, protocol="chunks", key_masks=masks, progress=False)
    assert short["ppl_key"] > 20
