"""Which methods compose on the scaled RoPE a model ships (transformers rope types other than ``default``), decided
by the method's kind: a frequency method, or a longer length alone, rescales the frequencies the module uses; NoPE,
the ALiBi swap and the remap methods keep the model's own rotation (its shipped frequencies and attention factor, at
the remapped positions; NoPE / ALiBi: at none, the attention factor kept as a logit temperature)."""

from __future__ import annotations

from ..methods.declaration import Kind, Method
from ..methods.registry import METHODS

#: Kinds that rescale the frequencies a module uses, composing on shipped ones.
COMPOSING_KINDS = (Kind.FREQUENCY, Kind.LENGTH)
#: Kinds that replace the rotation or remap the positions it is applied at: on a static scaled type they keep it.
ROTATION_KINDS = (Kind.NONE, Kind.BIAS, Kind.REMAP)
#: A shipped rope type that switches between a short and a long frequency set by sequence length in every forward.
LONGROPE = "longrope"


def compose_presets() -> tuple[str, ...]:
    """The shipped rope types ctxext's methods compose on: the static types its own methods are natively
    (transformers computes their frequencies once, from the config, and ``unit_inputs`` checks them against it), and
    ``longrope``. ``dynamic`` types recompute their frequencies from the sequence length in every forward, so they
    are refused."""
    static = [m.native.rope_type for m in METHODS.values()
              if m.kind is Kind.FREQUENCY and not m.per_sequence and m.native and m.native.rope_type]
    return (*dict.fromkeys(static), LONGROPE)


def _static_composing() -> list[str]:
    return [m.name for m in METHODS.values() if m.kind in COMPOSING_KINDS and not m.per_sequence]


def preset_refusal(kind: str, method: str | Method | None) -> str | None:
    """Why ``method`` cannot compose on a module that ships rope type ``kind`` (None: it composes)."""
    if kind == "default":
        return None
    if "dynamic" in kind:
        return (f"uses transformers rope_type {kind!r}, which recomputes its frequencies from the sequence length in "
                "every forward (dynamic_rope_update), so a patch of its buffers would be overwritten at run time; "
                "load the model with rope_parameters rope_type='default' to patch it")
    presets = compose_presets()
    if kind not in presets:
        return (f"uses transformers rope_type {kind!r}; ctxext composes its methods only on plain RoPE and on the "
                f"rope types {', '.join(presets)}")
    if method is None:
        return (f"already uses transformers rope_type {kind!r}; this ctxext path starts from plain RoPE. Load the "
                "model with rope_parameters rope_type='default' to use it")
    declared = method if isinstance(method, Method) else METHODS.get(method)
    name = declared.name if declared is not None else method
    if declared is not None and declared.kind in ROTATION_KINDS and kind == LONGROPE:
        return (f"already uses transformers rope_type 'longrope', which switches between a short and a long frequency "
                f"set by sequence length in every forward; method {name!r} replaces or remaps one rotation and "
                f"has none to keep there (methods that compose on it: {', '.join(_static_composing())}); load the "
                "model with rope_parameters rope_type='default' to use it")
    if declared is None or declared.kind not in (*COMPOSING_KINDS, *ROTATION_KINDS):
        known = _static_composing() + [m.name for m in METHODS.values()
                                       if m.kind in COMPOSING_KINDS and m.per_sequence or m.kind in ROTATION_KINDS]
        return (f"already uses transformers rope_type {kind!r}; ctxext does not know how method {name!r} composes "
                f"on it (methods that do: {', '.join(known)})")
    if kind == LONGROPE and declared.per_sequence:
        return ("already uses transformers rope_type 'longrope', which switches its frequencies by sequence length "
                f"itself; {name} would be overwritten by that switch (use a static method: "
                f"{', '.join(_static_composing())})")
    return None
