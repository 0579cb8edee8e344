"""The encoder copy task of "Positional Encoding for Self Attention" (peluche, 2023), and its tiny encoder.

A row is ``k`` random digits, a ``<copy>`` token, then padding to the row's length; the model reads the whole row
with bidirectional attention and writes, in one pass, the ``k`` digits again at the ``k`` positions after
``<copy>`` (only those positions are scored). ``k`` varies per row, so the model must find ``<copy>`` and count
back from it: a fixed offset would not do. The training length is ``2 * max_digits + 1``; at ``f`` times that length
every row has more digits than any training row (``(f - 1) * max_digits < k <= f * max_digits``), so a longer
length tests what the model learned, not a row it has already seen.

The encoder is the lab decoder's block (``model.Block``) given a full (not causal) attention mask, so the schemes
differ only in their position encoding (``positions.py``), as in the lab.
"""

from __future__ import annotations

import torch
from torch import nn

from .model import Block, ModelConfig
from .positions import make_position_encoding

#: Token ids: the digits 0-9, then <copy> and the padding token. Chance accuracy is 1/10.
COPY, PAD = 10, 11
VOCAB = 12
IGNORE = -100
#: The schemes of ``ctxext lab copy``: the write-up's four, ALiBi with a causal mask, and NoPE (no position at
#: all: a bidirectional encoder without positions is permutation-equivariant, so it cannot copy: a sanity check).
COPY_SCHEMES: tuple[str, ...] = ("sinusoidal", "learned", "rope", "alibi", "alibi-causal", "nope")


def copy_rows(n: int, length: int, digits: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of ``length`` tokens, each ``k`` digits (``digits[0] <= k <= digits[1]``, uniform), ``<copy>``,
    padding; targets are the digits at the ``k`` positions after ``<copy>`` and IGNORE elsewhere."""
    lo, hi = digits
    if not 1 <= lo <= hi or 2 * hi + 1 > length:
        raise ValueError(f"copy rows of {lo}-{hi} digits need length >= {2 * hi + 1}, got {length}")
    k = torch.randint(lo, hi + 1, (n,), generator=gen)
    d = torch.randint(0, 10, (n, length), generator=gen)
    col = torch.arange(length)[None]
    kk = k[:, None]
    ids = torch.where(col < kk, d, PAD)
    ids = torch.where(col == kk, COPY, ids)
    answer = (col > kk) & (col <= 2 * kk)
    # the digit written at position k + 1 + i is the one at i
    src = (col - kk - 1).clamp(min=0)
    targets = torch.where(answer, torch.gather(d, 1, src), IGNORE)
    return ids, targets


def digit_range(max_digits: int, factor: int) -> tuple[int, int]:
    """Digits per row at ``factor`` x the training length: 1..max_digits at 1x; longer than every training row
    beyond (at 2x: max_digits + 1 .. 2 * max_digits)."""
    return (1 if factor == 1 else (factor - 1) * max_digits + 1), factor * max_digits


class TinyEncoder(nn.Module):
    """Token embedding, the lab's pre-norm blocks with bidirectional attention (or causal, for 'alibi-causal'),
    a final norm and an untied head over the 12 tokens."""

    def __init__(self, cfg: ModelConfig, scheme: str):
        super().__init__()
        if scheme not in COPY_SCHEMES:
            raise ValueError(f"unknown copy-task scheme {scheme!r}; choose from {', '.join(COPY_SCHEMES)}")
        self.cfg, self.scheme = cfg, scheme
        self.causal = scheme == "alibi-causal"
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB)
        self.pe = make_position_encoding(scheme.removesuffix("-causal"), d_model=cfg.d_model, n_heads=cfg.n_heads,
                                         train_len=cfg.train_len)

    def attention_mask(self, pos: torch.Tensor) -> torch.Tensor:
        """(1 or heads, T, T) additive float mask: ALiBi's bias made symmetric (-slope * |i - j|) for the encoder,
        or its usual causal form for 'alibi-causal'; zeros (full attention) for the other schemes."""
        t = len(pos)
        bias = self.pe.bias(pos)
        if bias is None:
            return torch.zeros(1, t, t)
        if not self.causal:
            return -bias.abs()  # Alibi.bias is -slope * (i - j): signed, meant for a causal mask
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        return bias.masked_fill(~causal, float("-inf"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, 12). A learned table raises ValueError past its rows."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.pe.embed(self.tok(ids), pos)
        mask = self.attention_mask(pos).to(x.device, x.dtype)[None]
        for blk in self.blocks:
            x = blk(x, pos, self.pe, mask)
        return self.head(self.ln_f(x))


def build_encoder(cfg: ModelConfig, scheme: str, seed: int) -> TinyEncoder:
    torch.manual_seed(seed)
    return TinyEncoder(cfg, scheme)
