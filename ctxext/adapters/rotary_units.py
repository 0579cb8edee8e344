"""Where a model keeps its rotary frequencies, and what they are: the rotary modules and their frequency sets
(``RotaryUnit``: one per module, or one per layer type), the inputs a method needs from them (``unit_inputs``,
including scaled RoPE a model ships), snapshots that restore them bit-exactly, and the rotation layout the model's
attention applies. Shared by the rotary adapter and the position-remapping adapter."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..core.errors import PatchError
from ..methods import rope
from .base import Restore
from .rotary_compose import preset_refusal


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Rotary modules with one set of frequencies: ``inv_freq`` / ``original_inv_freq`` buffers, a float
    ``attention_scaling`` and a string ``rope_type`` (Llama, Mistral, Qwen2, GPT-NeoX, ...)."""
    found = []
    for name, module in model.named_modules():
        if (
            isinstance(getattr(module, "inv_freq", None), torch.Tensor)
            and isinstance(getattr(module, "original_inv_freq", None), torch.Tensor)
            and _is_number(getattr(module, "attention_scaling", None))
            and isinstance(getattr(module, "rope_type", None), str)
        ):
            found.append((name, module))
    return found


class RotaryUnit:
    """One set of rotary frequencies: a plain rotary module, or one layer type of a module that keeps
    ``<layer_type>_inv_freq`` / ``<layer_type>_original_inv_freq`` / ``<layer_type>_attention_scaling`` and a
    ``rope_type`` dict keyed by layer type (Gemma 3 in transformers 5.x)."""

    def __init__(self, name: str, module: nn.Module, layer_type: str | None = None):
        self.module = module
        self.layer_type = layer_type
        self.prefix = f"{layer_type}_" if layer_type else ""
        self.name = (name or "<root>") + (f"[{layer_type}]" if layer_type else "")

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.module, self.prefix + "inv_freq")

    @property
    def original_inv_freq(self) -> torch.Tensor:
        return getattr(self.module, self.prefix + "original_inv_freq")

    @original_inv_freq.setter
    def original_inv_freq(self, value) -> None:
        setattr(self.module, self.prefix + "original_inv_freq", value)

    @property
    def attention_scaling(self) -> float:
        return getattr(self.module, self.prefix + "attention_scaling")

    @attention_scaling.setter
    def attention_scaling(self, value: float) -> None:
        setattr(self.module, self.prefix + "attention_scaling", value)

    @property
    def rope_type(self) -> str:
        kind = self.module.rope_type
        return kind if self.layer_type is None else kind[self.layer_type]

    def thetas(self) -> list[float]:
        if self.layer_type is None:
            return _rope_thetas(self.module)
        params = getattr(getattr(self.module, "config", None), "rope_parameters", None) or {}
        theta = (params.get(self.layer_type) or {}).get("rope_theta") if isinstance(params, dict) else None
        return [float(theta)] if _is_number(theta) and theta > 0 else []


def _layered_types(module: nn.Module) -> list[str] | None:
    """The layer types of a rotary module with one set of frequencies per layer type, else None."""
    types = getattr(module, "layer_types", None)
    kinds = getattr(module, "rope_type", None)
    if not isinstance(types, (list, tuple, set)) or not types or not isinstance(kinds, dict):
        return None
    for t in types:
        if not (
            isinstance(t, str)
            and isinstance(getattr(module, f"{t}_inv_freq", None), torch.Tensor)
            and isinstance(getattr(module, f"{t}_original_inv_freq", None), torch.Tensor)
            and _is_number(getattr(module, f"{t}_attention_scaling", None))
            and isinstance(kinds.get(t), str)
        ):
            return None
    return sorted(types)


def rotary_units(model: nn.Module) -> list[RotaryUnit]:
    """Every set of rotary frequencies in ``model``: plain rotary modules and per-layer-type ones."""
    units = [RotaryUnit(name, module) for name, module in rotary_modules(model)]
    for name, module in model.named_modules():
        types = _layered_types(module)
        if types:
            units += [RotaryUnit(name, module, t) for t in types]
    return units


