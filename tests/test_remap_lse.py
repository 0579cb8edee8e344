"""The log-sum-exp path of the remap attention (``ctxext.attention.lse``, ``remap_attention.LSE_PATH``): key ranges
(``KeySplit``) on the fused CPU flash kernel, merged by log-sum-exp.

The dense reference here is written from the definition (one softmax over all pairs, each pair scored under the
rotation its range gives, or masked), and each method's declared ranges are checked pair by pair against its own
``select`` and shares nothing with the module; end to end, a patched model's logits with the path
on equal those with it off (the chunked path, itself checked against the papers' definitions in test_remap.py), and
a call counter makes sure the path was taken (or not, where it must not be).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_llama

import ctxext.attention.lse as lse_attention
import ctxext.attention.remap as remap_attention
from ctxext.adapters.remap import apply_remap
from ctxext.methods.remap import build_map

pytestmark = pytest.mark.skipif(not lse_attention.available(), reason="the CPU flash op is not pinned for this torch")

L0 = 64  # tiny_llama's trained length


def _dense(q0, q1, k0, k1, v, which, scale):
    """(batch, T, heads, dim) in float64: one softmax over the pairs, rotation ``which[i, j]`` (0 or 1; -1 masked)."""
    q0, q1, k0, k1, v = (t.double() for t in (q0, q1, k0, k1, v))
    heads, kv_heads = q0.shape[1], k0.shape[1]
    rep = heads // kv_heads  # query head h reads key head h // rep (transformers' repeat_kv)
    k0, k1, v = (t.repeat_interleave(rep, dim=1) for t in (k0, k1, v))
    s = torch.where(which == 0, q0 @ k0.transpose(-1, -2), q1 @ k1.transpose(-1, -2)) * scale
    s = s.masked_fill(which < 0, -math.inf)
    return (s.softmax(-1) @ v).transpose(1, 2)


def _which(near_start, far_keys):
    """The KeySplit definition, pair by pair: near keys near_start(i) .. i, far keys below min(near_start(i), G)."""
    T = near_start.numel()
    j = torch.arange(T)[None, :]
    i = torch.arange(T)[:, None]
    start = near_start[:, None]
    far_end = start if far_keys is None else start.clamp(max=far_keys)
    return torch.where((j >= start) & (j <= i), 0, torch.where(j < far_end, 1, -1))


def _inputs(seed, batch, T, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 16  # GQA
    q0, q1 = torch.randn(2, batch, heads, T, dim, generator=g).to(dtype).unbind(0)
    k0, k1, v = torch.randn(3, batch, kv_heads, T, dim, generator=g).to(dtype).unbind(0)
    return (q0, q1), (k0, k1), v


def _band(T, near):
    return (torch.arange(T) - near + 1).clamp(min=0)


def _chunks(T, s, w):  # DCA's shape: the query's chunk, and the one before for the first w rows of a chunk
    i = torch.arange(T)
    chunk = i // s
    return (chunk - ((i % s < w) & (chunk > 0)).long()) * s


SHAPES = {
    "band": (300, lambda T: _band(T, 64), None, 2),
    "band, one key": (400, lambda T: _band(T, 1), None, 1),
    "band, partial": (517, lambda T: _band(T, 250), None, 1),
    "band near T": (129, lambda T: _band(T, 128), None, 1),
    "band and sinks": (300, lambda T: _band(T, 40), 4, 2),
    "band, no sinks": (300, lambda T: _band(T, 40), 0, 1),
    "window then band, sinks": (300, lambda T: torch.where(torch.arange(T) < 100, 0, _band(T, 60)), 5, 1),
    "chunks": (333, lambda T: _chunks(T, 48, 16), None, 2),
    "chunks, no window": (333, lambda T: _chunks(T, 50, 0), None, 1),
    "random starts": (257, lambda T: (torch.rand(T, generator=torch.Generator().manual_seed(9)) *
                                      (torch.arange(T) + 1)).long(), 30, 2),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("block,min_block,min_run", [(1024, 128, 64), (48, 16, 4)])
def test_split_attention_matches_the_dense_definition(monkeypatch, name, block, min_block, min_run):
    # the shipped block sizes (mostly one block at these lengths, bands in blocks of 128, fixed blocks for chunks),
    # and small ones: several blocks, partial last ones, blocks that follow DCA's runs of one near start
    monkeypatch.setattr(lse_attention, "BLOCK", block)
    monkeypatch.setattr(lse_attention, "MIN_BLOCK", min_block)
    monkeypatch.setattr(lse_attention, "MIN_RUN", min_run)
    T, starts, far_keys, batch = SHAPES[name]
    near_start = starts(T)
    queries, keys, v = _inputs(T + block, batch, T)
    out = lse_attention.split_attention(queries, keys, v, near_start, far_keys, 16**-0.5)
    assert out.shape == (batch, T, 4, 16) and out.dtype == torch.float32 and out.is_contiguous()
    reference = _dense(*queries, *keys, v, _which(near_start, far_keys), 16**-0.5)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=0)


def test_split_attention_bfloat16_is_close_to_the_dense_definition():
    queries, keys, v = _inputs(2, 1, 300, torch.bfloat16)
    near_start = _chunks(300, 64, 20)
    out = lse_attention.split_attention(queries, keys, v, near_start, None, 0.25)
    assert out.dtype == torch.bfloat16
    reference = _dense(*queries, *keys, v, _which(near_start, None), 0.25)
    torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=0)


def test_split_attention_refuses_a_start_past_the_query():
    queries, keys, v = _inputs(3, 1, 20)
    bad = torch.arange(20)
    bad[5] = 6  # query 5 would not see itself
    with pytest.raises(ValueError, match="near_start"):
        lse_attention.split_attention(queries, keys, v, bad, None, 0.25)


DECLARED = [
    ("self-extend", 8, {}), ("self-extend", 8, {"group": 3, "window": 10}),
    ("rerope", 8, {}), ("rerope", 8, {"leaky": 4.0}), ("rerope", 8, {"window": 7, "log_scale": False}),
    ("string", None, {}), ("string", 1.5, {"shift": 40, "local": 3}),
    ("dca", 8, {}), ("dca", 8, {"chunk_size": 20, "local_window": 0}), ("dca", 8, {"chunk_size": 40}),
    ("lm-infinite", 8, {}), ("lm-infinite", 8, {"global_tokens": 0, "window": 30}),
    ("streaming-llm", 8, {}), ("streaming-llm", 8, {"sinks": 0, "window": 17}),
]


@pytest.mark.parametrize("method,factor,options", DECLARED)
def test_each_declared_split_restates_the_methods_selection(method, factor, options):
    """A method's key ranges say exactly what its ``select`` (checked against the paper in test_remap.py) says."""
    pmap = build_map(method, L0, factor, **options)
    assert pmap.split is not None and len(pmap.rotations) == 2 and pmap.rotations[0].is_identity
    T = 600
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    which = pmap.select(i, j).long().masked_fill(j > i, -1)
    expected = _which(pmap.split.near_start(torch.arange(T)), pmap.split.far_keys)
    assert torch.equal(which, expected), method


