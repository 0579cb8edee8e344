"""Architecture census: every causal-LM class of the installed transformers, built tiny, against every method.

For each model that can be built tiny from its config class (a small hidden size, 2 layers, a small vocabulary,
``L0`` positions) and each registered method, the census patches a fresh copy of the model and reports one of:

- ``ok``: every check that applies passed:
  - ``identity``: factor 1 gives the unpatched logits (within the original length; not for ``alibi`` / ``nope``,
    which replace the positional encoding, nor ``string``, which acts inside the original length by design);
  - ``parity``: logits equal those of the same weights configured with transformers' own rope type (``pi`` ~
    ``linear``, ``dynamic-ntk`` ~ ``dynamic``, ``yarn``, ``llama3``; ``ntk`` ~ a new ``rope_theta``), where the model
    honours that rope type;
  - ``cache``: greedy cached decoding (prefill, then one token at a time) equals the full forward pass, where the
    unpatched model's does;
  - ``changed``: the patch changes the logits past the original length (or makes the model run where it did not);
    ``extrapolate`` is the exception: positions unchanged, so logits equal the unpatched model's wherever that runs,
    and only the advertised length grows;
  - ``unpatch``: ``unpatch`` restores the unpatched logits bit for bit;
- ``refused: <reason>``: ``patch`` raised ``PatchError`` and left the model untouched (config unchanged);
- ``FAILED: <what>``: anything else, including a patch that changed nothing, a traceback, or a refusal that had
  already touched the model.

Models that cannot be built tiny (extra dependencies, composite configs whose sub-models stay large, a config
that rejects the tiny settings) are listed as skipped with the reason. ``run_census`` returns rows;
``format_census`` prints them as a model x method table (``ctxext methods --census``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import time
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .core.errors import PatchError

#: Original (advertised) length of every tiny model, the factor every method is applied with, the sequence length
#: of the long checks, and the number of tokens decoded one at a time in the cache check.
L0 = 16
FACTOR = 4
SEQ = 3 * L0
DECODE = 4
#: A small sliding window where a config has one, so that the feature is exercised: shorter than SEQ, and within the
#: trained length L0, as real hybrid models have it (Gemma 3: 1024 of 32k; Cohere2: 4096 of 8k).
WINDOW = 12
#: Models above this many parameters with the tiny settings are not tiny (composite configs, fixed large parts).
MAX_PARAMS = 3_000_000
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
#: Method -> transformers rope type with the same definition (the census checks parity where the model honours it).
ROPE_PARITY = {"pi": "linear", "dynamic-ntk": "dynamic", "yarn": "yarn", "llama3": "llama3", "ntk": "rope_theta"}

TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "n_inner": 96,
    "ffn_dim": 96,
    "ffn_hidden_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "rotary_dim": 8,
    # Mamba / Mamba-2 layers of hybrid models: a small state (their pure-PyTorch fallback is slow on CPU)
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_chunk_size": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "chunk_size": 16,
    # multi-head latent attention (DeepSeek-V2/V3 and relatives)
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # the decoder (and encoder) of encoder-decoder families that ship a causal-LM class
    "decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 96,
    "encoder_ffn_dim": 96,
    "max_position_embeddings": L0,
    "original_max_position_embeddings": L0,
    "n_positions": L0,
    "max_seq_len": L0,
    "seq_length": L0,
    "n_ctx": L0,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: Scaled RoPE as checkpoints ship it (Llama 3.1's llama3, Qwen2.5's yarn, Phi-3's longrope), written as 5.x
#: rope_parameters; advertised length L0, so the census's checks past L0 test the composed patch.
SCALED_ROPE: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0 // 4},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": L0 // 4},
    "longrope": {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": L0 // 2,
                 "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 2.5],
                 "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0]},
}

#: Extra configurations of a model type (name suffix, config overrides): structure variants the census covers.
#: ``{"rope": preset}`` is a scaled RoPE preset, given to the config in the API it has.
VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "falcon": [("alibi", {"alibi": True})],
    "llama": [(name, {"rope": SCALED_ROPE[name]}) for name in ("linear", "yarn", "llama3")],
    "qwen2": [("yarn", {"rope": SCALED_ROPE["yarn"]})],
    "phi3": [("longrope", {"rope": SCALED_ROPE["longrope"]})],
}


def _rope_overrides(config_class, default, preset: dict[str, Any]) -> dict[str, Any]:
    """Config kwargs for a scaled RoPE preset: 5.x rope_parameters (over the default's theta), or 4.x
    rope_scaling (Phi-3's 4.x longrope wants ``type`` and its two factor lists only)."""
    preset = dict(preset)
    original = preset.get("original_max_position_embeddings")
    kwargs: dict[str, Any] = {} if original is None else {"original_max_position_embeddings": original}
    if "rope_parameters" in inspect.signature(config_class.__init__).parameters:
        base = getattr(default, "rope_parameters", None) or {}
        kwargs["rope_parameters"] = {**{k: v for k, v in base.items() if k == "rope_theta"}, **preset}
    elif preset["rope_type"] == "longrope":
        kwargs["rope_scaling"] = {"type": "longrope", "short_factor": preset["short_factor"],
                                  "long_factor": preset["long_factor"]}
    else:
        kwargs["rope_scaling"] = preset
    return kwargs


@dataclass
class Row:
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


# -- building tiny models ------------------------------------------------------------------------------------------


def causal_lm_entries(model_types: Iterable[str] | None = None) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, model type, overrides) for every causal-LM model type of the installed transformers (and variants)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    wanted = None if model_types is None else set(model_types)
    if wanted:
        known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | {
            f"{t}+{suffix}" for t, variants in VARIANTS.items() for suffix, _ in variants
        }
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"not a causal-LM model type of this transformers: {', '.join(unknown)}")
    entries = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        names = [(model_type, {})] + [(f"{model_type}+{suffix}", o) for suffix, o in VARIANTS.get(model_type, [])]
        for name, overrides in names:
            if wanted is None or name in wanted:  # a variant is named on its own ("falcon+alibi")
                entries.append((name, model_type, overrides))
    return entries


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


