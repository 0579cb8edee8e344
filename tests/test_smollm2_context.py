"""What the toolkit is for, on a real checkpoint: SmolLM2-135M (trained to 8192 tokens) read at 16k tokens.

Slow (three forward passes of 8k-16k tokens, about 4 minutes on 2 CPU cores); needs ``../shared/tools/smollm2.sh``.
The numbers behind the bounds are in ``benchmarks/smollm2_context.md`` (last-quarter perplexity at 16k on *Emma*:
about 300 unpatched, 30 with ntk x2, against 26 unpatched at 8k).
"""

from __future__ import annotations

import pytest
import torch
from conftest import smollm2_gguf

import ctxext
from ctxext.evaluation.perplexity import perplexity
from ctxext.reference import reference_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    model = ctxext.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = torch.tensor(tok(reference_text()[:200_000])["input_ids"][:16384])
    assert ids.numel() == 16384
    return model, ids


def _last_quarter(model, ids, length):
    return perplexity(model, ids[-length:], length, protocol="chunks", progress=False)["ppl_last_quarter"]


def test_ntk_x2_holds_at_16k_where_the_unpatched_model_breaks(smollm2):
    model, ids = smollm2
    at_8k = _last_quarter(model, ids, 8192)  # trained length: the baseline
    unpatched_16k = _last_quarter(model, ids, 16384)
    with ctxext.patched(model, "ntk", 2):
        ntk_16k = _last_quarter(model, ids, 16384)
    assert ctxext.describe(model) is None
    # past 8192 the unpatched model falls apart; NTK x2 reads 16k tokens about as well as 8k
    assert unpatched_16k > 3 * ntk_16k, (at_8k, unpatched_16k, ntk_16k)
    assert ntk_16k < 1.5 * at_8k, (at_8k, unpatched_16k, ntk_16k)
