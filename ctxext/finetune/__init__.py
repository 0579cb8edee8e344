"""LoRA fine-tuning of patched models from short YAML recipes (see ``recipes/``).

    from ctxext.finetune import load_recipe, run
    summary = run(load_recipe("recipes/tiny/llama_pi_lora.yaml", ["train.steps=20"]))

or ``ctxext finetune RECIPE.yaml [--set KEY=VALUE ...] [--resume]``; multi-process with
``accelerate launch -m ctxext finetune ...`` or ``torchrun --nproc_per_node N -m ctxext finetune ...``.
The output folder holds a peft LoRA adapter plus ``ctxext_patch.json``, which
``ctxext.from_pretrained(base, adapter=DIR)`` reloads patched and adapted.
"""

from .config import Recipe, RecipeError, load_recipe, recipe_from_dict
from .train import check, run

__all__ = ["Recipe", "RecipeError", "check", "load_recipe", "recipe_from_dict", "run"]
