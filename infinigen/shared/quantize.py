"""Group-wise asymmetric min-max integer codes along head_dim, and their packing into bytes: what the quantisation
baselines share (Quant, FlexGen's scheme as InfiniGen compares with it; KIVI's per-channel keys and per-token
values)."""

from __future__ import annotations

import torch

BITS = (8, 4, 2, 1)
PARAM_DTYPE = torch.float16  # per-group scale and zero-point, as stored


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., d) -> codes (..., d) uint8 in [0, 2**bits - 1], scale and zero (..., d // group) fp16.

    Per group of `group` consecutive channels: zero = min, scale = (max - min) / (2**bits - 1), both rounded to
    fp16 *before* the codes are computed, so dequantisation with the stored fp16 values is as close as it can be.
    """
    levels = 2**bits - 1
    xg = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, group))  # (..., d // group, group)
    lo, hi = xg.amin(-1), xg.amax(-1)
    zero = lo.to(PARAM_DTYPE)
    # a constant group has max == min: any positive scale reproduces it (codes 0)
    scale = ((hi - lo) / levels).to(PARAM_DTYPE).clamp(min=torch.finfo(PARAM_DTYPE).tiny)
    codes = ((xg - zero.float()[..., None]) / scale.float()[..., None]).round().clamp(0, levels)
    return codes.to(torch.uint8).flatten(-2), scale, zero


def dequantize(codes, scale, zero, group: int, dtype) -> torch.Tensor:
    """Inverse of `quantize`: codes * scale + zero, in `dtype`. (..., d)"""
    c = codes.unflatten(-1, (-1, group)).float()
    return (c * scale.float()[..., None] + zero.float()[..., None]).flatten(-2).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """What attention sees of x once it went through the quantised cache (sim mode)."""
    return dequantize(*quantize(x, bits, group), group, x.dtype)


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., d) uint8 codes < 2**bits -> (..., d * bits // 8) uint8, 8 // bits codes per byte (low bits first)."""
    if bits == 8:
        return codes
    parts = codes.unflatten(-1, (-1, 8 // bits)) << _shifts(bits, codes.device)  # disjoint bit fields
    return parts.sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    fields = (packed[..., None] >> _shifts(bits, packed.device)) & (2**bits - 1)  # (..., d * bits // 8, 8 // bits)
    return fields.flatten(-2)
