"""Rotary sin-cos table adapter (GPT-J, CodeGen).

These models keep no rotary module: each attention layer holds a table ``embed_positions`` of ``n_positions`` rows,
row p = cat(sin(p * inv_freq), cos(p * inv_freq)) with inv_freq = 10000 ** (-2i / d) over the rotary dimension d
(``rotary_dim``, else the table's width), and gathers its rows by ``position_ids``. transformers 5.x registers it as
a non-persistent buffer, 4.57 keeps it as a plain tensor attribute; neither is in the state dict. Positions past the
last row fail (an index error), so the table's rows are the model's position limit.

A static method is a new table built from the method's frequencies (``ctxext.methods.rope``, the same functions as
for rotary modules) with ``round(factor * n_positions)`` rows; an attention factor (YaRN's mscale) multiplies sin and
cos, as transformers' rotary modules apply ``attention_scaling`` to cos and sin. ``nope`` is the table of the zero
frequencies (sin 0, cos 1: no rotation). The advertised length is ``config.n_positions`` (``max_position_embeddings``
is an alias of it; CodeGen's ``n_ctx`` is kept in step). ``unpatch`` puts the original table objects back.

Refused: ``dynamic-ntk`` (the table is fixed; keys enter the cache rotated by it), the ALiBi swap and the remap
methods (these models' attention is not dispatched through transformers' ``AttentionInterface``).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..core.errors import PatchError
from ..core.spec import PatchSpec
from ..methods import rope
from ..methods.declaration import Kind, Method
from .base import Adapter, Restore, declaration, run_all, undone_on_failure
from .gpt2 import _keep_n_ctx_in_step
from .rotary import rule_of  # the same frequency rules as rotary modules

#: The rope base GPT-J and CodeGen hard-code (their configs have no field for it).
BASE = 10000.0
TABLE = "embed_positions"
#: Where a patched layer keeps its original table (read by ``check`` when a patch is replaced).
ORIGINAL = "_ctxext_original_table"
#: Why the methods that replace the attention function are refused (its own eager / flash classes, no registry).
NO_ATTENTION_INTERFACE = "attention bypasses transformers' AttentionInterface (not replaceable)"



def plain_inv_freq(dim: int) -> torch.Tensor:
    """The frequencies GPT-J's ``create_sinusoidal_positions`` uses, computed the same way (float32)."""
    return 1.0 / (BASE ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))


def sincos_table(inv_freq: torch.Tensor, rows: int, attention_factor: float = 1.0) -> torch.Tensor:
    """cat(sin, cos) of position x inv_freq for positions 0..rows-1 (float32, as transformers builds it)."""
    angles = torch.arange(rows, dtype=torch.int64).float()[:, None] * inv_freq.float()
    table = torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)
    return table if attention_factor == 1.0 else table * attention_factor


