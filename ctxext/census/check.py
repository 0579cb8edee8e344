"""The census's checks: one tiny model patched with one method, and every model with every method.

For each model and each registered method, the census patches a fresh copy of the model and reports one of:

- ``ok``: every check that applies passed:
  - ``identity``: factor 1 gives the unpatched logits (within the original length; not for ``alibi`` / ``nope``,
    which replace the positional encoding, nor ``string``, which acts inside the original length by design);
  - ``parity``: logits equal those of the same weights configured with transformers' own rope type, where the
    model honours that rope type (``ctxext.census.parity``);
  - ``cache``: greedy cached decoding (prefill, then one token at a time) equals the full forward pass, where the
    unpatched model's does;
  - ``changed``: the patch changes the logits past the original length (or makes the model run where it did not);
    ``extrapolate`` is the exception: positions unchanged, so logits equal the unpatched model's wherever that runs,
    and only the advertised length grows;
  - ``unpatch``: ``unpatch`` restores the unpatched logits bit for bit;
- ``refused: <reason>``: ``patch`` raised ``PatchError`` and left the model untouched (config unchanged);
- ``FAILED: <what>``: anything else, including a patch that changed nothing, a traceback, or a refusal that had
  already touched the model.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import time
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import PatchError
from .build import DECODE, FACTOR, L0, SEQ, build_tiny, causal_lm_entries
from .parity import ROPE_PARITY, honours_rope_type, rope_reference, split_dynamic_scales

#: Models whose unpatched full forward pass takes longer than this (seconds) are not walked unless asked: their
#: tiny forms run slow pure-PyTorch fallbacks of fused kernels (Mamba scans), and each method runs about ten passes.
SLOW_FORWARD = 0.3
#: Tolerances, relative to the largest unpatched logit: parity and identity; cached decoding (other
#: kernels, same math); a patch "changes" the logits when they move by more than CHANGED (float noise: a patch that
#: does nothing moves them by 0 or ~1e-7; the tiny random models' logits react weakly to positions).
EXACT = 1e-5
CACHED = 1e-4
CHANGED = 1e-5

#: Methods checked at another factor: STRING overwrites positions it reaches only up to about twice the original
#: length (it refuses longer targets).
METHOD_FACTOR = {"string": 1.5}
#: Methods that are not the identity at factor 1 by design.
NOT_IDENTITY_AT_ONE = {"alibi", "nope", "string"}


@dataclass
class Row:
    """One cell of the census: a model patched with a method (or a model skipped, ``method`` ``*``)."""

    model: str  # model type, with a variant suffix ("falcon+alibi")
    cls: str
    method: str
    status: str  # "ok", "refused", "FAILED", "skipped"
    reason: str = ""
    checks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def cell(self) -> str:
        if self.status == "ok":
            return "ok"
        return f"{self.status}: {self.reason}"


def _short(exc: BaseException, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def _quiet():
    """Silence transformers' warnings and logs while building and running the tiny models."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            with contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        logging.disable(logging.NOTSET)
        hf_logging.set_verbosity(level)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def _cached_logits(model, ids: torch.Tensor, decode: int) -> torch.Tensor:
    """Logits at the last ``decode`` positions: prefill the tokens before them, then feed them one at a time with
    the cache."""
    with torch.no_grad():
        prefix = ids[:, :-decode]
        out = model(input_ids=prefix, use_cache=True)
        past = out.past_key_values
        if past is None:
            raise RuntimeError("the model returned no cache")
        logits = []
        for i in range(ids.shape[1] - decode, ids.shape[1]):
            step = ids[:, i : i + 1]
            position = torch.tensor([[i]])
            out = model(
                input_ids=step,
                past_key_values=past,
                use_cache=True,
                position_ids=position,
                cache_position=torch.tensor([i]),
            )
            past = out.past_key_values
            logits.append(out.logits.float())
        return torch.cat(logits, dim=1)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _config_state(model) -> str:
    from ..attention.features import _configs

    return repr([sorted((k, repr(v)) for k, v in vars(c).items()) for c in _configs(model)])


