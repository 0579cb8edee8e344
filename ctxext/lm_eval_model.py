"""The old import path of :mod:`ctxext.integrations.lm_eval`, kept for scripts that register lm-eval's ``ctxext``
model type with ``import ctxext.lm_eval_model`` (the README's spelling until the package was arranged in rooms, issue 26)."""

import warnings

from .integrations.lm_eval import *  # noqa: F401,F403  registers --model ctxext
from .integrations.lm_eval import CtxextLM, check_model_args, check_model_args_items  # noqa: F401

warnings.warn(
    "ctxext.lm_eval_model moved to ctxext.integrations.lm_eval; import that instead",
    DeprecationWarning,
    stacklevel=2,
)
