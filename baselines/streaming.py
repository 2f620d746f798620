"""StreamingLLM: attention sinks + a sliding window (Xiao et al., "Efficient Streaming Language Models with
Attention Sinks", ICLR'24). Its `recent` budget is an int (tokens) or a float in (0, 1] (a fraction of the tokens
seen so far): infinigen/budget.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.adapter import KVStore
from infinigen.budget import check_budget, token_count
from infinigen.contract import KVMethod


@dataclass
class Streaming(KVMethod):
    """Keeps the first `sinks` tokens (attention sinks) and the `recent` most recent tokens, the current one
    included; everything in between is evicted for good.

    At step t (t = tokens seen, current included) a query attends positions p < sinks or
    p >= t - token_count(recent, t). Sim mode builds that banded mask per chunk of rows; decode mode evicts
    from the KVStore (right after the prefill, then before each step's attention), so the cache really shrinks.
    """

    sinks: int = 4
    recent: int | float = 0.2

    size_params: ClassVar[tuple[str, ...]] = ("sinks", "recent")
    prefix_resumable: ClassVar[bool] = True
    test_variants: ClassVar[tuple[dict, ...]] = ({"recent": 32},)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be an int >= 0 (number of initial tokens always kept), got {self.sinks!r}")
        check_budget("recent", self.recent)

    def window_start(self, seen: int) -> int:
        return seen - token_count(self.recent, seen)

    # ------------------------------------------------------------------ sim mode
    def window_starts(self, rows: torch.Tensor) -> torch.Tensor:
        """`window_start(row + 1)` of each row (r,), on the rows' device: `token_count`'s arithmetic in the same
        float64 steps, so the two agree, and nothing is read back per row."""
        seen = rows + 1
        if isinstance(self.recent, int):
            return seen - seen.clamp(max=self.recent)
        count = torch.ceil(seen.double() * self.recent - 1e-9).long().clamp(min=1)
        return seen - torch.minimum(seen, count)

    def sim_keep(self, session, layer, state, rows, s):
        start = self.window_starts(rows)  # (r,)
        cols = torch.arange(s, device=rows.device)
        keep = (cols[None, :] < self.sinks) | (cols[None, :] >= start[:, None])  # (r, s)
        return keep[None, None]  # (1, 1, r, s): the same for every head

    # ------------------------------------------------------------------ decode mode
    def evict(self, store: KVStore) -> None:
        """The store holds the sinks, then an unbroken run up to the newest token (every step evicts so), so
        what stays is its first min(sinks, start) and last seen - start entries: known on the host."""
        start = self.window_start(store.seen)
        sinks, window, n = min(self.sinks, start), store.seen - start, store.stored
        if sinks + window >= n:
            return
        dev = store.positions.device
        index = torch.cat([torch.arange(sinks, device=dev), torch.arange(n - window, n, device=dev)])
        store.keep(index.expand(*store.positions.shape[:2], -1))

    def after_prefill(self, session, layer, store, q, probs) -> None:
        self.evict(store)

    def decode_attention(self, session, layer, q, store):
        self.evict(store)
        return super().decode_attention(session, layer, q, store)

    def max_held(self, max_len: int) -> int:
        # before a step's eviction: the sinks, the previous step's window and the current token
        return min(max_len, self.sinks + token_count(self.recent, max_len) + 1)
