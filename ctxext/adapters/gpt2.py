"""GPT-2 family adapter: learned absolute positions.

Acts on the ``wpe`` position table (an ``nn.Embedding`` next to the ``wte`` token table, with as many rows as the
config's ``n_positions``) and on the advertised length ``config.n_positions`` (what ``generate`` and lm-eval read;
``max_position_embeddings`` is an alias of it, and an ``n_ctx`` left in older configs is kept in step).

While patched, ``wpe`` is replaced by a ``PositionTable`` that shares the original ``weight`` parameter (so
``state_dict`` / ``save_pretrained`` still hold the original table under the same key) and looks positions up in the
method's table, a non-persistent buffer:

- ``pi``: the table interpolated to ``round(factor * n_positions)`` rows (``ctxext.methods.positions``);
- ``extrapolate``: the table extended to that many rows by repeating its last row;
- ``nope`` and ``alibi``: no table (the position embedding is zero); ``alibi`` also switches the attention to
  ``ctxext_alibi`` (``ctxext.attention``).

Positions past the end of the table are clamped to its last row, so inputs longer than the advertised length run.
``unpatch`` puts the original ``wpe`` module back (the same object) and restores the attention implementation.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import require_attention, use_attention
from ..core.spec import PatchSpec
from ..methods.declaration import Kind
from ..methods.positions import table_rule
from .base import Adapter, Restore, declaration, run_all, undone_on_failure
from .stand_in_table import StandInTable, put_back
from .trainable_table import freeze_unused_weights, make_tables_trainable


class PositionTable(StandInTable):
    """Stands in for a patched ``wpe``: same ``weight`` parameter, lookups in the method's table (or zeros)."""

    @property
    def num_embeddings(self) -> int | None:
        return self.table.shape[0] if self.table is not None else None

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        table = self.current_table()
        if table is None:  # position table bypassed
            return self.weight.new_zeros(*position_ids.shape, self.embedding_dim)
        index = position_ids.clamp(min=0, max=table.shape[0] - 1)
        return F.embedding(index, table)

    def extra_repr(self) -> str:
        rows = "none" if self.table is None else self.table.shape[0]
        return f"method={self.method}, rows={rows}, dim={self.embedding_dim}"


def position_owner(model: nn.Module) -> nn.Module | None:
    """The submodule holding ``wte`` and ``wpe`` (GPT2Model), with ``wpe`` sized by the config's ``n_positions``
    (GPT-Neo's config calls it ``max_position_embeddings``)."""
    config = getattr(model, "config", None)
    n_positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    for module in model.modules():
        wpe = getattr(module, "wpe", None)
        if isinstance(wpe, PositionTable):
            return module
        if (
            isinstance(wpe, nn.Embedding)
            and isinstance(getattr(module, "wte", None), nn.Embedding)
            and wpe.num_embeddings == n_positions
        ):
            return module
    return None


