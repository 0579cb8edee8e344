"""The position encodings compared by the lab. Each is a module with three hooks, all no-ops by default, so the
decoder (``model.TinyDecoder``) is the same for every scheme:

* ``embed(x, pos)``: added to the token embeddings (sinusoidal, learned);
* ``rotate(q, k, pos)``: applied to queries and keys (RoPE);
* ``bias(pos)``: an additive attention bias of shape (heads, T, T) (ALiBi, T5), or None.

``pos`` is a 1-D LongTensor of absolute position ids (one per token, shared by the batch).
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: Every scheme the lab can train, and the ones it trains by default.
SCHEMES: tuple[str, ...] = ("sinusoidal", "learned", "rope", "alibi", "nope", "t5")
DEFAULT_SCHEMES: tuple[str, ...] = ("sinusoidal", "learned", "rope", "alibi", "nope", "t5")


class PositionEncoding(nn.Module):
    """No position information at all (NoPE): the causal mask is the only source of order."""

    name = "nope"

    def embed(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor):
        return q, k

    def bias(self, pos: torch.Tensor):
        return None


def sinusoidal_table(pos: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al.: PE[p, 2i] = sin(p / base^(2i/dim)), PE[p, 2i+1] = cos(p / base^(2i/dim))."""
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    out = torch.empty(len(pos), dim, dtype=torch.float64)
    out[:, 0::2] = torch.sin(ang)
    out[:, 1::2] = torch.cos(ang)
    return out.to(torch.float32)


class Sinusoidal(PositionEncoding):
    """The fixed table times ``scale``: its entries have RMS ``scale / sqrt(2)``. Vaswani et al. scale the token
    embeddings up by sqrt(d_model) so that the table does not drown them; the lab's decoder scales the table down to
    its token embeddings' size instead (``model.TinyDecoder``)."""

    name = "sinusoidal"

    def __init__(self, dim: int, scale: float = 1.0):
        super().__init__()
        self.dim, self.scale = dim, scale

    def embed(self, x, pos):
        return x + self.scale * sinusoidal_table(pos, self.dim).to(x.device, x.dtype)


class Learned(PositionEncoding):
    """A learned table of exactly ``rows`` position vectors (GPT-2's ``wpe``): nothing exists past it."""

    name = "learned"

    def __init__(self, dim: int, rows: int):
        super().__init__()
        self.rows = rows
        self.table = nn.Embedding(rows, dim)
        nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, x, pos):
        if len(pos) and (int(pos.max()) >= self.rows or int(pos.min()) < 0):
            raise ValueError(
                f"learned position table has {self.rows} rows: cannot run past its {self.rows} positions "
                f"(asked for positions {int(pos.min())}..{int(pos.max())})")
        return x + self.table(pos)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope_angles(pos: torch.Tensor, head_dim: int, base: float = 10000.0):
    """cos and sin of RoPE's angles p * base^(-2i/head_dim), laid out for ``rotate_half`` (Llama's layout)."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


class Rope(PositionEncoding):
    name = "rope"

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        self.head_dim, self.base = head_dim, base

    def rotate(self, q, k, pos):
        cos, sin = rope_angles(pos, self.head_dim, self.base)
        cos, sin = cos.to(q.device, q.dtype), sin.to(q.device, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Press et al.'s head slopes: 2^(-8i/n) for i = 1..n when n is a power of two; otherwise the slopes of the
    next lower power of two followed by every other slope of twice that many (as in the paper's code)."""
    def pow2(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(pow2(n_heads))
    low = 2 ** math.floor(math.log2(n_heads))
    return torch.tensor(pow2(low) + pow2(2 * low)[0::2][: n_heads - low])


class Alibi(PositionEncoding):
    """bias[h, i, j] = -slope_h * (pos_i - pos_j): depends only on the distance, so shifting positions changes nothing."""

    name = "alibi"

    def __init__(self, n_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def bias(self, pos):
        dist = (pos[:, None] - pos[None, :]).to(torch.float32)  # integer difference first: exact under shifts
        return -self.slopes[:, None, None] * dist[None]


def t5_bucket(rel: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's causal (unidirectional) bucket of the distance ``rel`` = i - j >= 0: exact below num_buckets/2,
    logarithmic up to max_distance, the last bucket beyond."""
    rel = rel.clamp(min=0)
    exact = num_buckets // 2
    if max_distance <= exact:
        raise ValueError(f"T5 max_distance {max_distance} must exceed num_buckets / 2 = {exact}")
    large = exact + (torch.log(rel.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return torch.where(rel < exact, rel, large)


class T5Bias(PositionEncoding):
    """A learned scalar per head and distance bucket (Raffel et al.), shared by all layers here."""

    name = "t5"

    def __init__(self, n_heads: int, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, n_heads)
        nn.init.zeros_(self.table.weight)

    def bias(self, pos):
        b = t5_bucket(pos[:, None] - pos[None, :], self.num_buckets, self.max_distance)
        return self.table(b).permute(2, 0, 1)


def make_position_encoding(scheme: str, *, d_model: int, n_heads: int, train_len: int,
                           sinusoidal_scale: float = 1.0) -> PositionEncoding:
    if scheme == "nope":
        return PositionEncoding()
    if scheme == "sinusoidal":
        return Sinusoidal(d_model, sinusoidal_scale)
    if scheme == "learned":
        return Learned(d_model, train_len)
    if scheme == "rope":
        return Rope(d_model // n_heads)
    if scheme == "alibi":
        return Alibi(n_heads)
    if scheme == "t5":
        return T5Bias(n_heads, max_distance=max(train_len, 32))
    raise ValueError(f"unknown position scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
