"""The fine-tune asks the model's family (``ctxext.adapters``) for the length a model advertises, reading config
attributes itself only for a model no family claims; LoRA knows GPT-2's Conv1D layers by class, not by name."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_bloom, tiny_gpt2, tiny_llama  # noqa: E402

from ctxext.adapters import config_length  # noqa: E402
from ctxext.adapters.bloom import BLOOM_TRAINING_LENGTH  # noqa: E402
from ctxext.finetune.train import _advertised_length  # noqa: E402


def test_the_family_says_the_length():
    llama, gpt2, bloom = tiny_llama(), tiny_gpt2(), tiny_bloom()
    assert _advertised_length(llama) == llama.config.max_position_embeddings
    assert _advertised_length(gpt2) == gpt2.config.n_positions
    # BLOOM's config names no length: its family's answer, as a patched BLOOM's spec already recorded it
    assert _advertised_length(bloom) == BLOOM_TRAINING_LENGTH == 2048


class _Unclaimed(nn.Module):
    """A model no adapter claims: no positional surface, only a config."""

    def __init__(self, **config):
        super().__init__()
        self.config = types.SimpleNamespace(**config)
        self.proj = nn.Linear(2, 2)


def test_a_model_no_family_claims_is_read_from_its_config():
    assert _advertised_length(_Unclaimed(max_position_embeddings=96, n_positions=32)) == 96
    assert _advertised_length(_Unclaimed(max_position_embeddings=None, n_positions=32)) == 32
    # only those two, as the fine-tune always read them; the evaluator's model card also reads seq_length, n_ctx
    assert _advertised_length(_Unclaimed(seq_length=77, n_ctx=5)) is None
    assert config_length(_Unclaimed(seq_length=77, n_ctx=5).config) == 77


def test_lora_layers_are_known_by_class():
    from transformers.pytorch_utils import Conv1D

    from ctxext.finetune.model import _is_linear

    assert _is_linear(nn.Linear(3, 4)) and _is_linear(Conv1D(4, 3))
    assert not _is_linear(nn.Embedding(4, 3))
    named_alike = type("Conv1D", (nn.Module,), {})  # shares the name only: peft could not adapt it either
    assert not _is_linear(named_alike())


def test_an_unpatched_alibi_model_takes_a_pose_target_past_its_training_length():
    """BLOOM's 2048 is where it was trained, not a limit on its positions (ALiBi has no table): PoSE may aim past it,
    as it could before the family answered the length; a learned table still caps the target."""
    from types import SimpleNamespace

    from ctxext.finetune.config import RecipeError
    from ctxext.finetune.train import _pose_target

    def recipe(target):
        return SimpleNamespace(train=SimpleNamespace(pose=SimpleNamespace(target_length=target)))

    assert _pose_target(recipe(8192), None, tiny_bloom(), 512) == 8192
    gpt2 = tiny_gpt2()
    with pytest.raises(RecipeError, match="past the"):
        _pose_target(recipe(gpt2.config.n_positions * 2), None, gpt2, 16)
