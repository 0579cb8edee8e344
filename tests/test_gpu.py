"""The same behaviour on CUDA: remap attention against the dense reference, rotary parity with transformers'
rope types, the ALiBi swap, cached decoding and padded batches, in float32 and bfloat16.

Run with ``pytest -m gpu`` on a machine with a GPU (deselected by default; skipped without CUDA).

bfloat16 tolerances are not fixed numbers: a patched bf16 model may differ from its exact reference by no more
than ``BF16_SLACK`` times what bf16 costs the *unpatched* model on the same weights and inputs. A wrong position,
a dropped mask or a lost scale moves logits by orders of magnitude more than rounding does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_bloom, tiny_gpt2, tiny_llama, tiny_neox

import ctxext
from ctxext.adapters.remap import apply_remap

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
VOCAB = 128
BF16_SLACK = 3.0


def _ids(length, seed=1, batch=1):
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _bf16_rounded(model):
    """The model with bf16-representable weights, kept in float32: the exact reference of its bf16 copy. Buffers
    (rotary frequencies) stay as they are: a bf16 copy rounds them too, which the patch must cope with."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def _logits(model, ids, **kw):
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(ids.to(device), **{k: v.to(device) for k, v in kw.items()}).logits.float().cpu()


def _gap(a, b) -> float:
    return (a - b).abs().max().item()


def _bf16_budget(model_fp32_cpu, ids) -> float:
    """What bf16 on CUDA costs the unpatched model: max |logit| difference from its float32 CPU run."""
    want = _logits(model_fp32_cpu, ids)
    got = _logits(copy.deepcopy(model_fp32_cpu).to(CUDA, torch.bfloat16), ids)
    return _gap(got, want)


