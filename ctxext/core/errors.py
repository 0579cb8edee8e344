"""Exceptions raised by ctxext."""


class PatchError(ValueError):
    """A patch request that cannot be applied: bad method, factor, option or model.

    Raised before the model is touched, so nothing is left half-patched.
    """
