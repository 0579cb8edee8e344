"""Attention-side position remapping (self-extend, dca, rerope, lm-infinite, streaming-llm, string): the ``ctxext_remap`` attention
against a dense reference written from each paper's definition, identity settings, cached decoding, padded
batches, exact restore and bad input.

The dense reference runs the same model with its rotary modules turned off (so attention receives un-rotated q and
k) and an attention function written here: for every (query i, key j) pair it takes the relative position the
paper defines, rotates q_i by it explicitly (``R(a) q . R(b) k = R(a - b) q . k``) in float64, builds the full
(T x T) scores, masks, softmaxes. It shares nothing with ``ctxext.methods.remap`` or ``ctxext.attention.remap``.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from conftest import rope_kwargs

import ctxext.attention.remap as remap_attention
from ctxext.adapters.remap import REMAP_METHODS, apply_remap, check_remap
from ctxext.attention import use_attention
from ctxext.core.errors import PatchError
from ctxext.methods.remap import PositionMap, Rotation, build_map, suggest_self_extend

L0 = 64  # the tiny models' max_position_embeddings
VOCAB = 128


def _tiny(kind: str, rope: dict, **settings):
    """A tiny ``{kind}ForCausalLM`` (seed 0, sdpa): 2 layers, 4 heads, trained length L0; ``settings`` override."""
    import transformers

    config_class = getattr(transformers, f"{kind}Config")
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=L0, attn_implementation="sdpa")
    kw.update(settings)
    kw.update(rope_kwargs(config_class, rope))  # rope_parameters (5.x) or rope_theta + rope_scaling (4.x)
    return getattr(transformers, f"{kind}ForCausalLM")(config_class(**kw)).eval()


def _llama(**overrides):
    """GQA, head_dim != hidden / heads, rope_theta 500."""
    rope = overrides.pop("rope_parameters", {"rope_type": "default", "rope_theta": 500.0})
    return _tiny("Llama", rope, num_key_value_heads=2, head_dim=16, **overrides)


def _neox(**overrides):
    """Partial rotary (half of each head), theta 10000."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return _tiny("GPTNeoX", rope, hidden_size=64, intermediate_size=96, **overrides)


def _glm(**overrides):
    """GLM rotates neighbour pairs (2i, 2i + 1), on half of each head (partial_rotary_factor 0.5)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return _tiny("Glm", rope, hidden_size=64, intermediate_size=96, num_key_value_heads=2, head_dim=16,
                 pad_token_id=0, eos_token_id=1, **overrides)


def _cohere(**overrides):
    """Cohere's rotary module emits each frequency repeated in place and its attention rotates neighbour pairs.
    (logit_scale 1: Cohere's default 1/16 would shrink every logit difference the tests look at.)"""
    return _tiny("Cohere", {"rope_type": "default", "rope_theta": 10000.0}, num_key_value_heads=2, pad_token_id=0,
                 bos_token_id=2, eos_token_id=1, logit_scale=1.0, **overrides)


def _hybrid(**overrides):
    """Qwen2 with a full-attention layer and a sliding-window layer (window 24 < the trained 64)."""
    settings = dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=24, max_window_layers=1)
    return _tiny("Qwen2", {"rope_type": "default", "rope_theta": 500.0}, **{**settings, **overrides})


def _smollm3(**overrides):
    """SmolLM3 with its second layer run without rotary positions (no_rope_layers = [1, 0])."""
    settings = dict(num_key_value_heads=2, pad_token_id=0, no_rope_layers=[1, 0], use_sliding_window=False)
    return _tiny("SmolLM3", {"rope_type": "default", "rope_theta": 500.0}, **{**settings, **overrides})


MODELS = {"llama": _llama, "neox": _neox, "glm": _glm, "cohere": _cohere}
#: model types whose modeling code rotates neighbour pairs (transformers' GLM and Cohere apply_rotary_pos_emb)
INTERLEAVED = {"glm", "cohere"}


# ------------------------------------------------------------------------------- the papers' definitions, dense