def test_identity_settings_declare_no_split():
    for method, factor, options in [("self-extend", 1, {}), ("string", None, {"shift": 0}),
                                    ("rerope", 8, {"leaky": 1.0})]:
        assert build_map(method, L0, factor, **options).split is None, method


def test_is_causal_mask_check():
    T = 50
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    assert remap_attention._is_causal(causal)
    assert remap_attention._is_causal(causal.expand(3, T, T))
    padded = causal.clone()
    padded[:, :, 0] = False
    padded[:, 0, 0] = True  # row 0 still sees itself; the others miss key 0
    assert not remap_attention._is_causal(padded)
    extra = causal.clone()
    extra[0, 10, 20] = True
    assert not remap_attention._is_causal(extra)
    windowed = causal & torch.ones(T, T, dtype=torch.bool).triu(-9)
    assert not remap_attention._is_causal(windowed)
    swapped = causal.clone()  # right count per row, wrong keys
    swapped[0, 30, 3], swapped[0, 30, 31] = False, True
    assert not remap_attention._is_causal(swapped)
    batch = torch.cat([causal, padded])
    assert not remap_attention._is_causal(batch)


def _counting(monkeypatch):
    calls = []
    real = remap_attention.split_attention

    def counted(*args, **kwargs):
        calls.append(args[0][0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(remap_attention, "split_attention", counted)
    return calls


CASES = [("self-extend", 8, {}), ("rerope", 8, {}), ("rerope", 8, {"leaky": 4.0}), ("string", None, {}),
         ("dca", 8, {"chunk_size": 40}), ("lm-infinite", 8, {"window": 50}), ("streaming-llm", 8, {"window": 50}),
         ("streaming-llm", 8, {"sinks": 0, "window": 50})]


@pytest.mark.parametrize("method,factor,options", CASES)
def test_patched_model_logits_equal_the_chunked_path(monkeypatch, method, factor, options):
    monkeypatch.setattr(remap_attention, "LSE_MIN_LEN", 64)
    calls = _counting(monkeypatch)
    model = tiny_llama()
    apply_remap(model, method, factor, options)
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = model(ids).logits
        assert len(calls) == model.config.num_hidden_layers  # every layer took the new path
        monkeypatch.setattr(remap_attention, "LSE_PATH", False)
        slow = model(ids).logits
    assert len(calls) == model.config.num_hidden_layers  # and the switch turned it off
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=0)


def test_below_the_length_threshold_the_chunked_path_runs(monkeypatch):
    calls = _counting(monkeypatch)
    model = tiny_llama()
    apply_remap(model, "self-extend", 8, {})
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 300)))
    assert remap_attention.LSE_MIN_LEN > 300 and not calls


