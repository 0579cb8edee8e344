"""Public patching API: patch, unpatch, patched, describe, available_methods."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import numbers
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from .adapters import ADAPTERS, find_adapter
from .adapters.base import Restore, copy_restore, run_all
from .core.active import ACTIVE as _ACTIVE
from .core.active import PATCH_LOCK, active_patch, foreign_owner, mark_patched, model_name, own_patch, patch_name
from .core.active import base_model, describe, require_transformers_model  # base_model, describe: public here too
from .core.active import patched_parts, pickle_refusal, unmark_patched
from .core.errors import PatchError
from .core.own_config import own_config
from .methods.temperature import OPTION as TEMPERATURE
from .methods.registry import METHODS, resolve_method, validate_factor, validate_options
from .core.spec import CONFIG_KEY, LENGTH_ABSENT_KEY, SAVED_AS_KEY, PatchSpec, install_save_mark, unmark_live_config


class _Missing:
    """The value recorded for a config attribute that did not exist before the patch (BLOOM has no length
    attribute): unpatch deletes it. One object, kept as it is by copies and pickles (compared with ``is``)."""

    def __repr__(self) -> str:
        return "<missing>"

    def __copy__(self) -> _Missing:
        return self

    def __deepcopy__(self, memo: dict) -> _Missing:
        return self

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()


def _set_config(config: Any, key: str, value: Any) -> None:
    if value is _MISSING:
        if key in vars(config):
            delattr(config, key)
    else:
        setattr(config, key, value)


@dataclass
class _ActivePatch:
    """The live patch on a model (its ``_ctxext_active`` attribute): the spec, the undo tree and the config values
    the patch changed.

    ``copy.deepcopy(model)`` copies it through the model's memo (``__deepcopy__``): the undo tree then acts on the
    copy's modules, tensors and configs, so the copy is an independent patched model (``copy_restore``). Pickling
    it (``pickle.dumps(model)``, ``torch.save(model)``) raises ``PatchError`` saying how to save a patched model:
    the undo tree holds functions, and module-level dispatchers that a pickle cannot carry.

    ``model`` is a weak reference to the patched model, so that a deep copy of it counts as patched too (the owner of
    its modules: ``ctxext.core.active.foreign_owner``)."""

    spec: PatchSpec
    restore: Restore
    config_before: dict[str, Any]
    model: Any = None

    def __deepcopy__(self, memo: dict) -> _ActivePatch:
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.spec = copy.deepcopy(self.spec, memo)
        new.config_before = copy.deepcopy(self.config_before, memo)
        new.restore = copy_restore(self.restore, memo)
        new.model = None
        model = self.model() if self.model is not None else None
        copied = memo.get(id(model)) if model is not None else None  # the model's copy, made first (its memo)
        if copied is not None:
            new.model = weakref.ref(copied)
            mark_patched(copied)
        return new

    def __copy__(self) -> _ActivePatch:
        return type(self)(self.spec, self.restore, self.config_before, self.model)

    def __reduce_ex__(self, protocol):
        raise pickle_refusal(self.spec)


#: A config that records a spec is saved marked (see ctxext.core.spec); installed once, at import.
_SAVE_MARK = install_save_mark()


def build_spec(model: nn.Module, method: str, factor: Any = None, **options: Any) -> tuple[PatchSpec, Any]:
    """Validate a patch request against a model without touching it; returns the spec and the adapter."""
    require_transformers_model(model, "ctxext.build_spec")
    info = resolve_method(method)
    adapter = find_adapter(model)
    if not adapter.supports(info.name):
        fits = [m for m in METHODS if adapter.supports(m)]
        raise PatchError(
            f"method {info.name!r} does not fit {type(model).__name__} ({adapter.title}): "
            f"{adapter.reason(info.name)}. Methods that do: {', '.join(fits)}"
        )
    factor = validate_factor(info, factor)
    resolved = validate_options(info, options)
    if resolved.get(TEMPERATURE) and not adapter.takes_temperature:
        raise PatchError(f"{TEMPERATURE}={resolved[TEMPERATURE]} does not fit {type(model).__name__} ({adapter.title}): "
                         "an attention temperature composes with the rotary family's methods only")
    original = adapter.original_length(model)
    patched = original
    if original is not None and factor is not None:
        patched = int(round(original * factor))
    spec = PatchSpec(info.name, factor, resolved, adapter.family, original, patched)
    adapter.check(model, spec)
    return spec, adapter


def patch(model: nn.Module, method: str, factor: float | None = None, *, replace: bool = False, **options) -> nn.Module:
    """Patch ``model`` in place so it reads ``factor`` times longer inputs; returns the model.

    ``method`` is one of ``available_methods()``; ``options`` are the method's options (see ``ctxext methods``).
    The spec is recorded in ``model.config.ctxext`` and the advertised context length becomes
    ``factor * original``. Patching a patched model raises unless ``replace=True``. ``factor`` is a number (int,
    float, numpy or 0-d torch scalar) in [1, ``MAX_FACTOR``]. While patched, ``save_pretrained`` writes a
    ``config.json`` that plain transformers refuses (see ``ctxext.core.spec``); ``ctxext.from_pretrained`` reloads it.
    Bad input raises ``PatchError`` before anything changes.

    A patch of a sub-model inside ``model`` (``ctxext.patch(model.model, ...)``) counts as ``model``'s: it is
    refused the same way, and ``replace=True`` replaces it. A module that another patched model also holds (one
    module object in two models) is refused, naming that model. Patches of one process are applied one at a time
    (a thread waits for another's patch, then finds the model patched).
    """
    model = base_model(model, "ctxext.patch")
    try:
        with PATCH_LOCK:
            return _patch(model, method, factor, replace, options)
    except (NotImplementedError, RuntimeError) as exc:  # raised before any change, or after apply undid its part
        if "meta" in str(exc) and any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            raise PatchError(f"{type(model).__name__} holds tensors on the meta device (no values: built under "
                             "torch.device('meta'), or loaded without its weights), and this patch reads their "
                             "values; load the weights first (from_pretrained, or load_state_dict(..., assign=True))"
                             ) from exc
        raise


def _patch(model: nn.Module, method: str, factor, replace: bool, options: dict) -> nn.Module:
    if not _SAVE_MARK:
        raise PatchError(
            "this transformers version has no PreTrainedConfig.to_json_string, through which ctxext marks saved "
            "patched checkpoints so that plain from_pretrained refuses them; ctxext cannot patch safely here"
        )
    if not isinstance(replace, bool):
        raise PatchError(f"replace must be True or False, got {replace!r}")
    parts = patched_parts(model) if own_patch(model) is None else []
    if parts:  # a patch of a sub-model acts on this model too
        name, part = parts[0]
        if not replace:
            raise PatchError(
                f"model is already patched: its sub-model {name!r} ({model_name(part)}) holds a ctxext patch "
                f"({patch_name(own_patch(part))}), which acts on this model too; call ctxext.unpatch(model) first "
                "(it removes that patch) or pass replace=True"
            )
        return _replace_parts(model, parts, method, factor, options)
    if getattr(model, _ACTIVE, None) is not None and not replace:
        active = getattr(model, _ACTIVE).spec
        raise PatchError(
            f"model is already patched ({active.method}, factor {active.factor}); "
            "call ctxext.unpatch(model) first or pass replace=True"
        )
    refusal = foreign_owner(model)  # a module of it is another patched model's
    if refusal is not None:
        raise PatchError(f"cannot patch {model_name(model)}: {refusal}")
    if getattr(model, _ACTIVE, None) is not None:
        spec, adapter = _spec_for_replace(model, method, factor, options)
        replaced = getattr(model, _ACTIVE).spec
        unpatch(model)
    else:
        # the patch writes to the config: a config object shared with other models (transformers does not copy the
        # one a model is built from) would carry it to them
        put_back_config = own_config(model)
        try:
            take_saved_spec(model)  # a spec saved in config but not applied: start from the original length
            spec, adapter = build_spec(model, method, factor, **options)
        except BaseException:
            put_back_config()
            raise
        replaced = None

    config = model.config
    config_before = {adapter.length_attr: getattr(config, adapter.length_attr, _MISSING)} if adapter.length_attr else {}
    try:
        restore = adapter.apply(model, spec)
    except BaseException:  # apply leaves the model as it found it; a replaced patch goes back on
        if replaced is not None:
            patch(model, replaced.method, replaced.factor, **replaced.options)
        else:
            put_back_config()
        raise
    from .export import install_save_hook  # imports this module

    undo = [restore]
    try:  # an interruption from here on (Ctrl-C, SIGTERM) must not leave a patch that unpatch cannot see
        undo.append(install_save_hook(model))
        if adapter.length_attr and spec.patched_length is not None:
            setattr(config, adapter.length_attr, spec.patched_length)
        block = spec.to_dict()
        if adapter.length_attr and config_before[adapter.length_attr] is _MISSING:
            block[LENGTH_ABSENT_KEY] = True  # a reload leaves the attribute out again (take_saved_spec)
        setattr(config, CONFIG_KEY, block)
        setattr(model, _ACTIVE, _ActivePatch(spec, functools.partial(run_all, undo), config_before,
                                             weakref.ref(model)))
        mark_patched(model)
    except BaseException:
        unmark_patched(model)
        if getattr(model, _ACTIVE, None) is not None:
            delattr(model, _ACTIVE)
        run_all(undo)
        for key, value in config_before.items():
            _set_config(config, key, value)
        if CONFIG_KEY in vars(config):
            delattr(config, CONFIG_KEY)
        if replaced is not None:
            patch(model, replaced.method, replaced.factor, **replaced.options)
        else:
            put_back_config()
        raise
    return model


def _replace_parts(model: nn.Module, parts: list[tuple[str, nn.Module]], method, factor, options) -> nn.Module:
    """``replace=True`` on a model whose sub-models hold the patch: unpatch them, then patch ``model``; where that
    fails, the sub-models' patches go back on. The request is checked first, so bad input changes nothing."""
    info = resolve_method(method)
    validate_factor(info, factor)
    validate_options(info, options)
    removed = []
    try:
        for _, part in parts:
            spec = own_patch(part).spec
            _unpatch(part)
            removed.append((part, spec))
        return _patch(model, method, factor, False, options)
    except BaseException:
        for part, spec in reversed(removed):
            _patch(part, spec.method, spec.factor, False, dict(spec.options))
        raise


def _spec_for_replace(model, method, factor, options):
    """Validate a replacement against the unpatched model, without unpatching yet (nothing half-done on error)."""
    active: _ActivePatch = getattr(model, _ACTIVE)
    config = model.config
    saved = {k: getattr(config, k, _MISSING) for k in active.config_before}
    try:
        for key, value in active.config_before.items():
            _set_config(config, key, value)
        return build_spec(model, method, factor, **options)
    finally:
        for key, value in saved.items():
            _set_config(config, key, value)


def take_saved_spec(model: nn.Module) -> PatchSpec | None:
    """Remove a patch spec saved in the config of a freshly loaded model and restore the advertised length it had
    before that patch. ``ctxext.from_pretrained`` re-applies the returned spec."""
    model = base_model(model, "ctxext.take_saved_spec")
    with PATCH_LOCK:
        return _take_saved_spec(model)


def _take_saved_spec(model: nn.Module) -> PatchSpec | None:
    saved = getattr(model.config, CONFIG_KEY, None)
    if not saved or getattr(model, _ACTIVE, None) is not None:
        return None
    if not isinstance(saved, dict):
        raise PatchError(f"config.{CONFIG_KEY} should be a saved ctxext patch spec (a dict), got {saved!r}")
    if saved.get(SAVED_AS_KEY) == "native":
        # a native export loaded by plain transformers: the model *is* its config (e.g. rope type yarn, a resized
        # wpe); the record of how it was made goes, nothing is re-applied (ctxext.from_pretrained re-applies it)
        delattr(model.config, CONFIG_KEY)
        return None
    unmark_live_config(model.config)  # a marked config.json loaded without ctxext (a class-specific load)
    block = dict(getattr(model.config, CONFIG_KEY))
    spec = PatchSpec.from_dict(block)
    delattr(model.config, CONFIG_KEY)
    adapter = find_adapter(model)
    if adapter.length_attr and block.get(LENGTH_ABSENT_KEY) is True:
        if adapter.length_attr in vars(model.config):
            delattr(model.config, adapter.length_attr)
    elif adapter.length_attr and spec.original_length is not None:
        setattr(model.config, adapter.length_attr, spec.original_length)
    return spec


def unpatch(model: nn.Module) -> nn.Module:
    """Undo ``patch``: original frequencies/tables/attention and config values, bit-exact. Where the patch is a
    sub-model's inside ``model`` (``ctxext.patch(model.model, ...)``), that one is undone."""
    model = base_model(model, "ctxext.unpatch")
    with PATCH_LOCK:
        if own_patch(model) is not None:
            _unpatch(model)
            return model
        parts = patched_parts(model)
        if not parts:
            raise PatchError("model is not patched by ctxext")
        for _, part in parts:
            if own_patch(part) is not None:
                _unpatch(part)
        return model


def _unpatch(model: nn.Module) -> None:
    active: _ActivePatch = getattr(model, _ACTIVE)
    active.restore()
    for key, value in active.config_before.items():
        _set_config(model.config, key, value)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    delattr(model, _ACTIVE)
    unmark_patched(model)


@contextlib.contextmanager
def patched(model: nn.Module, method: str, factor: float | None = None, **options):
    """Context manager: ``with ctxext.patched(model, "yarn", 4): ...`` patches, then unpatches on exit."""
    patch(model, method, factor, **options)
    try:
        yield model
    finally:
        unpatch(model)


def available_methods(model: nn.Module | None = None) -> dict[str, list[str]]:
    """Method name -> families it applies to; with a model, only the methods that fit it."""
    adapters = ADAPTERS if model is None else [find_adapter(base_model(model, "ctxext.available_methods"))]
    table = {}
    for name in METHODS:
        families = [a.family for a in adapters if a.supports(name)]
        if families:
            table[name] = families
    return table


@contextlib.contextmanager
def dynamic_length(model: nn.Module, length: int):
    """Fix the dynamic-NTK scale (a per-sequence method's) for sequences decoded manually with a KV cache to
    ``length`` tokens.

    ``generate`` does this itself (prompt + max_new_tokens). Without it, a cached decode keeps the scale
    fixed at its prefill, which differs from a full forward pass over the final, longer sequence.
    """
    plain = base_model(model, "ctxext.dynamic_length")
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1:
        raise PatchError(f"dynamic_length needs the sequence's total length in tokens, a whole number >= 1; got "
                         f"{length!r}")
    with PATCH_LOCK:
        found = active_patch(plain)
    holder = found[0] if found is not None else None
    release = None if holder is None else find_adapter(holder).plan_length(holder, int(length))
    if release is None:
        per_sequence = " or ".join(repr(m.name) for m in METHODS.values() if m.per_sequence)
        raise PatchError(f"dynamic_length needs a model patched with method {per_sequence}")
    try:
        yield model
    finally:
        release()
