"""KIVI: asymmetric 2-bit KV quantisation, keys per channel and values per token (Liu et al., "KIVI: A Tuning-Free
Asymmetric 2bit Quantization for KV Cache", ICML'24)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.adapter import KVStore
from infinigen.attention import logits
from infinigen.contract import KVMethod
from infinigen.rows import row_chunks
from infinigen.shared.quantize import dequantize, fake_quantize, pack, quantize, unpack

BITS = (2, 4)


def quantize_keys(k: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel key quantisation: k (b, h_kv, n, d), n a multiple of `group` -> packed codes
    (b, h_kv, n / group, d, group * bits / 8) uint8 and fp16 scale, zero (b, h_kv, n / group, d, 1): every
    channel of every group of `group` consecutive tokens has its own min-max range."""
    per_channel = k.unflatten(2, (k.shape[2] // group, group)).transpose(-1, -2)  # (b, hk, n/G, d, G)
    codes, scale, zero = quantize(per_channel, bits, group)
    return pack(codes, bits), scale, zero


def dequantize_keys(codes, scale, zero, bits: int, group: int, dtype) -> torch.Tensor:
    """Inverse of `quantize_keys` -> (b, h_kv, n, d)."""
    x = dequantize(unpack(codes, bits), scale, zero, group, dtype)  # (b, hk, n/G, d, G)
    return x.transpose(-1, -2).flatten(2, 3)


def fake_quantize_keys(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """What attention sees of keys once quantised per channel (sim mode); a last incomplete group stays fp
    (it is never quantised: KIVI quantises whole groups only)."""
    full = k.shape[2] // group * group
    q = dequantize_keys(*quantize_keys(k[:, :, :full], bits, group), bits, group, k.dtype)
    return torch.cat([q, k[:, :, full:]], 2)


def quantized_keys(seen: int, residual: int) -> int:
    """Positions [0, this) whose keys are quantised once `seen` tokens exist: the fp key residual is flushed
    `residual` tokens at a time, when it fills (KIVI Algorithm 1)."""
    return seen // residual * residual


def quantized_values(seen: int, residual: int) -> int:
    """Positions [0, this) whose values are quantised: all but the `residual` most recent (a sliding window)."""
    return max(seen - residual, 0)


class KIVIStore(KVStore):
    """What KIVI keeps for one layer: `keys`/`values` are the fp residuals (the most recent tokens, in the
    model's dtype, on the device); `k_codes`, `k_scale`, `k_zero` the per-channel quantised key groups and
    `v_codes`, `v_scale`, `v_zero` the per-token quantised values (codes packed uint8, parameters fp16).
    `positions` lists every token: nothing is evicted."""

    def __init__(self, bits: int, group: int, value_group: int, residual: int):
        super().__init__()
        self.bits, self.group, self.value_group, self.residual = bits, group, value_group, residual
        self.quant: dict[str, torch.Tensor] = {}
        self.dtype = None

    @property
    def stored(self) -> int:
        return self.seen

    def update(self, key_states, value_states, *args, **kwargs):
        first = self.seen == 0
        self.dtype = key_states.dtype
        super().update(key_states, value_states)  # appends to the fp residuals; positions, seen
        self.flush()
        if first:
            return key_states, value_states  # the prefill attends its fp KV
        return self.kv()

    def reset(self) -> None:
        super().reset()
        self.quant, self.dtype = {}, None

    def flush(self) -> None:
        """Quantise what left the residuals (before the step's attention, as KIVI's Algorithm 1)."""
        n_k = quantized_keys(self.seen, self.residual) - (self.seen - self.keys.shape[2])
        if n_k > 0:
            self._append("k", quantize_keys(self.keys[:, :, :n_k], self.bits, self.group))
            self.keys = self.keys[:, :, n_k:]
        n_v = quantized_values(self.seen, self.residual) - (self.seen - self.values.shape[2])
        if n_v > 0:
            self._append("v", quantize(self.values[:, :, :n_v], self.bits, self.value_group))
            self.values = self.values[:, :, n_v:]

    def _append(self, which: str, parts) -> None:
        """Concatenate new (codes, scale, zero) after the old along axis 2 (key groups, value tokens)."""
        codes, scale, zero = parts
        if which == "v":
            codes = pack(codes, self.bits)  # (b, hk, n, d * bits / 8)
        for name, new in zip(("codes", "scale", "zero"), (codes, scale, zero)):
            old = self.quant.get(f"{which}_{name}")
            self.quant[f"{which}_{name}"] = new if old is None else torch.cat([old, new], 2)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as attention sees them, (b, h_kv, seen, d): dequantised part, then the fp residual."""
        k, v = self.keys, self.values
        if "k_codes" in self.quant:
            e = self.quant
            k = torch.cat([dequantize_keys(e["k_codes"], e["k_scale"], e["k_zero"], self.bits, self.group, self.dtype), k], 2)
        if "v_codes" in self.quant:
            e = self.quant
            vq = dequantize(unpack(e["v_codes"], self.bits), e["v_scale"], e["v_zero"], self.value_group, self.dtype)
            v = torch.cat([vq, v], 2)
        return k, v

    def nbytes(self) -> int:
        codes_and_params = sum(t.numel() * t.element_size() for t in self.quant.values())
        return super().nbytes() + codes_and_params  # + the fp residuals


@dataclass
class KIVI(KVMethod):
    """Keys quantised per channel (each channel of each group of `group_size` consecutive tokens has its own
    asymmetric min-max scale/zero-point: key outliers live in fixed channels), values per token (groups of
    `group_size` channels, min(group_size, head_dim)), to `bits` (2 or 4); scale/zero in fp16.

    Residual (KIVI Algorithm 1): new keys wait in full precision until `residual` of them (a multiple of
    group_size) have gathered, then are quantised together; values stay fp for the `residual` most recent
    tokens and are quantised one by one as they leave that window. Quantisation happens when a token enters
    the cache, before the step's attention: once `seen` tokens exist, keys of positions < residual *
    floor(seen / residual) and values of positions < seen - residual are dequantised, the rest is fp. The
    prefill (rows < dense_rows) attends its fp KV; the cache then holds it in the form above. Sim mode uses the
    same rule per row: a group's codes never change once quantised, so both versions of K and V are computed
    once and each row picks, per position, the one its step would see. Nothing is evicted (kv_fraction 1).
    """

    # its codes + fp residual stay on the device in the offloading runtime (moving KIVI's two-part cache across a
    # link is not modelled: cache_bytes has what it holds)
    offload: ClassVar[str] = "resident"
    size_params: ClassVar[tuple[str, ...]] = ("bits", "residual")
    # the default residual (128 tokens in full precision) quantises nothing in the tests' short sequences
    test_variants: ClassVar[tuple[dict, ...]] = (
        {"residual": 32, "group_size": 16}, {"bits": 4, "residual": 16, "group_size": 8})

    bits: int = 2
    group_size: int = 32
    residual: int = 128

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.bits, bool) or self.bits not in BITS or not isinstance(self.bits, int):
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1 \
                or (self.group_size * self.bits) % 8:
            raise ValueError(f"group_size must be an int >= 1 with group_size * bits a multiple of 8 (packed key "
                             f"codes), got {self.group_size!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < self.group_size \
                or self.residual % self.group_size:
            raise ValueError(f"residual must be a positive multiple of group_size={self.group_size} (fp tokens before "
                             f"a key flush), got {self.residual!r}")

    def value_group(self, head_dim: int) -> int:
        group = min(self.group_size, head_dim)
        if head_dim % group or (head_dim * self.bits) % 8:
            raise ValueError(f"group_size={self.group_size} must divide head_dim={head_dim} (or be >= it)")
        return group

    def new_store(self, layer) -> KIVIStore:
        return KIVIStore(self.bits, self.group_size, self.value_group(layer.head_dim), self.residual)

    # ------------------------------------------------------------------ sim mode
    def forward_attention(self, session, layer, q, k, v, allowed):
        if session.mode == "decode":  # dense fp prefill; the store quantises it
            return super().forward_attention(session, layer, q, k, v, allowed)
        (t, _), s = self.sim_rows(session, q, k), k.shape[2]
        kq = fake_quantize_keys(k, self.bits, self.group_size)  # (b, hk, s, d), the version each key has once flushed
        vq = fake_quantize(v, self.bits, self.value_group(layer.head_dim))
        # rows in chunks (infinigen.rows.SIM_CHUNK): (rows, s) score tensors, never (t, s)
        outs = [self._sim_rows(session, layer, q[:, :, r0:r1], k, v, kq, vq, allowed, r0) for r0, r1 in row_chunks(t)]
        self.record_sim(session, layer, allowed, allowed, torch.arange(s - t, s, device=q.device), start=s - t)
        return torch.cat(outs, 2)  # (b, h, t, d)

    def _sim_rows(self, session, layer, q_rows, k, v, kq, vq, allowed, r0: int) -> torch.Tensor:
        """Rows r0..r1-1 (q_rows (b, h, r, d)) against keys 0..r1-1: per position the quantised or the fp
        K and V, as that row's decode step holds them."""
        b, h, r, d = q_rows.shape
        r1 = r0 + r
        seen = torch.arange(r0, r1, device=q_rows.device) + 1  # (r,) tokens existing at each row's step
        decoded = (seen > session.dense_rows)[:, None]
        cols = torch.arange(r1, device=q_rows.device)[None, :]  # (1, r1)
        key_q = decoded & (cols < seen[:, None] // self.residual * self.residual)  # (r, r1)
        value_q = decoded & (cols < seen[:, None] - self.residual)
        scores = torch.where(key_q, logits(q_rows, kq[:, :, :r1], layer.logit_scale),
                             logits(q_rows, k[:, :, :r1], layer.logit_scale))  # (b, hk, g, r, r1)
        scores = scores.masked_fill(~allowed[:, :, None, r0:r1, :r1], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(v.dtype)
        out = torch.matmul(probs * value_q, vq[:, :, None, :r1]) + torch.matmul(probs * ~value_q, v[:, :, None, :r1])
        return out.view(b, h, r, d)
