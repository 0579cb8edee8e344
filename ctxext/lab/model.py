"""One tiny pre-norm decoder in plain torch. The position encoding (``positions.py``) is the only part that
differs between schemes; everything else, including the initialisation given the seed, is shared."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .positions import PositionEncoding, make_position_encoding

#: Token embeddings start at N(0, TOKEN_INIT_STD^2). The sinusoidal table is scaled so its entries have the same
#: RMS: at amplitude 1 (norm 8 against 0.2 at d_model 128) it drowned the tokens, and the decoder never learned to
#: copy (issue 50: 0.00 at 1x; scaled, 0.62 with the copy warm-up).
TOKEN_INIT_STD = 0.02


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    train_len: int = 64  # rows of the learned table; T5's max distance


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x, pos, pe: PositionEncoding, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = pe.rotate(q, k, pos)
        if mask is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig, scheme: str):
        super().__init__()
        self.cfg, self.scheme = cfg, scheme
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.tok.weight, std=TOKEN_INIT_STD)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.pe = make_position_encoding(scheme, d_model=cfg.d_model, n_heads=cfg.n_heads, train_len=cfg.train_len,
                                         sinusoidal_scale=TOKEN_INIT_STD * math.sqrt(2))

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T). ``position_ids``: a 1-D tensor of T absolute positions
        (default 0..T-1). A learned table raises ValueError for positions past its rows."""
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device) if position_ids is None else position_ids.to(ids.device)
        if pos.dim() != 1 or len(pos) != t:
            raise ValueError(f"position_ids must be a 1-D tensor of {t} positions, got shape {tuple(pos.shape)}")
        x = self.pe.embed(self.tok(ids), pos)
        bias = self.pe.bias(pos)
        mask = None
        if bias is not None:
            causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
            mask = bias.to(x.dtype).masked_fill(~causal, float("-inf"))[None]
        for blk in self.blocks:
            x = blk(x, pos, self.pe, mask)
        return self.ln_f(x) @ self.tok.weight.T  # tied head


def build_model(cfg: ModelConfig, scheme: str, seed: int = 0) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder(cfg, scheme)
