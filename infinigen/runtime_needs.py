"""What an offloading runtime (infinigen/offload/) and the performance model (infinigen/offload/perf.py) ask of a
method, apart from its accuracy: where its KV lives (`offload`, `offload_kind`), how a held row is stored (`codec`), how
many rows it holds or selects (`max_held`, `max_selected`, `selection_width`), what ranking them costs
(`score_channels`, `selection_flops`), the bytes its cache holds (`store_bytes`), and a copy to count on a
random-weight stand-in (`stand_in`, infinigen/offload/census.py). Every name has a default that is right for a method
that keeps dense KV or gathers by a mask; a method overrides only what differs (infinigen/contract.py inherits these).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from infinigen.adapter import AttentionLayer, KVStore, Session

# How an offloading runtime (infinigen/offload/) holds a method's KV, declared per layer by `KVMethod.offload_kind`:
#   resident  on the compute device; the method's own decode step runs there (nothing crosses the link)
#   held      every entry the method holds lives in a host pool and crosses before the layer's attention
#             (`codec` says how a row is stored, `max_held` how many entries it ever holds at once)
#   gather    past entries live in a host pool; `GatheringMethod.select` says which rows cross, at the method's
#             `speculation_point`; per-entry state (`store.entries`) stays on the device
OFFLOAD_KINDS = ("resident", "held", "gather")
# When a gathering method's selection for layer i is known: at the start of layer i-1's attention, at its end
# (after its residual add, before its MLP), or only from layer i's own query (the gather is synchronous).
SPECULATION_POINTS = ("attention_start", "attention_end", "query")


class RuntimeNeeds:
    """What every method declares to the runtimes (defaults: held in a host pool as K|V in the model's dtype)."""

    offload: ClassVar[str] = "held"  # what an offloading runtime does with this method's KV (OFFLOAD_KINDS)

    def stand_in(self) -> "RuntimeNeeds":
        """A fresh copy to run on a random-weight stand-in of the model (infinigen/offload/census.py counts the
        code path it runs, not its choices): it binds without reading data files."""
        return dataclasses.replace(self)

    def store_bytes(self, stores: list[KVStore]) -> int:
        """Bytes the decode-mode cache holds for its KV."""
        return sum(s.nbytes() for s in stores)

    def offload_kind(self, layer: AttentionLayer) -> str:
        return self.offload

    def codec(self, layer: AttentionLayer, dtype) -> Any:
        """How a held entry is stored on the host: an object with encode(k, v) -> rows (..., W), decode(rows) ->
        (k, v), `width` and `dtype` (of the rows); None = K|V in the model's dtype."""
        return None

    def max_held(self, max_len: int) -> int:
        """Most entries one layer holds at once (the current token included) in a sequence of max_len tokens."""
        return max_len

    def attention_end(self, session: Session, layer: AttentionLayer) -> None:
        """Called when `layer`'s attention output has been added to the residual stream, before its MLP."""


class GatheringNeeds:
    """What a gathering method (`GatheringMethod`) declares besides: how wide its selection is and what it costs."""

    offload: ClassVar[str] = "gather"

    def selection_width(self, session: Session, past: int, position: int) -> int:
        """A host bound on how many of the `past` entries the row at `position` selects (per row and KV head)."""
        return min(past, self.max_selected(session.max_len))

    def max_selected(self, max_len: int) -> int:
        """Most past entries one row and KV head selects in a sequence of max_len tokens (sizes landing buffers)."""
        return max_len

    def score_channels(self, layer: AttentionLayer) -> float:
        """Channels of the per-entry vector `select` ranks one past entry of one KV head by (its keys: head_dim)."""
        return layer.head_dim

    def selection_flops(self, layer: AttentionLayer, past: int) -> float:
        """FLOPs one batch row's `select` spends ranking `past` entries, for the performance model
        (infinigen/offload/roofline.py; the bytes it moves are counted by running it): each query head dotted with
        `past` stored vectors of `score_channels` elements."""
        return 2.0 * layer.num_heads * past * self.score_channels(layer)

