"""The checks of a run that the recipe alone cannot answer, each made once.

Before any weights load (``--check`` and the start of a run): the output folder can be written, TrainingArguments
takes the training settings, and on the architecture without weights (``model.skeleton``) the patch fits, the LoRA
targets exist, and the training length, PoSE's target and the evaluation windows follow. Once the model is loaded
and patched, only what needs it: the patch and LoRA targets where the skeleton could not tell, the lengths where the
loaded model differs from the skeleton (a saved patch), PoSE's probe of the position input, S²-Attn on the model.
"""

from __future__ import annotations

import os
from typing import Any

from ..attention.shifted_sparse import check_shift_attention
from ..core.errors import PatchError
from .config import Recipe, RecipeError
from .model import check_lora, check_patch, check_position_input, skeleton


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # torchrun / accelerate launch set it


def check_output(recipe: Recipe) -> None:
    """output.dir can be made and written: probed (a temporary file created and removed in it, or in the nearest
    folder that exists on the way), so a run that could not save fails before any model loads."""
    from ..core.outputs import check_writable_folder

    try:
        check_writable_folder(recipe.output.dir, "output.dir")
    except ValueError as exc:
        raise recipe.error(str(exc)) from None


def check(recipe: Recipe) -> dict[str, Any]:
    """Every check that needs no weights: the output folder can be written, the training settings (transformers'
    TrainingArguments built from them), the patch against the architecture, the LoRA targets, the lengths. Returns
    what the run would record (the patch spec and the training length)."""
    check_output(recipe)
    return check_recipe(recipe, progress=False)[0]


def check_recipe(recipe: Recipe, progress: bool):
    """:func:`check` but the output folder; also returns the run's TrainingArguments."""
    from .trainer import training_arguments

    args = training_arguments(recipe, accumulation(recipe, world_size()), progress,
                              use_cpu=recipe.train.cpu or not _has_accelerator())
    model = skeleton(recipe.model)
    if model is None:
        return {"checked_architecture": False}, args
    problems, spec = [], None  # both checks' problems reported at once
    try:
        spec = check_patch(recipe, model)
    except RecipeError as exc:
        problems += exc.problems
    try:
        check_lora(recipe, model)
    except RecipeError as exc:
        problems += exc.problems
    if problems:
        raise recipe.error((f"{len(problems)} problems: " if len(problems) > 1 else "") + "; ".join(problems), problems)
    if recipe.patch.method is not None and spec is None:  # an adapter that reads weight values: after the load
        return {"checked_architecture": False}, args
    checked = {"checked_architecture": True, "patch": spec, **lengths(recipe, spec, model)}
    check_eval_windows(recipe, list(recipe.eval.lengths) or [checked.get("pose_target") or checked["seq_length"]])
    return checked, args


def _has_accelerator() -> bool:
    """Whether torch sees an accelerator. Not TrainingArguments' use_cpu default (False): on a machine without one,
    that keeps pin_memory on (a warning per run) and refuses bf16 ("doesn't support bf16/gpu"), where use_cpu=True
    trains in bf16 on the CPU."""
    import torch

    probe = getattr(getattr(torch, "accelerator", None), "is_available", None)
    return bool(probe()) if callable(probe) else torch.cuda.is_available()


def check_patched(recipe: Recipe, model, checked: dict, spec: dict | None) -> tuple[int, int | None]:
    """Once the model is patched: its training length and PoSE target (those :func:`check` found, unless the loaded
    model is not the skeleton it read: a saved patch, or weights the patch reads), the PoSE probe, S²-Attn on this
    model. Returns (training length, PoSE target or None)."""
    if checked["checked_architecture"] and spec == checked["patch"]:
        found = checked
    else:
        found = lengths(recipe, spec, model)
    if recipe.train.pose is not None:
        check_position_input(model, found["pose_target"], recipe.patch.method)
    if recipe.train.shift_attention:
        try:  # the length and the method were checked with the recipe; whether this model's attention can be replaced
            check_shift_attention(group_ratio=recipe.train.shift_group_ratio, model=model)
        except PatchError as exc:
            raise recipe.error(f"train.shift_attention: {exc}") from None
    return found["seq_length"], found.get("pose_target")


def check_data_size(recipe: Recipe, sequences: int, seq_length: int) -> None:
    """The global batch fits in the data: one optimizer step must not use a packed sequence twice."""
    batch = recipe.train.batch_size
    if batch > sequences:
        raise RecipeError(
            f"train.batch_size ({batch}) is larger than the {sequences} packed sequences of {seq_length} tokens in "
            f"the data: one optimizer step would use some of them twice; lower train.batch_size to at most "
            f"{sequences}, add data, or shorten data.seq_length"
        )


