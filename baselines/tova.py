"""TOVA: Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", 2024).

The smallest evicting method: it shows the conventions every evicting method here follows (attend, record the
step's statistics, then evict; `max_held`; ties evict the earliest position; budgets from baselines/streaming.py).
See docs/adding_a_method.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from baselines.streaming import check_budget, remaining, token_count
from infinigen.adapter import KVStore
from infinigen.contract import KVMethod, attend, widen


@dataclass
class TOVA(KVMethod):
    """Keeps at most `budget` entries per KV head: after each step, while more are held, the entry the current
    query attended least (its probability summed over the KV head's query heads) is evicted for good. `budget`:
    int = tokens, float in (0, 1] = fraction of the tokens seen, the current one included (`token_count`). The
    dense prefill is evicted to the budget once, by its last row's attention."""

    budget: int | float = 0.2

    size_params: ClassVar[tuple[str, ...]] = ("budget",)
    test_variants: ClassVar[tuple[dict, ...]] = ({"budget": 8},)

    def __post_init__(self):
        super().__post_init__()
        check_budget("budget", self.budget)

    def max_held(self, max_len: int) -> int:
        return min(max_len, token_count(self.budget, max_len) + 1)  # kept after the last step + the current token

    def row_probs(self, layer, q: torch.Tensor, keys: torch.Tensor, held: torch.Tensor | None = None) -> torch.Tensor:
        """One query row q (b, h, 1, d) over keys (b, h_kv, s, d), only the `held` (b, h_kv, s) ones if given ->
        (b, h_kv, s) attention probabilities summed over each KV head's query heads (0 where not held)."""
        b, h, _, d = q.shape
        hk = keys.shape[1]
        # float32 at least: evicting the least attended of entries whose half-precision probabilities tie would be
        # decided by each mode's rounding (sim scores a row against every position, decode against the held ones)
        logits = torch.einsum("bkgd,bksd->bkgs", widen(q).reshape(b, hk, h // hk, d), widen(keys)) * layer.logit_scale
        if held is not None:
            logits = logits.masked_fill(~held[:, :, None], float("-inf"))
        return torch.softmax(logits, dim=-1).sum(2)

    @staticmethod
    def drop_index(probs: torch.Tensor, n: int) -> torch.Tensor:
        """(b, h_kv, s) probabilities (+inf = not held) -> (b, h_kv, n) indices of the n least attended entries;
        a stable sort, so ties evict the earliest position in both modes (entries are in position order)."""
        return probs.sort(dim=-1, stable=True).indices[..., :n]

    # ------------------------------------------------------------------ sim mode
    def sim_state(self, session, layer, q, k, v, allowed):
        """Replays decode mode's evictions row by row, one row's logits at a time (memory O(h x t)); returns
        last_row (b, h_kv, s): the last query row that attends each entry (t = never evicted)."""
        b, hk, s = q.shape[0], k.shape[1], k.shape[2]
        t, _ = self.sim_rows(session, q, k)
        held = torch.zeros(b, hk, s, dtype=torch.bool, device=q.device)
        last_row = torch.full((b, hk, s), t, device=q.device)

        def evict_after(row: int) -> None:  # row `row` has attended the held entries: evict down to the budget
            n = int(held[0, 0].sum()) - token_count(self.budget, row + 1)
            if n > 0:
                mask = held[..., : row + 1]
                probs = self.row_probs(layer, q[:, :, row : row + 1], k[:, :, : row + 1], mask)
                drop = self.drop_index(probs.masked_fill(~mask, float("inf")), n)  # (b, hk, n)
                held.scatter_(-1, drop, False)
                last_row.scatter_(-1, drop, row)

        n_dense = min(session.dense_rows, t)
        if n_dense:
            held[..., :n_dense] = True
            evict_after(n_dense - 1)
        for row in range(n_dense, t):
            held[..., row] = True
            evict_after(row)
        return last_row

    def sim_keep(self, session, layer, last_row, rows, s):
        cols = torch.arange(s, device=rows.device)
        return (rows[:, None] >= cols) & (rows[:, None] <= last_row[:, :, None, :s])  # (b, hk, r, s)

    # ------------------------------------------------------------------ decode mode
    def evict(self, layer, store: KVStore, q: torch.Tensor) -> None:
        n = store.stored - token_count(self.budget, store.seen)
        if n > 0:
            keys, _ = store.kv()
            drop = self.drop_index(self.row_probs(layer, q, keys), n)
            store.keep(remaining(drop, store.stored))

    def after_prefill(self, session, layer, store, q, mass) -> None:
        self.evict(layer, store, q[:, :, -1:])

    def decode_attention(self, session, layer, q, store):
        keys, values = store.kv()
        out, _ = attend(q, keys, values, None, layer.logit_scale)
        self.record_decode(layer, store, store.stored)  # what this step attended, before it evicts
        self.evict(layer, store, q)
        return out
