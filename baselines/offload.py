"""Full KV offload: the whole cache lives in host memory and every layer's KV crosses to the compute device
before its attention (the FlexGen baseline of InfiniGen's speed figures; Sheng et al., ICML'23)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.contract import KVMethod


@dataclass
class Offload(KVMethod):
    """Keeps and attends every token (accuracy = full; sim and decode mode are full attention). The offloading
    runtime (task=latency) holds its KV in host memory and moves each layer's whole K and V to the compute device
    before its attention. Decode mode counts that traffic as `h2d_bytes` (per layer and step):
    2 * b * h_kv * seen * head_dim * element size."""

    offload: ClassVar[str] = "held"
    prefix_resumable: ClassVar[bool] = True

    def decode_attention(self, session, layer, q, store):
        keys, values = store.kv()
        moved = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        self.stats.add(layer.index, "h2d_bytes", torch.tensor(moved, dtype=torch.float64))
        return super().decode_attention(session, layer, q, store)
