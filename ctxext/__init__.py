"""ctxext: extend the context window of pretrained Hugging Face causal LMs, and measure the result.

    import ctxext
    ctxext.patch(model, method="yarn", factor=4)   # model now reads 4x longer inputs
    ctxext.unpatch(model)                          # bit-exact original
    ctxext.evaluate(model, tokenizer=tok, methods="none,yarn", lengths=[4096, 8192]).table()
"""

from .api import available_methods, describe, dynamic_length, patch, patched, unpatch
from .core.errors import PatchError
from .loading import from_pretrained
from .core.spec import PatchSpec
from .evaluation.evaluate import evaluate

from .version import __version__

__all__ = [
    "PatchError",
    "PatchSpec",
    "available_methods",
    "describe",
    "dynamic_length",
    "evaluate",
    "from_pretrained",
    "patch",
    "patched",
    "unpatch",
]