def _rope_thetas(module: nn.Module) -> list[float]:
    """The RoPE bases the module's config names, where each transformers API keeps it: ``rope_parameters
    ["rope_theta"]`` (5.x), ``rope_theta`` (4.x, most models) or ``rotary_emb_base`` (4.x GPT-NeoX). A 4.x config
    may also carry a ``rope_parameters`` attribute it ignores (passed as an unknown kwarg), so the caller keeps the
    base the module's ``inv_freq`` was actually built from."""
    config = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None) or {}
    found = [params.get("rope_theta") if isinstance(params, dict) else None]
    found += [getattr(config, "rope_theta", None), getattr(config, "rotary_emb_base", None)]
    return [float(t) for t in found if _is_number(t) and t > 0]


def _rotary_output(unit: RotaryUnit, start: int = 1) -> torch.Tensor:
    inv_freq = unit.inv_freq
    x = torch.zeros(1, 2, 2 * inv_freq.numel(), dtype=torch.float32, device=inv_freq.device)
    position_ids = torch.tensor([[start, start + 1]], device=inv_freq.device)
    with torch.no_grad():  # .forward: without the module's hooks (a dynamic-NTK hook would rewrite inv_freq)
        if unit.layer_type is None:
            out = unit.module.forward(x, position_ids)
        else:
            out = unit.module.forward(x, position_ids, unit.layer_type)
    parts = list(out) if isinstance(out, (tuple, list)) else [out]  # (cos, sin), or one complex tensor
    return torch.cat([torch.view_as_real(p).flatten(-2) if p.is_complex() else p.float() for p in parts], dim=-1)


def _long_state(unit: RotaryUnit):
    """A snapshot of a longrope module's lazily computed ``long_inv_freq`` attribute (a plain attribute, not a
    buffer; transformers sets it in the first forward), and the function that puts it back exactly."""
    name = unit.prefix + "long_inv_freq"
    present = name in vars(unit.module)
    value = vars(unit.module).get(name)
    saved = value.detach().clone() if isinstance(value, torch.Tensor) else value

    def restore():
        if not present:
            vars(unit.module).pop(name, None)
            return
        setattr(unit.module, name, value)
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                value.copy_(saved)

    return restore


def unread_surface(unit: RotaryUnit) -> str | None:
    """Whether the module's forward reads the buffers a patch rewrites, probed on the module alone: its output with
    the original frequencies, with them halved, and with ``attention_scaling`` doubled (everything put back exactly;
    the original frequencies, not the current ones, so that a model patched with zero frequencies probes alike).
    Some modules recompute their frequencies from the config in every forward (Phimoe in transformers 5.x), so
    a patch of the buffers would change nothing. A ``longrope`` module copies its short or long set into
    ``inv_freq`` in every forward, so there the probe rewrites the long set (``long_inv_freq``, what a patch
    rewrites) and runs past ``original_max_position_embeddings``. Returns why not, or None."""
    longrope = unit.rope_type == "longrope"
    saved_freq = unit.inv_freq.detach().clone()
    saved_scaling = unit.attention_scaling
    restore_long = _long_state(unit)
    try:
        if longrope:
            name, start = unit.prefix + "long_inv_freq", _longrope_original(unit)
            original = long_frequencies(unit).to(unit.inv_freq.device)
        else:
            start, original = 1, unit.original_inv_freq.detach().clone()

        def output(freq: torch.Tensor) -> torch.Tensor:
            if longrope:
                setattr(unit.module, name, freq.clone())
            else:
                with torch.no_grad():
                    unit.inv_freq.copy_(freq)
            return _rotary_output(unit, start)

        unit.attention_scaling = 1.0
        base = output(original)
        halved = output(original * 0.5)
        unit.attention_scaling = 2.0
        doubled = output(original)
    except Exception as exc:  # a forward this probe cannot call: say so rather than guess
        return f"ctxext could not probe its forward ({type(exc).__name__}: {exc}) to confirm a patch acts on it"
    finally:
        with torch.no_grad():
            unit.inv_freq.copy_(saved_freq)
        unit.attention_scaling = saved_scaling
        restore_long()
    if torch.equal(halved, base) and longrope:
        return ("its rope_type 'longrope' forward recomputes its long frequencies from the config instead of reading "
                "long_inv_freq (as older transformers 5.x releases do, e.g. 5.0-5.12), so a patch would change "
                "nothing; a newer transformers, or rope_type 'default', lets ctxext patch it")
    if torch.equal(halved, base):
        return ("its forward does not read its inv_freq buffer (it recomputes the frequencies), so a patch would "
                "change nothing")
    if not torch.allclose(doubled, 2 * base, rtol=1e-5, atol=1e-6):
        return "its forward does not apply its attention_scaling, so a patch's attention factor would be lost"
    return None