@pytest.fixture(autouse=True)
def _exact_float32():
    """float32 on CUDA means float32: no TF32 matmuls."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# ------------------------------------------------------------------------------------- attention-side remapping


def _remap_cases():
    from test_remap import CASES

    return CASES


@pytest.mark.parametrize("arch", ["llama", "neox"])
@pytest.mark.parametrize("case", range(len(_remap_cases())))
def test_remap_matches_dense_reference_on_cuda(arch, case):
    from test_remap import MODELS, dense_logits

    method, factor, options = _remap_cases()[case]
    model = _bf16_rounded(MODELS[arch]())
    ids = _ids(200)
    want = dense_logits(model, method, factor, options, ids).float()  # float64 maths on the CPU
    budget = _bf16_budget(model, ids)

    gpu = copy.deepcopy(model).to(CUDA)
    restore = apply_remap(gpu, method, factor, options)
    try:
        torch.testing.assert_close(_logits(gpu, ids), want, atol=1e-5, rtol=0)
    finally:
        restore()

    half = copy.deepcopy(model).to(CUDA, torch.bfloat16)
    apply_remap(half, method, factor, options)
    err = _gap(_logits(half, ids), want)
    assert err <= BF16_SLACK * budget, f"bf16 remap error {err:.3g} vs unpatched bf16 error {budget:.3g}"


@pytest.mark.parametrize("case", [0, 2, 4, 5, 6, 7])
def test_remap_cached_generate_equals_full_forward_on_cuda(case):
    method, factor, options = _remap_cases()[case]
    model = tiny_llama().to(CUDA)
    apply_remap(model, method, factor, options)
    _generate_equals_full_forward(model, prompt_len=90, new=30)


@pytest.mark.parametrize("case", [0, 2, 5, 7])
def test_remap_padded_batch_equals_single_rows_on_cuda(case):
    method, factor, options = _remap_cases()[case]
    model = tiny_llama().to(CUDA)
    apply_remap(model, method, factor, options)
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(2, VOCAB, (n,), generator=gen) for n in (150, 85)]
    ids = torch.zeros(2, 150, dtype=torch.long)
    mask = torch.zeros(2, 150, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 150 - len(r) :], mask[i, 150 - len(r) :] = r, 1
    batch = _logits(model, ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for i, r in enumerate(rows):
        torch.testing.assert_close(batch[i, 150 - len(r) :], _logits(model, r[None])[0], atol=1e-5, rtol=0)


def _generate_equals_full_forward(model, prompt_len: int, new: int) -> None:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = _ids(prompt_len, seed=4).to(CUDA)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        full = model(out.sequences).logits[0, prompt_len - 1 : -1]
    torch.testing.assert_close(torch.cat(out.logits), full, atol=1e-4, rtol=0)
    assert torch.equal(full.argmax(-1), out.sequences[0, prompt_len:])


# --------------------------------------------------------------------------------------------- rotary methods


@pytest.mark.parametrize("case", range(4), ids=["pi", "dynamic-ntk", "yarn", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_methods_match_transformers_rope_types_on_cuda(case, dtype):
    from test_rotary_parity import TRANSFORMERS_EQUIVALENTS, _reference

    method, factor, options, rope = [c for c in TRANSFORMERS_EQUIVALENTS if c[0] != "linear" and not c[2]][case]
    model = _bf16_rounded(tiny_llama())
    native = _reference(model, rope)
    ids = _ids(256)
    patched = ctxext.patch(copy.deepcopy(model).to(CUDA, dtype), method, factor, **options)
    want = _logits(copy.deepcopy(native).to(CUDA, dtype), ids)
    got = _logits(patched, ids)
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    else:  # both in bf16 with the same kernels: they may differ by rounding, not by a position
        exact = _logits(native.to(CUDA), ids)
        assert _gap(got, want) <= BF16_SLACK * _gap(want, exact)


def test_rotary_patch_under_flex_attention_and_sdpa_agree_on_cuda():
    """The frequency patch is independent of the attention kernel: sdpa and flex give the same patched logits."""
    ids = _ids(256)
    out = {}
    for impl in ("sdpa", "flex_attention"):
        model = tiny_llama(attn_implementation=impl).to(CUDA)
        ctxext.patch(model, "yarn", factor=4)
        out[impl] = _logits(model, ids)
    torch.testing.assert_close(out["flex_attention"], out["sdpa"], atol=1e-4, rtol=0)


def test_dynamic_ntk_cached_generate_equals_full_forward_on_cuda():
    model = tiny_neox().to(CUDA)
    ctxext.patch(model, "ntk", factor=4)
    _generate_equals_full_forward(model, prompt_len=90, new=30)


# -------------------------------------------------------------------------------------- ALiBi, GPT-2, unpatch


@pytest.mark.parametrize("family,method,factor", [("llama", "alibi", 4), ("bloom", "pi", 4),
                                                  ("gpt2", "pi", 4), ("gpt2", "alibi", 4), ("llama", "nope", None)])
def test_patched_cuda_equals_patched_cpu(family, method, factor):
    build = {"llama": tiny_llama, "bloom": tiny_bloom, "gpt2": tiny_gpt2}[family]
    ids = _ids(120)
    cpu = ctxext.patch(build(), method, factor=factor)
    gpu = ctxext.patch(build().to(CUDA), method, factor=factor)
    torch.testing.assert_close(_logits(gpu, ids), _logits(cpu, ids), atol=1e-5, rtol=0)


def test_alibi_swap_in_bf16_stays_within_rounding():
    model = _bf16_rounded(tiny_llama())
    ids = _ids(200)
    exact = _logits(ctxext.patch(copy.deepcopy(model), "alibi", factor=4), ids)
    half = _logits(ctxext.patch(copy.deepcopy(model).to(CUDA, torch.bfloat16), "alibi", factor=4), ids)
    assert _gap(half, exact) <= BF16_SLACK * _bf16_budget(model, ids)


@pytest.mark.parametrize("method", ["yarn", "alibi", "self-extend"])
def test_unpatch_is_bit_exact_on_cuda(method):
    model = tiny_llama().to(CUDA, torch.bfloat16)
    ids = _ids(150)
    before = _logits(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ctxext.patch(model, method, factor=4)
    assert not torch.equal(_logits(model, ids), before)
    ctxext.unpatch(model)
    assert torch.equal(_logits(model, ids), before)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


# ----------------------------------------------------------- the remap merge path on CUDA's fused kernels (issue 23)


@pytest.fixture
def cuda_merge_path(monkeypatch):
    """The log-sum-exp merge path on CUDA (asked for on every torch version, not only the recorded ones), not flex."""
    monkeypatch.setenv("CTXEXT_CUDA_LSE", "1")
    monkeypatch.setenv("CTXEXT_FLEX", "0")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["band", "band, partial", "band and sinks", "chunks", "random starts"])
def test_split_attention_on_cuda_kernels_matches_the_dense_definition(cuda_merge_path, name, dtype, atol):
    import ctxext.attention.lse as lse_attention
    from test_remap_lse import SHAPES, _dense, _inputs, _which

    T, starts, far_keys, batch = SHAPES[name]
    near_start = starts(T)
    queries, keys, v = _inputs(5, batch, T, dtype)
    out = lse_attention.split_attention([t.to(CUDA) for t in queries], [t.to(CUDA) for t in keys], v.to(CUDA),
                                        near_start.to(CUDA), far_keys, 16**-0.5)
    reference = _dense(*queries, *keys, v, _which(near_start, far_keys), 16**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), reference, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["band", "band, partial", "band and sinks"])
def test_a_band_on_cuda_runs_batched_and_matches_the_dense_definition(cuda_merge_path, monkeypatch, name, dtype,
                                                                      atol):
    """On CUDA a band's masked blocks go many to one call of the memory-efficient kernel, with a bias per block
    (opt-in: ``CTXEXT_BATCHED_BAND=1``, until this passes on a GPU)."""
    import ctxext.attention.lse as lse_attention
    from test_remap_lse import SHAPES, _dense, _inputs, _which

    monkeypatch.setenv("CTXEXT_BATCHED_BAND", "1")

    # small blocks, several groups of several blocks (a budget of 2-4 blocks at these shapes: 100 kB held one)
    budget = 250_000 * torch.tensor([], dtype=dtype).element_size()
    for attr, value in (("BLOCK", 48), ("MIN_BLOCK", 16), ("MIN_RUN", 4), ("BATCH_BYTES", budget)):
        monkeypatch.setattr(lse_attention, attr, value)
    groups = []
    real = lse_attention._near_batched
    monkeypatch.setattr(lse_attention, "_near_batched", lambda *a: groups.append(a[4]) or real(*a))
    T, starts, far_keys, batch = SHAPES[name]
    near_start = starts(T)
    queries, keys, v = _inputs(7, batch, T, dtype)
    out = lse_attention.split_attention([t.to(CUDA) for t in queries], [t.to(CUDA) for t in keys], v.to(CUDA),
                                        near_start.to(CUDA), far_keys, 16**-0.5)
    assert len(groups) > 1 and max(groups) > 1  # batched on CUDA when asked, in several calls
    reference = _dense(*queries, *keys, v, _which(near_start, far_keys), 16**-0.5)
    torch.testing.assert_close(out.double().cpu(), reference, atol=atol, rtol=0)


@pytest.mark.parametrize("method,factor,options", [("self-extend", 8, {}), ("rerope", 8, {}),
                                                   ("dca", 8, {"chunk_size": 40}), ("string", None, {}),
                                                   ("streaming-llm", 8, {"window": 50})])
def test_patched_model_on_the_cuda_merge_path_equals_the_chunked_path(cuda_merge_path, monkeypatch, method, factor,
                                                                       options):
    import ctxext.attention.remap as remap_attention

    monkeypatch.setattr(remap_attention, "LSE_MIN_LEN", 64)
    calls = []
    real = remap_attention.split_attention
    monkeypatch.setattr(remap_attention, "split_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_llama()
    apply_remap(model, method, factor, options)
    model.to(CUDA)
    ids = _ids(300, batch=2).to(CUDA)
    with torch.no_grad():
        fast = model(ids).logits
        assert len(calls) == model.config.num_hidden_layers  # every layer took the merge path
        monkeypatch.setattr(remap_attention, "LSE_PATH", False)
        slow = model(ids).logits
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=0)


# ----------------------------------------------------- flash-attn, where installed (ctxext.attention.optional_kernels)


@pytest.fixture
def flash_attn_installed():
    from ctxext.attention import optional_kernels

    pytest.importorskip("flash_attn")
    probe = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16, device=CUDA)
    if not optional_kernels.usable(probe, probe, probe):
        pytest.skip(f"flash-attn is older than {optional_kernels.MIN_VERSION} or does not load on this device")
    return optional_kernels


@pytest.mark.parametrize("causal,q_len,kv_len", [(True, 257, 257), (False, 100, 300)])
def test_flash_attn_output_and_log_sum_exp_equal_torchs_kernels(flash_attn_installed, causal, q_len, kv_len):
    from ctxext.compat.torch import cuda_attention_with_lse

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, q_len, 64, generator=g).bfloat16().to(CUDA)
    k, v = (torch.randn(2, 4, kv_len, 64, generator=g).bfloat16().to(CUDA) for _ in range(2))
    out, lse = flash_attn_installed.attention_with_lse(q, k, v, causal, 0.125)
    ref_out, ref_lse = cuda_attention_with_lse(q, k, v, causal, 0.125)
    torch.testing.assert_close(lse.float(), ref_lse.float(), atol=1e-2, rtol=0)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)


def test_alibi_swap_through_flash_attn_stays_within_rounding(flash_attn_installed, monkeypatch):
    from ctxext.attention import optional_kernels

    calls = []
    real = optional_kernels.alibi_attention
    monkeypatch.setattr(optional_kernels, "alibi_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _bf16_rounded(tiny_llama())
    ids = _ids(300)
    exact = _logits(ctxext.patch(copy.deepcopy(model), "alibi", factor=4), ids)
    half = _logits(ctxext.patch(copy.deepcopy(model).to(CUDA, torch.bfloat16), "alibi", factor=4), ids)
    assert calls and _gap(half, exact) <= BF16_SLACK * _bf16_budget(model, ids)
