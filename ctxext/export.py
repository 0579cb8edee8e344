"""Native export: a patched model saved as a checkpoint that plain transformers (and serving engines reading
``config.json``) load as the same model.

Where a patch has an exact transformers-native form, ``model.save_pretrained(d)`` of the patched model writes that
form instead of the marked config of ``ctxext.core.spec``:

================  =========================================================================================
method (family)   what ``config.json`` / the weights say
================  =========================================================================================
pi (rotary)       rope type ``linear`` with the factor; ``max_position_embeddings`` = the patched length
yarn (rotary)     rope type ``yarn``: factor, ``original_max_position_embeddings``, beta_fast / beta_slow and the
                  options given (attention_factor, mscale / mscale_all_dim, truncate)
llama3 (rotary)   rope type ``llama3``: factor, low/high_freq_factor, ``original_max_position_embeddings``
dynamic-ntk       rope type ``dynamic`` with the factor, and ``max_position_embeddings`` = the *original*
(rotary)          length (transformers' dynamic type reads it as the original length); equal for a full
                  forward pass (transformers re-scales during cached decoding, ctxext fixes the scale per
                  sequence)
ntk (rotary)      plain RoPE with ``rope_theta`` = base * factor^(d / (d - 2))
extrapolate       the new ``max_position_embeddings`` only (rotary, BLOOM; GPT-J / CodeGen: ``n_positions``, from
                  which transformers builds the longer sin-cos table, verified against it)
pi, extrapolate   ``wpe`` saved as the method's table (``n_positions`` rows), ``n_positions`` the patched length
(GPT-2)           (the original table goes to ``ctxext_original_positions.safetensors`` beside the weights)
================  =========================================================================================

Every rotary candidate is *verified* before it is written: transformers' own rotary class is built from the native
config (the exact path a plain ``from_pretrained`` takes) and its frequencies and attention scale must equal the
patched model's to float32 rounding (``RTOL``); dynamic NTK is compared at several sequence lengths. So the config
form that this transformers reads (5.x ``rope_parameters`` or 4.x ``rope_scaling`` + ``rope_theta``) is found by
what works, not by version, and a form that would differ is never written: the checkpoint is then saved marked
(plain loading fails, naming ``ctxext.from_pretrained``), as for the methods with no native form at all (ALiBi
swap, NoPE, the attention-remap methods, BLOOM's ALiBi interpolation).

The saved config keeps ctxext's spec block (``"ctxext"``, with ``"saved_as": "native"`` and the replaced config
values), so ``ctxext.from_pretrained`` still reports the patch and ``unpatch`` restores the original model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import types
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .core.errors import PatchError
from .core.native_form import NativeForm, NoNativeForm, no_form_reason
from .core.spec import CONFIG_KEY, NATIVE_KEY, TENSORS_KEY, PatchSpec

#: Relative tolerance between the patched model's rotary frequencies / attention scale and those transformers
#: computes from the native config: float32 rounding (a few units in the last place), nothing more.
RTOL = 1e-6
#: The file (beside the weights) holding tensors the native form replaced: GPT-2's original position table.
ORIGINAL_TENSORS = "ctxext_original_positions.safetensors"


# -- deciding the native form --------------------------------------------------------------------------------------


def native_form(model: nn.Module, spec: PatchSpec | None = None, *, check_only: bool = False) -> NativeForm:
    """The native form of the patch active on ``model`` (or ``spec``, applied to it); raises NoNativeForm saying
    why there is none. ``check_only``: ``model`` may be an unpatched skeleton (weights on the meta device) of a
    family whose native form needs no verification (GPT-2, BLOOM); the form returned then only says that one
    exists (rotary models are verified, so they must be patched)."""
    from .adapters import find_adapter
    from .core.active import base_model, describe

    model = base_model(model, "ctxext.core.native_form")
    if spec is None:
        active = describe(model)
        if active is None:
            raise NoNativeForm("the model is not patched by ctxext")
        spec = PatchSpec.from_dict(active)
    adapter = find_adapter(model)
    if adapter.family == "rotary":
        return _rotary_form(model, spec)
    if adapter.family == "bloom" and spec.method == "extrapolate":
        return NativeForm({}, summary="ALiBi unchanged, max_position_embeddings advertised")
    return adapter.native_form(model, spec, check_only=check_only)  # each family's own (tables)


def _no_form_reason(spec: PatchSpec, title: str) -> str:
    return no_form_reason(spec.method, title)


def check_native(model: nn.Module) -> str | None:
    """None where the active patch has a native form, else the reason it has none."""
    try:
        native_form(model)
    except NoNativeForm as exc:
        return str(exc)
    return None


_NATIVE_ROPE = {"pi": "linear", "yarn": "yarn", "llama3": "llama3", "dynamic-ntk": "dynamic"}


def _rope_fields(spec: PatchSpec, rope_type: str) -> dict[str, Any]:
    """The native rope-type fields for the spec (without rope_theta and the other plain-RoPE fields)."""
    out: dict[str, Any] = {"rope_type": rope_type, "factor": float(spec.factor)}
    options = spec.options
    if rope_type == "yarn":
        out["original_max_position_embeddings"] = spec.original_length
        out["beta_fast"] = float(options.get("beta_fast", 32.0))
        out["beta_slow"] = float(options.get("beta_slow", 1.0))
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if options.get(key) is not None:
                out[key] = float(options[key])
        if options.get("truncate") is False:
            out["truncate"] = False
    elif rope_type == "llama3":
        out["original_max_position_embeddings"] = spec.original_length
        out["low_freq_factor"] = float(options.get("low_freq_factor", 1.0))
        out["high_freq_factor"] = float(options.get("high_freq_factor", 4.0))
    return out


def _composed_updates(spec: PatchSpec, preset: str, rope: dict[str, Any], base: float, dim: int,
                      attention_scaling: float) -> dict[str, Any]:
    """The changes to a shipped scaled rope type's settings (``rope``) that compute ``spec`` composed on it, where
    transformers has such a form (each is still verified): ``pi`` on ``linear`` x a is ``linear`` x (a * f); ``ntk``
    is the same rope type with rope_theta = base * f^(d/(d-2)) (exact for ``linear``; for the others verification
    decides); ``pi`` on ``longrope`` multiplies the long factors by f; ``extrapolate`` keeps the settings (only the
    advertised length grows). A ``longrope`` form writes its attention factor explicitly (transformers would
    otherwise derive it from the new advertised length)."""
    method, f = spec.method, float(spec.factor)
    updates: dict[str, Any] = {}
    if method == "pi" and preset == "linear" and isinstance(rope.get("factor"), (int, float)):
        updates["factor"] = float(rope["factor"]) * f
    elif method == "pi" and preset == "longrope" and isinstance(rope.get("long_factor"), (list, tuple)):
        updates["long_factor"] = [float(x) * f for x in rope["long_factor"]]
    elif method == "ntk":
        updates["rope_theta"] = base * f ** (dim / (dim - 2))
    elif method != "extrapolate":
        raise NoNativeForm(f"{method} x{f:g} composed on the shipped rope type {preset!r} has no transformers-native "
                           "form (no transformers rope type computes it)")
    if preset == "longrope":
        updates["attention_factor"] = float(attention_scaling)
    return updates


def _rotary_candidates(config: Any, spec: PatchSpec, base: float, dim: int, preset: str = "default",
                       attention_scaling: float = 1.0) -> list[dict[str, Any]]:
    """Native config changes for ``spec``, one per RoPE config API the config may have (5.x ``rope_parameters``,
    4.x ``rope_scaling`` + ``rope_theta`` / ``rotary_emb_base``); each is verified before use. ``preset``: the rope
    type the model ships (a method composed on a scaled one, see ``_composed_updates``)."""
    method = spec.method
    if method not in (*_NATIVE_ROPE, "ntk", "extrapolate"):  # NoPE, the ALiBi swap, the remap methods
        raise NoNativeForm(_no_form_reason(spec, "LLaMA-family (rotary)"))
    if preset != "default":
        candidates = []
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and params.get("rope_type") == preset:
            rope = {**params, **_composed_updates(spec, preset, params, base, dim, attention_scaling)}
            candidates.append({"rope_parameters": rope, "max_position_embeddings": spec.patched_length})
        scaling = getattr(config, "rope_scaling", None)
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == preset:
            updates = _composed_updates(spec, preset, scaling, base, dim, attention_scaling)
            theta = updates.pop("rope_theta", None)
            changes = {"rope_scaling": {**scaling, **updates}, "max_position_embeddings": spec.patched_length}
            if theta is not None:
                for key in ("rope_theta", "rotary_emb_base"):
                    if isinstance(getattr(config, key, None), (int, float)):
                        changes[key] = theta
            candidates.append(changes)
        return candidates
    length = spec.original_length if method == "dynamic-ntk" else spec.patched_length
    new_base = base * spec.factor ** (dim / (dim - 2)) if method == "ntk" else None
    candidates = []
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" in params:  # 5.x: one dict, rope_theta inside
        rope = dict(params)
        if method in _NATIVE_ROPE:
            rope.update(_rope_fields(spec, _NATIVE_ROPE[method]))
        elif new_base is not None:
            rope["rope_theta"] = new_base
        candidates.append({"rope_parameters": rope, "max_position_embeddings": length})
    if hasattr(config, "rope_scaling"):  # 4.x: rope_scaling (None for plain RoPE) + rope_theta / rotary_emb_base
        changes: dict[str, Any] = {"max_position_embeddings": length}
        scaling = getattr(config, "rope_scaling", None)
        if method in _NATIVE_ROPE:
            changes["rope_scaling"] = {**(scaling or {}), **_rope_fields(spec, _NATIVE_ROPE[method])}
        if new_base is not None:
            for key in ("rope_theta", "rotary_emb_base"):
                if isinstance(getattr(config, key, None), (int, float)):
                    changes[key] = new_base
        candidates.append(changes)
    return candidates


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return a.shape == b.shape and bool(torch.all((a - b).abs() <= RTOL * b.abs()))


def _native_rotary(module: nn.Module, config: Any):
    """transformers' rotary class of ``module`` built from ``config``, as a plain load builds it."""
    import warnings

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(module)(config=config)
    finally:
        hf_logging.set_verbosity(verbosity)