def paper_relative(method: str, factor, options: dict, i: torch.Tensor, j: torch.Tensor):
    """(relative position each pair sees, float64; pair visible to the method) from each paper's definition."""
    d = (i - j).double()
    if method == "self-extend":
        g, w = options["group"], options["window"]
        grouped = (i // g + (w - w // g) - j // g).double()
        return torch.where(d < w, d, grouped), torch.ones_like(d, dtype=torch.bool)
    if method == "rerope":
        w, k = options["window"], options.get("leaky")
        far = torch.full_like(d, float(w)) if k is None else w + (d - w) / k
        return torch.where(d < w, d, far), torch.ones_like(d, dtype=torch.bool)
    if method == "lm-infinite":
        w, n = options["window"], options["global_tokens"]
        near = d < w
        return torch.where(near, d, torch.full_like(d, float(L0))), near | (j < n)
    if method == "streaming-llm":  # the cache: n sinks + the w most recent tokens, positions = place in the cache
        n, w = options["sinks"], options["window"]
        cache = n + w
        full = i < cache  # nothing evicted yet: the unpatched model
        recent = d < w  # consecutive in the cache, ending at the query (cache position cache - 1)
        return torch.where(full | recent, d, (cache - 1 - j).double()), full | recent | (j < n)
    if method == "string":
        s, w = options["shift"], options["local"]
        return torch.where(d < s, d, d - s + w), torch.ones_like(d, dtype=torch.bool)
    if method == "dca":
        rel = dca_relative(options["chunk_size"], options["local_window"], L0, i, j)
        return rel, torch.ones_like(d, dtype=torch.bool)
    raise AssertionError(method)


def dca_positions(s: int, w: int, c: int, n: torch.Tensor):
    """The ChunkLlama paper's position indices (Eqs. 2, 5, 7) at absolute positions n: P_k = P_q^Intra = n mod s,
    P_q^Succ = [s, s + 1, ..., s + w - 1, c - 1, ..., c - 1] repeated per chunk, P_q^Inter = c - 1."""
    p_k = n % s
    p_intra = p_k
    p_succ = torch.where(n % s < w, s + n % s, torch.full_like(n, c - 1))
    p_inter = torch.full_like(n, c - 1)
    return p_k, p_intra, p_succ, p_inter


def dca_relative(s: int, w: int, c: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """M[i][j] of the paper's Eq. 8: by floor(i/s) - floor(j/s) = 0, 1 or > 1, intra / successive / inter."""
    p_k, _, _, _ = dca_positions(s, w, c, j)
    _, p_intra, p_succ, p_inter = dca_positions(s, w, c, i)
    apart = i // s - j // s
    return torch.where(apart == 0, p_intra - p_k, torch.where(apart == 1, p_succ - p_k, p_inter - p_k)).double()


class Dense:
    """A dense attention function for one method's definition; registered as ``ctxext_test_dense``."""

    name = "ctxext_test_dense"
    method: str = ""
    factor = None
    options: dict = {}
    inv_freq: torch.Tensor | None = None
    #: layer type -> (frequencies, attention factor) for a model with one set per layer type (Gemma 3); else None
    typed: dict | None = None
    layout: str = "half"  # "interleaved": frequency i turns dims (2i, 2i + 1) instead of (i, i + d/2)
    scale: float = 1.0  # the rotary module's attention_scaling: q and k each multiplied by it (YaRN's temperature)
    start: int = 0  # the first rotated dim of a head (multi-head latent attention: after its no-position part)

    @classmethod
    def forward(cls, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        b, h, t, dim = query.shape
        window = _sliding_window_of(module)  # a hybrid model's sliding layer: true distances, the last W keys
        assert key.shape[2] == t and (attention_mask is None or window)  # full passes without padding only
        key = key.repeat_interleave(h // key.shape[1], dim=1).double()
        value = value.repeat_interleave(h // value.shape[1], dim=1).double()
        q = query.double()
        pos = torch.arange(t)
        i, j = pos[:, None], pos[None, :]
        rel, visible = paper_relative(cls.method, cls.factor, cls.options, i, j)
        if window:
            rel, visible = (i - j).double(), (i - j) < window
        rope_free = not _rotates(module)  # a layer the model runs without rotary positions: the mask only
        if rope_free:
            rel = torch.zeros_like(rel)
        if cls.method == "rerope" and cls.options.get("log_scale", True) and not rope_free and not window:
            q = q * (torch.log(pos + 1.0).double() / math.log(L0)).clamp(min=1)[None, None, :, None]
        inv, scale = cls.inv_freq, cls.scale
        if cls.typed is not None:
            inv, scale = cls.typed[module.config.layer_types[module.layer_idx]]
        inv = inv.double()
        rd, st = 2 * inv.numel(), cls.start
        qr, qp = q[..., st:st + rd], torch.cat([q[..., :st], q[..., st + rd:]], -1)
        if cls.layout == "interleaved":
            angle = rel[..., None] * inv.repeat_interleave(2)  # (t, t, rd)
            q_half = torch.stack([-qr[..., 1::2], qr[..., 0::2]], dim=-1).flatten(-2)
        else:
            angle = rel[..., None] * torch.cat([inv, inv])
            half = rd // 2
            q_half = torch.cat([-qr[..., half:], qr[..., :half]], dim=-1)
        cos, sin = angle.cos(), angle.sin()
        kr, kp = key[..., st:st + rd], torch.cat([key[..., :st], key[..., st + rd:]], -1)
        scores = torch.einsum("bhid,ijd,bhjd->bhij", qr, cos, kr) + torch.einsum("bhid,ijd,bhjd->bhij", q_half, sin,
                                                                                  kr)
        scores = scores + torch.einsum("bhid,bhjd->bhij", qp, kp)
        scores = scores * scaling * scale**2
        if kw.get("softcap") is not None:  # Gemma 2's eager attention: cap * tanh(score / cap), before the mask
            scores = torch.tanh(scores / kw["softcap"]) * kw["softcap"]
        keep = visible & (j <= i)
        scores = scores.masked_fill(~keep, -math.inf)
        if kw.get("s_aux") is not None:  # GPT-OSS: a learned sink logit per head, one more softmax column, dropped
            sink = kw["s_aux"].double().view(1, h, 1, 1).expand(b, h, t, 1)
            out = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ value
        else:
            out = torch.softmax(scores, -1) @ value
        return out.transpose(1, 2).to(query.dtype).contiguous(), None


def _sliding_window_of(module) -> int | None:
    """The window of a sliding-attention layer of a hybrid model (config.layer_types), else None."""
    config = module.config
    types = getattr(config, "layer_types", None) or []
    if types and types[module.layer_idx] == "sliding_attention" and getattr(config, "use_sliding_window", True):
        return config.sliding_window
    return None


def _rotates(module) -> bool:
    """SmolLM3's no_rope_layers: 0 marks a layer without rotary positions."""
    flags = getattr(module.config, "no_rope_layers", None)
    return not flags or bool(flags[module.layer_idx])


def _register_dense():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(Dense.name, Dense.forward)
    AttentionMaskInterface.register(Dense.name, sdpa_mask)


_register_dense()


def dense_logits(model, method, factor, options, ids):
    """Logits of the paper's definition: the patched model (rotary off) with the dense attention swapped in."""
    restore, back = _with_dense(model, method, factor, options)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        back()
        restore()


def _with_dense(model, method, factor, options):
    """The model patched (rotary off) with the dense attention of the paper's definition swapped in; returns the
    functions that swap it back and undo the patch (in that order)."""
    pmap = build_map(method, L0, factor, **options)
    Dense.method, Dense.factor, Dense.options = method, factor, dict(pmap.options)
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    if hasattr(rotary, "original_inv_freq"):
        Dense.inv_freq, Dense.scale = rotary.original_inv_freq.clone(), float(rotary.attention_scaling)
        Dense.typed = None
    else:  # one set per layer type, as transformers built them
        Dense.typed = {t: (getattr(rotary, f"{t}_original_inv_freq").clone(), float(getattr(rotary,
                           f"{t}_attention_scaling"))) for t in rotary.layer_types}
    Dense.layout = "interleaved" if model.config.model_type in INTERLEAVED else "half"
    # DeepSeek's MLA: [no-position part, rotary part] per head; its interleaved rope reorders pairs into halves first
    Dense.start = model.config.qk_nope_head_dim if getattr(model.config, "qk_rope_head_dim", None) else 0
    restore = apply_remap(model, method, factor, options)  # after reading the frequencies: it zeroes them
    return restore, use_attention(model, Dense.name)


def remap_logits(model, method, factor, options, ids, **forward):
    restore = apply_remap(model, method, factor, options)
    try:
        with torch.no_grad():
            return model(ids, **forward).logits
    finally:
        restore()


def _ids(length, seed=1, batch=1):
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


CASES = [
    ("self-extend", 8, {"group": 4, "window": 16}),
    ("self-extend", 8, {"group": 3, "window": 10}),  # W not a multiple of G
    ("rerope", 8, {"window": 16}),  # log-length query scaling on (default)
    ("rerope", 8, {"window": 12, "leaky": 4.0, "log_scale": False}),
    ("lm-infinite", 8, {"global_tokens": 4, "window": 32}),
    ("string", 1.5, {"shift": 40, "local": 8}),
    ("dca", 4, {}),  # the paper's defaults: chunk 3/4 x 64 = 48, local window 64 - 48 = 16
    ("dca", 8, {"chunk_size": 20, "local_window": 7}),  # 10 chunks at 200 tokens, window below c - s
    ("dca", None, {"chunk_size": 24, "local_window": 0}),  # no successive-chunk attention (intra + inter only)
    ("streaming-llm", 8, {"sinks": 4, "window": 28}),  # cache of 32 < 64: evicts within the trained length too
    ("streaming-llm", 8, {}),  # the default cache: the original length (4 sinks + 60 recent)
]
#: by method, for the tests that take one case each
SELF_EXTEND, REROPE, LEAKY_REROPE, LM_INFINITE, STRING, DCA, DCA_SMALL, STREAMING = (CASES[i] for i in
                                                                                  (0, 2, 3, 4, 5, 6, 7, 9))


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("method,factor,options", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_dense_reference(arch, method, factor, options):
    """GQA + head_dim != hidden/heads + rope_theta 500 (llama), partial rotary + theta 10000 (neox), neighbour
    pairs on half of each head (glm), neighbour pairs from cos/sin emitted repeated in place (cohere)."""
    model = MODELS[arch]()
    ids = _ids(200)
    want = dense_logits(model, method, factor, options, ids)
    got = remap_logits(model, method, factor, options, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        plain = model(ids).logits
    # the patch does change the model, by well over the 1e-5 the comparison above allows (STRING moves few pairs of
    # the tiny partial-rotary NeoX: 4.6e-4 at most on transformers 5.0, whose random init differs from 5.23's)
    assert (got - plain).abs().max() > 1e-4


@pytest.mark.parametrize("strategy", ["scores", "concat"])
def test_small_chunks_and_both_strategies(monkeypatch, strategy):
    """Many small query chunks (each over the keys up to its last query) and both ways to merge rotations."""
    monkeypatch.setattr(remap_attention, "MIN_ROWS", 8)
    monkeypatch.setattr(remap_attention, "CHUNK_BYTES", 8 * 4 * 200 * 3 * 7)  # about 7 rows
    monkeypatch.setattr(remap_attention, "STRATEGY", strategy)
    model = _llama()
    ids = _ids(150, seed=3)
    for method, factor, options in (SELF_EXTEND, LM_INFINITE, DCA_SMALL):
        want = dense_logits(model, method, factor, options, ids)
        got = remap_logits(model, method, factor, options, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


IDENTITY = [
    ("self-extend", 8, {"group": 1}),
    ("self-extend", 8, {"group": 4, "window": 512}),  # every pair within the window
    ("rerope", 8, {"window": 512, "log_scale": False}),
    ("rerope", 8, {"window": 16, "leaky": 1.0, "log_scale": False}),
    ("lm-infinite", 8, {"window": 512}),
    ("string", 8, {"shift": 0}),
    ("streaming-llm", 8, {"window": 512}),
]


@pytest.mark.parametrize("method,factor,options", IDENTITY, ids=[f"{c[0]}-{i}" for i, c in enumerate(IDENTITY)])
def test_identity_settings_equal_the_unpatched_model(method, factor, options):
    model = _llama()
    for length in (5, 70, 300):
        ids = _ids(length, seed=length)
        with torch.no_grad():
            want = model(ids).logits
        torch.testing.assert_close(remap_logits(model, method, factor, options, ids), want, atol=1e-5, rtol=0)


def test_within_the_window_is_the_unpatched_model():
    """Shorter than every method's window: the fast path (rotate once, transformers' sdpa) is the original model."""
    model = _llama()
    ids = _ids(10)  # the smallest window below is 10
    with torch.no_grad():
        want = model(ids).logits
    for method, factor, options in CASES:
        got = remap_logits(model, method, factor, options, ids)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def _decodes_as_a_full_forward(model, method, factor, options):
    """Patched, the model decodes with the cache as a full pass does, past the original length (64) and past every
    window: prefill 90 tokens, decode 30 more; the model is restored after."""
    from checks import generate_equals_full_forward

    restore = apply_remap(model, method, factor, options)
    try:
        with torch.no_grad():
            generate_equals_full_forward(model, prompt_len=90, new=30)
    finally:
        restore()


@pytest.mark.parametrize("method,factor,options",
                         [SELF_EXTEND, REROPE, LM_INFINITE, LEAKY_REROPE, STRING, DCA, DCA_SMALL, STREAMING],
                         ids=["self-extend", "rerope", "lm-infinite", "leaky-rerope", "string", "dca", "dca-small",
                              "streaming-llm"])
def test_cached_generate_equals_full_forward(method, factor, options):
    """Past the original length (64) and past every window: prefill 90 tokens, decode 30 more with the cache."""
    model = _llama()
    _decodes_as_a_full_forward(model, method, factor, options)


@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, DCA_SMALL, STREAMING],
                         ids=["self-extend", "dca", "streaming-llm"])
def test_neighbour_pair_rotation_decodes_with_the_cache_as_a_full_forward_and_restores(method, factor, options):
    """GLM (interleaved pairs, partial rotary): cached decoding past the original length == full pass; unpatch
    restores the logits bit for bit."""
    model = _glm()
    ids = _ids(100)
    with torch.no_grad():
        before = model(ids).logits
    _decodes_as_a_full_forward(model, method, factor, options)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, REROPE, LM_INFINITE, STRING, DCA_SMALL, STREAMING],
                         ids=["self-extend", "rerope", "lm-infinite", "string", "dca", "streaming-llm"])
def test_padded_batch_equals_single_rows(method, factor, options):
    from checks import padded_batch_equals_single_rows

    model = _llama()
    restore = apply_remap(model, method, factor, options)
    try:
        with torch.no_grad():
            padded_batch_equals_single_rows(model, lengths=(150, 85))
    finally:
        restore()


def test_restore_is_bit_exact():
    model = _neox()
    ids = _ids(100)
    with torch.no_grad():
        before = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rotary = [m for m in model.modules() if hasattr(m, "original_inv_freq")]
    freqs = [(m.inv_freq.clone(), m.attention_scaling) for m in rotary]
    impl = model.config._attn_implementation
    for method, factor, options in CASES:
        restore = apply_remap(model, method, factor, options)
        assert model.config._attn_implementation == "ctxext_remap"
        assert all(torch.count_nonzero(m.inv_freq) == 0 for m in rotary)
        restore()
    assert model.config._attn_implementation == impl
    assert all(torch.equal(m.inv_freq, f) and m.attention_scaling == s for m, (f, s) in zip(rotary, freqs))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(hasattr(m, remap_attention.STATE_ATTR) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_defaults_follow_the_factor():
    # the smallest G with 1024 + 15360 / G < 2/3 x 4096 (= 1024 + 15360 / 9 exactly, so not 9)
    assert suggest_self_extend(4096, 16384) == (10, 1024)
    assert suggest_self_extend(4096, 16384, budget=1 / 2) == (16, 1024)
    assert suggest_self_extend(4096, 4096) == (1, 1024)
    assert build_map("self-extend", 4096, 4).options == {"group": 10, "window": 1024}
    assert build_map("self-extend", 4096).is_identity and build_map("self-extend", 4096, 1).is_identity
    assert build_map("rerope", 4096, 4).options == {"window": 512, "leaky": None, "log_scale": True}
    assert build_map("rerope", 4096).near == 4096  # identity within the original length
    assert build_map("lm-infinite", 4096, 4).options == {"global_tokens": 10, "window": 4096}
    assert build_map("string", 4096).options == {"shift": round(0.33 * 4096), "local": 128}
    assert build_map("string", 8192, 2).options == {"shift": 8192 + 128, "local": 128}
    assert build_map("dca", 4096, 4).options == {"chunk_size": 3072, "local_window": 1024}  # the paper's Llama 2
    assert build_map("dca", 4096).options == build_map("dca", 4096, 32).options  # DCA reaches any length
    assert build_map("dca", 4096, 4, chunk_size=1024).options == {"chunk_size": 1024, "local_window": 1024}
    assert build_map("dca", 4096, 4, chunk_size=3000).options == {"chunk_size": 3000, "local_window": 1096}
    assert build_map("streaming-llm", 4096, 4).options == {"sinks": 4, "window": 4092}  # a cache of 4096
    assert set(REMAP_METHODS) == {"self-extend", "dca", "rerope", "lm-infinite", "streaming-llm", "string"}
    assert all(not m.needs_factor for m in REMAP_METHODS.values())


def test_relative_positions_of_the_maps():
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    for method, factor, options in CASES:
        pmap = build_map(method, L0, factor, **options)
        rel, visible = paper_relative(method, factor, pmap.options, i, j)
        got = pmap.relative(i, j)
        causal = j <= i
        assert torch.equal(got.isnan() & causal, ~visible & causal), method
        torch.testing.assert_close(got[visible & causal], rel[visible & causal], atol=1e-12, rtol=0)


def test_dca_positions_are_the_papers_figure_2():
    """The running example of the ChunkLlama paper (Figure 2, Section 3): pretraining length c = 10, chunk size
    s = 6, local window w = 4, 12 tokens. P_k = [0..5, 0..5], P_q^Succ = [6, 7, 8, 9, 9, 9] per chunk, and the map's
    relative positions are the paper's M (Eq. 8): true distances within a chunk and for the first w queries of the
    next chunk, 9 - P_k[j] for the rest."""
    n = torch.arange(12)
    p_k, p_intra, p_succ, p_inter = dca_positions(6, 4, 10, n)
    assert p_k.tolist() == [0, 1, 2, 3, 4, 5] * 2 and torch.equal(p_intra, p_k)
    assert p_succ.tolist() == [6, 7, 8, 9, 9, 9] * 2 and p_inter.tolist() == [9] * 12
    pmap = build_map("dca", 10, None, chunk_size=6, local_window=4)
    got = pmap.relative(n[:, None], n[None, :])
    causal = n[None, :] <= n[:, None]
    want = dca_relative(6, 4, 10, n[:, None], n[None, :])
    assert torch.equal(got[causal], want[causal])
    assert got[10, :6].tolist() == [9, 8, 7, 6, 5, 4] and got[9, :6].tolist() == [9, 8, 7, 6, 5, 4]
    assert got[6, :6].tolist() == [6, 5, 4, 3, 2, 1]  # q6 at P_q^Succ = 6: its true distances
    # three chunks (inter-chunk pairs) and a window below c - s, by the paper's equations
    pmap = build_map("dca", 64, None, chunk_size=20, local_window=7)
    i, j = torch.arange(130)[:, None], torch.arange(130)[None, :]
    causal = j <= i
    assert torch.equal(pmap.relative(i, j)[causal], dca_relative(20, 7, 64, i, j)[causal])
    assert int(pmap.relative(i, j)[causal].max()) == 63  # every relative position stays below c


def test_dca_defaults_are_the_unpatched_model_within_the_trained_length(monkeypatch):
    """chunk 3/4 c and window c - s: no query before c is two chunks from a key or past the window, so up to the
    trained length DCA is the unpatched model, through the fast path (transformers' sdpa, rotated once)."""
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    plain = sdpa.sdpa_attention_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return plain(*args, **kwargs)

    model = _llama()
    for length in (5, 50, L0):
        ids = _ids(length, seed=length)
        with torch.no_grad():
            want = model(ids).logits
        monkeypatch.setattr(sdpa, "sdpa_attention_forward", counted)
        calls.clear()
        got = remap_logits(model, *DCA, ids)
        monkeypatch.setattr(sdpa, "sdpa_attention_forward", plain)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert len(calls) == model.config.num_hidden_layers, "DCA within the trained length left the fast path"
    ids = _ids(L0 + 1)
    with torch.no_grad():
        assert (remap_logits(model, *DCA, ids) - model(ids).logits).abs().max() > 1e-4  # past c it acts


def _dca_three_rotations(s: int, w: int, c: int) -> PositionMap:
    """DCA as the paper computes it: three query rotations (P_q^Intra, P_q^Succ, P_q^Inter), one key rotation
    (P_k = j mod s) shared by all three, selected by chunk distance. None of them is the identity."""
    key = lambda j: torch.remainder(j, s)  # noqa: E731
    intra = Rotation(query=lambda i: torch.remainder(i, s), key=key)
    succ = Rotation(query=lambda i: torch.where(torch.remainder(i, s) < w, s + torch.remainder(i, s),
                                                torch.full_like(i, c - 1)), key=key)
    inter = Rotation(query=lambda i: torch.full_like(i, c - 1), key=key)

    def select(i, j):
        apart = torch.div(i, s, rounding_mode="floor") - torch.div(j, s, rounding_mode="floor")
        return apart.clamp(0, 2).to(torch.int8)

    return PositionMap("dca", (intra, succ, inter), select, 0, None, {"chunk_size": s, "local_window": w})


@pytest.mark.parametrize("strategy", ["scores", "concat"])
def test_three_rotation_maps(monkeypatch, strategy):
    """The attention merges any number of rotations in one softmax: DCA written as the paper's three query
    rotations (swapped into the patched model's state) gives the dense reference's logits, in small query chunks
    (where some chunks use one, two or three rotations) and with both strategies; and so does the two-rotation map
    ctxext uses."""
    monkeypatch.setattr(remap_attention, "MIN_ROWS", 8)
    monkeypatch.setattr(remap_attention, "CHUNK_BYTES", 8 * 4 * 200 * 4 * 9)  # 18-25 rows a chunk
    monkeypatch.setattr(remap_attention, "STRATEGY", strategy)
    method, factor, options = DCA_SMALL
    for arch in sorted(MODELS):
        model = MODELS[arch]()
        ids = _ids(200, seed=5)
        want = dense_logits(model, method, factor, options, ids)
        restore = apply_remap(model, method, factor, options)
        try:
            with torch.no_grad():
                two = model(ids).logits
            three = _dca_three_rotations(options["chunk_size"], options["local_window"], L0)
            for module in model.modules():
                state = getattr(module, remap_attention.STATE_ATTR, None)
                if state is not None:
                    state.map = three
            with torch.no_grad():
                got = model(ids).logits
        finally:
            restore()
        torch.testing.assert_close(two, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ------------------------------------------------------------- hybrid models: sliding-window + full attention


def _matches_dense_changes_and_decodes(model, method, factor, options):
    """The patched model equals the dense reference at 200 tokens (1e-5), differs from the unpatched model, and
    decodes with the cache as a full pass (prompt 90, 30 new tokens)."""
    ids = _ids(200)
    want = dense_logits(model, method, factor, options, ids)
    got = remap_logits(model, method, factor, options, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert (got - model(ids).logits).abs().max() > 1e-4
    _decodes_as_a_full_forward(model, method, factor, options)


@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, LM_INFINITE, DCA_SMALL, STREAMING],
                         ids=["self-extend", "lm-infinite", "dca", "streaming-llm"])
def test_a_hybrid_model_keeps_its_sliding_layers_and_remaps_its_full_ones(method, factor, options):
    """The sliding layer (window 24, within the trained 64) never meets an untrained distance: it keeps true
    positions and its window; the full-attention layer takes the paper's map. Cached decoding == full pass."""
    model = _hybrid()
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    _matches_dense_changes_and_decodes(model, method, factor, options)


@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, REROPE, STREAMING],
                         ids=["self-extend", "rerope", "streaming-llm"])
def test_layers_without_rotary_positions_get_none(method, factor, options):
    """SmolLM3's NoPE layer: the remap adds no rotation there (and no ReRoPE query scaling), only the map's mask;
    the rotary layer takes the map. Found by a probe, not by reading no_rope_layers."""
    model = _smollm3()
    ids = _ids(200)
    want = dense_logits(model, method, factor, options, ids)
    got = remap_logits(model, method, factor, options, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_model_whose_rotary_layers_are_all_windowed_or_absent_is_refused():
    """Nothing for the map to act on: a refusal, not a patch that changes nothing."""
    model = _smollm3(no_rope_layers=[0, 0])
    with pytest.raises(PatchError, match="nothing to remap"):
        check_remap(model, "self-extend", 4, {})


def _linear_hybrid():
    """Qwen3-Next: a linear-attention layer (Gated DeltaNet: no positions, no attention function) and a full-attention
    layer with partial rotary (a quarter of each head) and a gated output."""
    import importlib.util

    from ctxext import census

    if importlib.util.find_spec("transformers.models.qwen3_next") is None:
        pytest.skip("Qwen3-Next arrived in transformers 4.57")
    return census.build_tiny("qwen3_next", {"max_position_embeddings": L0})


@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, REROPE, DCA_SMALL, STREAMING],
                         ids=["self-extend", "rerope", "dca", "streaming-llm"])
def test_a_linear_attention_hybrid_remaps_its_full_attention_layers(method, factor, options):
    """The linear-attention layer never calls the attention function and has no positions: it stays as trained;
    the full-attention layer takes the paper's map (dense reference, 1e-5); cached decoding (the hybrid cache with
    the recurrent state) equals a full pass."""
    model = _linear_hybrid()
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    _matches_dense_changes_and_decodes(model, method, factor, options)


def test_attention_layers_of_other_types_are_refused():
    """A layer type whose layers do call the attention function, with a meaning the remap does not implement
    (Llama 4's chunked attention), is refused; linear-attention layers are not (they never call it)."""
    from ctxext import census

    with pytest.raises(PatchError, match="chunked_attention"):
        check_remap(census.build_tiny("llama4_text", {"max_position_embeddings": L0}), "self-extend", 4, {})


def _mla(interleave: bool):
    """DeepSeek V3's multi-head latent attention: per head 8 dims without positions then 8 rotary dims (keys from a
    compressed latent, one rotary key shared by the heads), value heads of 12 dims, neighbour-pair rope reordered
    into halves (``rope_interleave``) or plain halves."""
    from ctxext import census

    return census.build_tiny("deepseek_v3", {"max_position_embeddings": L0, "rope_interleave": interleave,
                                             "head_dim": 8, "v_head_dim": 12, "num_key_value_heads": 4})


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved-rope", "half-rope"])
@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, DCA_SMALL, STREAMING],
                         ids=["self-extend", "dca", "streaming-llm"])