def tiny_config(model_type: str, overrides: dict[str, Any] | None = None):
    """The model type's config class with the tiny settings it has (and ``overrides``)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    kwargs = {
        k: v
        for k, v in TINY.items()
        if hasattr(default, k) and not isinstance(getattr(config_class, k, None), property)  # derived (read-only)
    }
    window = getattr(default, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        kwargs["sliding_window"] = WINDOW
    # every kind of layer the default config has, once each (attention next to linear-attention/Mamba layers,
    # sliding next to full attention): 2 layers of one kind could leave the positional surface unused
    hybrid = {"attn_layer_indices": [1], "layer_group_size": 2, "attn_layer_period": 2, "attn_layer_offset": 1}
    kwargs.update({k: v for k, v in hybrid.items() if hasattr(default, k)})
    kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or []))
    if kinds and "layer_types" in inspect.signature(config_class.__init__).parameters:
        layers = max(2, len(kinds))
        kwargs["layer_types"] = (kinds * 2)[:layers]
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if key in kwargs:
                kwargs[key] = layers
    layers = list(dict.fromkeys(getattr(default, "attention_layers", None) or []))  # GPT-Neo: global / local
    if layers and hasattr(default, "attention_types"):
        kwargs.update(attention_types=[[layers, 1]], num_layers=len(layers))
        if hasattr(default, "window_size"):
            kwargs["window_size"] = WINDOW
    if "qk_rope_head_dim" in kwargs:  # multi-head latent attention: the rotary module turns qk_rope_head_dim dims,
        kwargs.update(head_dim=TINY["qk_rope_head_dim"])  # which DeepSeek-style configs read from head_dim,
        if "num_key_value_heads" in kwargs:  # and every head has its own key (expanded from the latent)
            kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    overrides = dict(overrides or {})
    if "rope" in overrides:
        kwargs.update(_rope_overrides(config_class, default, overrides.pop("rope")))
    kwargs.update(overrides)
    try:
        config = config_class(**kwargs)
    except Exception:
        if "layer_types" not in kwargs:
            raise
        kwargs["layer_types"] = None  # derived from the layer count
        config = config_class(**kwargs)
    if not hasattr(config, "pad_token_id"):  # some config classes omit it, their modeling code reads it
        config.pad_token_id = None
    if getattr(config, "layer_types", None) is not None and len(config.layer_types) != config.num_hidden_layers:
        config.layer_types = list(config.layer_types)[: config.num_hidden_layers]
    return config


def build_tiny(model_type: str, overrides: dict[str, Any] | None = None, seed: int = 0):
    """A tiny instance of the causal-LM class of ``model_type`` (eval mode, float32); raises with why not."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import transformers

    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise ImportError(f"transformers.{cls_name} is not importable here (missing optional dependency?)")
    config = tiny_config(model_type, overrides)
    with torch.device("meta"):
        skeleton = cls(config)
    count = sum(p.numel() for p in skeleton.parameters())
    if count > MAX_PARAMS:
        raise ValueError(f"{count / 1e6:.1f}M parameters with the tiny settings (composite or fixed-size parts)")
    torch.manual_seed(seed)
    model = cls(config).eval()
    return model