def _config_with(config: Any, changes: dict[str, Any]):
    """A config of the same class, from the live one's dict with ``changes`` (what a plain load of the native
    ``config.json`` reads), through transformers' own ``from_dict`` (its validation and standardisation)."""
    import warnings

    from transformers.utils import logging as hf_logging

    data = config.to_dict()
    data.pop(CONFIG_KEY, None)
    data.update(copy.deepcopy(changes))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(config).from_dict(data)
    finally:
        hf_logging.set_verbosity(verbosity)


def _verify_rotary(model: nn.Module, spec: PatchSpec, changes: dict[str, Any], preset: str = "default") -> str | None:
    """None where transformers' rotary modules built from the native config equal the patched ones; else why not.
    A ``longrope`` module is compared on both its sets (short: ``original_inv_freq``; long: ``long_inv_freq``)."""
    from .adapters.rotary_units import RotaryUnit, long_frequencies, rotary_modules, unit_inputs
    from .methods import rope as rope_methods

    try:
        config = _config_with(model.config, changes)
    except Exception as exc:  # noqa: BLE001 - transformers refuses the candidate config
        return f"transformers refuses the native config ({type(exc).__name__}: {exc})"
    expected_type = _NATIVE_ROPE.get(spec.method, "default") if preset == "default" else preset
    for name, module in rotary_modules(model):
        try:
            native = _native_rotary(module, config)
        except Exception as exc:  # noqa: BLE001
            return f"transformers cannot build {type(module).__name__} from the native config ({exc})"
        if native.rope_type != expected_type:
            return f"transformers reads rope type {native.rope_type!r} from it, not {expected_type!r}"
        if preset == "longrope":
            try:
                native_long = long_frequencies(RotaryUnit(name, native))
            except PatchError as exc:
                return str(exc)
            patched_long = getattr(module, "long_inv_freq", None)
            if patched_long is None:
                patched_long = long_frequencies(RotaryUnit(name, module))
            if not _close(native.original_inv_freq, module.original_inv_freq) or not _close(native_long, patched_long):
                return f"its short or long frequencies differ from the patched ones in {name or 'the rotary module'}"
            if not math.isclose(native.attention_scaling, module.attention_scaling, rel_tol=RTOL, abs_tol=0):
                return (f"its attention scale {native.attention_scaling} differs from the patched "
                        f"{module.attention_scaling}")
            continue
        if spec.method != "dynamic-ntk":
            if not _close(native.inv_freq, module.inv_freq):
                return f"its rotary frequencies differ from the patched ones in {name or 'the rotary module'}"
            if not math.isclose(native.attention_scaling, module.attention_scaling, rel_tol=RTOL, abs_tol=0):
                return (f"its attention scale {native.attention_scaling} differs from the patched "
                        f"{module.attention_scaling}")
            continue
        inputs = unit_inputs(RotaryUnit(name, module), spec.original_length, spec.method)
        x = torch.zeros(1, 1, 1, dtype=torch.float32, device=module.inv_freq.device)
        lengths = sorted({spec.original_length, spec.original_length + 1, 2 * spec.original_length,
                          spec.patched_length, 2 * spec.patched_length + 3})
        for length in lengths:  # increasing: transformers' dynamic type only grows between resets
            native(x, torch.tensor([[length - 1]], device=x.device))
            ours, _ = rope_methods.dynamic_ntk_scale(inputs, spec.factor, length)
            if not _close(native.inv_freq, ours) or native.attention_scaling != 1.0:
                return f"transformers' dynamic frequencies differ from ctxext's at length {length}"
    return None