def test_multi_head_latent_attention_matches_the_dense_reference(interleave, method, factor, options):
    """MLA rotates the last qk_rope_head_dim dims of each head: the remap turns those (the paper's map, 1e-5 against
    the dense reference), keeps the others, and decodes with the cache as a full pass."""
    _matches_dense_changes_and_decodes(_mla(interleave), method, factor, options)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved-rope", "half-rope"])
def test_multi_head_latent_attention_identity_settings_equal_the_unpatched_model(interleave):
    """Where each dim of a head rotates, and how, is the model's own: identity settings give its logits."""
    model = _mla(interleave)
    for method, factor, options in IDENTITY[:3]:
        for length in (5, 150):
            ids = _ids(length, seed=length)
            with torch.no_grad():
                want = model(ids).logits
            got = remap_logits(model, method, factor, options, ids)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _gemma2(**overrides):
    """Gemma 2: soft-capped attention logits (cap 1; query_pre_attn_scalar 1, so scores reach the cap), a sliding
    layer (window 24 < the trained 64) and a full one; eager attention, where transformers applies the cap."""
    settings = dict(num_key_value_heads=2, head_dim=16, sliding_window=24, attn_logit_softcapping=1.0,
                    query_pre_attn_scalar=1, attn_implementation="eager", pad_token_id=0)
    return _tiny("Gemma2", {"rope_type": "default", "rope_theta": 10000.0}, **{**settings, **overrides})


