"""Model components of a recipe: load (hub id, local dir, GGUF, reference checkpoint), check the patch and
the LoRA targets against the architecture, patch, wrap with peft LoRA."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from ..compat.transformers import peft_wrap_quietly
from ..core.errors import PatchError
from .config import LoraConfig, ModelConfig, Recipe, RecipeError
from .errors import one_line


def model_source(cfg: ModelConfig) -> str:
    """Where ``from_pretrained`` reads the model: ``reference:NAME`` becomes the shipped checkpoint's folder."""
    from ..reference import model_source as shipped_or_given

    try:
        return shipped_or_given(cfg.name)
    except (ValueError, FileNotFoundError) as exc:
        raise RecipeError(f"model.name: {exc}") from None


def _load_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    if cfg.revision:
        kw["revision"] = cfg.revision
    if cfg.trust_remote_code:
        kw["trust_remote_code"] = True
    return kw


def load_tokenizer(cfg: ModelConfig):
    from ..loading import auto_tokenizer

    source = cfg.tokenizer or model_source(cfg)
    kw = _load_kwargs(cfg) if not cfg.tokenizer else {}
    try:
        return auto_tokenizer(source, **kw)
    except OSError as exc:
        raise RecipeError(f"cannot load tokenizer {source!r}: {str(exc).splitlines()[0]}") from None


def load_model(cfg: ModelConfig) -> nn.Module:
    """The base model (float weights, a saved ctxext patch re-applied), in training-ready form."""
    from ..loading import from_pretrained, name_model
    from ..reference import reference_name

    kw = _load_kwargs(cfg)
    kw["dtype"] = "auto" if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    if cfg.attn_implementation:
        kw["attn_implementation"] = cfg.attn_implementation
    try:
        model = from_pretrained(model_source(cfg), **kw)
    except ImportError as exc:  # an attention implementation whose package is missing (flash_attention_2, ...)
        raise _import_error(cfg, exc) from None
    # a shipped reference checkpoint is named reference:NAME where peft records the adapter's base
    # (adapter_config.json, the model card), not by its folder on this machine
    if reference_name(cfg.name) is not None:
        name_model(model, f"reference:{reference_name(cfg.name).strip().lower()}")
    return model


def _import_error(cfg: ModelConfig, exc: ImportError) -> RecipeError:
    how = f" with model.attn_implementation {cfg.attn_implementation!r}" if cfg.attn_implementation else ""
    return RecipeError(f"model.name {cfg.name!r} cannot load{how}: {one_line(exc)}")


def skeleton(cfg: ModelConfig) -> nn.Module | None:
    """The architecture without weights (:func:`ctxext.loading.model_skeleton`), for checks before the weights
    load; None if the config cannot be read this way (the checks then run on the loaded model)."""
    from ..loading import model_skeleton

    try:
        return model_skeleton(model_source(cfg), attn_implementation=cfg.attn_implementation, **_load_kwargs(cfg))
    except RecipeError:
        raise
    except ImportError as exc:  # the weights would not load either (a missing flash-attn, ...): said now
        raise _import_error(cfg, exc) from None
    except Exception:  # noqa: BLE001 - any failure here only postpones the checks
        return None


def check_patch(recipe: Recipe, model: nn.Module) -> dict[str, Any] | None:
    """Validate the recipe's patch against the model without changing it; returns the spec it would record."""
    p = recipe.patch
    if p.method is None:
        return None
    from ..api import build_spec

    try:
        spec, _ = build_spec(_plain(model), p.method, p.factor, **p.options)
    except PatchError as exc:
        raise RecipeError(f"patch does not fit model {recipe.model.name!r}: {exc}") from None
    except (NotImplementedError, RuntimeError):
        if not any(q.is_meta for q in model.parameters()):
            raise
        return None  # an adapter that reads weight values: checked again once the weights are loaded
    return spec.to_dict()