def _rotary_form(model: nn.Module, spec: PatchSpec) -> NativeForm:
    from .adapters.rotary_units import RotaryUnit, rotary_modules, unit_inputs

    modules = rotary_modules(model)
    if not modules or any(getattr(m, "config", None) is not model.config for _, m in modules):
        raise NoNativeForm("the rotary modules do not read the model's own config (a nested text config); "
                           "ctxext writes native forms for top-level configs only")
    try:
        inputs = unit_inputs(RotaryUnit(*modules[0]), spec.original_length, spec.method)
    except PatchError as exc:
        raise NoNativeForm(str(exc)) from exc
    reasons = []
    # a longrope form writes the patched attention factor (pi / ntk / extrapolate keep the shipped one)
    for changes in _rotary_candidates(model.config, spec, inputs.base, inputs.dim, inputs.preset,
                                      modules[0][1].attention_scaling):
        problem = _verify_rotary(model, spec, changes, inputs.preset)
        if problem is None:
            rope = changes.get("rope_parameters") or changes.get("rope_scaling") or {}
            what = f"rope type {rope.get('rope_type', 'default')!r}"
            if spec.method == "ntk":
                theta = changes.get("rope_parameters", changes)
                what += f", rope_theta {theta.get('rope_theta', changes.get('rotary_emb_base'))}"
            return NativeForm(changes, summary=f"{what}, max_position_embeddings {changes['max_position_embeddings']}")
        reasons.append(problem)
    raise NoNativeForm(f"{spec.method} x{spec.factor:g} has no exact native form on this model: "
                       + ("; ".join(reasons) or "its config has no RoPE settings transformers reads"))


