"""How a KV entry is laid out in a host pool row, and the pool's token-major layout."""

from __future__ import annotations

import torch


class FpCodec:
    """A row is K|V in the model's dtype: (..., d) x 2 <-> (..., 2d)."""

    def __init__(self, head_dim: int, dtype):
        self.d, self.width, self.dtype = head_dim, 2 * head_dim, dtype

    def encode(self, k, v):
        return torch.cat([k, v], dim=-1)

    def decode(self, rows):
        return rows[..., : self.d], rows[..., self.d :]



def token_major(rows: torch.Tensor) -> torch.Tensor:
    b, hk, t, w = rows.shape
    return rows.permute(2, 0, 1, 3).reshape(t, b * hk, w)  # (t, b*h_kv, W)


def head_major(rows: torch.Tensor, b: int, hk: int) -> torch.Tensor:
    n, _, w = rows.shape
    return rows.view(n, b, hk, w).permute(1, 2, 0, 3)  # (b, h_kv, n, W)

