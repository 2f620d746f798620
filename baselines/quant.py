"""KV-cache quantisation: group-wise asymmetric min-max integer codes along head_dim (the quantisation baseline
of InfiniGen, Lee et al. OSDI'24, which uses FlexGen's scheme: Sheng et al., ICML'23, 4 bits, groups of 64)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.adapter import KVStore
from infinigen.contract import KVMethod
from infinigen.offload import kernels
from infinigen.offload.codecs import head_major
from infinigen.shared.quantize import BITS, PARAM_DTYPE, dequantize, fake_quantize, pack, quantize, unpack


class QuantCodec:
    """A host-pool row of the offloading runtime: K codes|V codes|K scale|K zero|V scale|V zero as bytes, so the
    device decodes exactly what QuantStore.kv() gives."""

    def __init__(self, head_dim: int, bits: int, group: int, dtype):
        self.bits, self.group, self.out_dtype, self.dtype = bits, group, dtype, torch.uint8
        self.codes = head_dim * bits // 8
        self.params = (head_dim // group) * PARAM_DTYPE.itemsize
        self.width = 2 * self.codes + 4 * self.params

    def encode(self, k, v):  # (..., d) x 2 -> (..., width) uint8
        kc, ks, kz = quantize(k, self.bits, self.group)
        vc, vs, vz = quantize(v, self.bits, self.group)
        params = [p.contiguous().view(torch.uint8) for p in (ks, kz, vs, vz)]
        return torch.cat([pack(kc, self.bits), pack(vc, self.bits), *params], dim=-1)

    def decode_pool(self, rows: torch.Tensor, b: int, hk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-major pool rows (n, b*h_kv, W) -> K, V (b, h_kv, n, d): on CUDA one fused pass (Triton), reading
        each code byte once and writing a contiguous head-major cache; elsewhere `decode` on the permuted rows."""
        d = self.codes * 8 // self.bits
        if kernels.available(rows.device) and kernels.dequantize_supported(d, self.bits, self.codes, self.params,
                                                                           self.width):
            return kernels.dequantize_pool(rows, b, hk, d, self.bits, self.group, self.codes, self.params,
                                           self.out_dtype)
        return self.decode(head_major(rows, b, hk))

    def decode(self, rows):
        kc, vc, ks, kz, vs, vz = rows.split([self.codes] * 2 + [self.params] * 4, dim=-1)
        ks, kz, vs, vz = (p.contiguous().view(PARAM_DTYPE) for p in (ks, kz, vs, vz))
        k = dequantize(unpack(kc, self.bits), ks, kz, self.group, self.out_dtype)
        v = dequantize(unpack(vc, self.bits), vs, vz, self.group, self.out_dtype)
        return k, v


class QuantStore(KVStore):
    """A KVStore whose keys/values are packed integer codes, (b, h_kv, s, d * bits // 8) uint8; the per-group fp16
    scale/zero-point live in `entries` (k_scale, k_zero, v_scale, v_zero: (b, h_kv, s, d // group)), so
    eviction by another method would gather them too."""

    PARAMS = ("k_scale", "k_zero", "v_scale", "v_zero")

    def __init__(self, bits: int, group: int):
        super().__init__()
        self.bits, self.group = bits, group
        self.dtype = None  # of the fp KV it dequantises to

    def update(self, key_states, value_states, *args, **kwargs):
        first = self.stored == 0
        self.dtype = key_states.dtype
        kc, ks, kz = quantize(key_states, self.bits, self.group)
        vc, vs, vz = quantize(value_states, self.bits, self.group)
        super().update(pack(kc, self.bits), pack(vc, self.bits))  # positions, seen, concatenation
        for name, new in zip(self.PARAMS, (ks, kz, vs, vz)):
            old = self.entries.get(name)
            self.entries[name] = new if old is None else torch.cat([old, new], dim=-2)
        if first:
            return key_states, value_states  # the prefill attends densely in full precision
        return self.kv()

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as attention sees them, (b, h_kv, s, d) in the model's dtype."""
        e = self.entries
        k = dequantize(unpack(self.keys, self.bits), e["k_scale"], e["k_zero"], self.group, self.dtype)
        v = dequantize(unpack(self.values, self.bits), e["v_scale"], e["v_zero"], self.group, self.dtype)
        return k, v

    def nbytes(self) -> int:
        params = sum(t.numel() * t.element_size() for name, t in self.entries.items() if name in self.PARAMS)
        return super().nbytes() + params


@dataclass
class Quant(KVMethod):
    """Keeps every token, with K and V quantised to `bits` (8, 4, 2 or 1) per element: groups of `group_size`
    consecutive head_dim channels of one token and head share an asymmetric min-max scale/zero-point (fp16).

    A head_dim smaller than group_size makes one group per head (min(group_size, head_dim)); otherwise head_dim
    must be a multiple of group_size. Prefill rows attend the full-precision KV; every decoded token is
    quantised when it enters the cache, *before* it is attended, so a decoded query sees dequantised KV for all
    entries, its own included (sim: rows >= dense_rows attend dequantised K/V of every position).
    """

    bits: int = 4
    group_size: int = 64

    size_params: ClassVar[tuple[str, ...]] = ("bits",)
    prefix_resumable: ClassVar[bool] = True
    test_variants: ClassVar[tuple[dict, ...]] = ({"bits": 2},)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(
                f"group_size must be an int >= 1 (head_dim channels sharing a scale/zero), got {self.group_size!r}"
            )

    def group(self, head_dim: int) -> int:
        group = min(self.group_size, head_dim)
        if head_dim % group:
            raise ValueError(f"group_size={self.group_size} must divide head_dim={head_dim} (or be >= it)")
        if (head_dim * self.bits) % 8:
            raise ValueError(f"head_dim={head_dim} must be a multiple of {8 // self.bits} to pack {self.bits}-bit codes")
        return group

    def new_store(self, layer) -> QuantStore:
        return QuantStore(self.bits, self.group(layer.head_dim))

    def codec(self, layer, dtype) -> QuantCodec:
        return QuantCodec(layer.head_dim, self.bits, self.group(layer.head_dim), dtype)

    def sim_state(self, session, layer, q, k, v, allowed):
        """What decoded rows attend: K and V through the quantiser, (b, h_kv, s, d) each (O(t) memory)."""
        if session.dense_rows >= k.shape[2]:
            return None
        group = self.group(layer.head_dim)
        return fake_quantize(k, self.bits, group), fake_quantize(v, self.bits, group)

    def sim_kv(self, session, layer, state, k, v, rows):
        if state is None or session.chunk[0] < session.dense_rows:  # chunks never straddle dense_rows
            return k, v  # the prefill attends the full-precision KV
        e = k.shape[2]
        return state[0][:, :, :e], state[1][:, :, :e]
