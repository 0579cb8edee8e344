"""What an architecture adapter provides. Adapters know where positional logic lives in one family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..spec import PatchSpec

Restore = Callable[[], None]


class Adapter:
    #: Short family key used in specs and the method table.
    family: str = ""
    #: Column title in the method table.
    title: str = ""
    #: Config attribute that advertises the context length (read by generate and lm-eval).
    length_attr: str | None = None
    #: method -> what it does on this family (the table cell).
    methods: dict[str, str] = {}
    #: method -> why it does not apply (the table cell and the error message).
    unsupported: dict[str, str] = {}

    def detect(self, model: nn.Module) -> bool:
        raise NotImplementedError

    def support(self, method: str) -> str:
        """The method-table cell: what ``method`` does on this family, or ``error: <why not>``."""
        if method in self.methods:
            return self.methods[method]
        return "error: " + self.reason(method)

    def reason(self, method: str) -> str:
        """Why ``method`` does not apply to this family (used in the table and in the PatchError)."""
        return self.unsupported.get(method, "not implemented for this family")

    def supports(self, method: str) -> bool:
        return method in self.methods

    def original_length(self, model: nn.Module) -> int | None:
        return getattr(model.config, self.length_attr, None) if self.length_attr else None

    def check(self, model: nn.Module, spec: PatchSpec) -> None:
        """Raise PatchError if ``spec`` cannot be applied; must not modify the model."""

    def apply(self, model: nn.Module, spec: PatchSpec) -> Restore:
        """Apply ``spec`` and return a function that undoes it exactly.

        If applying fails midway, the adapter undoes what it did before re-raising.
        """
        raise NotImplementedError

    def plan_length(self, model: nn.Module, length: int) -> Restore | None:
        """Tell a patch whose positions depend on the sequence length (dynamic-NTK) the total length a cached
        decode will reach; returns how to forget it, or None where the active patch has no such dependence."""
        return None

    # -- what fine-tuning and evaluation ask of a family; the defaults: nothing family-specific -----------------

    def lora_settings(self, model: nn.Module) -> dict[str, Any]:
        """peft ``LoraConfig`` fields this family's layers need (e.g. GPT-2's transposed Conv1D weights)."""
        return {}

    def make_trainable(self, model: nn.Module, names: list[str]) -> list[str]:
        """Before peft wraps ``model`` (training, or loading an adapter): make the patched modules named in
        ``names`` (peft's ``modules_to_save``) hold their values as parameters peft can train and save. Returns the
        converted module names."""
        return []

    def after_lora(self, model: nn.Module) -> None:
        """After peft wrapped ``model`` for training: freeze what the forward pass no longer uses."""

    def bake_trained(self, model: nn.Module) -> bool:
        """In a merged (LoRA folded in) model: turn trained patched modules into the model's own, so the saved
        checkpoint needs no patch. Returns whether anything was baked."""
        return False

    def native_form(self, model: nn.Module, spec: PatchSpec, *, check_only: bool = False):
        """The transformers-native form of ``spec`` on ``model`` (``ctxext.native_form.NativeForm``), or raise
        ``NoNativeForm`` saying why there is none (the default: none). Rotary models are verified in
        ``ctxext.export``."""
        from ..native_form import NoNativeForm, no_form_reason

        raise NoNativeForm(no_form_reason(spec.method, self.title))

    def restore_exported(self, model: nn.Module, tensors: dict[str, Any], spec: PatchSpec) -> None:
        """A natively exported checkpoint whose weights the native form replaced, loaded as saved: put the original
        tensors (saved beside the weights) back and the original length in the config."""
        from ..errors import PatchError

        raise PatchError(f"{self.title} has no natively exported weights to restore")

    def position_limit(self, model: nn.Module) -> int | None:
        """How many positions the model can take at all, or None if unbounded. The default finds a learned
        absolute table by its usual names (``wpe``, ``embed_positions``, ``position_embeddings``; OPT-style tables
        carry an ``offset`` of rows that are not positions), which also covers models no adapter claims."""
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Embedding) and leaf in ("wpe", "embed_positions", "position_embeddings"):
                return module.num_embeddings - int(getattr(module, "offset", 0))
        return None


def run_all(undo: list[Restore]) -> None:
    """Run undo steps in reverse order."""
    for step in reversed(undo):
        step()


def acquire_module_function(modeling, attr: str, make: Callable, registry: dict) -> Restore:
    """Install ``make(original)`` in place of ``modeling.<attr>`` (one per module, shared by every patched model that
    uses it, counted in ``registry``); returns this user's release, which puts the original back after the last."""
    name = modeling.__name__
    dispatcher = registry.get(name)
    if dispatcher is None or getattr(modeling, attr) is not dispatcher:
        dispatcher = make(getattr(modeling, attr))
        setattr(modeling, attr, dispatcher)
        registry[name] = dispatcher
    dispatcher.users += 1
    released = []

    def release():
        if released:
            return
        released.append(True)
        dispatcher.users -= 1
        if dispatcher.users == 0:
            if getattr(modeling, attr) is dispatcher:
                setattr(modeling, attr, dispatcher.original)
            if registry.get(name) is dispatcher:
                del registry[name]

    return release