def test_gradients_padding_and_cached_decoding_take_the_chunked_path(monkeypatch):
    monkeypatch.setattr(remap_attention, "LSE_MIN_LEN", 64)
    calls = _counting(monkeypatch)
    model = tiny_llama()
    apply_remap(model, "self-extend", 8, {})
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(4))
    # with autograd: the chunked path, whose gradients test_remap.py checks
    out = model(ids).logits
    out.sum().backward()
    assert not calls and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    with torch.no_grad():
        fast = model(ids).logits
    assert len(calls) == 2
    torch.testing.assert_close(out.detach(), fast, atol=1e-5, rtol=0)
    calls.clear()
    # left padding: positions are not 0 .. T-1 in every row
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert not calls
    # cached decoding: the prefill takes the path, the decoding steps do not
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids[:1]))
    assert len(calls) == 2 and all(shape[2] == 300 for shape in calls)


def test_soft_capped_attention_never_takes_the_path(monkeypatch):
    from ctxext import census

    monkeypatch.setattr(remap_attention, "LSE_MIN_LEN", 64)
    calls = _counting(monkeypatch)
    model = census.build_tiny("gemma2")  # attention logits soft-capped: the chunked "scores" path only
    apply_remap(model, "self-extend", 8, {})
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 300)))
    assert not calls


def test_the_causal_mask_check_reads_a_new_mask_anew():
    from ctxext.attention import remap as ra

    t = 6
    causal = torch.ones(1, t, t, dtype=torch.bool).tril()
    assert ra._is_causal(causal) and ra._is_causal(causal)  # the second answer from the cache
    padded = causal.clone()
    padded[0, :, 0] = False  # a left-padded row: not the causal mask
    assert not ra._is_causal(padded)
    causal[0, 3, 0] = False  # changed in place: read again
    assert not ra._is_causal(causal)