class GPT2Adapter(Adapter):
    family = "gpt2"
    title = "GPT-2 (learned absolute)"
    length_attr = "n_positions"
    interpolation = "wpe interpolated to f x rows"
    kinds = {Kind.LENGTH: "wpe extended (last row repeated)", Kind.BIAS: "wpe bypassed + ALiBi bias",
             Kind.NONE: "wpe bypassed"}
    refusals = {Kind.FREQUENCY: "not rotary", Kind.REMAP: "not rotary"}

    def detect(self, model: nn.Module) -> bool:  # GPT-2's config names the length n_positions (GPT-Neo's does not)
        return position_owner(model) is not None and getattr(model.config, "n_positions", None) is not None

    def check(self, model: nn.Module, spec: PatchSpec) -> None:
        if declaration(spec).kind is Kind.BIAS:
            require_attention(model)

    def position_limit(self, model: nn.Module) -> int | None:
        """The rows of the method's table while patched (a lookup past them would read the last row: the evaluator
        reports such lengths as n/a), None while the table is bypassed (nope, alibi); unpatched, the base rule."""
        owner = position_owner(model)
        wpe = getattr(owner, "wpe", None)
        if isinstance(wpe, PositionTable):
            return wpe.num_embeddings
        return super().position_limit(model)

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        with undone_on_failure() as undo:
            owner = position_owner(model)
            original = owner.wpe
            rule = table_rule(declaration(spec))
            derive = functools.partial(rule, factor=spec.factor) if rule is not None else None
            owner.wpe = PositionTable(original, derive, spec.method)
            undo.append(functools.partial(put_back, owner, "wpe", original))
            undo.append(_keep_n_ctx_in_step(model.config, spec))
            if declaration(spec).kind is Kind.BIAS:
                undo.append(use_attention(model))
        return functools.partial(run_all, undo)


    # -- fine-tuning: the patched table trains, saves, loads and bakes ------------------------------------------

    def lora_settings(self, model: nn.Module) -> dict[str, Any]:
        return {"fan_in_fan_out": True}  # GPT-2's Conv1D layers store their weights transposed

    def make_trainable(self, model: nn.Module, names: list[str]) -> list[str]:
        return make_tables_trainable(model, names, PositionTable)

    def after_lora(self, model: nn.Module) -> None:
        freeze_unused_weights(model, PositionTable)

    def bake_trained(self, model: nn.Module) -> bool:
        """Trained tables become plain embeddings of their size, that length is advertised and the patch record
        dropped: the saved model is an ordinary checkpoint with a longer table (re-applying the patch on load
        would interpolate the trained table a second time)."""
        from ..core.spec import CONFIG_KEY

        baked = False
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                table = child.current_table() if isinstance(child, PositionTable) else None
                if isinstance(table, torch.Tensor):
                    table = table.detach().clone()
                    emb = nn.Embedding(table.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
                    emb.weight.data.copy_(table)
                    setattr(parent, child_name, emb)
                    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
                        if attr in model.config.to_dict():
                            setattr(model.config, attr, table.shape[0])
                    baked = True
        if baked and hasattr(model.config, CONFIG_KEY):
            delattr(model.config, CONFIG_KEY)
        return baked

    def native_form(self, model: nn.Module, spec: PatchSpec, *, check_only: bool = False):
        return native_form(model, spec, check_only=check_only)

    def restore_exported(self, model: nn.Module, tensors: dict[str, torch.Tensor], spec: PatchSpec) -> None:
        restore_exported(model, tensors, spec, self.length_attr)


def _keep_n_ctx_in_step(config, spec: PatchSpec) -> Restore:
    """Older GPT-2 configs carry ``n_ctx`` = ``n_positions``; advertise the new length there too."""
    before = vars(config).get("n_ctx")
    if before is None or spec.patched_length is None or before != spec.original_length:
        return lambda: None
    config.n_ctx = spec.patched_length

    def restore():
        config.n_ctx = before

    return restore


# -- native export (ctxext.export) ---------------------------------------------------------------------------------


def native_form(model: nn.Module, spec: PatchSpec, *, check_only: bool = False):
    """The methods with a table (``pi`` / ``extrapolate``: ``positions.table_rule``) have an exact plain-GPT-2 form:
    ``wpe`` holding the method's table (``n_positions`` rows, the patched length, already advertised) for inputs up to
    that length. The original table is kept beside the weights so ``ctxext.from_pretrained`` can re-apply the patch
    and ``unpatch`` restore it."""
    from ..core.native_form import NativeForm, NoNativeForm

    owner = position_owner(model)
    wpe = getattr(owner, "wpe", None)
    has_table = table_rule(declaration(spec)) is not None
    if check_only and has_table:
        return NativeForm({}, summary=f"wpe resized to {spec.patched_length} rows ({spec.method})")
    if not has_table or not isinstance(wpe, PositionTable) or wpe.current_table() is None:
        raise NoNativeForm(
            f"method {spec.method!r} on GPT-2 (learned absolute) has no transformers-native form (a plain GPT-2 "
            "always adds a position table); only pi and extrapolate (a resized wpe) have one"
        )
    if wpe.table.shape[0] != spec.patched_length:
        raise NoNativeForm(f"the {spec.method} table has {wpe.table.shape[0]} rows, not the advertised "
                           f"{spec.patched_length}")
    prefix = next(name for name, module in model.named_modules() if module is owner)
    key = f"{prefix}.wpe.weight" if prefix else "wpe.weight"

    @contextlib.contextmanager
    def weights():
        table = wpe.current_table()
        plain = nn.Embedding(table.shape[0], wpe.embedding_dim, device="meta")
        plain.weight = nn.Parameter(table, requires_grad=False)
        owner.wpe = plain
        try:
            yield
        finally:
            owner.wpe = wpe

    return NativeForm({}, weights=weights, originals=lambda: {key: wpe.weight},
                      summary=f"wpe resized to {spec.patched_length} rows ({spec.method}), n_positions "
                              f"{spec.patched_length}")


def restore_exported(model: nn.Module, tensors: dict[str, torch.Tensor], spec: PatchSpec,
                     length_attr: str = "n_positions") -> None:
    """A GPT-2 exported natively and loaded as saved (``wpe`` = the patched table): the original table back (from
    ``tensors``, as :func:`native_form` saved it) and the original length in the config (``length_attr``)."""
    from ..core.errors import PatchError

    config = model.config
    owner = position_owner(model)
    if owner is None or len(tensors) != 1:
        raise PatchError("a natively exported GPT-2 checkpoint whose position table or saved original does not "
                         "match; load it with AutoModelForCausalLM.from_pretrained")
    (original,) = tensors.values()
    wpe = owner.wpe
    restored = nn.Embedding(original.shape[0], original.shape[1], device="meta")
    restored.weight = nn.Parameter(original.to(dtype=wpe.weight.dtype, device=wpe.weight.device),
                                   requires_grad=wpe.weight.requires_grad)
    restored.train(wpe.training)
    owner.wpe = restored
    patched = getattr(config, length_attr, None)
    setattr(config, length_attr, original.shape[0])
    if vars(config).get("n_ctx") == patched:
        config.n_ctx = original.shape[0]
