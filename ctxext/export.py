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
+ temperature=    the method's form plus ``rope_parameters.llama_4_scaling_beta`` = beta, on models whose attention
llama4 (rotary)   reads it (Ministral 3), shipped with beta 0, floored at ``original_max_position_embeddings``
================  =========================================================================================

Every rotary candidate is *verified* before it is written: transformers' own rotary class is built from the native
config (the exact path a plain ``from_pretrained`` takes) and its frequencies and attention scale must equal the
patched model's to float32 rounding (``ctxext.adapters.rotary_native``); dynamic NTK is compared at several sequence
lengths. So the config form that this transformers reads (5.x ``rope_parameters`` or 4.x ``rope_scaling`` +
``rope_theta``) is found by what works, not by version, and a form that would differ is never written: the checkpoint
is then saved marked (plain loading fails, naming ``ctxext.from_pretrained``), as for the methods with no native form
at all (ALiBi swap, NoPE, the attention-remap methods, BLOOM's ALiBi interpolation). Each family's adapter builds its
own form (``Adapter.native_form``).

The saved config keeps ctxext's spec block (``"ctxext"``, with ``"saved_as": "native"`` and the replaced config
values), so ``ctxext.from_pretrained`` still reports the patch and ``unpatch`` restores the original model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import types
from pathlib import Path
from typing import Any, Callable

from torch import nn

from .core.native_form import NativeForm, NoNativeForm
from .core.spec import CONFIG_KEY, NATIVE_KEY, TENSORS_KEY, PatchSpec

#: The file (beside the weights) holding tensors the native form replaced: GPT-2's original position table.
ORIGINAL_TENSORS = "ctxext_original_positions.safetensors"
#: The patch record beside a LoRA adapter trained on a patched model, which ``ctxext.from_pretrained(base,
#: adapter=DIR)`` applies again: written by a ctxext fine-tune, and by every adapter save of a patched model (peft's
#: ``PeftModel.save_pretrained``, transformers' ``save_pretrained`` of a model with ``add_adapter``), see
#: :func:`write_adapter_record`.
ADAPTER_RECORD = "ctxext_patch.json"


# -- deciding the native form --------------------------------------------------------------------------------------


def native_form(model: nn.Module, spec: PatchSpec | None = None, *, check_only: bool = False) -> NativeForm:
    """The native form of the patch active on ``model`` (or ``spec``, applied to it); raises NoNativeForm saying
    why there is none. ``check_only``: ``model`` may be an unpatched skeleton (weights on the meta device) of a
    family whose native form needs no verification (GPT-2, BLOOM); the form returned then only says that one
    exists (families whose form is verified, ``Adapter.native_form_needs_patch``, must be patched)."""
    from .adapters import find_adapter
    from .core.active import base_model, describe

    model = base_model(model, "ctxext.export.native_form")
    if spec is None:
        active = describe(model)
        if active is None:
            raise NoNativeForm("the model is not patched by ctxext")
        spec = PatchSpec.from_dict(active)
    return find_adapter(model).native_form(model, spec, check_only=check_only)  # each family's own


def check_native(model: nn.Module) -> str | None:
    """None where the active patch has a native form, else the reason it has none."""
    try:
        native_form(model)
    except NoNativeForm as exc:
        return str(exc)
    return None


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
    if getattr(self, "_hf_peft_config_loaded", False):  # transformers' own adapters (add_adapter): it saves the
        result = original(save_directory, *args, **kwargs)  # adapter alone, without config.json
        if kwargs.get("is_main_process", True):
            write_adapter_record(self, [Path(save_directory)])
        return result
    try:
        form = native_form(self)
    except NoNativeForm:
        return original(save_directory, *args, **kwargs)
    with _native_json(self, form):
        if kwargs.get("state_dict") is not None and form.originals is not None:
            kwargs["state_dict"] = _native_state_dict(self, kwargs["state_dict"], form)
        result = original(save_directory, *args, **kwargs)
    if form.originals is not None and kwargs.get("is_main_process", True):
        _write_originals(save_directory, form)
    return result


def _native_state_dict(model: nn.Module, given: dict, form: NativeForm) -> dict:
    """A caller's own ``state_dict`` (Trainer's save passes one) with the tensors the native form replaces taken from
    the model as it is written (GPT-2's resized table): the original rows under a config that advertises the patched
    length would not load."""
    now = model.state_dict()
    return {**given, **{key: now[key] for key in form.originals() if key in given}}