class _Model:
    """One tiny model and its unpatched reference outputs."""

    def __init__(self, name: str, model_type: str, overrides: dict[str, Any], slow_ok: bool = True):
        self.name = name
        self.model_type = model_type
        self.model = build_tiny(model_type, overrides)
        self.cls = type(self.model).__name__
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, 128, (1, SEQ), generator=generator)
        self.short = self.ids[:, :L0]
        start = time.perf_counter()
        self.base_short = _logits(self.model, self.short)
        seconds = time.perf_counter() - start
        if seconds > SLOW_FORWARD and not slow_ok:
            raise TimeoutError(f"slow: a forward pass takes {seconds:.1f}s on this CPU (a fused kernel's fallback); "
                               "walked with --slow-models")
        # tolerances scale with the logits (Cohere's logit_scale makes them small)
        self.scale = max(1e-6, float(self.base_short.abs().max()))
        try:
            start = time.perf_counter()
            self.base_long = _logits(self.model, self.ids)
            seconds = time.perf_counter() - start
        except Exception as exc:  # e.g. a learned position table of L0 rows
            self.base_long = None
            self.base_long_error = _short(exc)
        else:
            if seconds > SLOW_FORWARD and not slow_ok:
                raise TimeoutError(f"slow: a forward pass takes {seconds:.1f}s on this CPU (a fused kernel's "
                                   "fallback); walked with --slow-models")
        self.cache_note = None
        if self.base_long is None:
            self.cache_note = "unpatched model does not run past the original length"
        else:
            try:
                cached = _cached_logits(self.model, self.ids, DECODE)
                if _diff(cached, self.base_long[:, -DECODE:]) > CACHED * self.scale:
                    self.cache_note = "the unpatched model's cached decoding already differs from its full pass"
            except Exception as exc:
                self.cache_note = f"the unpatched model cannot decode with a cache ({_short(exc, 80)})"

    def fresh(self):
        return copy.deepcopy(self.model)


