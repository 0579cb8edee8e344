"""A patched model gets its own config object.

transformers does not copy the config a model is built from: ``LlamaForCausalLM(cfg)`` twice gives two models whose
``.config`` (and every layer's ``.config``) is one object. A patch writes to the config (the advertised length, the
attention implementation, the ``ctxext`` record), so without a copy it would reach every model sharing it: an
unpatched sibling would run the patched attention or lose the record a later ``save_pretrained`` needs.
"""

from __future__ import annotations

import copy
from typing import Callable

from torch import nn

from .spec import transformers_config_class


def _pair(old, new, pairs: dict[int, tuple]) -> None:
    """old config object id -> (old, its copy), for the config and every config nested in it (``text_config``...)."""
    pairs[id(old)] = (old, new)
    base = transformers_config_class()
    for name, value in vars(old).items():
        twin = vars(new).get(name)
        if isinstance(value, base) and isinstance(twin, base) and id(value) not in pairs:
            _pair(value, twin, pairs)


def own_config(model: nn.Module) -> Callable[[], None]:
    """Give ``model`` and every submodule that holds its config (or a config nested in it) a private deep copy.
    Returns a function that puts the original objects back (for a patch that fails)."""
    old = model.config
    pairs: dict[int, tuple] = {}
    _pair(old, copy.deepcopy(old), pairs)
    swapped = [(module, name, value) for module in model.modules() for name, value in list(vars(module).items())
               if id(value) in pairs and value is pairs[id(value)][0]]
    for module, name, value in swapped:
        module.__dict__[name] = pairs[id(value)][1]

    def put_back() -> None:
        for module, name, value in swapped:
            module.__dict__[name] = value

    return put_back