def install_save_hook(model: nn.Module) -> Callable[[], None]:
    """Make ``model.save_pretrained`` (and ``push_to_hub``, which saves through it) write the native form of the
    active patch where one exists (else the marked checkpoint of ``ctxext.core.spec``). A bound method, so a deep copy of
    the model saves itself. Returns the undo. Also makes sure that peft's adapter save records the patch
    (:func:`install_adapter_record`)."""
    from .core.undo import set_on_instance

    install_adapter_record()
    return set_on_instance(model, "save_pretrained", types.MethodType(_save_pretrained, model))


# -- the patch record beside an adapter ----------------------------------------------------------------------------


def write_adapter_record(model: nn.Module, folders: list[Path]) -> None:
    """Beside an adapter saved from ``model`` (each of ``folders``): ``ADAPTER_RECORD`` with the patch the model
    has; where it has none, no such file (one left by an earlier save would apply a patch the adapter was not
    trained with)."""
    from .core.active import describe
    from .core.errors import PatchError

    try:
        spec = describe(model)
    except PatchError:  # not a transformers model inside: nothing ctxext patched
        return
    for folder in folders:
        path = Path(folder) / ADAPTER_RECORD
        if spec is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _quiet_reference_base(model: nn.Module):
    """While peft saves an adapter whose base is a shipped reference checkpoint, named ``reference:NAME``
    (``ctxext.loading.name_model``): without peft's warning that it finds no config.json under that name (it looks
    for one to see whether the vocabulary was resized; ctxext never resizes it)."""
    import warnings

    from .core.shipped import reference_name

    base = getattr(model, "get_base_model", lambda: model)()
    if reference_name(getattr(base, "name_or_path", None)) is None:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Could not find a config file in (ctxext\.)?reference:")
        yield


def _peft_save_pretrained(original: Callable) -> Callable:
    """``PeftModel.save_pretrained``, then the patch record beside each adapter folder it wrote."""
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        with _quiet_reference_base(self):
            result = original(self, save_directory, *args, **kwargs)
        try:
            given = signature.bind(self, save_directory, *args, **kwargs).arguments
        except TypeError:
            given = {}
        if given.get("is_main_process", True):
            names = given.get("selected_adapters") or list(getattr(self, "peft_config", None) or {"default": None})
            folders = [Path(save_directory) / ("" if name == "default" else name) for name in names]
            write_adapter_record(self, [f for f in folders if (f / "adapter_config.json").is_file()])
        return result

    save_pretrained._ctxext_record = True
    return save_pretrained


def read_adapter_record(adapter_dir: str | os.PathLike) -> PatchSpec | None:
    """The patch an adapter folder records in :data:`ADAPTER_RECORD`; None where it holds no record. A record that
    cannot be read, or a damaged one, is a PatchError naming the file (the one reader of that file)."""
    from .core.errors import PatchError

    path = Path(adapter_dir) / ADAPTER_RECORD
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8-sig"))  # a BOM an editor added is harmless
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise PatchError(f"{path.name} cannot be read ({exc}); it records the patch the adapter was trained with: "
                         "restore it from the training run's output") from None
    return PatchSpec.from_dict(saved, f" in {path}")


def install_adapter_record() -> bool:
    """Make peft's ``PeftModel.save_pretrained`` write ``ADAPTER_RECORD`` beside an adapter saved from a patched
    model (peft saves only the adapter: without the record, ``ctxext.from_pretrained(base, adapter=DIR)`` would load
    it on the unpatched base). peft calls nothing of the patched model that knows the folder, so this wraps the class's
    method once, as ``ctxext.core.spec`` wraps transformers' config writer; the wrapper only adds the record (or
    removes a stale one) after peft's own save. Called at every patch; returns False where peft is not installed."""
    import importlib.util

    try:
        if importlib.util.find_spec("peft") is None:
            return False
        from peft import PeftModel
    except Exception:  # noqa: BLE001 - a peft that does not import cannot save adapters either
        return False
    current = PeftModel.__dict__.get("save_pretrained")
    if current is None or getattr(current, "_ctxext_record", False):
        return current is not None
    PeftModel.save_pretrained = _peft_save_pretrained(current)
    return True