# ----------------------------------------------------------------------------- a band's masked calls, batched
# On CUDA a band's full masked blocks run many to one kernel call (``BATCHED_BAND``); here it is forced on the CPU
# kernel. Batch 2 and GQA (``_inputs``); no T below is a multiple of its block size (the partial last block runs
# alone); byte budgets from everything in one call down to one block per call.

SIZES = {"shipped": (1024, 128, 64), "small": (48, 16, 4)}
BATCHED = [(name, sizes) for name in SHAPES for sizes in SIZES  # the pairs with masked band blocks
           if name != "band near T" and not (name.startswith("chunks") and sizes == "small")]


def _batched_groups(monkeypatch):
    groups = []
    real = lse_attention._near_batched

    def counted(q, k, v, first, count, *args):
        groups.append(count)
        return real(q, k, v, first, count, *args)

    monkeypatch.setattr(lse_attention, "_near_batched", counted)
    return groups


def _split(monkeypatch, name, sizes, batched, budget=64 << 20, seed=11):
    for attr, value in zip(("BLOCK", "MIN_BLOCK", "MIN_RUN"), SIZES[sizes]):
        monkeypatch.setattr(lse_attention, attr, value)
    monkeypatch.setattr(lse_attention, "BATCHED_BAND", batched)
    monkeypatch.setattr(lse_attention, "BATCH_BYTES", budget)
    T, starts, far_keys, _ = SHAPES[name]
    queries, keys, v = _inputs(seed, 2, T)
    out = lse_attention.split_attention(queries, keys, v, starts(T), far_keys, 16**-0.5)
    return out, (queries, keys, v, starts(T), far_keys)


@pytest.mark.parametrize("budget", [64 << 20, 100_000, 1])
@pytest.mark.parametrize("name,sizes", BATCHED)
def test_batched_band_matches_the_dense_definition(monkeypatch, name, sizes, budget):
    groups = _batched_groups(monkeypatch)
    out, (queries, keys, v, near_start, far_keys) = _split(monkeypatch, name, sizes, True, budget)
    assert groups and (budget > 1 or set(groups) == {1})  # batched; a budget of one byte: one block per call
    reference = _dense(*queries, *keys, v, _which(near_start, far_keys), 16**-0.5)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,sizes", BATCHED)
def test_batched_band_equals_the_unbatched_path(monkeypatch, name, sizes):
    groups = _batched_groups(monkeypatch)
    one_by_one, _ = _split(monkeypatch, name, sizes, False)
    assert not groups
    for budget in (64 << 20, 100_000):
        batched, _ = _split(monkeypatch, name, sizes, True, budget)
        torch.testing.assert_close(batched, one_by_one, atol=1e-6, rtol=0)
    assert groups


def test_the_band_runs_batched_only_where_asked(monkeypatch):
    groups = _batched_groups(monkeypatch)
    assert lse_attention.BATCHED_BAND is None
    monkeypatch.setenv("CTXEXT_BATCHED_BAND", "1")  # asks for it on CUDA; the CPU path stays one call per block
    _split(monkeypatch, "band", "shipped", None)
    assert not groups


@pytest.mark.parametrize("method,factor,options", [("self-extend", 8, {}), ("rerope", 8, {}),
                                                   ("lm-infinite", 8, {"window": 50})])
