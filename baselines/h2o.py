"""H2O: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS'23).

Two readings of the method, `heavy_hitters`:

* "cache" (this project's default): the paper's Algorithm 1 on a real cache. Each step attends what the cache holds
  plus itself, adds the probabilities it gave to the entries' accumulators, then keeps the recent window and the
  heaviest others; every other entry is gone for good (the cache holds only what it keeps).
* "mask": H2O's released code, which the InfiniGen artifact's H2O baseline is a copy of
  (accuracy/lm_eval/utils_lm_eval/modify_llama.py `local_heavy_hitter_mask`, LlamaAttention_heavy_hitter): a mask
  over one full forward. A heavy set of `heavy` entries (the row itself included) is ranked by each entry's
  accumulated attention from the *dense* causal softmax of every row since it arrived (the rows never see a smaller
  cache); before each row the heavy set drops its least-accumulated entry, and the row attends the heavy set, itself
  and the `recent` entries before it, the two chosen independently. An entry dropped from the heavy set never comes
  back. Computing dense probabilities needs every key: in decode mode the cache holds every entry (the attention
  reads only the kept ones), as the artifact's mask simulation does.

`budget_of` "prefix" (default): heavy and recent are fractions of the tokens seen so far (`token_count`);
"sequence": int(fraction x the sequence length), fixed for the whole sequence (the artifact's `heavy_budget`,
`recent_budget`; the sequence is the session's longest: sim mode's forward, decode mode's max_len), so that the first
`heavy` rows attend everything. `dense_layers`: the first layers attend densely (the artifact converts layers 2+).
docs/methods.md has each option's measured effect.
"""

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