def _gpt_oss(**overrides):
    """GPT-OSS: a learned sink logit per head (``s_aux``; drawn large here, so it matters), YaRN x4 shipped over an
    original 16 tokens, rotary cos/sin emitted once per frequency, a sliding layer (24) and a full one, MoE MLP."""
    rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0}
    settings = dict(num_key_value_heads=2, head_dim=16, sliding_window=24, num_local_experts=2, num_experts_per_tok=1,
                    layer_types=["sliding_attention", "full_attention"], attn_implementation="eager", pad_token_id=0)
    model = _tiny("GptOss", rope, **{**settings, **overrides})
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=torch.Generator().manual_seed(5)) * 2)
    return model


#: models whose attention does what sdpa cannot: soft-capped logits (Gemma 2), per-head sink logits (GPT-OSS)
EAGER_ONLY = {"gemma2": _gemma2, "gpt-oss": _gpt_oss}


@pytest.mark.parametrize("arch", sorted(EAGER_ONLY))
@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, REROPE, LM_INFINITE, DCA_SMALL, STREAMING],
                         ids=["self-extend", "rerope", "lm-infinite", "dca", "streaming-llm"])
def test_soft_capped_logits_and_sinks_are_kept(arch, method, factor, options):
    """Gemma 2 soft-caps its attention logits (``softcap`` in the attention call), GPT-OSS adds a sink logit per
    head (``s_aux``): the remap applies them as the model's eager attention does, so the patched model equals the
    dense reference with them (1e-5), its sliding layer stays as trained, and cached decoding equals a full pass."""
    model = EAGER_ONLY[arch]()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    _matches_dense_changes_and_decodes(model, method, factor, options)


