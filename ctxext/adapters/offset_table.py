"""OPT-style adapter: learned absolute positions in an ``embed_positions`` table that computes its own position ids.

OPT, BioGPT and the BART-family decoders (BART, mBART, PLBart, MVP, Blenderbot as ``...ForCausalLM``) keep their
positions in an ``nn.Embedding`` subclass called ``embed_positions``. Its ``forward`` works out the position ids
(from the attention mask or the cache length, in a signature that differs per model and per transformers release)
and looks them up at ``position + offset`` (OPT-style tables carry ``offset`` = 2 leading rows that are not
positions). ``config.max_position_embeddings`` = rows - offset is the advertised length.

While patched, each table is replaced by an ``OffsetTable`` that shares the original ``weight`` parameter (the state
dict is unchanged) and runs the *original module's own forward* with its weight swapped for the method's table
(``torch.func.functional_call``), so the position-id logic of whatever release is installed is reused, never copied:

- ``pi``: the position rows interpolated to ``round(factor * n)`` rows (``ctxext.methods.positions``);
- ``extrapolate``: extended to that many rows by repeating the last row;
- ``nope`` and ``alibi``: one zero row seen at every position (a stride-0 view, so any length runs and nothing
  is allocated); ``alibi`` also switches the attention to ``ctxext_alibi``.

The ``offset`` rows are kept in front of the ``pi`` / ``extrapolate`` tables. Positions past their end raise
IndexError, as in the unpatched model past its length; ``position_limit`` reports the patched limit to the
evaluator.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..attention import require_attention, use_attention
from ..core.spec import PatchSpec
from ..methods.declaration import Kind
from ..methods.positions import table_rule
from .base import Adapter, Restore, declaration, run_all, undone_on_failure
from .stand_in_table import StandInTable, put_back
from .trainable_table import freeze_unused_weights, make_tables_trainable

NAME = "embed_positions"
#: rows a zero table claims to have (a stride-0 view of one row): longer than any input
UNBOUNDED = 2**40


class OffsetTable(StandInTable):
    """Stands in for a patched ``embed_positions``: same ``weight`` parameter, the original forward run on the
    method's table."""

    def __init__(self, original: nn.Embedding, derive, method: str, zeros: bool):
        super().__init__(original, derive, method)
        self.zeros = zeros  # one zero row seen at every position (the method keeps no table)
        self.offset = int(getattr(original, "offset", 0))
        self.__dict__["original"] = original  # not a submodule: no second copy of the weight in the state dict

    @property
    def num_embeddings(self) -> int:
        return UNBOUNDED if self.zeros else self.table.shape[0]

    def forward(self, *args, **kwargs):
        table = self.current_table()
        table = table.expand(UNBOUNDED, -1) if self.zeros else table
        return torch.func.functional_call(self.original, {"weight": table}, args, kwargs)

    def extra_repr(self) -> str:
        if self.zeros:
            return f"method={self.method}, zero at every position"
        return f"method={self.method}, positions={self.table.shape[0] - self.offset}, offset={self.offset}"


def _sinusoidal(weight: torch.Tensor, offset: int) -> bool:
    """A fixed sinusoidal table (Marian, Pegasus) has sin(0) = 0 / cos(0) = 1 in its position-0 row; a learned
    table never does. Such tables are not claimed (interpolating their rows is not PI of a sinusoid)."""
    if weight.device.type == "meta" or weight.shape[0] <= offset:
        return False
    row = weight[offset].detach()
    return bool(((row == 0) | (row == 1)).all())