HEAVY_HITTERS = ("cache", "mask")
BUDGET_OF = ("prefix", "sequence")
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
    heavy_hitters: str = "cache"  # cache | mask (see the module docstring)
    budget_of: str = "prefix"  # prefix | sequence
    dense_layers: int = 0

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
        if self.heavy_hitters not in HEAVY_HITTERS:
            raise ValueError(f"heavy_hitters must be one of {HEAVY_HITTERS}, got {self.heavy_hitters!r}")
        if self.budget_of not in BUDGET_OF:
            raise ValueError(f"budget_of must be one of {BUDGET_OF}, got {self.budget_of!r}")
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise ValueError(f"dense_layers must be an integer >= 0, got {self.dense_layers!r}")
        self._length = 0  # budget_of="sequence": the session's longest sequence, read where a session is at hand

    @property
    def prefix_resumable(self) -> bool:
        """The replay goes on from a prefix's state (`resumed_state`), unless budgets are fractions of the
        sequence's length or heavy hitters come from the dense attention mask (h2o_reference)."""
        return self.budget_of == "prefix" and self.heavy_hitters == "cache"

    def dense_layer(self, layer) -> bool:
        return self.dense_layers > 0 and layer.index < self.dense_layers

    def sim_dense(self, layer) -> bool:
        return self.dense_layer(layer) or super().sim_dense(layer)

    def use_session(self, session) -> None:
        """Remember the session's longest sequence (budget_of="sequence" counts are fractions of it)."""
        if self.budget_of == "sequence":
            self._length = session.longest("budget_of='sequence'")

    def counts(self, seen: int) -> tuple[int, int]:
        """(heavy, recent) token counts once `seen` tokens exist."""
        if self.budget_of == "sequence":
            fixed = [b if isinstance(b, int) else int(b * self._length) for b in (self.heavy, self.recent)]
            return min(fixed[0], seen), min(fixed[1], seen)
        return token_count(self.heavy, seen), token_count(self.recent, seen)

    def budget(self, seen: int) -> int:
        """Entries kept after the step at which `seen` tokens exist."""
        return min(seen, sum(self.counts(seen)))

    def max_held(self, max_len: int) -> int:
        if self.heavy_hitters == "mask" or self.dense_layers:
            return max_len  # every entry, for the dense probabilities (or on a dense layer)
        if self.budget_of == "sequence":
            self._length = max_len
        return min(max_len, self.budget(max_len) + 1)  # what it kept after the previous step + the current token

    def plan(self, seen: int, held: int) -> tuple[int, int]:
        """(window start, number of entries to evict) after the step at which `seen` tokens exist and `held`
        entries (the whole window among them) are in the cache. The candidates for eviction are the held
        entries before the window: all but the `heavy` of them with the largest accumulated attention go.

        Once the budget binds this evicts exactly one entry per step (the window advances by at most one
        token and heavy(t) >= heavy(t-1)); only the eviction right after the prefill drops many at once.
        """
        heavy, recent = self.counts(seen)
        heavy = min(heavy, held - recent)
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
        if self.dense_layer(layer):
            return None
        self.use_session(session)
        if self.heavy_hitters == "mask":
            return self.mask_state(session, layer, q, k, allowed)
        b, hk, s = q.shape[0], k.shape[1], k.shape[2]
        if s > q.shape[2]:  # rows resumed after a prefix: its forward's state, all of it decoded rows from here
            return self.resumed_state(session, layer, q, k)
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
        # minus the accumulated attention: evicted -inf, the least attended an argmax
        return self.replay(session, layer, q, k, acc.neg_(), last_row, held, n_dense)

    def replay(self, session, layer, q, k, state, last_row, held: int, first: int):
        """The decoded rows first..s-1 (q's rows: the last s - first) through `eviction.Replay`, from `state` (b, h_kv,
        s: minus the accumulated attention), `last_row` and `held` entries after row first - 1. Leaves them for a
        forward resuming after this one (`Session.carry`); returns last_row."""
        b, hk, s = k.shape[0], k.shape[1], k.shape[2]
        schedule = Schedule(range(first, s))
        for row in schedule.rows:  # host arithmetic only: each row's window start and whether it evicts
            held += 1
            start, n = self.plan(row + 1, held)
            assert n <= 1, "past the prefill a step evicts at most one entry"
            schedule.add(start, n == 1)
            held -= n
        if schedule.rows:
            replay = Replay(q, k, layer.logit_scale, state.view(b * hk, s), last_row.view(b * hk, s), "h2o",
                            self.gqa_reduce, layer.sliding_window, first=s - q.shape[2])
            self.capture_used = replay.run(schedule, self.capture)  # False off CUDA: the eager replay ran
        session.carry[layer.index] = {"state": state, "last_row": last_row, "held": held}
        return last_row

    def resumed_state(self, session, layer, q, k):
        """sim_state of rows resumed after a prefix (`prefix_resumable`): the replay goes on from the prefix's
        (its entries never evicted, last_row = its length then, attend to the end of this sequence)."""
        kept = session.carried[layer.index]
        b, hk, s = k.shape[0], k.shape[1], k.shape[2]
        p = kept["state"].shape[-1]
        state = torch.cat([kept["state"], kept["state"].new_zeros(b, hk, s - p)], dim=-1)
        last_row = torch.cat([kept["last_row"].masked_fill(kept["last_row"] == p, s),
                              kept["last_row"].new_full((b, hk, s - p), s)], dim=-1)
        return self.replay(session, layer, q, k, state, last_row, kept["held"], p)

    def sim_keep(self, session, layer, last_row, rows, s):
        if last_row is None:  # a dense layer
            return None
        cols = torch.arange(s, device=rows.device)
        keep = (rows[:, None] >= cols) & (rows[:, None] <= last_row[:, :, None, :s])  # (b, hk, r, s)
        if self.heavy_hitters == "mask":  # the recent entries before each row, beside its heavy set
            recent = torch.tensor([self.counts(r + 1)[1] for r in range(*session.chunk)], device=rows.device)
            keep |= (rows[:, None] >= cols) & (rows[:, None] - cols <= recent[:, None])
        return keep

    def prefill_mass(self, probs):
        return self.reduce(probs).sum(-2)  # (b, h_kv, g, r, s) -> (b, h_kv, s)

    def mask_state(self, session, layer, q, k, allowed):
        """heavy_hitters="mask" in sim mode: last_row (b, h_kv, s), the last row whose heavy set holds each entry.
        Rows one block at a time: the block's dense causal probabilities (reduced over each KV head's query heads),
        then row by row the heavy set's trim and the row's probabilities added to every accumulator (+inf marks an
        entry dropped from the heavy set: it stays dropped). How many a row drops is host arithmetic, so nothing
        is read back. The prompt's rows (dense_rows) only accumulate; the row after them trims the heavy set at
        once, as decode mode's after_prefill does."""
        b, hk, s = q.shape[0], k.shape[1], k.shape[2]
        t, n_dense = self.sim_rows(session, q, k)
        acc = torch.zeros(b, hk, s, dtype=torch.float32, device=q.device)
        last_row = torch.full((b, hk, s), t - 1, device=q.device)
        size = 0  # entries in the heavy set (the same for every head)
        masked = torch.finfo(q.dtype).min
        for r0, r1 in row_chunks(t):
            sc = logits(q[:, :, r0:r1], k[:, :, :r1], layer.logit_scale)  # (b, hk, g, r, r1)
            sc = sc.masked_fill(~allowed[:, :, None, r0:r1, :r1], masked)
            probs = self.reduce(torch.softmax(sc, dim=-1, dtype=torch.float32))  # (b, hk, r, r1)
            for row in range(r0, r1):
                if row >= n_dense:
                    size = self.trim(acc[..., :row], size, row, last_row)
                acc[..., :r1] += probs[:, :, row - r0]
                size += 1
        return last_row

    def trim(self, acc, size: int, row: int, last_row=None) -> int:
        """Drops the least-accumulated entries of the heavy set down to heavy - 1 before the row at `row` attends
        (the row itself makes it `heavy`): acc (b, h_kv, n) over the entries before the row, +inf where dropped
        (written in place); returns the new size. last_row: marks each dropped entry's last row (sim mode)."""
        keep = max(self.counts(row + 1)[0] - 1, 0)
        for _ in range(size - keep):
            drop = acc.argmin(-1, keepdim=True)  # (b, hk, 1)
            acc.scatter_(-1, drop, float("inf"))
            if last_row is not None:
                last_row.scatter_(-1, drop, row - 1)
        return min(size, keep)

    # ------------------------------------------------------------------ decode mode
    def mask_attention(self, session, layer, q, store):
        """heavy_hitters="mask", one decoded token: trim the heavy set, attend it, the recent entries and itself,
        then add the row's dense causal probabilities to the accumulators (+inf: dropped from the heavy set)."""
        acc = store.entries["acc"]  # (b, h_kv, stored - 1): the past entries
        position = store.seen - 1
        store.state["heavy"] = self.trim(acc, store.state["heavy"], position)
        acc = torch.cat([acc, acc.new_zeros(*acc.shape[:2], 1)], dim=-1)
        keys, values = store.kv()
        window = in_window(layer, store, position)  # (b, h_kv, s) or None
        recent = store.positions >= position - self.counts(position + 1)[1]  # (b, h_kv, s), the current included
        attended = acc.isfinite() | recent if window is None else (acc.isfinite() | recent) & window
        out, _ = attend(q, keys, values, attended[:, :, None], layer.logit_scale)
        _, probs = attend(q, keys, values, None if window is None else window[:, :, None], layer.logit_scale,
                          need_probs=True)  # the dense causal row, for the accumulators
        self.record_decode(layer, store, attended.sum(-1))
        store.entries["acc"] = acc + self.reduce(probs[:, :, :, 0])
        store.state["heavy"] += 1
        return out

    def evict(self, store: KVStore) -> None:
        start, n = self.plan(store.seen, store.stored)
        if n:
            acc = store.entries["acc"]  # (b, h_kv, held), in position order: candidates come first
            drop = self.drop_index(acc[..., : store.stored - (store.seen - start)], n)
            store.keep(remaining(drop, acc.shape[-1]))  # gathers entries["acc"] too

    def after_prefill(self, session, layer, store, q, mass) -> None:
        if self.dense_layer(layer):
            return
        self.use_session(session)
        store.entries["acc"] = mass  # (b, h_kv, s): prefill_mass summed over the prefill rows
        if self.heavy_hitters == "mask":  # every prompt entry is in the heavy set; the first decoded row trims it
            store.state["heavy"] = mass.shape[-1]
            return
        self.evict(store)

    def decode_attention(self, session, layer, q, store):
        if self.dense_layer(layer):
            return super().decode_attention(session, layer, q, store)
        if self.heavy_hitters == "mask":
            return self.mask_attention(session, layer, q, store)
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