@pytest.mark.parametrize("arch", sorted(EAGER_ONLY))
def test_soft_capped_and_sunk_attention_trains_like_the_dense_reference(arch):
    """LoRA / fine-tuning goes through the same path: the loss's gradient matches the dense reference's (the cap's
    tanh and the sink column are differentiated, nothing in place breaks autograd)."""
    method, factor, options = SELF_EXTEND
    model = EAGER_ONLY[arch]()
    ids = _ids(120)
    grads = []
    for dense in (False, True):
        model.zero_grad()
        restore, back = _with_dense(model, method, factor, options) if dense else (
            apply_remap(model, method, factor, options), lambda: None)
        try:
            model(ids, labels=ids).loss.backward()
        finally:
            back()
            restore()
        grads.append(model.model.layers[1].self_attn.q_proj.weight.grad.clone())
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", sorted(EAGER_ONLY))
@pytest.mark.parametrize("method,factor,options", IDENTITY, ids=[f"{c[0]}-{i}" for i, c in enumerate(IDENTITY)])
def test_identity_settings_equal_the_models_own_capped_or_sunk_attention(arch, method, factor, options):
    """Settings that map every pair to its true distance give the model's own eager logits (soft-capped / with
    sinks), on the chunked path, short and long."""
    model = EAGER_ONLY[arch]()
    for length in (5, 200):
        ids = _ids(length, seed=length)
        with torch.no_grad():
            want = model(ids).logits
        torch.testing.assert_close(remap_logits(model, method, factor, options, ids), want, atol=1e-5, rtol=0)


