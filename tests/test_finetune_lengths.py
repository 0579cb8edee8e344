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
from ctxext.finetune import RecipeError  # noqa: E402
from ctxext.finetune.checks import lengths  # noqa: E402
from ctxext.finetune.config import Recipe  # noqa: E402


def _advertised_length(model) -> int:
    """The training length the fine-tune takes for ``model`` given no patch and no data.seq_length: the length the
    model advertises."""
    return lengths(Recipe(), None, model)["seq_length"]


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
    with pytest.raises(RecipeError, match="data.seq_length is required: the patch gives no target length"):
        _advertised_length(_Unclaimed(seq_length=77, n_ctx=5))
    assert config_length(_Unclaimed(seq_length=77, n_ctx=5).config) == 77


def test_lora_layers_are_known_by_class():
    """The layers LoRA can adapt, as the refusal of a missing target lists them: nn.Linear and transformers' Conv1D
    (GPT-2's), known by class; an embedding, or a class that only shares Conv1D's name, is not one."""
    from transformers.pytorch_utils import Conv1D

    from ctxext.finetune.model import check_lora

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.conv, self.emb = nn.Linear(3, 4), Conv1D(4, 3), nn.Embedding(4, 3)
            self.fake = type("Conv1D", (nn.Module,), {})()  # shares the name only: peft could not adapt it either

    recipe = Recipe(lora={"target_modules": ["absent"]})
    with pytest.raises(RecipeError) as err:
        check_lora(recipe, Layers())
    assert str(err.value).endswith("its linear layers are: conv, lin")


def test_an_unpatched_alibi_model_takes_a_pose_target_past_its_training_length():
    """BLOOM's 2048 is where it was trained, not a limit on its positions (ALiBi has no table): PoSE may aim past it,
    as it could before the family answered the length; a learned table still caps the target."""
    def recipe(target, window):
        return Recipe(train={"pose": {"target_length": target}}, data={"seq_length": window})

    assert lengths(recipe(8192, 512), None, tiny_bloom())["pose_target"] == 8192
    gpt2 = tiny_gpt2()
    with pytest.raises(RecipeError, match="past the"):
        lengths(recipe(gpt2.config.n_positions * 2, 16), None, gpt2)