# -- the checks -----------------------------------------------------------------------------------------------------


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


def _shipped_rope_type(config) -> str | None:
    """The scaled rope type a config ships (5.x rope_parameters or 4.x rope_scaling), if any."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" in params:
        return params["rope_type"]
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        return scaling.get("rope_type", scaling.get("type"))
    return None


def _rope_reference(model, method: str):
    """The unpatched weights configured with transformers' own form of ``method``; None where this model has no
    such config surface."""
    from .adapters.rotary_units import rotary_units

    config = copy.deepcopy(model.config)
    units = rotary_units(model)
    if not units:
        return None
    dim = 2 * units[0].original_inv_freq.numel()
    kind = ROPE_PARITY[method]
    if kind == "rope_theta":
        extra = {}
    else:
        extra = {"rope_type": kind, "factor": float(FACTOR)}
        if kind in ("yarn", "llama3"):
            extra["original_max_position_embeddings"] = L0
        if kind == "llama3":
            extra.update(low_freq_factor=1.0, high_freq_factor=4.0)

    def merged(params: dict) -> dict:
        new = {**params, **extra}
        if kind == "rope_theta":
            new["rope_theta"] = params["rope_theta"] * FACTOR ** (dim / (dim - 2))
        return new

    params = getattr(config, "rope_parameters", None)
    shipped = _shipped_rope_type(config)
    if shipped not in (None, "default"):
        # a composed patch has a transformers form only in closed form: pi x f on linear x a is linear x (a * f)
        if not (shipped == "linear" and kind == "linear"):
            raise LookupError(f"{method} on shipped rope type {shipped!r} has no transformers rope type")
        scaling = params if isinstance(params, dict) and "rope_type" in params else config.rope_scaling
        extra = {"factor": float(scaling["factor"]) * FACTOR}
        if isinstance(params, dict) and "rope_type" in params:
            config.rope_parameters = {**params, **extra}
        else:
            config.rope_scaling = {**config.rope_scaling, **extra}
    elif isinstance(params, dict) and params:
        if "rope_theta" in params:
            config.rope_parameters = merged(params)
        elif all(isinstance(v, dict) and "rope_theta" in v for v in params.values()):
            config.rope_parameters = {k: merged(v) for k, v in params.items()}
        else:
            return None
    else:  # 4.x: rope_theta (rotary_emb_base) + rope_scaling, which some 4.x configs (Mistral) do not declare
        if len(units) > 1:
            # e.g. 4.x Gemma 3 / OLMo 3: rope_scaling reaches the global rotary module only, ctxext scales every one
            raise LookupError("4.x rope_scaling scales one of the model's rotary modules, ctxext all of them")
        theta_attr = next((a for a in ("rope_theta", "rotary_emb_base") if isinstance(getattr(config, a, None),
                                                                                     (int, float))), None)
        if theta_attr is None:
            return None
        if kind == "rope_theta":
            setattr(config, theta_attr, getattr(config, theta_attr) * FACTOR ** (dim / (dim - 2)))
        else:
            config.rope_scaling = dict(extra)
    if kind in ("yarn", "llama3"):
        config.max_position_embeddings = FACTOR * L0
    reference = type(model)(config).eval()
    reference.load_state_dict(model.state_dict())
    return reference


def _config_state(model) -> str:
    from .attention.features import _configs

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
    from .methods.registry import METHODS

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
    family = ctxext.describe(model)["family"]
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
        # parity with transformers' own rope type
        if method in ROPE_PARITY and family == "rotary":
            try:
                reference = _rope_reference(model, method)
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
                    split = _split_dynamic_scales(reference) if method == "dynamic-ntk" else None
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


def _split_dynamic_scales(reference) -> str | None:
    """Whether transformers' ``dynamic`` rope type left the reference's rotary modules at different lengths after
    its full pass (e.g. DeepSeek-V4's compressors rotate entries at positions of their own)."""
    lengths = sorted({int(value) for m in reference.modules() for key, value in vars(m).items()
                      if key.endswith("max_seq_len_cached") and isinstance(value, (int, float, torch.Tensor))})
    return f"lengths {lengths}" if len(lengths) > 1 else None


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    frame = next((f for f in reversed(frames) if "ctxext" in f.filename), frames[-1] if frames else None)
    return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}" if frame else "?"


