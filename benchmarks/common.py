"""What several benchmarks share: the small LLaMA they time, and where the real SmolLM2 checkpoint is.

Benchmarks run as scripts (``python benchmarks/NAME.py``), so this folder is on ``sys.path`` and they import it
as ``common``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

SMOLLM2_TOOL = Path(__file__).resolve().parent.parent.parent / "shared" / "tools" / "smollm2.sh"


def small_llama_config(max_positions: int, vocab_size: int = 4096, rope_parameters: dict | None = None) -> dict:
    """LlamaConfig kwargs of the small LLaMA the speed and memory benchmarks use (about 5M parameters, GQA 8/4)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope_parameters or {})},
        attn_implementation="sdpa",
    )


def smollm2_gguf() -> Path:
    """The SmolLM2-135M GGUF file that ``../shared/tools/smollm2.sh`` prints (it downloads it on first use)."""
    if not SMOLLM2_TOOL.exists():
        raise SystemExit(f"{SMOLLM2_TOOL} not found: it provides the SmolLM2 checkpoint")
    out = subprocess.run(["bash", str(SMOLLM2_TOOL)], capture_output=True, text=True, check=True).stdout
    return Path(out.strip().splitlines()[-1])
