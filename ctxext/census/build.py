"""Tiny models for the census: every causal-LM class of the installed transformers, built small.

A model is built tiny from its config class: a small hidden size, 2 layers (one of each kind of layer the default
config has), a small vocabulary and ``L0`` positions. ``VARIANTS`` adds structure variants of some model types
(Falcon with ALiBi, checkpoints that ship scaled RoPE). A model that cannot be built tiny (extra dependencies,
composite configs whose sub-models stay large, a config that rejects the tiny settings) raises with why not; the
census lists it as skipped with that reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

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

#: The tiny settings, under every name config classes give them; a config takes the ones it has.
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
    # models that ship an attention temperature by position, set to act from the first positions on (the plain tiny
    # configs put it past every length the census runs): Ministral 3's llama_4_scaling_beta over its YaRN, divided
    # by the original length (L0 / 4); Llama 4's attn_temperature_tuning on its NoPE layers, floor_scale 4
    "ministral3": [("temperature", {"rope": {**SCALED_ROPE["yarn"], "llama_4_scaling_beta": 0.3}})],
    "llama4_text": [("temperature", {"attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.3,
                                     "no_rope_layers": [1, 0]})],  # layer 1 NoPE: the temperature's layer
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
