"""The switch between a model's own attention and the registered ctxext functions: registration with transformers'
``AttentionInterface`` / ``AttentionMaskInterface``, the checks that a model dispatches through them, and
``use_attention``, which switches a model and returns the exact undo."""

from __future__ import annotations

import copy

from torch import nn

from ..compat import transformers as hf_compat
from ..core.active import unwrapped
from ..core.errors import PatchError
from .alibi import ALIBI, ALIBI_MARK, alibi_attention_forward
from .features import _configs, attention_features


MISSING_HOOK_MESSAGE = (
    "this transformers has no AttentionInterface / masking_utils.AttentionMaskInterface, the hook point of the ALiBi "
    "swap (they exist from transformers 4.53; ctxext is tested from 4.56.2)"
)
#: Why the attention hook point is missing from the installed transformers (None: registered).
MISSING_HOOK: str | None = None
#: Prefix of the names of LongLoRA's shift attention (``ctxext.attention.shifted_sparse``), which a patch that swaps
#: the attention must not silently replace (nor have put back over it by the shift attention's undo).
SHIFT = "ctxext_shift"


def _register() -> str | None:
    """Register ``ctxext_alibi`` with both interfaces; where this transformers lacks one, say which and since when."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return MISSING_HOOK_MESSAGE
    AttentionInterface.register(ALIBI, alibi_attention_forward)
    AttentionMaskInterface.register(ALIBI, sdpa_mask)
    return None


MISSING_HOOK = _register()


def can_use_attention(model: nn.Module) -> str | None:
    """None if ``model`` (or the transformers model inside its peft wrapper) dispatches its attention through
    ``AttentionInterface``; otherwise why not."""
    if MISSING_HOOK:
        return MISSING_HOOK
    model = unwrapped(model)  # a PeftModel runs its base model's attention, switched there
    can_set = hf_compat.can_set_attn_implementation(model)
    if can_set is None:
        return f"{type(model).__name__} is not a transformers model with a settable attention implementation"
    if not can_set:
        return (
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so a bias cannot be added without copying its modeling code"
        )
    if getattr(model.config, "add_cross_attention", False) or getattr(model.config, "is_encoder_decoder", False):
        return "ALiBi applies to causal self-attention only; this model has cross-attention"
    current = hf_compat.attn_implementation(model.config)
    if isinstance(current, str) and current.startswith(SHIFT):
        return ("LongLoRA's shift attention (a training attention) is enabled on this model; undo it before "
                "patching the attention")
    return None


def require_attention(model: nn.Module) -> None:
    """Raise PatchError unless ``model`` can take the ALiBi attention (the adapters' check for ``alibi``)."""
    model = unwrapped(model)
    reason = can_use_attention(model) or attention_features(model)
    if reason:
        raise PatchError(f"cannot swap in ALiBi: {reason}")


def use_attention(model: nn.Module, name: str = ALIBI):
    """Switch ``model`` to the registered attention ``name``; returns a function restoring the previous one exactly.
    The ALiBi swap is checked here; other functions (the remap attention, its probe) honour other features, which
    their adapter checks (``ctxext.adapters.remap``), so only the dispatch is checked for them. A peft wrapper is
    switched through the transformers model inside it (``ctxext.core.active.unwrapped``), whose modules the wrapper
    runs: a probe or a check on a ``PeftModel`` acts on that model."""
    model = unwrapped(model)
    if name == ALIBI:
        require_attention(model)
    else:
        reason = can_use_attention(model)
        if reason:
            raise PatchError(f"cannot use attention {name!r}: {reason}")
    before = [(config, hf_compat.stored_attn_implementation(config)) for config in _configs(model)]
    # the model and every transformers model inside it (``model.model`` has the method too); a switch inside another
    # (a probe while patched) finds them guarded and leaves the outer guards in place
    candidates = [m for m in model.modules() if callable(getattr(type(m), GUARD, None)) and GUARD not in vars(m)]
    guarded: list[nn.Module] = []

    marked: list[nn.Module] = []

    def restore():
        for module in marked:
            vars(module).pop(ALIBI_MARK, None)
        for module in guarded:
            vars(module).pop(GUARD, None)
        for config, value in before:
            hf_compat.restore_attn_implementation(config, value)

    try:
        if name == ALIBI:  # the function runs only inside a swapped model: not in one built from its config
            marked[:] = [m for m in model.modules() if ALIBI_MARK not in vars(m)]
            for module in marked:
                vars(module)[ALIBI_MARK] = True
        type(model).set_attn_implementation(model, name)  # the class's: the instance's own is the guard below
        if hf_compat.attn_implementation(model.config) != name:
            raise PatchError(f"{type(model).__name__} refused attention implementation {name!r}")
        # only the models the switch reached (transformers leaves a part that cannot switch, a vision tower, as it was)
        guarded[:] = [m for m in candidates if hf_compat.attn_implementation(m.config) == name]
        for module in guarded:
            setattr(module, GUARD, _SwitchGuard(module))
    except BaseException:
        restore()
        raise
    return restore


#: The model method a switched model refuses (an instance attribute while switched, as ``save_pretrained``'s hook in
#: ``ctxext.export``; a deepcopy rebinds it to the copy).
GUARD = "set_attn_implementation"


class _SwitchGuard:
    """``set_attn_implementation`` of a model whose attention ctxext switched: the patch (or the shift attention)
    runs inside the registered function, so another implementation would silently run the model without it (the
    rotary module of a remap patch is an identity: no positions at all). The current one is accepted as a no-op.
    A deep copy guards the copy (its model comes through the memo); a pickle is refused, as a patched model's is."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, attn_implementation, *args, **kwargs):
        model = self.model
        current = hf_compat.attn_implementation(model.config)
        if attn_implementation == current:
            return type(model).set_attn_implementation(model, attn_implementation, *args, **kwargs)
        from ..core.active import ACTIVE

        active = getattr(model, ACTIVE, None)  # on the outer model (an inner one names no method)
        if active is not None:
            owner, fix = f"ctxext's {active.spec.method!r} patch", "call ctxext.unpatch(model) first"
        elif isinstance(current, str) and current.startswith(SHIFT):
            owner, fix = "LongLoRA's shift attention", "undo it first (the function enable_shift_attention returned)"
        else:
            owner, fix = "ctxext (a patch)", "unpatch the model that holds this one first"
        raise PatchError(f"{type(model).__name__}.set_attn_implementation({attn_implementation!r}): {owner} runs "
                         f"this model's attention as {current!r}, and another implementation would silently run it "
                         f"without that; {fix}, set the implementation, then patch again")

    def __deepcopy__(self, memo: dict) -> "_SwitchGuard":
        return type(self)(copy.deepcopy(self.model, memo))  # the copy, through the model's memo

    def __reduce_ex__(self, protocol):
        from ..core.active import pickle_refusal

        raise pickle_refusal()


__all__ = ["MISSING_HOOK", "SHIFT", "can_use_attention", "require_attention", "use_attention"]