def tables(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(owner, table) for every ``embed_positions`` learned table sized by ``config.max_position_embeddings``."""
    length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    found = []
    for owner in model.modules():
        table = owner._modules.get(NAME)
        if isinstance(table, OffsetTable):
            found.append((owner, table))
        elif (isinstance(table, nn.Embedding) and isinstance(length, int)
              and table.num_embeddings - int(getattr(table, "offset", 0)) == length
              and not _sinusoidal(table.weight, int(getattr(table, "offset", 0)))):
            found.append((owner, table))
    return found


def _method_table(weight: torch.Tensor, offset: int, spec: PatchSpec) -> torch.Tensor:
    rule = table_rule(declaration(spec))
    if rule is None:  # nope / alibi: one zero row, seen at every position
        return weight.new_zeros(1, weight.shape[1])
    rows = rule(weight[offset:], spec.factor or 1)
    return torch.cat([weight[:offset], rows]).clone()


class OffsetTableAdapter(Adapter):
    family = "offset-table"
    title = "OPT-style (learned absolute, embed_positions)"
    length_attr = "max_position_embeddings"
    interpolation = "embed_positions interpolated to f x rows"
    kinds = {Kind.LENGTH: "embed_positions extended (last row repeated)",
             Kind.BIAS: "embed_positions zeroed + ALiBi bias", Kind.NONE: "embed_positions zeroed"}
    refusals = {Kind.FREQUENCY: "not rotary", Kind.REMAP: "not rotary"}

    def detect(self, model: nn.Module) -> bool:
        return bool(tables(model))

    def check(self, model: nn.Module, spec: PatchSpec) -> None:
        if declaration(spec).kind is Kind.BIAS:
            require_attention(model)

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        with undone_on_failure() as undo:
            zeros = table_rule(declaration(spec)) is None
            for owner, original in tables(model):
                derive = functools.partial(_method_table, offset=int(getattr(original, "offset", 0)), spec=spec)
                setattr(owner, NAME, OffsetTable(original, derive, spec.method, zeros))
                undo.append(functools.partial(put_back, owner, NAME, original))
            if declaration(spec).kind is Kind.BIAS:
                undo.append(use_attention(model))
        return functools.partial(run_all, undo)

    def position_limit(self, model: nn.Module) -> int | None:
        limits = [t.num_embeddings - int(getattr(t, "offset", 0)) for _, t in tables(model)
                  if not getattr(t, "zeros", False)]
        return min(limits) if limits else None

    # -- fine-tuning: the patched table trains, saves, loads and bakes ------------------------------------------

    def make_trainable(self, model: nn.Module, names: list[str]) -> list[str]:
        return make_tables_trainable(model, names, OffsetTable)

    def after_lora(self, model: nn.Module) -> None:
        freeze_unused_weights(model, OffsetTable)

    def bake_trained(self, model: nn.Module) -> bool:
        """Trained tables become the model's own (the original module, its weight = the trained table), the
        patched length is advertised and the patch record dropped: an ordinary checkpoint with a longer table."""
        from ..core.spec import CONFIG_KEY

        baked = False
        for owner, table in tables(model):
            if isinstance(table, OffsetTable) and isinstance(table.table, nn.Parameter):
                module = table.original
                module.weight = nn.Parameter(table.table.detach().clone(), requires_grad=False)
                module.num_embeddings = module.weight.shape[0]
                setattr(owner, NAME, module)
                model.config.max_position_embeddings = module.num_embeddings - table.offset
                baked = True
        if baked and hasattr(model.config, CONFIG_KEY):
            delattr(model.config, CONFIG_KEY)
        return baked

    # -- native export: a resized table is a plain checkpoint ------------------------------------------------------

    def native_form(self, model: nn.Module, spec: PatchSpec, *, check_only: bool = False):
        """``pi`` / ``extrapolate``: ``embed_positions`` saved as the method's table (offset rows first) with
        ``max_position_embeddings`` the patched length: what the model class builds from that config. The original
        tables are kept beside the weights so ``ctxext.from_pretrained`` can re-apply the patch."""
        from ..core.native_form import NativeForm, NoNativeForm

        summary = f"embed_positions resized to {spec.patched_length} positions ({spec.method})"
        has_table = table_rule(declaration(spec)) is not None
        if check_only and has_table:
            return NativeForm({}, summary=summary)
        found = [(o, t) for o, t in tables(model) if isinstance(t, OffsetTable)]
        if not has_table or not found:
            raise NoNativeForm(
                f"method {spec.method!r} on {self.title} has no transformers-native form (the model always adds "
                "its position table); only pi and extrapolate (a resized table) have one"
            )
        names = {module: name for name, module in model.named_modules()}
        keys = {f"{names[o]}.{NAME}.weight".lstrip("."): t for o, t in found}

        @contextlib.contextmanager
        def weights():
            for owner, patched in found:
                table = patched.current_table()
                plain = nn.Embedding(table.shape[0], patched.embedding_dim, device="meta")
                plain.weight = nn.Parameter(table, requires_grad=False)
                setattr(owner, NAME, plain)
            try:
                yield
            finally:
                for owner, patched in found:
                    setattr(owner, NAME, patched)

        return NativeForm({}, weights=weights, originals=lambda: {k: t.weight for k, t in keys.items()},
                          summary=summary + f", max_position_embeddings {spec.patched_length}")

    def restore_exported(self, model: nn.Module, tensors: dict[str, torch.Tensor], spec: PatchSpec) -> None:
        """A natively exported model loaded as saved (tables = the patched ones): the original tables back from
        ``tensors`` and the original length in the config."""
        from ..core.errors import PatchError

        names = {module: name for name, module in model.named_modules()}
        found = tables(model)
        keys = {f"{names[o]}.{NAME}.weight".lstrip("."): (o, t) for o, t in found}
        if not found or set(keys) != set(tensors):
            raise PatchError("a natively exported checkpoint whose position tables or saved originals do not "
                             "match; load it with AutoModelForCausalLM.from_pretrained")
        for key, (owner, table) in keys.items():
            original = tensors[key].to(dtype=table.weight.dtype, device=table.weight.device)
            table.weight = nn.Parameter(original, requires_grad=table.weight.requires_grad)
            table.num_embeddings = original.shape[0]
        model.config.max_position_embeddings = spec.original_length