# -- writing it ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _native_json(model: nn.Module, form: NativeForm):
    """While open, ``model.config`` is written in its native form (``ctxext.core.spec`` reads ``NATIVE_KEY``) and the
    state dict holds the native weights."""
    config = model.config
    block = getattr(config, CONFIG_KEY)
    block[NATIVE_KEY] = copy.deepcopy(form.changes)
    if form.originals is not None:
        block[TENSORS_KEY] = ORIGINAL_TENSORS
    try:
        with form.weights() if form.weights is not None else contextlib.nullcontext():
            yield
    finally:
        block.pop(NATIVE_KEY, None)
        block.pop(TENSORS_KEY, None)


def _write_originals(folder: str | os.PathLike, form: NativeForm) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in form.originals().items()}
    save_file(tensors, str(Path(folder) / ORIGINAL_TENSORS), metadata={"format": "pt", "written_by": "ctxext"})


def _save_pretrained(self: nn.Module, save_directory, *args, **kwargs):
    """``save_pretrained`` of a patched model: the native form of its patch where one exists, else (the class's
    own ``save_pretrained`` with) the marked checkpoint of ``ctxext.core.spec``."""
    original = functools.partial(type(self).save_pretrained, self)
    if not isinstance(vars(self.config).get(CONFIG_KEY), dict):  # the record was dropped (a baked table)
        return original(save_directory, *args, **kwargs)
    try:
        form = native_form(self)
    except NoNativeForm:
        return original(save_directory, *args, **kwargs)
    with _native_json(self, form):
        result = original(save_directory, *args, **kwargs)
    if form.originals is not None and kwargs.get("is_main_process", True):
        _write_originals(save_directory, form)
    return result