def run_census(models: Iterable[str] | None = None, methods: Iterable[str] | None = None, progress=None,
               slow_models: bool = False) -> list[Row]:
    """Census rows for the given model types (default: all causal LMs) and methods (default: all registered).

    Models whose tiny forward pass is slow on this machine (see ``SLOW_FORWARD``) are listed as skipped unless
    ``slow_models`` or they are named in ``models``."""
    from .methods.registry import METHODS, resolve_method

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


def summarize(rows: list[Row]) -> dict[str, int]:
    """Counts of models: all ok / refused rows, any failure, skipped."""
    by_model: dict[str, list[Row]] = {}
    for row in rows:
        by_model.setdefault(row.model, []).append(row)
    counts = {"models": len(by_model), "skipped": 0, "with failures": 0, "patched by some method": 0,
              "refused every method": 0, "ok rows": 0, "refused rows": 0, "failed rows": 0}
    for model_rows in by_model.values():
        if model_rows[0].status == "skipped":
            counts["skipped"] += 1
            continue
        statuses = [r.status for r in model_rows]
        counts["ok rows"] += statuses.count("ok")
        counts["refused rows"] += statuses.count("refused")
        counts["failed rows"] += statuses.count("FAILED")
        if "FAILED" in statuses:
            counts["with failures"] += 1
        if "ok" in statuses:
            counts["patched by some method"] += 1
        elif "FAILED" not in statuses:
            counts["refused every method"] += 1
    return counts


def _generic(row: Row) -> str:
    """A row's reason with the class name generalised and the list of fitting methods dropped (one note for all
    the models refused for the same reason)."""
    import re

    reason = row.reason.split(" Methods that do: ")[0]
    reason = re.sub(r"method '[^']+'", "the method", reason)
    return reason.replace(row.cls, "<model>")


def format_census(rows: list[Row], markdown: bool = False, reasons: bool = True) -> str:
    """A model x method table: ``ok``, ``refused`` (reasons listed below the table), ``FAILED`` or skipped."""
    from .methods.registry import METHODS

    methods = [m for m in METHODS if any(r.method == m for r in rows)]
    models: dict[str, dict[str, Row]] = {}
    skipped: dict[str, Row] = {}
    for row in rows:
        if row.status == "skipped":
            skipped[row.model] = row
        else:
            models.setdefault(row.model, {})[row.method] = row
    notes: dict[str, int] = {}

    def cell(row: Row | None) -> str:
        if row is None:
            return ""
        if row.status == "ok":
            return "ok"
        key = f"{row.status}: {_generic(row)}"
        if key not in notes:
            notes[key] = len(notes) + 1
        return f"{'refused' if row.status == 'refused' else 'FAILED'} [{notes[key]}]"

    header = ["model", "class"] + methods
    body = [[name, next(iter(cells.values())).cls] + [cell(cells.get(m)) for m in methods]
            for name, cells in models.items()]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in body]
    if reasons and notes:
        bullet = "- " if markdown else ""
        lines += ["", "Reasons:"] + [f"{bullet}[{n}] {text}" for text, n in notes.items()]
    if skipped:
        lines += ["", f"Not built tiny ({len(skipped)}):"]
        lines += [f"- {name} ({row.cls}): {row.reason}" for name, row in skipped.items()]
    counts = summarize(rows)
    lines += ["", "Summary: " + ", ".join(f"{k} {v}" for k, v in counts.items())]
    return "\n".join(lines)


__all__ = ["L0", "FACTOR", "Row", "build_tiny", "check_method", "format_census", "run_census", "summarize",
           "tiny_config"]