def _gemma3():
    """Gemma 3: a sliding layer (window 24, plain RoPE base 10k) and a full layer (linear x2 on base 1M), one set of
    frequencies per layer type (the transformers 5.x rotary module), query_pre_attn_scalar scaling."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if "rope_parameters" not in inspect.signature(Gemma3TextConfig.__init__).parameters:
        pytest.skip("per-layer-type rope_parameters are a transformers 5.x surface (4.x: two rotary modules, refused)")
    torch.manual_seed(0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=L0,
                              sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                              rope_parameters=rope, pad_token_id=0, attn_implementation="sdpa")
    return Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, REROPE, DCA_SMALL, STREAMING],
                         ids=["self-extend", "rerope", "dca", "streaming-llm"])
def test_gemma3_sliding_layers_keep_their_set_and_the_full_layers_take_the_map(method, factor, options):
    """Each layer rotates with its own layer type's frequencies; the sliding layer keeps true positions and its
    window, the full layer (linear x2 shipped) takes the paper's map. Cached decoding == full pass."""
    _matches_dense_changes_and_decodes(_gemma3(), method, factor, options)


def test_sliding_layers_that_see_untrained_distances_or_no_full_layer_are_refused():
    with pytest.raises(PatchError, match="past its trained 64"):
        check_remap(_hybrid(sliding_window=100), "self-extend", 4, {})
    all_sliding = _hybrid(max_window_layers=0)
    assert set(all_sliding.config.layer_types) == {"sliding_attention"}
    with pytest.raises(PatchError, match="in every layer"):
        check_remap(all_sliding, "self-extend", 4, {})