def test_patched_model_logits_with_the_band_batched(monkeypatch, method, factor, options):
    monkeypatch.setattr(remap_attention, "LSE_MIN_LEN", 64)
    monkeypatch.setattr(lse_attention, "BATCH_BYTES", 200_000)  # a few blocks per call
    groups = _batched_groups(monkeypatch)
    model = tiny_llama()
    apply_remap(model, method, factor, options)
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        monkeypatch.setattr(lse_attention, "BATCHED_BAND", True)
        batched = model(ids).logits
        assert len(groups) >= model.config.num_hidden_layers
        monkeypatch.setattr(lse_attention, "BATCHED_BAND", False)
        one_by_one = model(ids).logits
    torch.testing.assert_close(batched, one_by_one, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------- CUDA's fused kernels, emulated
# No GPU here: the adapter that runs the merge path on CUDA (``compat.torch.cuda_attention_with_lse``) is checked
# with stand-ins for the two CUDA ops, written from their contracts as torch's sources state them (flash: no mask,
# grouped keys read as they are, log-sum-exp (B, H, L); memory-efficient: as many key/value heads as query heads, a
# 4D bias whose rows start at multiples of 16, log-sum-exp padded to a multiple of 32 queries), and the real ops' signatures and output shapes on the meta device. tests/test_gpu.py runs
# the real kernels.

import ctxext.compat.torch as torch_compat  # noqa: E402


def _contract_attention(q, k, v, causal, scale, bias=None):
    assert q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1]
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))  # query head h: key head h // rep
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:
        assert q.shape[2] == k.shape[2]
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    lse = s.logsumexp(-1)
    return (s.softmax(-1).nan_to_num(0.0) @ v.double()).to(q.dtype), lse.float()


def _fake_flash(q, k, v, dropout, causal, debug, scale=None):
    assert dropout == 0.0 and not debug and q.dtype in (torch.float16, torch.bfloat16)
    return (*_contract_attention(q, k, v, causal, scale), None, None, 0, 0, None, None, None)


def _fake_efficient(q, k, v, bias, compute_lse, dropout, causal, scale=None):
    assert compute_lse and dropout == 0.0
    assert k.shape[1] == q.shape[1] == v.shape[1], "the memory-efficient op wants as many key/value heads as queries"
    if bias is not None:
        assert bias.dim() == 4 and bias.stride(-2) % torch_compat.EFFICIENT_BIAS_ALIGN == 0 and bias.stride(-1) == 1
    out, lse = _contract_attention(q, k, v, causal, scale, bias)
    padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), math.inf)
    padded[..., : lse.shape[-1]] = lse
    return out, padded, None, None


@pytest.fixture
def emulated_cuda(monkeypatch):
    fakes = {torch_compat.CUDA_FLASH_OP: _fake_flash, torch_compat.CUDA_EFFICIENT_OP: _fake_efficient}
    monkeypatch.setattr(torch_compat, "_aten", fakes.__getitem__)
    monkeypatch.setattr(lse_attention, "_attend", torch_compat.cuda_attention_with_lse)


@pytest.mark.parametrize("name", ["band", "band and sinks", "chunks", "random starts"])
def test_split_attention_on_cudas_kernel_contracts_matches_the_dense_definition(emulated_cuda, name):
    T, starts, far_keys, batch = SHAPES[name]
    near_start = starts(T)
    queries, keys, v = _inputs(5, batch, T)
    out = lse_attention.split_attention(queries, keys, v, near_start, far_keys, 16**-0.5)
    reference = _dense(*queries, *keys, v, _which(near_start, far_keys), 16**-0.5)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=0)
    q16, k16, v16 = ([t.to(torch.bfloat16) for t in queries], [t.to(torch.bfloat16) for t in keys],
                     v.to(torch.bfloat16))  # bf16: mask-free calls take the flash contract, masked ones the other
    out16 = lse_attention.split_attention(q16, k16, v16, near_start, far_keys, 16**-0.5)
    reference16 = _dense(*q16, *k16, v16, _which(near_start, far_keys), 16**-0.5)
    torch.testing.assert_close(out16.double(), reference16, atol=2e-2, rtol=0)