def restore_original_tensors(model: nn.Module, pretrained: Any, block: dict[str, Any], hub_kwargs: dict) -> dict:
    """A natively exported checkpoint whose weights the native form replaced (GPT-2's table), loaded as it is
    saved: put the original tensors back (from ``ORIGINAL_TENSORS``) and the original length in the config, so the
    saved spec can be re-applied and ``unpatch`` gives the original model. Returns the replaced tensors as loaded,
    for :func:`check_rebuilt_tensors`."""
    from safetensors.torch import load_file
    from transformers.utils import cached_file

    name = block.get(TENSORS_KEY)
    try:
        path = cached_file(str(pretrained), name, **hub_kwargs)
    except Exception as exc:  # noqa: BLE001
        raise OSError(f"{pretrained}: the natively exported checkpoint lacks {name}, which holds the tensors the "
                      f"export replaced ({exc}); load it with AutoModelForCausalLM.from_pretrained instead") from exc
    from .adapters import find_adapter
    from .core.outputs import file_damage

    damage = file_damage(path)
    try:
        tensors = load_file(path) if damage is None else None
    except Exception as exc:  # noqa: BLE001 - safetensors' own error for a file cut short or not safetensors
        damage = str(exc).splitlines()[0]
    if tensors is None:
        raise OSError(f"{pretrained}: {name}, which holds the tensors the export replaced, is damaged ({damage}); "
                      "copy the checkpoint again, or load it with AutoModelForCausalLM.from_pretrained")
    state = model.state_dict()
    # with the dtype the export saved them in: a float16 export loaded in float32 holds float16-rounded values
    as_loaded = {key: (state[key].detach().clone(), tensors[key].dtype) for key in tensors if key in state}
    find_adapter(model).restore_exported(model, tensors, PatchSpec.from_dict(block))
    return as_loaded


def check_rebuilt_tensors(model: nn.Module, as_loaded: dict[str, Any], pretrained: Any) -> None:
    """After the saved patch is applied again to a natively exported checkpoint: the tensors it rebuilds (GPT-2's
    table) must be the ones saved. They differ where the checkpoint was changed after the export (a table
    fine-tuned and saved back with plain transformers, beside the old originals file); re-applying the patch would
    then drop those weights silently."""
    import torch

    from .core.active import describe

    form = native_form(model)
    with form.weights() if form.weights is not None else contextlib.nullcontext():
        now = model.state_dict()
        for key, (saved, saved_dtype) in as_loaded.items():
            rebuilt = now.get(key)
            eps = max((torch.finfo(d).eps for d in (saved.dtype, saved_dtype) if d.is_floating_point), default=0.0)
            if rebuilt is None or rebuilt.shape != saved.shape or not torch.allclose(
                    rebuilt.float(), saved.float(), rtol=2 * eps, atol=2 * eps * float(saved.abs().max())):
                raise OSError(
                    f"{pretrained}: the saved {key} is not the table the {describe(model)['method']!r} patch builds "
                    f"from {ORIGINAL_TENSORS}: the checkpoint was changed after its export (saved back with plain "
                    "transformers?), and applying the patch again would drop those weights. Load it with "
                    "AutoModelForCausalLM.from_pretrained, which reads it as saved")


def check_rebuilt_config(model: nn.Module, saved: dict[str, Any], pretrained: Any) -> None:
    """After the saved patch is applied again to a natively exported checkpoint: the config values its native form
    writes (rope parameters, the advertised length) must be the ones in ``config.json``. They differ where the file
    was edited after the export (a factor changed by hand); re-applying the recorded patch would then load another
    model than the one plain transformers loads, silently."""
    from .core.active import describe

    try:
        changes = native_form(model).changes
    except NoNativeForm:
        return
    for key, value in changes.items():
        if key in saved and json.loads(json.dumps(value)) != saved[key]:
            raise OSError(
                f"{pretrained}: config.json's {key} ({saved[key]!r}) is not what the recorded {describe(model)['method']!r} "
                f"patch writes ({value!r}): the config was changed after its export, and applying the recorded patch "
                "would load another model. Load it with AutoModelForCausalLM.from_pretrained, which reads it as "
                "saved, or export again")


# -- the export command's work -------------------------------------------------------------------------------------


def export(model: nn.Module, out: str | os.PathLike, *, tokenizer: Any = None, overwrite: bool = False,
           inputs: tuple = ()) -> NativeForm:
    """Save the patched ``model`` (and ``tokenizer``) natively to ``out``; NoNativeForm (nothing written) where the
    patch has no native form. The folder is written beside ``out`` and renamed into place when complete, with a
    marker (``OUTPUT_MARKER``) listing what it wrote. ``overwrite`` replaces only such a folder (or an empty one),
    never one holding other files or a folder ``ctxext.core.outputs`` protects (``inputs``: the folders read from).
    ``ctxext export`` holds ``ctxext.core.outputs.OutputLock`` on ``out`` around this (and the model's load)."""
    from .core.outputs import check_replaceable_folder, staged_folder

    form = native_form(model)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} exists; pass --overwrite to replace it")
    check_replaceable_folder(out, "--out", is_ours=is_export_folder, inputs=inputs, what="a ctxext export")
    with staged_folder(out) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        (tmp / OUTPUT_MARKER).write_text(json.dumps({"written_by": "ctxext export", "files": files}, indent=1))
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
