"""TOVA: Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", 2024).

The smallest evicting method: it shows the conventions every evicting method here follows (attend, record the
step's statistics, then evict; `max_held`; ties evict the earliest position; budgets from infinigen/budget.py).
See docs/adding_a_method.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.adapter import KVStore
from infinigen.attention import attend, widen
from infinigen.budget import check_budget, token_count
from infinigen.contract import KVMethod
from infinigen.rows import in_window
from infinigen.shared.eviction import Replay, Schedule, check_capture, remaining


@dataclass
class TOVA(KVMethod):
    """Keeps at most `budget` entries per KV head: after each step, while more are held, the entry the current
    query attended least (its probability summed over the KV head's query heads) is evicted for good. `budget`:
    int = tokens, float in (0, 1] = fraction of the tokens seen, the current one included (`token_count`). The
    dense prefill is evicted to the budget once, by its last row's attention. On a local layer (Gemma 3's sliding
    window W) a query attends only the held entries in its window, as the model's attention does, so the entries
    past it are the least attended (probability 0) and go first.

    `capture` ("none" | "graph" | "compile") only sets how sim mode's row loop runs on a CUDA device: eagerly, or
    through a CUDA graph of a whole block of rows ("compile": its step compiled with torch.compile first;
    infinigen/shared/eviction.py). Results are the same; off CUDA the loop always runs eagerly.
    """

    budget: int | float = 0.2
    capture: str = "none"

    size_params: ClassVar[tuple[str, ...]] = ("budget",)
    test_variants: ClassVar[tuple[dict, ...]] = ({"budget": 8},)

    def __post_init__(self):
        super().__post_init__()
        check_budget("budget", self.budget)
        check_capture(self.capture)

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
        """Replays decode mode's evictions row by row; returns last_row (b, h_kv, s): the last query row that
        attends each entry (t = never evicted). The prefill's eviction runs once (by its last row); the decoded
        rows go through `eviction.Replay`: a row that evicts takes a softmax over its logits (evicted entries
        at -inf), one product for minus its probabilities summed over the query heads, an argmax over the held
        entries up to itself and one write evicting it; a row that evicts nothing runs no op at all."""
        b, hk, s = q.shape[0], k.shape[1], k.shape[2]
        t, n_dense = self.sim_rows(session, q, k)
        last_row = torch.full((b, hk, s), t, device=q.device)
        state = torch.zeros(b, hk, t, dtype=torch.float32, device=q.device)  # 0 held, -inf evicted
        count = n_dense  # entries held per KV head (the same for every head): a host count
        n = count - token_count(self.budget, n_dense)
        if n_dense and n > 0:  # the prefill's eviction, by its last row's attention (as after_prefill's)
            row = n_dense - 1
            window = None
            if layer.sliding_window is not None:  # the last prefill row's window, as decode's in_window
                window = torch.arange(n_dense, device=q.device) > row - layer.sliding_window  # (n_dense,)
                window = window.expand(b, hk, -1)
            probs = self.row_probs(layer, q[:, :, row : row + 1], k[:, :, :n_dense], window)  # (b, hk, n_dense)
            drop = self.drop_index(probs, n)  # (b, hk, n)
            state.scatter_(-1, drop, float("-inf"))
            last_row.scatter_(-1, drop, row)
            count -= n
        schedule = Schedule(range(n_dense, t))
        for row in schedule.rows:  # host arithmetic only: whether each row evicts (its candidates: keys <= row)
            count += 1
            n = count - token_count(self.budget, row + 1)
            assert n <= 1, "past the prefill a step evicts at most one entry"
            schedule.add(row + 1, n == 1)
            count -= max(n, 0)
        if schedule.rows:
            replay = Replay(widen(q), widen(k[:, :, :t]), layer.logit_scale, state.view(b * hk, t),
                            last_row.view(b * hk, s), "tova", window=layer.sliding_window)
            self.capture_used = replay.run(schedule, self.capture)  # False off CUDA: the eager replay ran
        return last_row

    def sim_keep(self, session, layer, last_row, rows, s):
        cols = torch.arange(s, device=rows.device)
        return (rows[:, None] >= cols) & (rows[:, None] <= last_row[:, :, None, :s])  # (b, hk, r, s)

    # ------------------------------------------------------------------ decode mode
    def evict(self, layer, store: KVStore, q: torch.Tensor) -> None:
        n = store.stored - token_count(self.budget, store.seen)
        if n > 0:
            keys, _ = store.kv()
            window = in_window(layer, store, store.seen - 1)  # (b, h_kv, s) or None
            drop = self.drop_index(self.row_probs(layer, q, keys, window), n)
            store.keep(remaining(drop, store.stored))

    def after_prefill(self, session, layer, store, q, mass) -> None:
        self.evict(layer, store, q[:, :, -1:])

    def decode_attention(self, session, layer, q, store):
        keys, values = store.kv()
        window = in_window(layer, store, store.seen - 1)  # (b, h_kv, s) or None: a local layer's held entries
        out, _ = attend(q, keys, values, None if window is None else window[:, :, None], layer.logit_scale)
        self.record_decode(layer, store, store.stored if window is None else window.sum(-1))  # before it evicts
        self.evict(layer, store, q)
        return out
