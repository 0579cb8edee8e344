"""ctxext: extend the context window of pretrained Hugging Face causal LMs, and measure the result.

    import ctxext
    ctxext.patch(model, method="yarn", factor=4)   # model now reads 4x longer inputs
    ctxext.unpatch(model)                          # bit-exact original
"""

from .api import available_methods, describe, dynamic_length, patch, patched, unpatch
from .core.errors import PatchError
from .loading import from_pretrained
from .core.spec import PatchSpec

__version__ = "0.1.0.dev0"

__all__ = [
    "PatchError",
    "PatchSpec",
    "available_methods",
    "describe",
    "dynamic_length",
    "from_pretrained",
    "patch",
    "patched",
    "unpatch",
]
