"""H2O: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS'23)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.adapter import KVStore
from infinigen.attention import attend, logits
from infinigen.budget import check_budget, token_count
from infinigen.contract import KVMethod
from infinigen.rows import in_window, row_chunks
from infinigen.shared.eviction import Replay, Schedule, check_capture, remaining


REDUCE = {
    "sum": lambda p: p.sum(2),  # total attention mass the entry received from its query-head group
    "max": lambda p: p.amax(2),  # the strongest single query head's attention
    "mean": lambda p: p.mean(2),  # sum / group size: same ranking as "sum", for comparison with averaging codes
}


@dataclass
class H2O(KVMethod):
    """Keeps the `recent` most recent tokens plus the `heavy` tokens with the largest accumulated attention
    probability received so far; every other token is evicted for good, one decoding step at a time.

    Budgets (int = tokens, float in (0, 1] = fraction of t, see `token_count`) are evaluated at t = tokens seen,
    the current one included. Accumulated attention is kept per KV head: each step adds the step's softmax
    probabilities (prefill rows included), aggregated over the query heads sharing the KV head by `gqa_reduce`
    ("sum" | "max" | "mean"; per-head models have one query per group, where all three agree).

    Step t, as in the paper's Algorithm 1: the query attends the entries kept after step t-1 plus itself
    (so at most budget(t-1) + 1 entries), adds its probabilities to the accumulators, then the cache shrinks to
    the window [t - recent(t), t) plus the top heavy(t) other entries by accumulated attention. On a local layer
    (Gemma 3's sliding window W) the query attends only the held entries in its window, as the model's attention
    does: an entry past the window receives no more attention, keeps what it accumulated and is evicted when it
    ranks least, like any other (budgets count tokens seen, as on a global layer). The dense
    prefill counts as the steps up to t = dense_rows and is evicted to budget(dense_rows) right after it.
    `capture` ("none" | "graph" | "compile") only sets how sim mode's row loop runs on a CUDA device: eagerly, or
    through a CUDA graph of a whole block of rows ("compile": its step compiled with torch.compile first;
    infinigen/shared/eviction.py). Results are the same; off CUDA the loop always runs eagerly.
    """

    heavy: int | float = 0.1
    recent: int | float = 0.1
    gqa_reduce: str = "sum"
    capture: str = "none"

    needs_prefill_probs = True
    size_params: ClassVar[tuple[str, ...]] = ("heavy", "recent")
    test_variants: ClassVar[tuple[dict, ...]] = ({"gqa_reduce": "max"}, {"heavy": 8, "recent": 8})

    def __post_init__(self):
        super().__post_init__()
        check_budget("heavy", self.heavy)
        check_budget("recent", self.recent)
        if self.gqa_reduce not in REDUCE:
            raise ValueError(f"gqa_reduce must be one of {sorted(REDUCE)}, got {self.gqa_reduce!r}")
        check_capture(self.capture)

    def budget(self, seen: int) -> int:
        """Entries kept after the step at which `seen` tokens exist."""
        return min(seen, token_count(self.heavy, seen) + token_count(self.recent, seen))

    def max_held(self, max_len: int) -> int:
        return min(max_len, self.budget(max_len) + 1)  # what it kept after the previous step + the current token

    def plan(self, seen: int, held: int) -> tuple[int, int]:
        """(window start, number of entries to evict) after the step at which `seen` tokens exist and `held`
        entries (the whole window among them) are in the cache. The candidates for eviction are the held
        entries before the window: all but the `heavy` of them with the largest accumulated attention go.

        Once the budget binds this evicts exactly one entry per step (the window advances by at most one
        token and heavy(t) >= heavy(t-1)); only the eviction right after the prefill drops many at once.
        """
        recent = token_count(self.recent, seen)
        heavy = min(token_count(self.heavy, seen), held - recent)
        return seen - recent, held - recent - heavy

    def reduce(self, probs: torch.Tensor) -> torch.Tensor:
        return REDUCE[self.gqa_reduce](probs)  # (b, h_kv, g, ...) -> (b, h_kv, ...)

    @staticmethod
    def drop_index(cand_acc: torch.Tensor, n: int) -> torch.Tensor:
        """(b, h_kv, c) accumulated attention of the candidates (+inf = not held) -> (b, h_kv, n) indices of the
        n with the least. argmin (first occurrence) for the common single eviction: it is the cheapest."""
        if n == 1:
            return cand_acc.argmin(-1, keepdim=True)
        return cand_acc.topk(n, dim=-1, largest=False).indices

    # ------------------------------------------------------------------ sim mode
    def sim_state(self, session, layer, q, k, v, allowed):
        """Replays the decode-mode eviction row by row; returns last_row (b, h_kv, s), the last query row that
        attends each entry (t = never evicted). The dense prefill is accumulated chunk by chunk and evicted once;
        the decoded rows go through `eviction.Replay`: per row a softmax over its logits (future and evicted
        entries at -inf: probability exactly 0), one product adding minus its reduced probabilities to the state
        (minus the accumulated attention; -inf = evicted), and when it evicts an argmax over the candidates (the
        held entries before the window) and one write evicting it: static shapes, nothing read back, memory linear
        in t (one block of rows' logits at a time)."""
        b, hk, s = q.shape[0], k.shape[1], k.shape[2]
        t, n_dense = self.sim_rows(session, q, k)
        scale = layer.logit_scale
        masked = torch.finfo(q.dtype).min
        acc = torch.zeros(b, hk, s, dtype=torch.float32, device=q.device)  # +inf = evicted
        last_row = torch.full((b, hk, s), t, device=q.device)  # last query row that attends each entry
        held = 0
        # the dense prefill: accumulate its rows chunk by chunk, then one bulk eviction (as after_prefill does)
        for r0, r1 in row_chunks(n_dense):
            sc = logits(q[:, :, r0:r1], k[:, :, :n_dense], scale)  # (b, hk, g, r, n_dense)
            sc = sc.masked_fill(~allowed[:, :, None, r0:r1, :n_dense], masked)
            acc[..., :n_dense] += self.prefill_mass(torch.softmax(sc, dim=-1, dtype=torch.float32))
        if n_dense:
            held = n_dense
            start, n = self.plan(n_dense, held)
            if n:
                drop = self.drop_index(acc[..., :start], n)  # (b, hk, n), all < start
                acc.scatter_(-1, drop, float("inf"))
                last_row.scatter_(-1, drop, n_dense - 1)
                held -= n
        schedule = Schedule(range(n_dense, t))
        for row in schedule.rows:  # host arithmetic only: each row's window start and whether it evicts
            held += 1
            start, n = self.plan(row + 1, held)
            assert n <= 1, "past the prefill a step evicts at most one entry"
            schedule.add(start, n == 1)
            held -= n
        if schedule.rows:
            state = acc.neg_().view(b * hk, s)  # minus the accumulated attention: evicted -inf, argmax = least
            replay = Replay(q, k[:, :, :t], scale, state, last_row.view(b * hk, s), "h2o", self.gqa_reduce,
                            layer.sliding_window)
            self.capture_used = replay.run(schedule, self.capture)  # False off CUDA: the eager replay ran
        return last_row

    def sim_keep(self, session, layer, last_row, rows, s):
        cols = torch.arange(s, device=rows.device)
        return (rows[:, None] >= cols) & (rows[:, None] <= last_row[:, :, None, :s])  # (b, hk, r, s)

    def prefill_mass(self, probs):
        return self.reduce(probs).sum(-2)  # (b, h_kv, g, r, s) -> (b, h_kv, s)

    # ------------------------------------------------------------------ decode mode
    def evict(self, store: KVStore) -> None:
        start, n = self.plan(store.seen, store.stored)
        if n:
            acc = store.entries["acc"]  # (b, h_kv, held), in position order: candidates come first
            drop = self.drop_index(acc[..., : store.stored - (store.seen - start)], n)
            store.keep(remaining(drop, acc.shape[-1]))  # gathers entries["acc"] too

    def after_prefill(self, session, layer, store, q, mass) -> None:
        store.entries["acc"] = mass  # (b, h_kv, s): prefill_mass summed over the prefill rows
        self.evict(store)

    def decode_attention(self, session, layer, q, store):
        keys, values = store.kv()
        window = in_window(layer, store, store.seen - 1)  # (b, h_kv, s) or None: a local layer's held entries
        out, probs = attend(q, keys, values, None if window is None else window[:, :, None], layer.logit_scale,
                            need_probs=True)
        self.record_decode(layer, store, store.stored if window is None else window.sum(-1))
        acc = store.entries["acc"]
        acc = torch.cat([acc, acc.new_zeros(*acc.shape[:2], 1)], dim=-1)  # the current token's accumulator
        store.entries["acc"] = acc + self.reduce(probs[:, :, :, 0])  # probs (b, h_kv, g, 1, s)
        self.evict(store)
        return out
