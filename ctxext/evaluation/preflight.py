"""Checks that need the model's structure but not its weights, run before anything loads.

They run on :func:`ctxext.loading.model_skeleton` (the model with its buffers but no weights), so ``build_spec``
says whether a patch fits the model exactly as it will after loading.
"""

from __future__ import annotations

from ..core.errors import PatchError
from .requests import NONE, MethodRequest, check_request


def unfit_requests(skeleton, requests: list[MethodRequest], *, default_factor: float | None) -> list[str]:
    """One message per request that cannot be applied to the model (``default_factor`` stands in for requests
    whose factor the evaluator derives from the lengths)."""
    problems = []
    for req in requests:
        if req.method == NONE:
            continue
        if req.factor is None and default_factor is not None:
            req = MethodRequest(req.method, default_factor, req.options)
        try:
            check_request(skeleton, req)
        except PatchError as exc:
            problems.append(str(exc))
    return problems
