"""``train.shift_attention``: LongLoRA's S²-Attn in a fine-tune recipe (the attention function itself is tested against
a dense reference in test_shift_attention.py): used for every training forward, gone for evaluation and the saved
adapter, refused with its key before anything loads where it cannot apply."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from test_finetune import bases, make  # noqa: E402,F401 - the module's fixture and recipe builder

import ctxext  # noqa: E402
import ctxext.attention.shifted_sparse as shifted_sparse  # noqa: E402
from ctxext.finetune import RecipeError, run  # noqa: E402


def test_a_recipe_trains_with_shift_attention_and_evaluates_and_saves_with_full_attention(bases, tmp_path,  # noqa: F811
                                                                                           monkeypatch):
    calls = []
    original = shifted_sparse.shifted_sparse_attention

    def counted(query, *args, **kwargs):
        calls.append(query.shape[2])
        return original(query, *args, **kwargs)

    monkeypatch.setattr(shifted_sparse, "shifted_sparse_attention", counted)
    out = tmp_path / "s2"
    recipe = make(bases, out, train={"steps": 2, "save_every": 0, "shift_attention": True})
    summary = run(recipe, progress=False)
    assert summary["finished"] and summary["seq_length"] == 128
    # 2 steps x 2 micro-batches x 2 layers, forward (and the checkpointed recomputation) at the training length
    assert len(calls) >= 8 and set(calls) == {128}
    assert all(v["ppl"] is not None for v in summary["after"].values())
    model = ctxext.from_pretrained(str(bases["llama"]), adapter=str(out))
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("train,patch,data,message", [
    ({"shift_group_ratio": 0.3}, {}, {}, "whole groups"),
    ({}, {}, {"seq_length": 60}, "do not split into 4 groups"),
    ({}, {"method": "self-extend", "factor": None}, {}, "computes the attention in its own attention function"),
])
def test_shift_attention_is_refused_with_its_key_before_anything_loads(bases, tmp_path, train, patch, data,  # noqa: F811
                                                                        message):
    out = tmp_path / "refused"
    with pytest.raises(RecipeError, match=f"train.shift_attention.*{message}"):
        recipe = make(bases, out, train={"shift_attention": True, **train}, patch=patch, data=data)
        run(recipe, progress=False)
    assert not out.exists()
