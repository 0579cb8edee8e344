"""Private reaches into torch: the fused CPU flash-attention op that returns the log-sum-exp (the remap methods'
merge path, ``ctxext.attention.lse``) and the dynamo setting that bounds recompilations (``ctxext.attention.
flex_paths``).

Versions: torch 2.13 on this CPU machine (the version constraints.txt pins); the GPU machine runs torch 2.11, where
the flex path compiles on CUDA. The private op is refused on versions it was not tested on, so that torch release
falls back to the sdpa path rather than trusting an op that may have changed.
"""

from __future__ import annotations

import torch

#: The CPU flash kernel with a log-sum-exp output (``out, logsumexp = op(q, k, v, dropout, is_causal, attn_mask=,
#: scale=)``): no public function returns the log-sum-exp, which merging disjoint key ranges needs.
CPU_FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"
#: torch versions (major.minor) the CPU flash op was tested on (2.13 here; not checked on the GPU machine's 2.11).
CPU_FLASH_TESTED = ("2.13",)


def cpu_flash_attention():
    """The private CPU flash op (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``), or None."""
    return getattr(torch.ops.aten, CPU_FLASH_OP, None)


def cpu_flash_attention_tested() -> bool:
    """The op exists and this torch (major.minor) is one it was tested on."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return version in CPU_FLASH_TESTED and hasattr(torch.ops.aten, CPU_FLASH_OP)


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo compile a function up to ``limit`` times before it falls back to eager, for the compiled flex
    paths (one recompilation per new input length). The setting lives in the private ``torch._dynamo.config``:
    ``recompile_limit`` in torch 2.13 (read here), ``cache_size_limit`` its older name, tried where the first is
    missing or already high enough (as before the move); never lowered."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if isinstance(getattr(dynamo_config, name, None), int) and getattr(dynamo_config, name) < limit:
            setattr(dynamo_config, name, limit)
            break


__all__ = ["CPU_FLASH_OP", "CPU_FLASH_TESTED", "cpu_flash_attention", "cpu_flash_attention_tested",
           "raise_recompile_limit"]
