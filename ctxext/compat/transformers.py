"""Private reaches into transformers: the attention-implementation switch, the module-level ALiBi builders that
the ALiBi adapters replace, and transformers' own sdpa attention function.

"Checked on" names the releases of the CI matrix (``.ci/matrix``, results in ``.ci/supported_versions.json``):
4.56.2, 4.57.6, 5.0.0, 5.12.1 and 5.23.0, each passing the test suite that exercises every reach here; the
definitions were also read in the sources of 4.57.6, 5.0.0 and 5.23.0. transformers is imported lazily, where the
call sites imported it lazily before.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

# -- the attention implementation ---------------------------------------------------------------------------------
# A registered attention function (ALiBi, remap) is selected by the config's attention implementation. The public
# ``PreTrainedModel.set_attn_implementation`` switches a model, but there is no public getter, no public way to
# write a config before the model is built, and no public way to put back the raw stored value (None when the
# default was never resolved) exactly as it was.


def attn_implementation(config) -> str | None:
    """The attention implementation ``config`` selects (``config._attn_implementation``, a property; checked on
    4.56.2 - 5.23.0)."""
    return config._attn_implementation


def set_attn_implementation(config, name: str) -> None:
    """Make ``config`` select attention ``name`` before a model is built from it (the property's setter; checked on
    4.56.2 - 5.23.0)."""
    config._attn_implementation = name


def stored_attn_implementation(config):
    """The raw value behind the property (``config._attn_implementation_internal``; None or a name, a dict in some
    composite configs), read so that an undo restores it exactly rather than a resolved default. Checked on
    4.56.2 - 5.23.0."""
    return config._attn_implementation_internal


def restore_attn_implementation(config, value) -> None:
    """Put back a value read by :func:`stored_attn_implementation` (checked on 4.56.2 - 5.23.0)."""
    config._attn_implementation_internal = value


def can_set_attn_implementation(model) -> bool | None:
    """Whether ``model`` dispatches its attention through ``AttentionInterface`` (the classmethod
    ``_can_set_attn_implementation``, which ``set_attn_implementation`` itself consults); None when ``model`` is not a
    transformers model with a settable attention implementation. Checked on 4.56.2 - 5.23.0."""
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is None or not callable(getattr(model, "set_attn_implementation", None)):
        return None
    return bool(can_set())


def sdpa_attention() -> Callable:
    """transformers' own sdpa attention function (``transformers.integrations.sdpa_attention.
    sdpa_attention_forward``), which the ctxext attention functions hand plain causal or cross attention to, so it
    runs exactly as the unpatched model would. Looked up at every call, not bound once: a test (or a user) that
    replaces the module attribute is followed. Checked on 4.56.2 - 5.23.0."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def model_attention_function(module, name: str) -> Callable | None:
    """The attention function ``module`` (an attention layer) calls when its config selects ``name``, looked up as its
    own modeling module looks it up: ``eager_attention_forward`` of that module for ``"eager"`` (each family has its
    own), its ``ALL_ATTENTION_FUNCTIONS[name]`` otherwise (the global interface, or a family's own instance). A
    function that stands in for another only while training (``ctxext.attention.shifted_sparse``) hands every other
    call to this, so those run exactly as before. None where the modeling module lacks the name or the entry.
    Checked on 4.56.2, 4.57.6, 5.0.0 and 5.23.0 (Llama: tests/test_compat.py, tests/test_shift_attention.py); 5.12.1
    not run."""
    import sys

    modeling = sys.modules.get(type(module).__module__)
    if name == "eager":
        function = getattr(modeling, "eager_attention_forward", None)
    else:
        interface = getattr(modeling, "ALL_ATTENTION_FUNCTIONS", None)
        try:
            function = interface[name] if interface is not None else None
        except KeyError:
            function = None
    return function if callable(function) else None


# -- ALiBi builders -----------------------------------------------------------------------------------------------
# ALiBi models compute their biases in functions that the ALiBi adapters replace (principle 1: the model's own
# attention path is untouched). The names are the transformers modeling modules'; the adapters pass them to
# ``ctxext.adapters.base.acquire_module_function`` or wrap the method on one model instance.

#: BLOOM's module-level slope function in ``transformers.models.bloom.modeling_bloom``, called on every path.
#: Present in 5.23.0; absent in 4.57.6, 5.0.0, 5.12.1, 5.17.0 and 5.18.0 (read in their sources), where
#: ``ALIBI_TENSOR_BUILDER`` on the model instance is the hook point instead.
BLOOM_SLOPE_FUNCTION = "_get_alibi_slopes"

#: The ALiBi tensor builder: a method of ``BloomModel`` and a module-level function of
#: ``transformers.models.falcon.modeling_falcon`` (called by its global name). Checked on 4.56.2 - 5.23.0.
ALIBI_TENSOR_BUILDER = "build_alibi_tensor"

#: MPT's ALiBi tensor builder, a method of ``MptModel``. Checked on 4.56.2 - 5.23.0.
MPT_ALIBI_TENSOR_BUILDER = "build_mpt_alibi_tensor"


def bloom_slope_function(modeling) -> Callable | None:
    """``modeling``'s module-level BLOOM slope function, or None where this release has none."""
    function = getattr(modeling, BLOOM_SLOPE_FUNCTION, None)
    return function if callable(function) else None


def alibi_tensor_builder(owner) -> Callable | None:
    """``owner``'s ALiBi tensor builder (a ``BloomModel``'s method, or Falcon's modeling module's function), or
    None."""
    builder = getattr(owner, ALIBI_TENSOR_BUILDER, None)
    return builder if callable(builder) else None


def mpt_alibi_tensor_builder(owner) -> Callable | None:
    """``owner``'s MPT ALiBi tensor builder method, or None."""
    builder = getattr(owner, MPT_ALIBI_TENSOR_BUILDER, None)
    return builder if callable(builder) else None


def wrap_instance_builder(owner, name: str, make: Callable) -> Callable[[], None]:
    """Replace ``owner.<name>`` (one of the builder methods above) on this instance only by ``make(original)``;
    returns the undo, which puts back what the instance held (or lets the class's method show through again)."""
    from ..core.undo import set_on_instance

    return set_on_instance(owner, name, make(getattr(owner, name)))


__all__ = [
    "ALIBI_TENSOR_BUILDER",
    "BLOOM_SLOPE_FUNCTION",
    "MPT_ALIBI_TENSOR_BUILDER",
    "alibi_tensor_builder",
    "attn_implementation",
    "bloom_slope_function",
    "can_set_attn_implementation",
    "model_attention_function",
    "mpt_alibi_tensor_builder",
    "peft_wrap_quietly",
    "restore_attn_implementation",
    "sdpa_attention",
    "set_attn_implementation",
    "stored_attn_implementation",
    "wrap_instance_builder",
]


@contextlib.contextmanager
def peft_wrap_quietly():
    """peft's ``get_peft_model`` reads transformers' deprecated ``model.is_gradient_checkpointing`` (peft <= 0.21 with
    transformers >= 5), a FutureWarning on every fine-tune that neither ctxext nor the user can act on. Only that
    warning, only while ctxext wraps the model; the user's own warnings and every other one are left as they are."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`?is_gradient_checkpointing`? is deprecated",
                                category=FutureWarning)
        yield
