"""Triton programs for the offloading runtime on CUDA, each with the torch code it replaces as its reference
(tests/test_kernels.py runs both through Triton's interpreter on a CPU; `available()` is False without Triton,
and callers then take the torch path):

  dequantize_pool  a quantised pool's rows (n, b*h_kv, W) uint8 -> K, V (b, h_kv, n, d) in the model's dtype in one
                   pass: the torch path (split, unpack, dequantise, cast) dispatches ~20 ops per tensor and moves
                   ~10x the bytes of an fp16 cache
  gather_rows      selected rows read straight from the pinned host pool by the GPU (zero-copy, as ShadowKV's
                   gather): only valid rows cross PCIe, no host thread and no index copy to the host
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without it: torch paths only
    triton = None


def available(device: torch.device | str) -> bool:
    """Whether the Triton programs run for tensors on `device` (CUDA, or Triton's interpreter for tests)."""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _dequantize(rows, scales, k_out, v_out, n, bh, W: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                    GROUP: tl.constexpr, CODES: tl.constexpr, PARAMS: tl.constexpr, BLOCK_N: tl.constexpr):
        # one program: BLOCK_N tokens of one (batch row, KV head); rows are token-major (token * bh + head)
        t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        head = tl.program_id(1)
        c = tl.arange(0, D)
        live = (t < n)[:, None]
        row = (t.to(tl.int64) * bh + head)[:, None]  # (BLOCK_N, 1)
        if BITS == 4:  # the paper's INT4: each row's code bytes read as one contiguous run, then unpacked
            j = tl.arange(0, CODES)[None, :]
            kb = tl.load(rows + row * W + j, mask=live, other=0).to(tl.int32)  # (BLOCK_N, CODES)
            vb = tl.load(rows + row * W + CODES + j, mask=live, other=0).to(tl.int32)
            # low nibble first (baselines/quant.py `pack`): channels 2j, 2j + 1 of byte j
            kc = tl.reshape(tl.join(kb & 15, kb >> 4), (BLOCK_N, D))
            vc = tl.reshape(tl.join(vb & 15, vb >> 4), (BLOCK_N, D))
        else:
            byte = (c * BITS) // 8
            shift = ((c * BITS) % 8)[None, :]
            levels = (1 << BITS) - 1
            kc = (tl.load(rows + row * W + byte[None, :], mask=live, other=0).to(tl.int32) >> shift) & levels
            vc = (tl.load(rows + row * W + CODES + byte[None, :], mask=live, other=0).to(tl.int32) >> shift) & levels
        # the fp16 scale/zero of each channel's group: scales is the same storage viewed as fp16 (W / 2 per row);
        # (not named `params`: Triton's generated binder has a local of that name)
        p = row * (W // 2) + CODES + (c // GROUP)[None, :]
        k_scale = tl.load(scales + p, mask=live, other=0).to(tl.float32)
        k_zero = tl.load(scales + p + PARAMS // 2, mask=live, other=0).to(tl.float32)
        v_scale = tl.load(scales + p + PARAMS, mask=live, other=0).to(tl.float32)
        v_zero = tl.load(scales + p + 3 * (PARAMS // 2), mask=live, other=0).to(tl.float32)
        out = (head * n + t.to(tl.int64))[:, None] * D + c[None, :]
        # multiply, round, add, round: the torch path's float32 steps (the launch turns off fma contraction)
        tl.store(k_out + out, (kc.to(tl.float32) * k_scale + k_zero).to(k_out.dtype.element_ty), mask=live)
        tl.store(v_out + out, (vc.to(tl.float32) * v_scale + v_zero).to(v_out.dtype.element_ty), mask=live)

    @triton.jit
    def _gather(pool, src, valid, out, k, W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
        # one program: BLOCK_K selected slots of one head; out (bh * k, W) on the device
        j = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        head = tl.program_id(1)
        inside = j < k
        slot = head.to(tl.int64) * k + j
        take = tl.load(valid + slot, mask=inside, other=0) != 0
        row = tl.load(src + slot, mask=take, other=0).to(tl.int64)
        for w0 in range(0, W, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            cols = (w < W)[None, :]
            x = tl.load(pool + row[:, None] * W + w[None, :], mask=take[:, None] & cols, other=0)
            tl.store(out + slot[:, None] * W + w[None, :], x, mask=take[:, None] & cols)


def dequantize_pool(rows: torch.Tensor, b: int, hk: int, d: int, bits: int, group: int, codes: int, params: int,
                    dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (n, b*h_kv, W) uint8 as QuantCodec lays them out (K codes | V codes | K scale | K zero | V scale |
    V zero) -> K, V (b, h_kv, n, d) contiguous in `dtype`."""
    n, bh, width = rows.shape
    rows = rows.contiguous()
    k = torch.empty(b, hk, n, d, dtype=dtype, device=rows.device)
    v = torch.empty_like(k)
    block = 64
    _dequantize[(triton.cdiv(n, block), bh)](
        rows, rows.view(torch.float16), k, v, n, bh, W=width, D=d, BITS=bits, GROUP=group, CODES=codes,
        PARAMS=params, BLOCK_N=block, enable_fp_fusion=False)
    return k, v


def dequantize_supported(d: int, bits: int, codes: int, params: int, width: int) -> bool:
    """The program's layout assumptions: d a power of two, fp16 parameters at even byte offsets (4 bits: the code
    bytes a power of two too)."""
    return (d & (d - 1) == 0 and codes % 2 == 0 and params % 2 == 0 and width % 2 == 0 and 8 % bits == 0
            and (bits != 4 or codes & (codes - 1) == 0))


class HostPointer:
    """A pinned host tensor as a kernel argument: under CUDA's unified addressing the device reads it at the
    host's own address (Triton asks the driver for the device pointer of what data_ptr() returns)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.dtype = tensor, tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def gather_rows(pool: torch.Tensor, src: torch.Tensor, valid: torch.Tensor, out: torch.Tensor) -> None:
    """out[h * k + j] = pool[src[h, j]] where valid[h, j] (others untouched): pool (rows, W) pinned host memory
    (read by the device through unified addressing) or device memory; src, valid (bh, k) on the device."""
    bh, k = src.shape
    width = pool.shape[-1]
    block_w = min(triton.next_power_of_2(width), 256)
    arg = HostPointer(pool) if out.is_cuda and not pool.is_cuda else pool
    _gather[(triton.cdiv(k, 32), bh)](arg, src, valid, out, k, W=width, BLOCK_K=32, BLOCK_W=block_w)