def _rope_init_function(kind: str):
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:  # pragma: no cover - every supported release has it
        return None
    fn = ROPE_INIT_FUNCTIONS.get(kind) if isinstance(ROPE_INIT_FUNCTIONS, dict) else None
    return fn if callable(fn) else None


def _shipped(unit: RotaryUnit, kind: str, seq_len: int | None = None) -> torch.Tensor:
    """The float32 frequencies transformers' own init function for ``kind`` computes from the module's config."""
    fn = _rope_init_function(kind)
    if fn is None:
        raise PatchError(f"rotary module {unit.name}: this transformers has no init function for rope_type {kind!r}")
    kwargs = {"layer_type": unit.layer_type} if unit.layer_type else {}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    try:
        inv_freq, _ = fn(unit.module.config, None, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a config transformers' function cannot read
        raise PatchError(f"rotary module {unit.name}: transformers cannot recompute its rope_type {kind!r} "
                         f"frequencies from its config ({type(exc).__name__}: {exc})") from exc
    return inv_freq.detach().to("cpu", torch.float32)


def _longrope_original(unit: RotaryUnit) -> int:
    params = getattr(unit.module.config, "rope_parameters", None) or {}
    if unit.layer_type is not None and isinstance(params, dict):
        params = params.get(unit.layer_type) or {}
    # a 4.x config may carry a rope_parameters attribute it ignores: only one that names longrope counts
    ok = isinstance(params, dict) and params.get("rope_type") == "longrope"
    value = params.get("original_max_position_embeddings") if ok else None
    if not isinstance(value, int):
        raise PatchError(f"rotary module {unit.name} (rope_type 'longrope') has no integer "
                         "rope_parameters['original_max_position_embeddings'] (the transformers 5.x surface its "
                         "switch reads); ctxext composes on longrope only there")
    return value


def long_frequencies(unit: RotaryUnit) -> torch.Tensor:
    """A longrope module's long frequency set (what it uses past original_max_position_embeddings), float32."""
    return _shipped(unit, "longrope", seq_len=_longrope_original(unit) + 1)


def _rounded_by_cast(inv_freq: torch.Tensor, bases) -> str:
    """Why a float buffer misses base**(-2i/d): the formula rounded to a half dtype (a model cast ``.to(bfloat16)``
    and back: the cast rounds the buffer with the weights, the way back does not restore it), else an unknown
    variant."""
    dim = 2 * inv_freq.numel()
    for dtype in (torch.bfloat16, torch.float16):
        for b in bases:  # built in float32, as transformers' default rope init builds it
            built = 1.0 / (float(b) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            if torch.equal(inv_freq.cpu(), built.to(dtype).float()):
                name = str(dtype).removeprefix("torch.")
                return (f"it equals that formula rounded to {name}: the model was cast to {name} and back, which "
                        f"rounds the rotary frequencies for good; reload it in float32, or patch it in {name}")
    return "ctxext does not know this rotary variant"


def unit_inputs(unit: RotaryUnit, original_length: int, method: str | None = None) -> rope.RopeInputs:
    """The frequencies ``method`` starts from on ``unit``: plain RoPE (checked against base**(-2i/d)), or the
    frequencies a shipped scaled rope type (``rotary_compose.compose_presets``) actually uses, checked against
    transformers' own init function for that type (for ``longrope`` its long set), with the shipped attention factor.
    PatchError where ``method`` does not compose on the unit's rope type (``method=None``: plain RoPE only)."""
    kind = unit.rope_type
    reason = preset_refusal(kind, method)
    if reason:
        raise PatchError(f"rotary module {unit.name} {reason}")
    stored = unit.original_inv_freq.detach()
    # a copy: on transformers 4.x original_inv_freq is inv_freq itself, which dynamic methods rewrite per sequence
    # (the inputs then drifted with every length: dynamic-NTK at 120 after a pass at 60 differed by 2e-3)
    inv_freq = stored.float().clone()
    dim = 2 * inv_freq.numel()
    bases = unit.thetas()
    if not bases or dim < 4:
        raise PatchError(f"rotary module {unit.name} has no rope_theta or too few dimensions ({dim})")
    # Guard against a rotary module of the same shape but another frequency formula. A model cast with
    # ``.to(torch.bfloat16)`` (or .half()) rounds the buffer too, so the check allows that dtype's rounding.
    rtol = max(1e-4, torch.finfo(stored.dtype).eps)
    if kind != "default":
        shipped = _shipped(unit, kind)
        if shipped.shape != inv_freq.shape or not torch.allclose(inv_freq.cpu(), shipped, rtol=rtol, atol=0):
            raise PatchError(f"rotary module {unit.name}: its frequencies are not what transformers' rope_type "
                             f"{kind!r} computes from its config; ctxext does not know this rotary variant")
        if kind == "longrope":  # the set the model uses at its advertised length (transformers' own, lazily set)
            shipped = long_frequencies(unit)
        return rope.RopeInputs(inv_freq=shipped, base=float(bases[0]), dim=dim, original_length=int(original_length),
                               preset=kind, attention_scaling=float(unit.attention_scaling))
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    matching = [b for b in bases if torch.allclose(inv_freq.cpu().double(), 1.0 / (b**exponents), rtol=rtol, atol=0)]
    base = matching[0] if matching else bases[0]
    if not matching:
        raise PatchError(f"rotary module {unit.name}: inv_freq does not follow base**(-2i/d) with rope_theta={base}; "
                         + _rounded_by_cast(inv_freq, bases))
    if stored.dtype != torch.float32:
        # Scale the float32 frequencies transformers builds (as its default rope init computes them), not the
        # rounded ones: the patched buffer is then what a model built with the native rope type and cast the same
        # way holds. Writing it back into the low-precision buffer rounds it again.
        inv_freq = 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return rope.RopeInputs(inv_freq=inv_freq.cpu(), base=float(base), dim=dim, original_length=int(original_length))


def _saver(module: nn.Module) -> Restore:
    """Snapshot what a patch may change on a plain rotary module (see ``_unit_saver``)."""
    return _unit_saver(RotaryUnit("", module))


def _unit_saver(unit: RotaryUnit) -> Restore:
    """Snapshot what a patch may change on a set of rotary frequencies; the returned function puts it back
    bit-exactly.

    Where ``original_inv_freq`` is the ``inv_freq`` tensor itself (transformers 4.x rotary modules alias them; 5.x
    keeps a separate buffer), it becomes a copy while patched, so the in-place rewrite of ``inv_freq`` leaves the
    original frequencies intact (a replace, a second patch and transformers' own dynamic update read them); unpatch
    restores the alias."""
    inv_freq = unit.inv_freq.detach().clone()
    attention_scaling = unit.attention_scaling
    original = unit.original_inv_freq
    aliased = original is unit.inv_freq
    restore_long = _long_state(unit)  # a longrope module's long set (absent until its first forward)
    if aliased:
        unit.original_inv_freq = original.detach().clone()

    def restore():
        with torch.no_grad():
            unit.inv_freq.copy_(inv_freq.to(unit.inv_freq.device))
        unit.attention_scaling = attention_scaling
        restore_long()
        if aliased:
            unit.original_inv_freq = unit.inv_freq

    return restore


def _half_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _interleaved_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    return x * cos + torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2) * sin


@contextlib.contextmanager
def original_rotation(model: nn.Module):
    """Within the block every set of rotary frequencies is its original one (``original_inv_freq``, attention
    factor 1), whatever patch is active; put back exactly after. For probes of how the model rotates, which a patch
    that zeroes the frequencies (NoPE, the ALiBi swap, the remap methods) would hide."""
    units = rotary_units(model)
    undo = [_unit_saver(unit) for unit in units]
    try:
        with torch.no_grad():
            for unit in units:
                unit.inv_freq.copy_(unit.original_inv_freq.to(unit.inv_freq.dtype))
                unit.attention_scaling = 1.0
        yield
    finally:
        for restore in reversed(undo):
            restore()


def _emitted_form(model: nn.Module) -> str:
    """How the model's rotary module hands out cos/sin: ``"halves"`` (f0 f1 ... f0 f1 ..., Llama and most others),
    ``"interleaved"`` (each frequency repeated in place, f0 f0 f1 f1 ..., Cohere) or ``"once"`` (each frequency once,
    half the rotated width: GPT-OSS, whose attention pairs the halves of q and k itself)."""
    modules = rotary_modules(model)
    if not modules:
        return "halves"
    count = modules[0][1].inv_freq.numel()
    try:
        with original_rotation(model):
            out = _rotary_output(RotaryUnit(*modules[0]))  # cos then sin
    except Exception:  # noqa: BLE001 - a module this cannot call: the common layout
        return "halves"
    if out.shape[-1] == 2 * count:
        return "once"
    cos = out[..., : 2 * count]
    interleaved = torch.equal(cos[..., 0::2], cos[..., 1::2]) and not torch.equal(cos[..., :count], cos[..., count:])
    return "interleaved" if interleaved else "halves"


def rotation_layout(model: nn.Module) -> str | None:
    """How the model's attention rotates q and k by its rotary cos/sin, read from what its modeling code computes
    (the cos/sin its rotary module emits, then the ``apply_rotary_pos_emb`` its attention modules call on them,
    probed on a random vector), not from a class name: ``"half"`` (frequency i turns dims i and i + d/2: Llama,
    Mistral, GPT-NeoX, GPT-OSS, ...), ``"interleaved"`` (frequency i turns dims 2i and 2i + 1: GLM, ERNIE 4.5,
    Cohere, whose module emits the frequencies repeated in place, ...), or None where neither fits or the function
    is not found.

    Methods that only rewrite ``inv_freq`` work with any layout; a function that rotates q and k itself (the
    position-remapping attention) must use the model's layout or refuse the model.

    The rotation is read as applied after whatever the function does at angle zero: DeepSeek's
    ``apply_rotary_pos_emb_interleave`` reorders neighbour pairs into halves and rotates those, so what reaches the
    attention function of an identity-rotated model is already in halves order, and "half" is how it turns. Where
    the modeling code has both that function and ``apply_rotary_pos_emb`` (chosen by a config flag), both must
    agree."""
    import sys

    functions = set()
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "is_causal"):
            namespace = sys.modules.get(type(module).__module__)
            for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):
                fn = getattr(namespace, name, None)
                if callable(fn):
                    functions.add(fn)
    if not functions or len({getattr(f, "__module__", None) for f in functions}) != 1:
        return None
    form = _emitted_form(model)
    layouts = {_layout_of(fn, form) for fn in functions}
    return layouts.pop() if len(layouts) == 1 else None


def _layout_of(fn, form: str) -> str | None:
    """The layout ``fn`` (an ``apply_rotary_pos_emb``) rotates by, on cos/sin emitted in ``form``."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 3, 8, generator=generator)
    k = torch.randn(1, 1, 3, 8, generator=generator)
    freqs = torch.outer(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([1.0, 0.3, 0.1, 0.01]))
    halves = torch.cat((freqs, freqs), dim=-1)[None]  # (1, seq, dim)
    emb = {"interleaved": freqs.repeat_interleave(2, dim=-1)[None], "once": freqs[None]}.get(form, halves)
    try:
        rq, rk = fn(q, k, emb.cos(), emb.sin())[:2]
        q0, k0 = fn(q, k, torch.ones_like(emb), torch.zeros_like(emb))[:2]  # angle zero: its reordering, if any
    except Exception:
        return None
    c, s_ = halves.cos()[:, None], halves.sin()[:, None]  # the rotations below read the two-halves form
    for name, rotate in (("half", _half_rotation), ("interleaved", _interleaved_rotation)):
        if torch.allclose(rq, rotate(q0, c, s_), atol=1e-6) and torch.allclose(rk, rotate(k0, c, s_), atol=1e-6):
            return name
    return None
