"""Per-step token selection from a KV pool, in both modes: the machinery InfiniGen and the oracle share.

A subclass supplies the vectors each decoded row ranks its candidates with (`score_queries` · `score_keys`);
this class applies the dynamic count + cap (`selection.select`), the pool with capacity and eviction, and
the statistics (kv_fraction, selected tokens, recall), identically in sim and decode mode.

Three options set how a row's count and candidates are defined; their defaults are this project's, the other values
what the InfiniGen artifact's accuracy code computes (accuracy/src/modeling_llama_ours.py and modeling_opt_ours.py,
`kv_cache_mask`; docs/methods.md has each one's measured effect):

    budget_of       "prefix": a row fetches at most ceil(budget x the entries before it); "sequence": at most
                    int(budget x the sequence length), the same for every row, and rows with fewer entries before
                    them than that attend all of them (the artifact's `fetch_max` and its dense first rows). The
                    length is the session's longest sequence (sim: the forward's; decode: `max_len`)
    threshold_head  "own": each head counts the candidates within alpha of its own best; "first": of the layer's
                    first query head's best, for every head (the artifact's Llama code; its OPT code uses "own")
    current_token   "kept": a decoded row attends itself besides its selection; "ranked": it is a candidate like the
                    past, so the count may leave it out, and a row that selects nothing attends its whole prefix (the
                    artifact adds -10000 to every unselected logit: an empty selection shifts them all alike)

The selection statics of the harness's defaults (a captured CUDA step, `static_step`) serve those defaults; the other
values run the general path. In the offloading runtime current_token="ranked" cannot gather a selection ahead of the
layer (it ranks the layer's current key, and an empty selection attends everything): every entry crosses (`held`)
and the selection is made where the attention runs, so the runtime computes the reference but moves what full
offloading moves.

On a local layer (a sliding window) the candidates are the pool's entries inside the row's window and the cap is
`budget` of what the model's own attention attends there (`full_past`): a budget means the same share of the
layer's attention on local and global layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.adapter import AttentionLayer, KVStore, Session
from infinigen.attention import attend, attend_fused, grouped_matmul, score_dtype, selection_logits
from infinigen.budget import check_budget
from infinigen.contract import GatheringMethod
from infinigen.rows import count_true, full_past, in_window, keep_mask, row_chunks
from infinigen.shared.select_evict import (EVICTION, GQA_REDUCE, RowCaps, cap_of, pool_limit, rank, select,
                                           sequence_cap, top_k, victim)
from infinigen.shared.sim_pool import SimPool
from infinigen.shared.step import StaticStep


BUDGET_OF = ("prefix", "sequence")
# current_token="ranked": the InfiniGen artifact adds -10000 to every logit it did not select, so a row that selected
# nothing attends everything, its logits shifted by -10000 before the float32 softmax (which rounds them to ~1e-3):
# the same shift here reproduces its numbers, not only its choice
EMPTY_SHIFT = -10000.0
THRESHOLD_HEADS = ("own", "first")
CURRENT_TOKEN = ("kept", "ranked")


@dataclass
class SelectiveAttention(SimPool, StaticStep, RowCaps, GatheringMethod):
    alpha: float = math.inf
    budget: float = 0.2
    max_num_kv: int | None = None
    capacity: float = 1.0
    eviction: str = "counter"
    skip_layers: int = 1
    gqa_reduce: str = "prob_sum"
    track_recall: bool = True
    budget_of: str = "prefix"  # see the module docstring: prefix | sequence
    threshold_head: str = "own"  # own | first
    current_token: str = "kept"  # kept | ranked

    size_params: ClassVar[tuple[str, ...]] = ("alpha", "budget", "max_num_kv")

    def __post_init__(self):
        super().__post_init__()
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0 (math.inf = no threshold), got {self.alpha}")
        check_budget("budget", self.budget, counts=False)
        if self.max_num_kv is not None and self.max_num_kv < 1:
            raise ValueError(f"max_num_kv must be null or >= 1, got {self.max_num_kv}")
        if not self.capacity > 0:
            raise ValueError(f"capacity must be a fraction in (0, 1] or an absolute token count > 1, got {self.capacity}")
        if self.eviction not in EVICTION:
            raise ValueError(f"eviction must be one of {EVICTION}, got {self.eviction!r}")
        if self.gqa_reduce not in GQA_REDUCE:
            raise ValueError(f"gqa_reduce must be one of {GQA_REDUCE}, got {self.gqa_reduce!r}")
        if self.skip_layers < 0:
            raise ValueError(f"skip_layers must be >= 0, got {self.skip_layers}")
        for name, allowed in (("budget_of", BUDGET_OF), ("threshold_head", THRESHOLD_HEADS),
                              ("current_token", CURRENT_TOKEN)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self._views: dict = {}  # layer -> StepBuffers views of its store's static partial key cache
        self._keep: dict = {}  # layer -> its latest static selection's keep (b, h_kv, W + 1): the attention's mask
        self._thresholds: dict = {}  # ((b, h_kv, width), heads, finite, device) -> [limit, (width,) long, its view]
        self._ones: dict = {}  # (b*h_kv, g, dtype, device) -> the query's constant channel

    # ------------------------------------------------------------------ what subclasses provide
    def score_queries(self, session: Session, layer: AttentionLayer, q) -> torch.Tensor:
        """(b, h, t, d) queries -> (b, h_kv, g, t, d) vectors each row ranks its candidates with."""
        raise NotImplementedError

    def score_keys(self, layer: AttentionLayer, k) -> torch.Tensor:
        """(b, h_kv, s, d) keys -> (b, h_kv, s, d) vectors the rows' score vectors are dotted with."""
        raise NotImplementedError

    def sync_store(self, session: Session, layer: AttentionLayer, store: KVStore) -> None:
        """Bring per-entry state up to date with newly appended entries: their score keys (what `select` ranks
        them by, kept beside the KV so selection never needs the KV itself) and, where the pool evicts, the fetch
        counter and last use its eviction rule reads (a pool that never evicts keeps neither: a decode step on a
        GPU dispatches a dozen ops fewer per layer). A static step (`static_step`) writes them into its buffers."""
        if self.static_step(session, layer):
            buf = self.step_buffers(session, layer, store)
            written = store.state["step_written"]
            if store.stored > written:
                self.step_keys(layer, store.recent_keys(store.stored - written), buf.rows[:, written : store.stored])
                store.state["step_written"] = store.stored
            return
        fresh = store.stored - (store.entries["score_keys"].shape[2] if "score_keys" in store.entries else 0)
        if not fresh:
            return
        keys = self.score_keys(layer, store.recent_keys(fresh))
        state = {"score_keys": keys.to(score_dtype(keys.dtype))}
        if self.pool_size(session) is not None:
            tail = store.positions[:, :, -fresh:]
            state.update(count=torch.zeros_like(tail), last=tail.clone())
        store.append_entries(**state)

    def bind(self, session: Session) -> None:
        # the static step's buffers and views belong to one session: another may run outside inference mode, where
        # a tensor made inside it cannot be written
        self._views, self._keep, self._thresholds, self._ones = {}, {}, {}, {}
        super().bind(session)

    @property
    def prefix_resumable(self) -> bool:
        """A row's selection reads the tokens up to it, unless a capped pool (its evictions) or budget_of="sequence"
        (the sequence's length) decides it."""
        return self.capacity == 1 and self.budget_of == "prefix"

    def dense_layer(self, layer: AttentionLayer) -> bool:
        return layer.index < self.skip_layers

    def pool_size(self, session: Session) -> int | None:
        if self.capacity == 1:
            return None
        if self.capacity < 1:
            return pool_limit(self.capacity, session.longest(f"capacity={self.capacity}"))
        return pool_limit(self.capacity, session.max_len)

    def offload_kind(self, layer: AttentionLayer) -> str:
        """Dense layers resident; the others gather their selection, except under current_token="ranked", whose
        selection needs the layer's current key (no prefetch) and whose empty selection attends everything: every
        entry crosses (held) and the selection is made on the device."""
        if self.dense_layer(layer):
            return "resident"
        return "held" if self.current_token == "ranked" else "gather"

    def max_held(self, max_len: int) -> int:
        return max_len if self.capacity == 1 else min(max_len, pool_limit(self.capacity, max_len) + 1)

    def max_selected(self, max_len: int) -> int:
        if self.budget_of == "sequence":
            return max(1, min(self.max_held(max_len), sequence_cap(self.budget, max_len, self.max_num_kv)))
        return max(1, min(self.max_held(max_len), cap_of(self.budget, max_len, self.max_num_kv)))

    def selection_width(self, session, past: int, position: int) -> int:
        """At most what the row at `position` (its `full_past`) may fetch (its cap) or what is held before it; all
        of it on a row budget_of="sequence" leaves dense."""
        if self.budget_of == "sequence":  # a bound: a local layer's cap is at most a global one's
            cap = sequence_cap(self.budget, session.max_len, self.max_num_kv)
            return past if position < cap else min(past, cap)
        return min(past, max(cap_of(self.budget, position, self.max_num_kv), 0))

    # ------------------------------------------------------------------ sim mode
    def forward_attention(self, session, layer, q, k, v, allowed):
        if session.mode == "decode" or self.dense_layer(layer):
            return super().forward_attention(session, layer, q, k, v, allowed)
        b, t, s = q.shape[0], q.shape[2], k.shape[2]
        offset = s - t  # sequence position of query row 0: > 0 resuming after a prefix (`prefix_resumable`)
        assert offset == 0 or self.prefix_resumable, "sim mode runs a whole sequence in one forward"
        qs = self.score_queries(session, layer, q) * layer.logit_scale  # (b, hk, g, t, d), scaled once
        ks = self.score_keys(layer, k)  # (b, hk, s, d)
        qs, ks = (x.to(score_dtype(x.dtype)) for x in (qs, ks))
        limit = self.pool_size(session)
        pool = None if limit is None else self._sim_pool_state(session, b, ks.shape[1], s, limit, q.device)
        # recall's denominator without a pool: each row's log-sum-exp over its whole causal prefix, one fused call
        causal_lse = None
        if self.track_recall and pool is None and not offset and session.plain_causal and session.attention == "fused":
            causal_lse = attend_fused(q, k, v, None, layer.logit_scale, causal=True)[1]  # (b, h, t) or None
        outs = []
        # each chunk against the keys its rows can see (half the work); a capped pool's free rows apart (`free_until`)
        for r0, r1 in row_chunks(t, 0 if pool is None else pool["free_until"]):
            outs.append(self._sim_chunk(session, layer, q, k, v, allowed, qs, ks, r0, r1, pool, causal_lse, offset))
        return torch.cat(outs, dim=2)

    def _sim_chunk(self, session, layer, q, k, v, allowed, qs, ks, i0, i1, pool, causal_lse, offset=0):
        """Query rows i0..i1-1, at sequence positions r0..r1-1 (offset + i), against the entries they can see
        (0..r1-1): select, attend, record."""
        dev = q.device
        r0, r1 = offset + i0, offset + i1
        rows = torch.arange(r0, r1, device=dev)
        diag = rows[:, None] == torch.arange(r1, device=dev)[None, :]  # (r, s)
        allowed = allowed[..., i0:i1, :r1]  # (b|1, 1, r, s)
        ranked = self.current_token == "ranked"
        candidates = allowed if ranked else allowed & ~diag
        scores = grouped_matmul(qs[:, :, :, i0:i1], ks[:, :, :r1])  # (b, hk, g, r, s)
        past = full_past(layer, rows)  # (r,) entries before each row that the model's attention sees
        if pool is None or r1 <= pool["free_until"]:
            # a plain causal chunk's rows all see its first r0 columns; the widest cap is the last row's
            first = r0 if session.plain_causal else None
            width = min(r1, self.row_cap(session, layer, full_past(layer, r1 - 1)) + ranked)
            keep, n = select(scores, candidates, self.row_caps(session, layer, past), self.alpha, self.gqa_reduce,
                             width=width, first=first, threshold_head=self.threshold_head)
            held = candidates
            if pool is not None and r1 > session.dense_rows:
                self._sim_pool_fill(session, pool, keep & ~diag if ranked else keep, rows, r0, r1)
        else:
            session.chunk = (r0, r1)  # the rows as host ints: the pool's row loop branches on them
            keep, n, held = self._sim_pool_rows(session, layer, scores, candidates, rows, pool, diag)
        every = ~(rows >= session.dense_rows)  # (r,) rows that attend their whole prefix: the prompt's,
        dense = self.dense_rows(session, layer, past)  # those budget_of="sequence" leaves dense,
        every = every if dense is None else every | dense
        empty = (n == 0) & ~every[None] if ranked else None  # and a ranked row that selected nothing
        selected = keep | diag if not ranked else keep
        keep = allowed & (selected | every.view(1, 1, -1, 1) | (False if empty is None else empty[:, None, :, None]))
        first = min(max(session.dense_rows - r0, 0), r1 - r0)  # rows ascend: the chunk's dense rows come first
        qc, kc, vc = q[:, :, i0:i1], k[:, :, :r1], v[:, :, :r1]
        shift = None if empty is None else empty[:, None, :].to(q.dtype) * EMPTY_SHIFT  # (b, 1, r): the artifact's
        if session.attention == "exact":
            out, lse = attend(qc, kc, vc, keep, layer.logit_scale, shift=shift)[0], None
        else:
            out, lse = attend_fused(qc, kc, vc, keep, layer.logit_scale, shift=shift)  # lse (b, h, r) or None
        if first < r1 - r0:
            self.record_sim(session, layer, keep, allowed, rows, start=r0, kept=None if empty is None else
                            count_true(keep).float().masked_fill_(empty[:, None], 0))
            self.stats.add(layer.index, "selected", n[:, first:])
            if self.track_recall:
                if lse is None:  # the exact kernel, or a device whose fused kernel gives no log-sum-exp
                    held = (held | diag) & allowed
                    self._record_recall(layer, qc[:, :, first:], kc, held[:, :, first:], keep[:, :, first:])
                else:  # kept mass / held mass = exp(lse_kept - lse_held), per query head and row
                    held_lse = (causal_lse[:, :, i0:i1] if causal_lse is not None
                                else attend_fused(qc, kc, vc, (held | diag) & allowed, layer.logit_scale)[1])
                    recall = (lse - held_lse).exp()  # (b, h, r); an empty row (its lse shifted) attends all it holds
                    recall = recall if empty is None else recall.masked_fill(empty[:, None], 1.0)
                    self.stats.add(layer.index, "recall", recall[:, :, first:])
        return out

    def _record_recall(self, layer, q, k, held, keep) -> None:
        """Share of the true attention mass (over what the pool holds) that the fetched entries carry."""
        true = selection_logits(q, k, layer.logit_scale).masked_fill(~held.unsqueeze(2), float("-inf"))
        probs = torch.softmax(true, dim=-1)  # (b, hk, g, r, s), in float32 at least
        self.stats.add(layer.index, "recall", (probs * keep.unsqueeze(2)).sum(-1))

    # ------------------------------------------------------------------ decode mode
    def after_prefill(self, session, layer, store, q, probs):
        if self.dense_layer(layer):
            return
        self.sync_store(session, layer, store)
        limit = self.pool_size(session)
        if limit is not None and store.stored > limit:
            self._evict_store(store, store.stored - limit)

    def _rank_step(self, session, layer, q, store, past, position):
        """One decode row's ranking of the first `past` held entries: agg (b, hk, 1, past), n (b, 1). On a local
        layer whose window has moved past position 0 the candidates are the held entries inside it."""
        keys = store.entries["score_keys"][:, :, :past]  # (b, hk, past, c), in the score dtype
        qs = self.score_queries(session, layer, q) * layer.logit_scale  # as in sim mode: scaled, then dotted
        scores = grouped_matmul(qs.to(keys.dtype), keys)  # (b, hk, g, 1, past)
        window = in_window(layer, store, position, past)  # (b, hk, past) or None
        before = full_past(layer, position)
        if window is None:
            return rank(scores, None, self.row_cap(session, layer, before), self.alpha, self.gqa_reduce,
                        threshold_head=self.threshold_head)
        cap = self.row_caps(session, layer, torch.full((1,), before, device=scores.device))
        return rank(scores, window[:, :, None], cap, self.alpha, self.gqa_reduce, first=0,
                    threshold_head=self.threshold_head)

    def _width(self, session, layer, past, position) -> int:
        """What the row at `position` selects at most on `layer` (a host int)."""
        before = full_past(layer, position)
        dense = self.dense_rows(session, layer, before)
        if dense is not None:
            return past if dense else min(past, self.layer_cap(session, layer))
        return self.selection_width(session, past, before)

    def select(self, session, layer, q, store, past, position):
        """keep (b, hk, past) over the past entries, or (b, hk, past + 1) with the current token last when it is
        ranked with them (current_token="ranked": `attend_selected` reads the wider keep)."""
        if self.static_step(session, layer):
            return keep_mask(*self.static_select(session, layer, q, store, past, position), past)  # (b, hk, past)
        ranked = self.current_token == "ranked"
        if self.dense_rows(session, layer, full_past(layer, position)):  # budget_of="sequence": attends them all
            return store.positions.new_ones(*store.positions.shape[:2], past + ranked, dtype=torch.bool)
        if ranked:
            self.sync_store(session, layer, store)  # the current token's score key: it is a candidate
        idx, valid = self._top(session, layer, q, store, past + ranked, position)
        return keep_mask(idx, valid, past + ranked)

    def _top(self, session, layer, q, store, past, position):
        """The row's ranking of the first `past` held entries: its top (index, valid), each (b, hk, width)."""
        agg, n = self._rank_step(session, layer, q, store, past, position)
        idx, valid = top_k(agg, n, self._width(session, layer, past, position))
        return idx[:, :, 0], valid[:, :, 0]

    def select_indices(self, session, layer, q, store, past, position):
        """The top selection_width entries straight from top-k, best first (no mask over the whole past to sort);
        a static step's top `max_selected` of the longest sequence, whatever the step (`static_select`); every
        entry, on a row budget_of="sequence" leaves dense."""
        if self.static_step(session, layer):
            return self.static_select(session, layer, q, store, past, position)
        if self.dense_rows(session, layer, full_past(layer, position)):
            return super().select_indices(session, layer, q, store, past, position)  # sorts select's all-True keep
        return self._top(session, layer, q, store, past, position)

    def attend_selected(self, session, layer, q, store, keep):
        """current_token="ranked" (keep covers the current token too): attention over the selection, or over every
        entry when it is empty (as the artifact's additive mask makes it), then the step's statistics."""
        if keep.shape[-1] != store.stored:
            return super().attend_selected(session, layer, q, store, keep)
        self.before_step(session, layer, store)
        window = in_window(layer, store, store.seen - 1)  # (b, hk, s) or None
        everything = keep.new_ones(()) if window is None else window
        empty = ~keep.any(-1, keepdim=True)  # (b, hk, 1)
        attended = keep | (empty & everything)  # (b, hk, s)
        keys, values = store.kv()
        out, _ = attend(q, keys, values, attended[:, :, None], layer.logit_scale,
                        shift=empty.to(q.dtype) * EMPTY_SHIFT)
        full = full_past(layer, store.seen - 1) + 1
        self.stats.add(layer.index, "kv_fraction", attended.sum(-1), scale=1 / full)
        self.record_kept(layer, keep.sum(-1), full)
        self.after_step(session, layer, q, store, keep, attended)
        return out

    def before_step(self, session, layer, store):
        self.sync_store(session, layer, store)

    def after_step(self, session, layer, q, store, keep, attended=None):
        """keep: the selection over the past (b, hk, past), or past + the current token (current_token="ranked",
        whose `attended` mask then says what the row attended)."""
        past, position = store.stored - 1, store.seen - 1
        self.stats.add(layer.index, "selected", keep[:, :1].sum(-1))
        if self.track_recall and store.keys is not None:  # needs every key: decode mode only
            keys = store.kv()[0]
            if attended is None:
                attended = torch.cat([keep, keep.new_ones(*keep.shape[:2], 1)], dim=-1)
            mask = attended[:, :, None]  # (b, hk, 1, s)
            self._record_recall(layer, q, keys, torch.ones_like(mask), mask)
        limit = self.pool_size(session)
        if limit is None:  # nothing is ever evicted: no counter to keep
            return
        fetched = keep[..., :past]
        store.entries["count"][..., :past] += fetched
        store.entries["last"][..., :past].masked_fill_(fetched, position)
        if store.stored > limit:
            self._evict_store(store, store.stored - limit)

    def _evict_store(self, store: KVStore, how_many: int) -> None:
        valid = torch.ones_like(store.positions, dtype=torch.bool)
        for _ in range(how_many):
            idx = victim(store.positions, store.entries["count"], store.entries["last"], valid, self.eviction)
            valid.scatter_(-1, idx[..., None], False)
        # (b, hk, s - how_many): the kept entries in position order, by a stable sort of the mask (a static shape;
        # nonzero would read the count back)
        remaining = torch.argsort(valid.to(torch.uint8), dim=-1, descending=True, stable=True)
        store.keep(remaining[..., : valid.shape[-1] - how_many])
