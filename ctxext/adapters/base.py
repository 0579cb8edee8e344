"""What an architecture adapter provides. Adapters know where positional logic lives in one family."""

from __future__ import annotations

import copy
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from ..core.spec import PatchSpec
from ..core.undo import Restore, run_all, undone_on_failure  # noqa: F401  the adapters' undo lists
from ..methods.declaration import Kind, Method
from ..methods.registry import METHODS

#: Why a method is refused where the family states nothing about its kind.
NOT_IMPLEMENTED = "not implemented for this family"

#: What a wrapper installed in place of a model's method takes over from it (``functools.update_wrapper``; it also
#: gets ``__wrapped__``, which ``inspect.signature`` follows). Not the annotations: they may hold forward references,
#: which carry code objects that neither a pickle nor a deep copy of the model can take.
WRAPPED_NAMES = ("__module__", "__name__", "__qualname__", "__doc__")


class Adapter:
    """One positional family. Support is stated by method kind (``ctxext.methods.declaration.Kind``) and declaration
    attributes, never by method name, so a new method of a known kind needs no adapter change."""

    #: Short family key used in specs and the method table.
    family: str = ""
    #: Column title in the method table.
    title: str = ""
    #: Config attribute that advertises the context length (read by generate and lm-eval).
    length_attr: str | None = None
    #: Kind -> what a method of that kind does on this family (the table cell after "yes: "); absent: not supported.
    kinds: dict[Kind, str] = {}
    #: What a method that divides every position by the factor (``Method.interpolates``) does here, for families
    #: with no rotary frequencies to rescale (None: decided by its kind).
    interpolation: str | None = None
    #: Kind -> why methods of that kind do not apply (the table cell and the error message).
    refusals: dict[Kind, str] = {}
    #: Whether the native form is verified on the patched model itself (so an export check must patch first).
    native_form_needs_patch: bool = False
    #: Whether the family carries an attention temperature (``ctxext.methods.temperature``): the rotary family only.
    takes_temperature: bool = False

    def detect(self, model: nn.Module) -> bool:
        raise NotImplementedError

    def does(self, method: Method) -> str | None:
        """What ``method`` does on this family, in a few words, or None where it does not apply."""
        if method.interpolates and self.interpolation is not None:
            return self.interpolation
        return self.kinds.get(method.kind)

    def refusal(self, method: Method) -> str:
        """Why ``method`` does not apply to this family."""
        return self.refusals.get(method.kind, NOT_IMPLEMENTED)

    def support(self, method: str | Method) -> str:
        """The method-table cell: what ``method`` does on this family, or ``error: <why not>``."""
        declared = _declared(method)
        does = self.does(declared) if declared is not None else None
        return "error: " + self.reason(method) if does is None else "yes: " + does

    def reason(self, method: str | Method) -> str:
        """Why ``method`` does not apply to this family (used in the table and in the PatchError)."""
        declared = _declared(method)
        return NOT_IMPLEMENTED if declared is None else self.refusal(declared)

    def supports(self, method: str | Method) -> bool:
        declared = _declared(method)
        return declared is not None and self.does(declared) is not None

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
        """The transformers-native form of ``spec`` on ``model`` (``ctxext.core.native_form.NativeForm``), or raise
        ``NoNativeForm`` saying why there is none (the default: none). ``check_only``: ``model`` may be an unpatched
        skeleton; families that verify their form on the patched model (``native_form_needs_patch``) ignore it."""
        from ..core.native_form import NoNativeForm, no_form_reason

        raise NoNativeForm(no_form_reason(spec.method, self.title))

    def restore_exported(self, model: nn.Module, tensors: dict[str, Any], spec: PatchSpec) -> None:
        """A natively exported checkpoint whose weights the native form replaced, loaded as saved: put the original
        tensors (saved beside the weights) back and the original length in the config."""
        from ..core.errors import PatchError

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


def _declared(method: str | Method) -> Method | None:
    """The declaration of ``method`` (a name looked up in the registry at call time, so a method registered later
    counts), or None for a name nobody declared."""
    return method if isinstance(method, Method) else METHODS.get(method)


def declaration(spec: PatchSpec) -> Method:
    """The declaration of the method ``spec`` applies."""
    return METHODS[spec.method]


def acquire_module_function(modeling, attr: str, make: Callable, registry: dict) -> Restore:
    """Install ``make(original)`` in place of ``modeling.<attr>`` (one per module, shared by every patched model that
    uses it, counted in ``registry``); returns this user's release, which puts the original back after the last.

    ``make`` returns the dispatcher: a callable with ``original`` (the function it replaces) and a ``users`` count."""
    name = modeling.__name__
    dispatcher = registry.get(name)
    if dispatcher is None or getattr(modeling, attr) is not dispatcher:
        dispatcher = make(getattr(modeling, attr))
        setattr(modeling, attr, dispatcher)
        registry[name] = dispatcher
    return ModuleFunctionUser(modeling, attr, dispatcher, registry)