def install_save_hook(model: nn.Module) -> Callable[[], None]:
    """Make ``model.save_pretrained`` (and ``push_to_hub``, which saves through it) write the native form of the
    active patch where one exists (else the marked checkpoint of ``ctxext.core.spec``). A bound method, so a deep copy of
    the model saves itself. Returns the undo."""
    model.save_pretrained = types.MethodType(_save_pretrained, model)
    return lambda: model.__dict__.pop("save_pretrained", None)


def restore_original_tensors(model: nn.Module, pretrained: Any, block: dict[str, Any], hub_kwargs: dict) -> None:
    """A natively exported checkpoint whose weights the native form replaced (GPT-2's table), loaded as it is
    saved: put the original tensors back (from ``ORIGINAL_TENSORS``) and the original length in the config, so the
    saved spec can be re-applied and ``unpatch`` gives the original model."""
    from safetensors.torch import load_file
    from transformers.utils import cached_file

    name = block.get(TENSORS_KEY)
    try:
        path = cached_file(str(pretrained), name, **hub_kwargs)
    except Exception as exc:  # noqa: BLE001
        raise OSError(f"{pretrained}: the natively exported checkpoint lacks {name}, which holds the tensors the "
                      f"export replaced ({exc}); load it with AutoModelForCausalLM.from_pretrained instead") from exc
    from .adapters import find_adapter

    find_adapter(model).restore_exported(model, load_file(path), PatchSpec.from_dict(block))


# -- the export command's work -------------------------------------------------------------------------------------


def export(model: nn.Module, out: str | os.PathLike, *, tokenizer: Any = None, overwrite: bool = False,
           inputs: tuple = ()) -> NativeForm:
    """Save the patched ``model`` (and ``tokenizer``) natively to ``out``; NoNativeForm (nothing written) where the
    patch has no native form. The folder is written beside ``out`` and renamed into place when complete, with a
    marker (``OUTPUT_MARKER``) listing what it wrote. ``overwrite`` replaces only such a folder (or an empty one),
    never one holding other files or a folder ``ctxext.core.outputs`` protects (``inputs``: the folders read from).
    ``ctxext export`` holds ``ctxext.core.outputs.OutputLock`` on ``out`` around this (and the model's load)."""
    import shutil
    import tempfile

    from .core.outputs import check_replaceable_folder

    form = native_form(model)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} exists; pass --overwrite to replace it")
    check_replaceable_folder(out, "--out", is_ours=is_export_folder, inputs=inputs, what="a ctxext export")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        (tmp / OUTPUT_MARKER).write_text(json.dumps({"written_by": "ctxext export", "files": files}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return form


#: Written into an exported folder: what ctxext wrote there, so ``--overwrite`` replaces nothing else.
OUTPUT_MARKER = ".ctxext-export.json"


def is_export_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a ctxext export and nothing but the files its marker lists."""
    try:
        listed = set(json.loads((folder / OUTPUT_MARKER).read_text(encoding="utf-8"))["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()} - {OUTPUT_MARKER}
    return present <= listed