def table_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Attention modules holding a sin-cos table: a 2-D tensor ``embed_positions`` (buffer or plain attribute; an
    ``nn.Embedding`` of that name, as in OPT / BioGPT, is not one) beside a ``rotary_dim`` it is as wide as."""
    found = []
    for name, module in model.named_modules():
        table = getattr(module, TABLE, None)
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] % 2:
            continue
        if hasattr(module, "rotary_dim") and module.rotary_dim in (None, table.shape[1]):
            found.append((name, module))
    return found


class SinCosTableAdapter(Adapter):
    family = "sincos"
    title = "GPT-J / CodeGen (rotary sin-cos table)"
    length_attr = "n_positions"
    kinds = {Kind.NONE: "table of sin 0, cos 1", Kind.LENGTH: "table extended, same frequencies"}
    refusals = {Kind.BIAS: NO_ATTENTION_INTERFACE, Kind.REMAP: NO_ATTENTION_INTERFACE}

    def does(self, method: Method) -> str | None:
        if method.kind is Kind.FREQUENCY and not method.per_sequence:
            return "table of " + method.described_as_table
        return super().does(method)

    def refusal(self, method: Method) -> str:
        if method.per_sequence:
            return "the sin-cos table is fixed, not scaled per sequence length"
        return super().refusal(method)

    def detect(self, model: nn.Module) -> bool:
        return bool(table_modules(model))

    def check(self, model: nn.Module, spec: PatchSpec) -> None:
        if spec.original_length is None:
            raise PatchError(f"{type(model).__name__} config has no {self.length_attr}; cannot size the table")
        modules = table_modules(model)
        shapes = {tuple(getattr(m, TABLE).shape) for _, m in modules}
        if len(shapes) > 1:
            raise PatchError(f"{type(model).__name__}: its sin-cos tables differ in shape ({sorted(shapes)}); refused")
        for name, module in modules:
            table = module.__dict__.get(ORIGINAL, getattr(module, TABLE))  # a replace is checked while patched
            if table.device.type == "meta":
                continue  # a skeleton without values: checked when the real model is patched
            expected = sincos_table(plain_inv_freq(table.shape[1]), table.shape[0]).to(table.dtype)
            tol = max(1e-5, 4 * torch.finfo(table.dtype).eps)  # sin / cos of another device or dtype
            if not torch.allclose(table.detach().cpu(), expected, atol=tol, rtol=0):
                # another base or layout than GPT-J's: the method's frequencies would start from wrong values
                raise PatchError(f"{type(model).__name__}: the sin-cos table of {name} is not GPT-J's "
                                 f"(base {BASE:g} sin | cos); refused")

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        with undone_on_failure() as undo:
            original = getattr(table_modules(model)[0][1], TABLE)
            dim = original.shape[1]
            inputs = rope.RopeInputs(plain_inv_freq(dim), BASE, dim, spec.original_length)
            inv_freq, attention_factor = rule_of(declaration(spec))(inputs, spec.factor, **spec.options)
            rows = max(original.shape[0], spec.patched_length or 0)
            table = sincos_table(inv_freq, rows, attention_factor)
            for _, module in table_modules(model):
                before = getattr(module, TABLE)
                # one table object per layer, as transformers builds them (a layer may move its own to a device)
                setattr(module, TABLE, table.to(device=before.device, dtype=before.dtype, copy=True))
                module.__dict__[ORIGINAL] = before
                undo.append(functools.partial(_put_back, module, before))
            undo.append(_keep_n_ctx_in_step(model.config, spec))
        return functools.partial(run_all, undo)

    def position_limit(self, model: nn.Module) -> int | None:
        modules = table_modules(model)
        return min(getattr(m, TABLE).shape[0] for _, m in modules) if modules else None

    def native_form(self, model: nn.Module, spec: PatchSpec, *, check_only: bool = False):
        return native_form(model, spec, check_only=check_only)


def _put_back(module: nn.Module, original: torch.Tensor) -> None:
    """The original table object; converted only where the model was moved or cast while patched."""
    current = getattr(module, TABLE)
    if current.device != original.device or current.dtype != original.dtype:
        original = original.to(device=current.device, dtype=current.dtype)
    setattr(module, TABLE, original)
    module.__dict__.pop(ORIGINAL, None)


# -- native export (ctxext.export) ---------------------------------------------------------------------------------


def native_form(model: nn.Module, spec: PatchSpec, *, check_only: bool = False):
    """Only a longer length alone (``extrapolate``) has a native form: the longer ``n_positions`` (already
    advertised), from which a plain load builds exactly the patched table. Verified against the modeling module's own
    table function."""
    from ..core.native_form import NativeForm, NoNativeForm

    if declaration(spec).kind is not Kind.LENGTH:
        raise NoNativeForm(
            f"method {spec.method!r} on GPT-J / CodeGen (rotary sin-cos table) has no transformers-native form: the "
            "config has no rope scaling field (transformers always builds the table from n_positions with base "
            f"{BASE:g})"
        )
    summary = f"sin-cos table unchanged, n_positions {spec.patched_length}"
    if check_only:
        return NativeForm({}, summary=summary)
    for name, module in table_modules(model):
        create = getattr(inspect.getmodule(type(module)), "create_sinusoidal_positions", None)
        table = getattr(module, TABLE)
        if not callable(create):
            raise NoNativeForm(f"cannot verify the native form of {name}: its modeling module has no "
                               "create_sinusoidal_positions")
        native = create(spec.patched_length, table.shape[1]).to(dtype=table.dtype)
        if not torch.equal(native, table.detach().cpu()):
            raise NoNativeForm(f"the table transformers builds for n_positions {spec.patched_length} differs from "
                               f"the patched one in {name}")
    return NativeForm({}, summary=summary)