class ModuleFunctionUser:
    """One user of a module-level function replaced by a shared dispatcher (``acquire_module_function``); calling it
    releases that use (once; later calls do nothing), and the last release puts the original function back.

    The dispatcher and its registry are process-wide state: a deep copy of a user (made when a patched model is deep
    copied) is one more user of the same dispatcher, never a second dispatcher, so unpatching one model leaves the
    dispatcher the other still needs."""

    def __init__(self, modeling, attr: str, dispatcher, registry: dict):
        self.modeling = modeling
        self.attr = attr
        self.dispatcher = dispatcher
        self.registry = registry
        self.released = False
        dispatcher.users += 1

    def __call__(self) -> None:
        if self.released:
            return
        self.released = True
        dispatcher = self.dispatcher
        dispatcher.users -= 1
        if dispatcher.users == 0:
            if getattr(self.modeling, self.attr) is dispatcher:
                setattr(self.modeling, self.attr, dispatcher.original)
            name = self.modeling.__name__
            if self.registry.get(name) is dispatcher:
                del self.registry[name]

    def _another(self) -> ModuleFunctionUser:
        if self.released:  # a copy of a released user holds nothing either
            other = object.__new__(type(self))
            other.__dict__.update(self.__dict__)
            return other
        return type(self)(self.modeling, self.attr, self.dispatcher, self.registry)

    def __copy__(self) -> ModuleFunctionUser:
        return self._another()

    def __deepcopy__(self, memo: dict) -> ModuleFunctionUser:
        other = self._another()
        memo[id(self)] = other
        return other

    def __reduce_ex__(self, protocol):  # process-wide state, held by a live patch: a pickle cannot carry it
        from ..core.active import pickle_refusal

        raise pickle_refusal()


# -- deep copies of undo steps -----------------------------------------------------------------------------------


def copy_restore(step: Any, memo: dict) -> Any:
    """A deep copy of an undo step (``Restore``), or of a tree of them, made through ``memo``: the memo of the deep
    copy of the patched model (``copy.deepcopy(model)``), so that every model object the step acts on (modules,
    tensors, configs) is the copy's, as the rest of that deep copy sees it.

    ``copy.deepcopy`` treats functions as atomic, so a copied closure would still undo the original model. Here
    closures are rebuilt with copied cells (a cell shared by two closures stays shared; a function is in the memo
    before its cells are filled, so a closure that refers to itself works), and ``functools.partial``, bound methods
    (rebound to the copy of ``__self__``), ``weakref.finalize`` (a new finalizer on the copy of its object) and
    lists, tuples, dicts and sets of them are copied through here. Python modules, classes, module-level functions
    and builtins bound to a module are returned as they are; everything else goes to ``copy.deepcopy(x, memo)``
    (process-wide state says by ``__deepcopy__`` how it is copied: ``ModuleFunctionUser``)."""
    if step is None or isinstance(step, (str, bytes, int, float, complex, bool, types.ModuleType, type)):
        return step
    key = id(step)
    if key in memo:
        return memo[key]
    if isinstance(step, types.FunctionType):
        return _copy_function(step, memo)
    kind = type(step)
    if kind is list:
        new: Any = []
        _remember(step, new, memo)
        new.extend(copy_restore(item, memo) for item in step)
        return new
    if kind is dict:
        new = {}
        _remember(step, new, memo)
        for k, v in step.items():
            new[copy_restore(k, memo)] = copy_restore(v, memo)
        return new
    if kind in (tuple, set, frozenset):
        items = [copy_restore(item, memo) for item in step]
        if key in memo:  # reached again through its own items
            return memo[key]
        new = kind(items)
    elif isinstance(step, functools.partial):
        new = kind(copy_restore(step.func, memo), *copy_restore(step.args, memo),
                   **copy_restore(step.keywords, memo))
        if getattr(step, "__dict__", None):
            new.__dict__.update(copy_restore(step.__dict__, memo))
    elif isinstance(step, types.MethodType):
        new = types.MethodType(copy_restore(step.__func__, memo), copy_restore(step.__self__, memo))
    elif isinstance(step, (types.BuiltinFunctionType, types.MethodWrapperType)):
        owner = getattr(step, "__self__", None)
        if owner is None or isinstance(owner, (types.ModuleType, type)):
            return step
        new = getattr(copy_restore(owner, memo), step.__name__)  # a builtin method of an object: rebound
    elif isinstance(step, weakref.finalize):
        info = step.peek()
        if info is None:  # already called or detached: calling it does nothing, nor will the copy
            return step
        target, func, args, kwargs = info
        new = weakref.finalize(copy_restore(target, memo), copy_restore(func, memo), *copy_restore(args, memo),
                               **copy_restore(kwargs or {}, memo))
        new.atexit = step.atexit
    else:
        return copy.deepcopy(step, memo)
    _remember(step, new, memo)
    return new


def _remember(original: Any, new: Any, memo: dict) -> None:
    """Record a copy in ``memo`` and keep the original alive while the memo is (as ``copy.deepcopy`` does: an id
    must not be reused by another object during the copy)."""
    memo[id(original)] = new
    memo.setdefault(id(memo), []).append(original)


def _copy_function(function: types.FunctionType, memo: dict) -> types.FunctionType:
    closure = function.__closure__ or ()
    if not closure and "<locals>" not in function.__qualname__:
        return function  # a module-level function: shared, like a module
    cells, pending = [], []
    for cell in closure:
        if id(cell) in memo:
            cells.append(memo[id(cell)])
            continue
        new_cell = types.CellType()
        _remember(cell, new_cell, memo)
        cells.append(new_cell)
        pending.append((cell, new_cell))
    new = types.FunctionType(function.__code__, function.__globals__, function.__name__, None, tuple(cells) or None)
    _remember(function, new, memo)
    new.__qualname__ = function.__qualname__
    new.__module__ = function.__module__
    new.__doc__ = function.__doc__
    new.__defaults__ = copy_restore(function.__defaults__, memo)
    new.__kwdefaults__ = copy_restore(function.__kwdefaults__, memo)
    new.__dict__.update(copy_restore(function.__dict__, memo))
    for cell, new_cell in pending:
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name not bound yet)
            continue
        new_cell.cell_contents = copy_restore(contents, memo)
    return new
