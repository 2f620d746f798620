"""H2O: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS'23)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch

from baselines.streaming import check_budget, remaining, token_count
from infinigen.adapter import KVStore
from infinigen.contract import KVMethod, attend, logits, row_chunks


def row_blocks(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Logits of a chunk of rows laid out row-major, so that one row's (h_kv, g, s) block is contiguous and its
    softmax reads it in place: q (b, h, r, d) already scaled, k (b, h_kv, s, d) -> (b, r, h_kv, g, s). One
    matrix product per head written straight into its strided slot (BLAS takes the row stride as is)."""
    b, h, r, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    g = h // hk
    out = torch.empty(b, r, hk, g, s, dtype=q.dtype, device=q.device)
    for i in range(b):
        for j in range(hk):
            for head in range(g):
                torch.mm(q[i, j * g + head], k[i, j].T, out=out[i, :, j, head])
    return out


REDUCE = {
    "sum": lambda p: p.sum(2),  # total attention mass the entry received from its query-head group
    "max": lambda p: p.amax(2),  # the strongest single query head's attention
    "mean": lambda p: p.mean(2),  # sum / group size: same ranking as "sum", for comparison with averaging codes
}


@contextmanager
def one_thread():
    """The sim-mode row loop runs thousands of tiny ops per layer: on CPU, OpenMP fork/join costs more than
    their work (milliseconds each when the cores are shared), so they run on one thread; restored on exit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    the window [t - recent(t), t) plus the top heavy(t) other entries by accumulated attention. The dense
    prefill counts as the steps up to t = dense_rows and is evicted to budget(dense_rows) right after it.
    """

    heavy: int | float = 0.1
    recent: int | float = 0.1
    gqa_reduce: str = "sum"

    needs_prefill_probs = True
    size_params: ClassVar[tuple[str, ...]] = ("heavy", "recent")
    test_variants: ClassVar[tuple[dict, ...]] = ({"gqa_reduce": "max"}, {"heavy": 8, "recent": 8})

    def __post_init__(self):
        super().__post_init__()
        check_budget("heavy", self.heavy)
        check_budget("recent", self.recent)
        if self.gqa_reduce not in REDUCE:
            raise ValueError(f"gqa_reduce must be one of {sorted(REDUCE)}, got {self.gqa_reduce!r}")

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
        attends each entry (t = never evicted). Logits are computed one chunk of rows at a time, (b, r, h_kv, g,
        <= s) with a row's block contiguous, so memory stays linear in t and a row's softmax reads it in place;
        per row only (b, h_kv, g, r1)-sized ops run: future and evicted entries are masked (their
        probability is exactly 0) and evicted ones carry +inf accumulated attention, so candidates are simply
        the prefix before the window."""
        b, hk, s = q.shape[0], k.shape[1], k.shape[2]
        t, n_dense = self.sim_rows(session, q, k)
        scale = layer.logit_scale
        masked = torch.finfo(q.dtype).min
        acc = torch.zeros(b, hk, s, dtype=torch.float32, device=q.device)  # +inf = evicted
        last_row = torch.full((b, hk, s), t, device=q.device)  # last query row that attends each entry
        evictions: list[tuple[int, torch.Tensor]] = []  # (row, (b, hk, n) entries evicted after it)
        held = 0

        def evict(seen: int, row: int, scores=None, i: int = 0) -> int:
            """Evicts after the step at which `seen` tokens exist; masks the evicted entries in the remaining rows
            of the chunk's `scores` (b, r, hk, g, r1) (later chunks mask them from acc)."""
            start, n = self.plan(seen, held)
            if n:
                drop = self.drop_index(acc[..., :start], n)  # (b, hk, n), all < start
                acc.scatter_(-1, drop, float("inf"))
                evictions.append((row, drop))
                if scores is not None and i + 1 < scores.shape[1]:
                    rest = scores[:, i + 1 :]  # (b, r - i - 1, hk, g, r1)
                    rest.scatter_(-1, drop[:, None, :, None].expand(*rest.shape[:-1], n), masked)
            return held - n

        # the dense prefill: accumulate its rows chunk by chunk, then one bulk eviction (as after_prefill does)
        for r0, r1 in row_chunks(n_dense):
            sc = logits(q[:, :, r0:r1], k[:, :, :n_dense], scale)  # (b, hk, g, r, n_dense)
            sc = sc.masked_fill(~allowed[:, :, None, r0:r1, :n_dense], masked)
            acc[..., :n_dense] += self.prefill_mass(torch.softmax(sc, dim=-1, dtype=torch.float32))
        if n_dense:
            held = n_dense
            held = evict(n_dense, n_dense - 1)
        reduce = REDUCE[self.gqa_reduce]
        qs = q * scale  # scaled once: the row loop's logits need no pass over (heads x rows x t)
        for r0, r1 in row_chunks(t - n_dense):
            r0, r1 = r0 + n_dense, r1 + n_dense
            scores = row_blocks(qs[:, :, r0:r1], k[:, :, :r1])  # (b, r, hk, g, r1)
            # each row's future and the entries evicted before this chunk: masked for all rows at once
            future = torch.arange(r1, device=q.device) > torch.arange(r0, r1, device=q.device)[:, None]
            scores.masked_fill_(future[None, :, None, None] | acc[:, None, :, None, :r1].isinf(), masked)
            seen_acc = acc[..., :r1]  # a view: `acc[..., :r1] += x` would also copy it back through __setitem__
            with one_thread() if q.device.type == "cpu" else nullcontext():
                for i, row in enumerate(range(r0, r1)):
                    held += 1
                    probs = torch.softmax(scores[:, i], dim=-1, dtype=torch.float32)  # (b, hk, g, r1)
                    seen_acc.add_(reduce(probs))  # + exactly 0 for the masked entries
                    held = evict(row + 1, row, scores, i)
        if evictions:
            rows = torch.cat([torch.full_like(drop, row) for row, drop in evictions], dim=-1)
            last_row.scatter_(-1, torch.cat([drop for _, drop in evictions], dim=-1), rows)
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
        out, probs = attend(q, keys, values, None, layer.logit_scale, need_probs=True)
        self.record_decode(layer, store, store.stored)
        acc = store.entries["acc"]
        acc = torch.cat([acc, acc.new_zeros(*acc.shape[:2], 1)], dim=-1)  # the current token's accumulator
        store.entries["acc"] = acc + self.reduce(probs[:, :, :, 0])  # probs (b, h_kv, g, 1, s)
        self.evict(store)
        return out
