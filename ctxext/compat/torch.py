"""Private reaches into torch: the fused attention ops that return the log-sum-exp (the remap methods' merge path,
``ctxext.attention.lse``: torch's CPU flash op; on CUDA its flash and memory-efficient ops) and the dynamo setting
that bounds recompilations, patched only around the compiled calls (``ctxext.attention.flex_paths``).

Versions: torch 2.13 on this CPU machine (the version constraints.txt pins); the GPU machine runs torch 2.11, where
the flex path compiles on CUDA. The private ops are refused on versions they were not tested on, so that torch
release falls back to the paths built on public functions rather than trusting an op that may have changed.
"""

from __future__ import annotations

import contextlib
import os

import torch

#: The CPU flash kernel with a log-sum-exp output (``out, logsumexp = op(q, k, v, dropout, is_causal, attn_mask=,
#: scale=)``): no public function returns the log-sum-exp, which merging disjoint key ranges needs.
CPU_FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"
#: torch versions (major.minor) the CPU flash op was tested on (2.13 here; not checked on the GPU machine's 2.11).
CPU_FLASH_TESTED = ("2.13",)


#: CUDA's fused kernels with a log-sum-exp output: flash (no mask; float16 / bfloat16; ``out, lse, ... = op(q, k, v,
#: dropout, is_causal, return_debug_mask, scale=)``) and memory-efficient (an additive bias, float32 too; ``out, lse,
#: seed, offset = op(q, k, v, bias, compute_log_sumexp, dropout, is_causal, scale=)``, its log-sum-exp padded to a
#: multiple of 32 queries). Both align a causal diagonal top-left; the callers' causal calls are square.
CUDA_FLASH_OP = "_scaled_dot_product_flash_attention"
CUDA_EFFICIENT_OP = "_scaled_dot_product_efficient_attention"
#: torch versions (major.minor) whose CUDA ops ran ctxext's ``gpu`` tests of the merge path: 2.11 (2.11.0+cu130 on
#: an H100, 2026-11-26: tests/test_gpu.py all passed, benchmarks/results/gpu/). On other versions the path runs on
#: CUDA only when ``CTXEXT_CUDA_LSE=1`` asks for it; ``CTXEXT_CUDA_LSE=0`` turns it off on any.
CUDA_FUSED_TESTED: tuple[str, ...] = ("2.11",)
#: bias rows are allocated at multiples of this many elements (the memory-efficient kernel needs 8 in half precision
#: and 4 in float32, what sdpa's ``pad_bias`` gives a mask)
EFFICIENT_BIAS_ALIGN = 16


def _aten(name: str):
    return getattr(torch.ops.aten, name)


def ampere_or_newer(device: torch.device) -> bool:
    """Compute capability 8.0 or newer, what CUDA's flash kernel and every bfloat16 kernel need; devices other than
    CUDA (the meta device in tests) pass."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def _version() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def cuda_fused_attention_tested() -> bool:
    """The CUDA ops exist and this torch is one they were tested on, or ``CTXEXT_CUDA_LSE=1`` asks for them;
    ``CTXEXT_CUDA_LSE=0`` refuses them on any version."""
    if not all(hasattr(torch.ops.aten, op) for op in (CUDA_FLASH_OP, CUDA_EFFICIENT_OP)):
        return False
    setting = os.environ.get("CTXEXT_CUDA_LSE", "").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return False
    return setting in ("1", "true", "on", "yes", "force") or _version() in CUDA_FUSED_TESTED


def cuda_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                            mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and each query's log-sum-exp (float32, (batch, heads, q_len)) from CUDA's fused kernels, as
    the CPU flash op gives them: q (batch, heads, q_len, dim), k / v (batch, kv_heads, kv_len, dim), kv_heads
    dividing heads; mask: None or an additive (q_len, kv_len) mask in q's dtype; ``causal`` only for a square call.
    Query head h reads key head h // (heads / kv_heads): flash reads grouped keys as they are; for the
    memory-efficient op they are expanded. Its bias must be 4D, in q's dtype, rows aligned (``EFFICIENT_BIAS_ALIGN``,
    a multiple of its 8-element alignment); a row with every key masked comes back as output 0, log-sum-exp 0."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("a causal fused call must be square (the kernels disagree on where a longer diagonal sits)")
    heads, kv_heads = q.shape[1], k.shape[1]
    dim = q.shape[-1]
    if mask is None and q.dtype in (torch.float16, torch.bfloat16) and dim % 8 == 0 and dim <= 256 \
            and v.shape[-1] == dim and ampere_or_newer(q.device):  # flash reads grouped keys itself
        out = _aten(CUDA_FLASH_OP)(q, k, v, 0.0, causal, False, scale=scale)
        return out[0], out[1]
    if kv_heads != heads:  # the memory-efficient op wants as many key/value heads as query heads
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    bias = None
    if mask is not None:
        rows, cols = mask.shape[-2:]
        aligned = mask.new_zeros(rows, -(-cols // EFFICIENT_BIAS_ALIGN) * EFFICIENT_BIAS_ALIGN)
        aligned[:, :cols] = mask
        bias = aligned[:, :cols].expand(q.shape[0], heads, rows, cols)
    out = _aten(CUDA_EFFICIENT_OP)(q, k, v, bias, True, 0.0, causal, scale=scale)
    return out[0], out[1][..., : q.shape[2]]


def efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's memory-efficient op with an additive bias (the ALiBi plan's biased call): output and float32
    log-sum-exp (batch, heads, q_len); as many key/value heads as query heads."""
    out = _aten(CUDA_EFFICIENT_OP)(q, k, v, bias, True, 0.0, causal, scale=scale)
    return out[0], out[1][..., : q.shape[2]].float()


def cpu_flash_attention():
    """The private CPU flash op (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``), or None."""
    return getattr(torch.ops.aten, CPU_FLASH_OP, None)


def cpu_flash_attention_tested() -> bool:
    """The op exists and this torch (major.minor) is one it was tested on."""
    return _version() in CPU_FLASH_TESTED and hasattr(torch.ops.aten, CPU_FLASH_OP)


@contextlib.contextmanager
def raised_recompile_limit(limit: int | None):
    """Within the block, let dynamo compile a function up to ``limit`` times before it falls back to eager (the
    compiled flex paths: one recompilation per new mask function or length). The setting lives in the private
    ``torch._dynamo.config`` (``recompile_limit`` in torch 2.13, ``cache_size_limit`` its older name); it is patched
    for the block only and restored after, so the process's own setting is never changed, and never lowered. Dynamo
    reads it when a compiled function is called, which is inside the block."""
    import torch._dynamo.config as dynamo_config

    name = next((n for n in ("recompile_limit", "cache_size_limit")
                 if isinstance(getattr(dynamo_config, n, None), int)), None)
    if limit is None or name is None or getattr(dynamo_config, name) >= limit:
        yield
        return
    with dynamo_config.patch(**{name: limit}):
        yield


__all__ = ["CPU_FLASH_OP", "CPU_FLASH_TESTED", "CUDA_EFFICIENT_OP", "CUDA_FLASH_OP", "CUDA_FUSED_TESTED",
           "ampere_or_newer", "cpu_flash_attention", "cpu_flash_attention_tested", "cuda_attention_with_lse",
           "cuda_fused_attention_tested", "raised_recompile_limit"]