# ------------------------------------------------------------- models that ship scaled RoPE (static rope types)

#: Llama 3.1-style llama3, Qwen2.5-style yarn (attention factor 1 + 0.1 ln 4) and a linear x2 config
SHIPPED = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500.0},
}


@pytest.mark.parametrize("preset", sorted(SHIPPED))
@pytest.mark.parametrize("method,factor,options", [SELF_EXTEND, REROPE, LM_INFINITE, STRING, DCA],
                         ids=["self-extend", "rerope", "lm-infinite", "string", "dca"])
def test_on_a_shipped_scaled_rope_matches_the_dense_reference_with_the_models_rotation(preset, method, factor,
                                                                                       options):
    """The remap keeps the model's own rotation: the frequencies transformers built for its rope type and its
    attention factor, applied at the paper's relative positions (advertised max_position_embeddings = 64 as the
    original length)."""
    model = _llama(rope_parameters=SHIPPED[preset])
    ids = _ids(200)
    want = dense_logits(model, method, factor, options, ids)
    got = remap_logits(model, method, factor, options, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert (got - model(ids).logits).abs().max() > 1e-4


@pytest.mark.parametrize("preset", sorted(SHIPPED))
def test_identity_settings_on_a_shipped_scaled_rope_equal_transformers_own_rope_type(preset):
    model = _llama(rope_parameters=SHIPPED[preset])
    for method, factor, options in IDENTITY:
        ids = _ids(150, seed=7)
        with torch.no_grad():
            want = model(ids).logits
        torch.testing.assert_close(remap_logits(model, method, factor, options, ids), want, atol=1e-5, rtol=0)


BAD = [
    ("self-extend", 8, {"group": 0}, r"'group'.*>= 1"),
    ("self-extend", 8, {"window": 0}, r"'window'.*>= 1"),
    ("self-extend", 2, {"window": 1000}, r"larger than needed.*128 tokens"),
    ("self-extend", 8, {"group": 2.5}, r"whole number"),
    ("rerope", 8, {"window": 600}, r"larger than needed"),
    ("rerope", 8, {"leaky": 0.5}, r"'leaky'.*>= 1"),
    ("rerope", 8, {"log_scale": "yes"}, r"true or false"),
    ("lm-infinite", 8, {"global_tokens": -1}, r"'global_tokens'.*>= 0"),
    ("string", 1.5, {"shift": 8, "local": 16}, r"local=16.*<= shift=8"),
    ("string", 4, {}, r"STRING reaches at most"),
    ("string", 8, {"bogus": 1}, r"bad option"),
    ("dca", 8, {"chunk_size": 0}, r"'chunk_size'.*>= 1"),
    ("dca", 8, {"chunk_size": 64}, r"chunk_size=64.*< the trained length 64"),
    ("dca", 8, {"chunk_size": 12.5}, r"whole number"),
    ("dca", 8, {"local_window": -1}, r"'local_window'.*>= 0"),
    ("dca", 8, {"chunk_size": 20, "local_window": 21}, r"local_window=21.*larger than needed.*<= 20"),
    ("dca", 8, {"chunk_size": 48, "local_window": 17}, r"local_window=17.*past the trained.*<= 16"),
    ("dca", 8, {"local_window": 17}, r"local_window <= 16"),  # against the default chunk size 48
]


@pytest.mark.parametrize("method,factor,options,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_options_raise_before_touching_the_model(method, factor, options, match):
    model = _llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PatchError, match=match):
        apply_remap(model, method, factor, options)
    assert model.config._attn_implementation == "sdpa"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_models_it_cannot_serve_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=1, n_head=4, n_positions=32))
    with pytest.raises(PatchError, match="no rotary module"):
        check_remap(gpt2, "rerope", 4, {})
    with pytest.raises(PatchError, match="rope_type 'dynamic'"):
        check_remap(_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}),
                    "rerope", 4, {})
    with pytest.raises(PatchError, match="sliding-window"):
        check_remap(_llama(sliding_window=32), "self-extend", 4, {})
    odd_sinks = _llama()  # sinks other than one logit per head: not what the remap applies
    for module in odd_sinks.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "is_causal"):
            module.sinks = torch.nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(PatchError, match=r"sinks of shape \(4, 2\)"):
        check_remap(odd_sinks, "self-extend", 4, {})
    with pytest.raises(PatchError, match="unknown position-remapping method"):
        check_remap(_llama(), "dca2", 4, {})


