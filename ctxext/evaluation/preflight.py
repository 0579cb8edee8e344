"""Checks that need the model's structure but not its weights, run before anything loads.

A skeleton is the model built from its config with the parameters on the meta device and the buffers real
(``accelerate.init_empty_weights(include_buffers=False)``): it costs no memory for the weights, yet it has the
rotary ``inv_freq`` buffers, the position tables' shapes and the config that the adapters inspect, so
``build_spec`` can say whether a patch fits the model exactly as it will after loading.
"""

from __future__ import annotations

from typing import Any

from ..errors import PatchError
from .requests import NONE, MethodRequest, check_request


def model_skeleton(model_id: str, *, gguf_file: str | None = None, **config_kwargs: Any):
    """The model ``model_id`` without weights, with a saved ctxext patch taken off (as loading does before it
    re-applies it). Raises OSError / ValueError where the config itself cannot be read."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..api import take_saved_spec

    if gguf_file:
        config_kwargs["gguf_file"] = gguf_file
    try:
        config = AutoConfig.from_pretrained(model_id, **config_kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OSError(f"cannot read the config of {model_id!r}: {first}") from exc
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    take_saved_spec(model)
    return model


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