@pytest.mark.parametrize("name", ["band", "band and sinks", "band, partial"])
def test_batched_band_on_the_efficient_ops_contract_matches_the_dense_definition(emulated_cuda, monkeypatch, name):
    groups = _batched_groups(monkeypatch)
    monkeypatch.setattr(lse_attention, "_attend_blocks", lambda q, k, v, mask, scale: lse_attention._efficient_blocks(
        q, k, v, mask, scale, _fake_efficient))  # its 4D bias, aligned rows, heads expanded, padded lse
    out, (queries, keys, v, near_start, far_keys) = _split(monkeypatch, name, "small", True, 100_000)
    assert groups
    reference = _dense(*queries, *keys, v, _which(near_start, far_keys), 16**-0.5)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_band_call_takes_the_efficient_ops_arguments_on_the_meta_device(dtype):
    q = torch.empty(6, 8, 128, 64, device="meta", dtype=dtype)  # 3 blocks x batch 2, 4 heads; 2 key heads
    k = torch.empty(6, 4, 191, 64, device="meta", dtype=dtype)
    mask = torch.empty(6, 128, 191, device="meta", dtype=dtype)
    op = getattr(torch.ops.aten, torch_compat.CUDA_EFFICIENT_OP)
    out, lse = lse_attention._efficient_blocks(q, k, k, mask, 0.125, op)
    assert out.shape == (6, 8, 128, 64) and out.dtype == dtype
    assert lse.shape == (6, 8, 128) and lse.dtype == torch.float32


def test_cuda_adapter_refuses_a_causal_call_that_is_not_square(emulated_cuda):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="square"):
        torch_compat.cuda_attention_with_lse(q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), True, 0.3)


@pytest.mark.parametrize("dtype,masked", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False),
                                          (torch.float16, True)])
def test_cuda_ops_take_the_adapters_arguments_on_the_meta_device(dtype, masked):
    """The real CUDA ops' signatures and output shapes (their meta kernels run on CPU): GQA keys expanded, an
    unaligned masked width, the efficient op's padded log-sum-exp cut back to the queries."""
    q = torch.empty(2, 6, 100, 64, device="meta", dtype=dtype)
    k = torch.empty(2, 3, 100 if not masked else 130, 64, device="meta", dtype=dtype)
    mask = torch.empty(100, 130, device="meta", dtype=dtype) if masked else None
    out, lse = torch_compat.cuda_attention_with_lse(q, k, k, not masked, 0.125, mask)
    assert out.shape == (2, 6, 100, 64) and out.dtype == dtype
    assert lse.shape == (2, 6, 100) and lse.dtype == torch.float32


def test_the_cuda_merge_path_is_opt_in_until_a_torch_version_is_recorded(monkeypatch):
    monkeypatch.delenv("CTXEXT_CUDA_LSE", raising=False)
    recorded = torch_compat._version() in torch_compat.CUDA_FUSED_TESTED
    assert lse_attention.available("cuda") == recorded
    monkeypatch.setenv("CTXEXT_CUDA_LSE", "1")
    assert lse_attention.available("cuda")
    assert lse_attention.available("cpu") and not lse_attention.available("meta")


def test_the_cuda_merge_path_can_be_turned_off_on_a_tested_torch(monkeypatch):
    monkeypatch.setattr(torch_compat, "CUDA_FUSED_TESTED", (torch_compat._version(),))
    monkeypatch.delenv("CTXEXT_CUDA_LSE", raising=False)
    assert lse_attention.available("cuda")
    for off in ("0", "off", "false"):
        monkeypatch.setenv("CTXEXT_CUDA_LSE", off)
        assert not lse_attention.available("cuda")
    monkeypatch.setattr(torch_compat, "CUDA_FUSED_TESTED", ())
    monkeypatch.delenv("CTXEXT_CUDA_LSE")
    assert not lse_attention.available("cuda")


@pytest.mark.parametrize("capability,bf16", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_the_kernels_take_bfloat16_on_cuda_only_from_ampere(monkeypatch, capability, bf16):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert lse_attention.accepts("cuda", torch.bfloat16) == bf16
    assert lse_attention.accepts("cuda", torch.float16) and lse_attention.accepts("cuda", torch.float32)
    assert lse_attention.accepts("cpu", torch.bfloat16) and not lse_attention.accepts("cpu", torch.float16)
    assert not lse_attention.accepts("meta", torch.float32)