# ----------------------------------------------------------------------------- through the public API and the CLI


@pytest.mark.parametrize("method, factor, options", [SELF_EXTEND, REROPE, LM_INFINITE, STRING, DCA_SMALL],
                         ids=lambda v: str(v))
def test_public_patch_equals_the_map_and_survives_save(method, factor, options, tmp_path):
    """ctxext.patch gives the logits of the position map; save -> ctxext.from_pretrained keeps the patch (bit for
    bit); a plain transformers load refuses the checkpoint; unpatch restores the model exactly."""
    import ctxext
    from transformers import AutoModelForCausalLM

    model, ids = _llama(), _ids(150)
    with torch.no_grad():
        before = model(ids).logits
    expected = remap_logits(_llama(), method, factor, options, ids)
    ctxext.patch(model, method, factor, **options)
    spec = ctxext.describe(model)
    assert spec["method"] == method and spec["patched_length"] == int(round(L0 * factor))
    with torch.no_grad():
        patched = model(ids).logits
    torch.testing.assert_close(patched, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(patched, before, atol=1e-3)  # the patch changes the logits past L0
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(Exception, match="ctxext.from_pretrained"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    again = ctxext.from_pretrained(str(tmp_path / "saved"))
    assert ctxext.describe(again) == spec
    with torch.no_grad():
        assert torch.equal(again(ids).logits, patched)
    ctxext.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("first,factor", [("self-extend", 4), ("nope", None), ("yarn", 4)])
def test_replacing_a_patch_with_a_remap_equals_patching_the_plain_model(first, factor):
    """A replacement is checked on the patched model: the rotation probes must see the model's own rotation, not the
    zeroed one a remap / NoPE patch leaves (they refused "nothing to remap" before)."""
    import ctxext

    ids = _ids(150)
    model, fresh = _llama(), _llama()
    ctxext.patch(model, first, factor)
    ctxext.patch(model, "dca", 4, replace=True)
    ctxext.patch(fresh, "dca", 4)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)


def test_remap_methods_refuse_other_families_and_bad_options_via_the_api():
    import ctxext
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=L0))
    with pytest.raises(PatchError, match="not rotary"):
        ctxext.patch(gpt2, "self-extend", 4)
    model = _llama()
    with pytest.raises(PatchError, match="whole number"):
        ctxext.patch(model, "self-extend", 4, group=2.5)
    with pytest.raises(PatchError):
        ctxext.patch(model, "rerope", 4, window=0)
    assert ctxext.describe(model) is None and model.config._attn_implementation == "sdpa"


def test_eval_cli_runs_remap_methods(tmp_path):
    """`ctxext eval --methods self-extend,dca,rerope,lm-infinite,string` on a tiny saved model."""
    import json

    from ctxext.cli import main
    from test_eval_fixtures import CORPUS, save_tiny_llama

    model_dir = save_tiny_llama(tmp_path / "llama")
    out = tmp_path / "r.json"
    rc = main(["eval", "--no-progress", "--device", "cpu", "--model", str(model_dir), "--data", str(CORPUS),
               "--lengths", "64,128", "--methods", "none,self-extend,dca,rerope,lm-infinite,string:1.5",
               "--factor", "2", "--max-windows", "1", "--output", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["method"] for r in rows} == {"none", "self-extend", "dca", "rerope", "lm-infinite", "string"}
    assert all(r["ppl"] and r["ppl"] > 1 for r in rows)