def check_method(entry: _Model, method: str) -> Row:
    """Patch a fresh copy of the model with ``method`` and run every check that applies."""
    import ctxext
    from ..methods.registry import METHODS

    row = Row(entry.name, entry.cls, method, "ok")
    info = METHODS[method]
    model = entry.fresh()
    before = _config_state(model)
    factor = METHOD_FACTOR.get(method, FACTOR)
    length = min(SEQ, int(L0 * factor))
    ids = entry.ids[:, :length]
    base_long = None if entry.base_long is None else entry.base_long[:, :length]
    try:
        ctxext.patch(model, method, factor)
    except PatchError as exc:
        if _config_state(model) != before or getattr(model, "_ctxext_active", None) is not None:
            return Row(entry.name, entry.cls, method, "FAILED", f"refused after touching the model: {exc}")
        return Row(entry.name, entry.cls, method, "refused", str(exc).strip().splitlines()[0])
    except Exception as exc:
        return Row(entry.name, entry.cls, method, "FAILED", f"patch raised {_short(exc)}")

    failures: list[str] = []
    tol = entry.scale
    try:
        # changed past the original length (extrapolate: unchanged, only the advertised length grows)
        patched = _logits(model, ids)
        if method == "extrapolate":
            if base_long is not None and _diff(patched, base_long) > EXACT * tol:
                failures.append("extrapolate changed the logits")
            if ctxext.describe(model)["patched_length"] == ctxext.describe(model)["original_length"]:
                failures.append("extrapolate did not grow the advertised length")
            row.checks.append("extrapolated")
        elif base_long is None:
            row.checks.append("runs past L0")
        else:
            change = _diff(patched[:, L0:], base_long[:, L0:])
            if change <= CHANGED * tol:
                failures.append(f"patched but nothing changed past the original length (max |diff| {change:.2e})")
            else:
                row.checks.append("changed")
        # cached decoding equals the full pass
        if entry.cache_note is None:
            hint = ctxext.dynamic_length(model, length) if method == "dynamic-ntk" else contextlib.nullcontext()
            with hint:
                cached = _cached_logits(model, ids, DECODE)
            d = _diff(cached, patched[:, -DECODE:])
            if d > CACHED * tol:
                failures.append(f"cached decoding differs from the full pass ({d:.2e})")
            else:
                row.checks.append("cache")
        else:
            row.checks.append(f"cache n/a ({entry.cache_note})")
        # unpatch is exact
        ctxext.unpatch(model)
        if not torch.equal(_logits(model, entry.short), entry.base_short):
            failures.append("unpatch did not restore the logits bit for bit")
        else:
            row.checks.append("unpatch")
        # parity with transformers' own rope type, asked of the (unpatched again) model's structure
        if method in ROPE_PARITY and honours_rope_type(model):
            try:
                reference = rope_reference(model, method)
                ref_logits = None if reference is None else _logits(reference, entry.ids)
            except Exception as exc:
                reference, ref_logits = None, None
                row.checks.append(f"parity n/a ({_short(exc, 90)})")
            if reference is None and not any(c.startswith("parity") for c in row.checks):
                row.checks.append("parity n/a (no rope settings in the config)")
            if ref_logits is not None:
                if entry.base_long is not None and _diff(ref_logits, entry.base_long) <= EXACT * tol:
                    row.checks.append(f"parity n/a (model ignores rope type {ROPE_PARITY[method]})")
                else:
                    ctxext.patch(model, method, FACTOR)
                    d = _diff(_logits(model, entry.ids), ref_logits)
                    ctxext.unpatch(model)
                    split = split_dynamic_scales(reference) if method == "dynamic-ntk" else None
                    if d > EXACT * tol and split:
                        # transformers' dynamic keeps a scale per rotary module, from the positions each one saw
                        # first; ctxext fixes one per sequence (cached decoding == full pass needs that)
                        row.checks.append(f"parity n/a (transformers' dynamic scales this model's rotary modules "
                                          f"apart in one pass: {split})")
                    elif d > EXACT * tol:
                        failures.append(f"differs from transformers' {ROPE_PARITY[method]} ({d:.2e})")
                    else:
                        row.checks.append("parity")
        # factor 1 is the identity
        if method not in NOT_IDENTITY_AT_ONE and (info.needs_factor or info.scales_with_factor):
            ctxext.patch(model, method, 1)
            d = _diff(_logits(model, entry.short), entry.base_short)
            ctxext.unpatch(model)
            if d > EXACT * tol:
                failures.append(f"factor 1 is not the identity ({d:.2e})")
            else:
                row.checks.append("identity")
    except Exception as exc:
        failures.append(f"{_short(exc)} [{_where(exc)}]")
    if failures:
        row.status, row.reason = "FAILED", "; ".join(failures)
    return row


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    frame = next((f for f in reversed(frames) if "ctxext" in f.filename), frames[-1] if frames else None)
    return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}" if frame else "?"


def run_census(models: Iterable[str] | None = None, methods: Iterable[str] | None = None, progress=None,
               slow_models: bool = False) -> list[Row]:
    """Census rows for the given model types (default: all causal LMs) and methods (default: all registered).

    Models whose tiny forward pass is slow on this machine (see ``SLOW_FORWARD``) are listed as skipped unless
    ``slow_models`` or they are named in ``models``."""
    from ..methods.registry import METHODS, resolve_method

    method_names = list(METHODS) if methods is None else [resolve_method(m).name for m in methods]
    rows: list[Row] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    try:
        _walk(models, method_names, rows, progress, slow_models or models is not None)
    finally:
        torch.set_num_threads(threads)
    return rows


def _walk(models, method_names, rows, progress, slow_ok: bool) -> None:
    entries = causal_lm_entries(models)
    for name, model_type, overrides in entries:
        start = time.perf_counter()
        with _quiet():
            try:
                entry = _Model(name, model_type, overrides, slow_ok)
            except Exception as exc:
                from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

                why = str(exc) if isinstance(exc, TimeoutError) else f"cannot be built tiny: {_short(exc)}"
                row = Row(name, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], "*", "skipped", why)
                row.seconds = time.perf_counter() - start
                rows.append(row)
                if progress:
                    progress(row)
                continue
            for method in method_names:
                t = time.perf_counter()
                row = check_method(entry, method)
                row.seconds = time.perf_counter() - t
                rows.append(row)
                if progress:
                    progress(row)