def _plain(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_lora(recipe: Recipe, model: nn.Module) -> None:
    """LoRA target and trainable modules must name modules of this model, and lora.r fit the layers it adapts.
    ctxext's own: peft says only "not found", without the names to pick from, and never checks the rank."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    from transformers.pytorch_utils import Conv1D  # GPT-2's transposed linear layer, which peft also adapts

    lo, kind = recipe.lora, type(model).__name__
    names = [n for n, _ in model.named_modules() if n]
    linears = {n: m for n, m in model.named_modules() if n and isinstance(m, (nn.Linear, Conv1D))}
    linear = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linears}))
    targets = lo.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        targets = [targets]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    problems = []
    if isinstance(targets, list):
        missing = [t for t in targets if not any(_names(n, t) for n in names)]
        if missing:
            problems.append(f"lora.target_modules: no module named {', '.join(map(repr, missing))} in {kind}; its "
                            f"linear layers are: {linear}")
    elif targets is None and model_type not in defaults:
        problems.append(f"lora.target_modules: peft has no default for model type "
                        f"{getattr(model.config, 'model_type', '?')!r}; name them "
                        f"(its linear layers are: {linear}) or use all-linear")
    missing = [t for t in lo.trainable if not any(n == t or n.endswith(t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        problems.append(f"lora.trainable: no module named {', '.join(map(repr, missing))} in {kind}; module names "
                        f"include: {', '.join(leaves[:40])}")
    if not problems:  # the largest rank LoRA can reach: min(in, out) over the layers it adapts
        targets = list(defaults.get(model_type, [])) if targets is None else targets
        out = getattr(model, "get_output_embeddings", lambda: None)()
        ranks = [min(m.weight.shape) for n, m in linears.items()
                 if (m is not out if targets == "all-linear" else any(_names(n, t) for t in targets))
                 and getattr(m, "weight", None) is not None and m.weight.dim() == 2]
        full = max(ranks, default=None)
        if full and lo.r > full:
            problems.append(f"lora.r ({lo.r}) is larger than the rank any targeted layer can have (at most {full}, "
                            "the smaller side of its weight): the update B @ A cannot exceed it, so the extra rank "
                            f"only costs memory; use lora.r <= {full}")
    if problems:
        raise RecipeError("; ".join(problems), problems)


def _names(name: str, target: str) -> bool:
    """Whether a target_modules entry names the module ``name``: as peft matches (the name or its suffix), or a glob."""
    return name == target or name.endswith("." + target) or fnmatch.fnmatch(name, target)


def apply_patch(recipe: Recipe, model: nn.Module) -> dict[str, Any] | None:
    """Patch the model as the recipe says (replacing a patch saved with the checkpoint); returns the spec."""
    from ..api import describe, patch

    p = recipe.patch
    if p.method is None:
        return describe(model)
    try:
        patch(model, p.method, p.factor, replace=describe(model) is not None, **p.options)
    except PatchError as exc:
        raise RecipeError(f"patch does not fit model {recipe.model.name!r}: {exc}") from None
    return describe(model)


def check_position_input(model: nn.Module, target: int, method: str | None = None) -> None:
    """PoSE trains through ``position_ids``: refuse a model whose output does not depend on them.

    A capability probe, not a list of families: one short forward pass with consecutive positions, one with the
    second half shifted to end at ``target - 1`` (as a PoSE sample). A rotary model sees the skip (relative
    distances change), a learned position table too; a model that orders tokens by their index in the sequence
    (BLOOM's ALiBi, ctxext's ALiBi swap, NoPE) gives the same logits, and PoSE would train nothing."""
    vocab = int(getattr(model.config, "vocab_size", 0) or 0) or 2
    n = 8
    device = next((q.device for q in model.parameters() if not q.is_meta), torch.device("cpu"))
    ids = (torch.arange(n, device=device) * 7 + 3).remainder(vocab).unsqueeze(0)
    plain = torch.arange(n, device=device).unsqueeze(0)
    skipped = plain.clone()
    skipped[:, n // 2:] += target - n
    mask = torch.ones_like(ids)
    what = f"model {type(_plain(model)).__name__}" + (f" patched with {method!r}" if method else "")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            a = model(input_ids=ids, position_ids=plain, attention_mask=mask, use_cache=False).logits
            b = model(input_ids=ids, position_ids=skipped, attention_mask=mask, use_cache=False).logits
    except TypeError as exc:
        raise RecipeError(f"train.pose: the {what} takes no position_ids ({str(exc).splitlines()[0]}); PoSE trains "
                          "through them: drop train.pose") from None
    except (IndexError, RuntimeError) as exc:
        raise RecipeError(f"train.pose: the {what} cannot run positions up to {target - 1} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0]}); patch it to reach the target "
                          "length or shorten train.pose.target_length") from None
    finally:
        model.train(was_training)
    diff = (a.float() - b.float()).abs().max().item()
    if diff <= 1e-6 * max(1.0, a.float().abs().max().item()):
        raise RecipeError(f"train.pose: the {what} ignores position_ids (the same logits with positions skipped to "
                          f"{target - 1}): its positions come from the token order, not the input, so PoSE has "
                          "nothing to train; drop train.pose (PoSE works where position ids reach the model: rotary "
                          "models, GPT-2's position table)")


def add_lora(recipe: Recipe, model: nn.Module, source: str) -> nn.Module:
    """Wrap the (patched) model with a peft LoRA adapter; ``trainable`` modules become ``modules_to_save``."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from ..adapters import adapter_for

    lo: LoraConfig = recipe.lora
    config = PeftLoraConfig(
        r=lo.r,
        lora_alpha=lo.alpha,
        lora_dropout=lo.dropout,
        target_modules=lo.target_modules,
        modules_to_save=list(lo.trainable) or None,
        bias=lo.bias,
        use_rslora=lo.use_rslora,
        task_type="CAUSAL_LM",
        base_model_name_or_path=model.__dict__.get("name_or_path") or source,  # as peft reads it (reference:NAME)
    )
    adapter = adapter_for(model)
    for key, value in adapter.lora_settings(model).items():
        setattr(config, key, value)
    adapter.make_trainable(model, list(lo.trainable))
    try:
        with peft_wrap_quietly():  # peft reads a property transformers deprecated
            peft_model = get_peft_model(model, config)
    except ValueError as exc:
        raise RecipeError(f"lora: {exc}") from None
    adapter.after_lora(peft_model)
    return peft_model
