"""Full KV offload: the whole cache lives in host memory and every layer's KV crosses to the compute device
before its attention (the FlexGen baseline of InfiniGen's speed figures; Sheng et al., ICML'23)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinigen.adapter import KVStore
from infinigen.method import KVMethod, attend


class HostStore(KVStore):
    """A KVStore whose keys/values are views of a host buffer (pinned when the model runs on CUDA, so the copies
    to the device can be asynchronous). The buffer doubles when full: appending a token costs one small copy
    rather than re-allocating (and re-pinning) the whole cache every step."""

    def __init__(self):
        super().__init__()
        self._k: torch.Tensor | None = None  # (b, h_kv, capacity, d)
        self._v: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        b, hk, t, d = key_states.shape
        first = self.seen == 0
        pos = torch.arange(self.seen, self.seen + t, device=key_states.device).expand(b, hk, t)
        self.positions = pos if self.positions is None else torch.cat([self.positions, pos], dim=-1)
        self.seen += t
        n = self.stored
        if self._k is None or n + t > self._k.shape[2]:
            self._grow(key_states, n + t)
        self._k[:, :, n : n + t].copy_(key_states)  # device -> host
        self._v[:, :, n : n + t].copy_(value_states)
        self.keys, self.values = self._k[:, :, : n + t], self._v[:, :, : n + t]
        self.device, self.is_initialized = key_states.device, True
        if first:
            return key_states, value_states  # the prefill attends what it just computed, on the device
        return self.keys, self.values

    def _grow(self, like: torch.Tensor, needed: int) -> None:
        b, hk, _, d = like.shape
        capacity = max(needed, 2 * (0 if self._k is None else self._k.shape[2]), 64)
        pin = like.is_cuda
        new = [torch.empty(b, hk, capacity, d, dtype=like.dtype, pin_memory=pin) for _ in range(2)]
        if self._k is not None:
            n = self.stored
            new[0][:, :, :n].copy_(self._k[:, :, :n])
            new[1][:, :, :n].copy_(self._v[:, :, :n])
        self._k, self._v = new


def kv_bytes(store: KVStore) -> int:
    return store.keys.numel() * store.keys.element_size() + store.values.numel() * store.values.element_size()


@dataclass
class Offload(KVMethod):
    """Keeps and attends every token (accuracy = full; sim mode is full attention). Decode mode holds the KV in
    host memory and copies each layer's whole K and V to the compute device right before its attention;
    `h2d_bytes` (per layer and step) counts those bytes: 2 * b * h_kv * seen * head_dim * element size.

    On a CPU-only run host and device coincide and no copy happens; the count is still the traffic the scheme
    implies, which is what the speed model needs."""

    def new_store(self, layer) -> HostStore:
        return HostStore()

    def decode_attention(self, session, layer, q, store):
        k = store.keys.to(q.device, non_blocking=True)  # ordered before the attention on the same stream
        v = store.values.to(q.device, non_blocking=True)
        self.stats.add(layer.index, "h2d_bytes", torch.tensor(kv_bytes(store), dtype=torch.float64))
        out, _ = attend(q, k, v, None, layer.logit_scale)
        self.record_decode(layer, store, store.stored)
        return out