def check_eval_windows(recipe: Recipe, lengths: list[int]) -> None:
    """eval.stride fits every evaluation length (a sliding window's stride is below its length): checked before
    training, not found after it."""
    from ..evaluation.windows import check_protocol

    e = recipe.eval
    for length in lengths if e.enabled else ():
        try:
            check_protocol(e.protocol, int(length), e.stride)
        except ValueError as exc:
            raise recipe.error(f"eval.stride: {exc} (eval.lengths, default: the training length)") from None


def lengths(recipe: Recipe, spec: dict | None, model) -> dict[str, int]:
    """The training length and (with PoSE) the target, and the checks on them the recipe could not make (a length
    the patch gives; the recipe checked a data.seq_length it gives)."""
    seq_length = _seq_length(recipe, spec, model)
    found = {"seq_length": seq_length}
    given = recipe.data.seq_length is not None
    if recipe.train.shift_attention and not given:
        try:
            check_shift_attention(seq_length, recipe.train.shift_group_ratio)
        except PatchError as exc:
            raise recipe.error(f"train.shift_attention: {exc}") from None
    if recipe.train.pose is not None:
        try:
            chunks = recipe.train.pose.chunks
            if not given and chunks > seq_length:  # each chunk of the default window holds at least one token
                raise RecipeError(f"train.pose.chunks ({chunks}) is more than the {seq_length} tokens of the training "
                                  "window (data.seq_length, by default the model's original length): each chunk holds "
                                  f"at least one token; use at most {seq_length} chunks (the PoSE paper uses 2)")
            found["pose_target"] = _pose_target(recipe, spec, model, seq_length)
        except RecipeError as exc:
            raise recipe.error(str(exc), exc.problems) from None
    return found


def _advertised_length(model) -> int | None:
    """The context length the model advertises: its family's answer (``ctxext.adapters``); for a model no family
    claims, the first of the two attributes the fine-tune has always read there."""
    from ..adapters import adapter_for, config_length

    adapter = adapter_for(model)
    if adapter.family:
        length = adapter.original_length(model)
    else:
        length = config_length(model.config, ("max_position_embeddings", "n_positions"))
    return int(length) if length else None


def _seq_length(recipe: Recipe, spec: dict | None, model) -> int:
    """The training length: data.seq_length; else the patched length; with PoSE, the original length (PoSE trains
    at the length the model was trained at and moves the positions instead)."""
    if recipe.data.seq_length:
        return recipe.data.seq_length
    if recipe.train.pose is not None:
        length = int(spec["original_length"]) if spec and spec.get("original_length") else None
        length = length or (_advertised_length(model) if spec is None else None)
        if length:
            return length
        raise RecipeError("data.seq_length is required with train.pose: the patch records no original length")
    if spec and spec.get("patched_length"):
        return int(spec["patched_length"])
    length = _advertised_length(model)
    if length:
        return length
    raise RecipeError("data.seq_length is required: the patch gives no target length for this model")


def _pose_target(recipe: Recipe, spec: dict | None, model, seq_length: int) -> int:
    """PoSE's target length (train.pose.target_length, else the patched length), checked against the window and
    against the length the patched model advertises: positions past it would index past a learned position table
    (GPT-2's ``wpe``; ctxext's patched table clamps them) or train a rotary model where no patch put them."""
    from ..adapters import config_length

    pose = recipe.train.pose
    patched = int(spec["patched_length"]) if spec and spec.get("patched_length") else None
    # Unpatched, the cap is the length the config itself advertises (a rotary model's, a position table's); not
    # the family's training length, which BLOOM / MPT state without a position limit (ALiBi positions are unbounded)
    advertised = patched or config_length(model.config, ("max_position_embeddings", "n_positions"))
    target = pose.target_length or patched
    if target is None:
        raise RecipeError("train.pose.target_length is required: the patch gives no target length for this model")
    if target <= seq_length:  # (a target and a window both given: the recipe has said so already)
        raise RecipeError(f"train.pose.target_length ({target}) must be longer than the training window "
                          f"data.seq_length ({seq_length}): PoSE spreads a short window over a longer span")
    if advertised is not None and target > advertised:
        how = (f"patch.factor >= {target / (spec.get('original_length') or advertised):g}" if spec
               else "a patch that reaches it (e.g. patch.method: pi or extrapolate, with a factor)")
        raise RecipeError(f"train.pose.target_length ({target}) is past the {advertised} positions the "
                          f"{'patched ' if spec else ''}model has; use {how}, or a shorter target")
    return target


def accumulation(recipe: Recipe, world: int) -> int:
    t = recipe.train
    if t.batch_size % world:
        raise RecipeError(f"train.batch_size ({t.batch_size}) must be a multiple of the number of processes ({world})")
    per_rank = t.batch_size // world
    if per_rank % t.micro_batch_size:
        raise RecipeError(
            f"train.batch_size / processes = {per_rank} must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size})"
        )
    return per_rank // t.micro_batch_size
