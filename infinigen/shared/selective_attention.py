"""Per-step token selection from a KV pool, in both modes: the machinery InfiniGen and the oracle share.

A subclass supplies the vectors each decoded row ranks its candidates with (`score_queries` · `score_keys`);
this class applies the dynamic count + cap (`selection.select`), the pool with capacity and eviction, and
the statistics (kv_fraction, selected tokens, recall), identically in sim and decode mode.

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
from infinigen.attention import attend, attend_fused, attend_rows, grouped_matmul, score_dtype, selection_logits, widen
from infinigen.budget import check_budget
from infinigen.contract import GatheringMethod
from infinigen.rows import full_past, in_window, keep_mask, row_chunks
from infinigen.shared.select_evict import EVICTION, GQA_REDUCE, cap_of, pool_limit, rank, select, top_k, victim
from infinigen.shared.step import StepBuffers, select_step, thresholds


@dataclass
class SelectiveAttention(GatheringMethod):
    alpha: float = math.inf
    budget: float = 0.2
    max_num_kv: int | None = None
    capacity: float = 1.0
    eviction: str = "counter"
    skip_layers: int = 1
    gqa_reduce: str = "prob_sum"
    track_recall: bool = True

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

    def dense_layer(self, layer: AttentionLayer) -> bool:
        return layer.index < self.skip_layers

    def pool_size(self, session: Session) -> int | None:
        if self.capacity == 1:
            return None
        if self.capacity < 1 and not session.max_len:
            raise ValueError(f"capacity={self.capacity} is a fraction of the longest sequence, which this session was "
                             "not told (model.generate inside infinigen.apply tells it; direct forwards: "
                             "apply(..., max_len=N))")
        return pool_limit(self.capacity, session.max_len)

    def offload_kind(self, layer: AttentionLayer) -> str:
        return "resident" if self.dense_layer(layer) else "gather"

    def max_held(self, max_len: int) -> int:
        return max_len if self.capacity == 1 else min(max_len, pool_limit(self.capacity, max_len) + 1)

    def max_selected(self, max_len: int) -> int:
        return max(1, min(self.max_held(max_len), cap_of(self.budget, max_len, self.max_num_kv)))

    def selection_width(self, session, past: int, position: int) -> int:
        """At most what the row at `position` may fetch (its budget cap) or what is held before it."""
        return min(past, max(cap_of(self.budget, position, self.max_num_kv), 0))

    # ------------------------------------------------------------------ sim mode
    def forward_attention(self, session, layer, q, k, v, allowed):
        if session.mode == "decode" or self.dense_layer(layer):
            return super().forward_attention(session, layer, q, k, v, allowed)
        b, t, s = q.shape[0], q.shape[2], k.shape[2]
        assert s == t, "sim mode runs a whole sequence in one forward"
        qs = self.score_queries(session, layer, q) * layer.logit_scale  # (b, hk, g, t, d), scaled once
        ks = self.score_keys(layer, k)  # (b, hk, s, d)
        qs, ks = (x.to(score_dtype(x.dtype)) for x in (qs, ks))
        limit = self.pool_size(session)
        pool = None if limit is None else self._sim_pool_state(session, b, ks.shape[1], s, limit, q.device)
        # recall's denominator without a pool: each row's log-sum-exp over its whole causal prefix, one fused call
        causal_lse = None
        if self.track_recall and pool is None and session.plain_causal and session.attention == "fused":
            causal_lse = attend_fused(q, k, v, None, layer.logit_scale, causal=True)[1]  # (b, h, t) or None
        outs = []
        for r0, r1 in row_chunks(t):  # each chunk against the keys its rows can see (half the work)
            outs.append(self._sim_chunk(session, layer, q, k, v, allowed, qs, ks, r0, r1, pool, causal_lse))
        return torch.cat(outs, dim=2)

    def _sim_chunk(self, session, layer, q, k, v, allowed, qs, ks, r0, r1, pool, causal_lse):
        """Rows r0..r1-1 against the entries they can see (0..r1-1): select, attend, record."""
        dev = q.device
        rows = torch.arange(r0, r1, device=dev)
        diag = rows[:, None] == torch.arange(r1, device=dev)[None, :]  # (r, s)
        allowed = allowed[..., r0:r1, :r1]  # (b|1, 1, r, s)
        candidates = allowed & ~diag
        scores = grouped_matmul(qs[:, :, :, r0:r1], ks[:, :, :r1])  # (b, hk, g, r, s)
        if pool is None:
            # a plain causal chunk's rows all see its first r0 columns; the widest cap is the last row's
            first = r0 if session.plain_causal else None
            width = min(r1, cap_of(self.budget, full_past(layer, r1 - 1), self.max_num_kv))
            keep, n = select(scores, candidates, full_past(layer, rows), self.alpha, self.budget, self.gqa_reduce,
                             self.max_num_kv, width=width, first=first)
            held = candidates
        else:
            session.chunk = (r0, r1)  # the rows as host ints: the pool's row loop branches on them
            keep, n, held = self._sim_pool_rows(session, layer, scores, candidates, rows, pool)
        decoded = rows >= session.dense_rows
        keep = allowed & (keep | diag | ~decoded.view(1, 1, -1, 1))  # (b, hk, r, s)
        first = min(max(session.dense_rows - r0, 0), r1 - r0)  # rows ascend: the chunk's dense rows come first
        qc, kc, vc = q[:, :, r0:r1], k[:, :, :r1], v[:, :, :r1]
        if session.attention == "exact":
            out, lse = attend(qc, kc, vc, keep, layer.logit_scale)[0], None
        else:
            out, lse = attend_fused(qc, kc, vc, keep, layer.logit_scale)  # lse (b, h, r) or None
        if first < r1 - r0:
            self.record_sim(session, layer, keep, allowed, rows, start=r0)
            self.stats.add(layer.index, "selected", n[:, first:])
            if self.track_recall:
                if lse is None:  # the exact kernel, or a device whose fused kernel gives no log-sum-exp
                    held = (held | diag) & allowed
                    self._record_recall(layer, qc[:, :, first:], kc, held[:, :, first:], keep[:, :, first:])
                else:  # kept mass / held mass = exp(lse_kept - lse_held), per query head and row
                    held_lse = (causal_lse[:, :, r0:r1] if causal_lse is not None
                                else attend_fused(qc, kc, vc, (held | diag) & allowed, layer.logit_scale)[1])
                    self.stats.add(layer.index, "recall", (lse - held_lse)[:, :, first:].exp())
        return out

    def _sim_pool_state(self, session, b, hk, s, limit, dev) -> dict:
        positions = torch.arange(s, device=dev).expand(b, hk, s)
        state = {
            "limit": limit,
            "size": min(session.dense_rows, s),  # entries each KV head's pool holds (the same for every head)
            "positions": positions,
            "in_pool": (positions < session.dense_rows).clone(),
            "counts": torch.zeros(b, hk, s, dtype=torch.long, device=dev),
            "last": positions.clone(),
        }
        self._evict_to(state)  # a prompt longer than the pool is trimmed right after the prefill
        return state

    def _sim_pool_rows(self, session, layer, scores, candidates, rows, pool):
        """Row by row, because what the pool holds depends on earlier rows' fetches (counters) and evictions.
        The rows' positions come from `session.chunk` (host ints): nothing is read back to branch on."""
        b, hk, g, r, s = scores.shape
        keep = torch.zeros(b, hk, r, s, dtype=torch.bool, device=scores.device)
        held = torch.zeros_like(keep)
        n = torch.zeros(b, r, dtype=torch.long, device=scores.device)
        for i, row in enumerate(range(*session.chunk)):
            if row < session.dense_rows:
                continue
            cand = pool["in_pool"][..., :s] & candidates[:, :, i]  # (b, hk, s)
            width = min(s, cap_of(self.budget, full_past(layer, row), self.max_num_kv))
            ki, ni = select(scores[:, :, :, i : i + 1], cand[:, :, None], full_past(layer, rows[i : i + 1]),
                            self.alpha, self.budget, self.gqa_reduce, self.max_num_kv, width=width,
                            first=0)  # the pool's candidates are no prefix (evictions leave holes): mask every column
            keep[:, :, i], held[:, :, i], n[:, i] = ki[:, :, 0], cand, ni[:, 0]
            pool["counts"][..., :s] += ki[:, :, 0]
            pool["last"][..., :s].masked_fill_(ki[:, :, 0], row)
            pool["in_pool"][..., row] = True
            pool["size"] += 1
            self._evict_to(pool)
        return keep, n, held

    def _evict_to(self, pool: dict) -> None:
        """Evicts down to the pool's limit. Every head holds pool["size"] entries (each row adds one to every head,
        each eviction removes one from every head): a host count, so nothing is read back."""
        while pool["size"] > pool["limit"]:
            idx = victim(pool["positions"], pool["counts"], pool["last"], pool["in_pool"], self.eviction)  # (b, hk)
            pool["in_pool"].scatter_(-1, idx[..., None], False)
            pool["size"] -= 1

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
        if window is None:
            return rank(scores, None, position, self.alpha, self.budget, self.gqa_reduce, self.max_num_kv)
        row = torch.full((1,), full_past(layer, position), device=scores.device)
        return rank(scores, window[:, :, None], row, self.alpha, self.budget, self.gqa_reduce, self.max_num_kv,
                    first=0)

    def _width(self, session, layer, past, position) -> int:
        return self.selection_width(session, past, full_past(layer, position))

    def select(self, session, layer, q, store, past, position):
        if self.static_step(session, layer):
            return keep_mask(*self.static_select(session, layer, q, store, past, position), past)  # (b, hk, past)
        agg, n = self._rank_step(session, layer, q, store, past, position)
        idx, valid = top_k(agg, n, self._width(session, layer, past, position))
        return keep_mask(idx[:, :, 0], valid[:, :, 0], past)  # (b, hk, past)

    def select_indices(self, session, layer, q, store, past, position):
        """The top selection_width entries straight from top-k, best first (no mask over the whole past to sort);
        a static step's top `max_selected` of the longest sequence, whatever the step (`static_select`)."""
        if self.static_step(session, layer):
            return self.static_select(session, layer, q, store, past, position)
        agg, n = self._rank_step(session, layer, q, store, past, position)
        idx, valid = top_k(agg, n, self._width(session, layer, past, position))
        return idx[:, :, 0], valid[:, :, 0]

    # ------------------------------------------------------------------ the static decode step
    def static_step(self, session, layer) -> bool:
        """Whether `layer`'s decode steps select through `step.select_step`, over buffers allocated once per store
        (`StepBuffers`) with the same shapes every step: where entry n stays entry n (a pool that never evicts), no
        window moves over the candidates (a global layer) and the longest sequence is known (the buffers' length).
        The rest take the general path (`_rank_step`); both select the same entries (tests/test_infinigen_step.py)."""
        return (session.mode == "decode" and session.max_len > 0 and layer.sliding_window is None
                and self.pool_size(session) is None)

    def step_buffers(self, session, layer, store: KVStore) -> StepBuffers:
        """The layer's static partial key cache: the tensor is per-entry state of the store (`entries`, its first
        `state["step_written"]` rows written: a store reset drops it, a beam reorder moves its rows with the batch,
        and the runtime counts its bytes), its views here, rebuilt when the tensor was replaced."""
        b, hk = store.positions.shape[:2]
        keys = store.entries.get("step_keys")
        if keys is None or keys.shape[0] != b:
            keys = store.entries["step_keys"] = StepBuffers.new(
                b, hk, session.max_len, int(self.score_channels(layer)), score_dtype(layer.q_proj.weight.dtype),
                store.positions.device)
            store.state["step_written"] = 0
        views = self._views.get(layer.index)
        if views is None or views.keys is not keys:
            views = self._views[layer.index] = StepBuffers(keys)
        return views

    def static_select(self, session, layer, q, store, past, position) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, valid), each (b, h_kv, W), W = `max_selected` of the longest sequence: the ranks below the row's
        count and budget cap are valid (host ints set the cap; nothing is read back)."""
        buf = self.step_buffers(session, layer, store)
        if store.state["step_written"] != past:
            raise RuntimeError(f"layer {layer.index}: {store.state['step_written']} partial keys written, the row "
                               f"ranks {past} entries")
        b, hk = buf.keys.shape[:2]
        width = self.max_selected(session.max_len)
        thr = self.step_thresholds(self._width(session, layer, past, position), (b, hk, width + 1), layer.num_heads,
                                   buf.keys.device)
        index, keep = self.step_select(session, layer, q, buf, thr, width)
        self._keep[layer.index] = keep
        return index, keep[..., :width]

    def step_select(self, session, layer, q, buf: StepBuffers, thr: torch.Tensor, width: int):
        """`select_step` of this layer's query: the top-`width` index and keep."""
        return select_step(self.step_query(session, layer, q), buf.keys_t, buf.live, thr, alpha=self.alpha,
                           width=width, batch=buf.keys.shape[0], reduce=self.gqa_reduce)

    def step_thresholds(self, limit: int, shape, heads: int, device) -> torch.Tensor:
        """The (width + 1,) thresholds of `step.thresholds` viewed as `shape` (b, h_kv, width + 1), one buffer per
        shape, rewritten in place (a captured graph reads it) only when the row's cap changes (every 1 / budget
        positions); heads: the layer's query heads."""
        finite = not math.isinf(self.alpha)
        key = (tuple(shape), heads, finite, device)
        entry = self._thresholds.get(key)
        if entry is None:
            t = thresholds(limit, shape[-1] - 1, heads, finite, device)
            entry = self._thresholds[key] = [limit, t, t.expand(*shape)]
        elif entry[0] != limit:
            entry[1].copy_(thresholds(limit, shape[-1] - 1, heads, finite, device))
            entry[0] = limit
        return entry[2]

    def step_query(self, session, layer, q) -> torch.Tensor:
        """(b*h_kv, g, c + 1) in the score dtype: `score_queries` scaled by the logit scale, then the constant channel
        the static keys' liveness channel is dotted with (a subclass may compute it in fewer ops)."""
        qs = widen(self.score_queries(session, layer, q) * layer.logit_scale)  # (b, hk, g, 1, c)
        b, hk, g = qs.shape[:3]
        key = (b * hk, g, qs.dtype, qs.device)
        if key not in self._ones:
            self._ones[key] = torch.ones(b * hk, g, 1, dtype=qs.dtype, device=qs.device)
        return torch.cat([qs.reshape(b * hk, g, -1), self._ones[key]], dim=-1)

    def step_keys(self, layer, k: torch.Tensor, out: torch.Tensor) -> None:
        """Writes the score keys of k (b, h_kv, n, d) into out (b*h_kv, n, c + 1), the liveness channel c at 0 (a
        subclass may compute them in fewer ops)."""
        keys = widen(self.score_keys(layer, k))  # (b, hk, n, c)
        out[..., :-1].copy_(keys.reshape(out.shape[0], -1, keys.shape[-1]))
        out[..., -1].zero_()

    def attend_gathered(self, session, layer, q, store, index, valid):
        """A static step attends the gathered rows with its selection's keep (the valid ranks, then the current
        token) as the mask, and records its statistics from the runtime's counts: no mask over the past."""
        if not self.static_step(session, layer):
            return super().attend_gathered(session, layer, q, store, index, valid)
        self.before_step(session, layer, store)  # the current token's partial key, for the next step's selection
        keys, values = store.gathered.kv()  # (b, hk, W + 1, d)
        out = attend_rows(q, keys, values, self._keep[layer.index], layer.logit_scale)
        n = store.gathered.counts  # (b, hk)
        self.stats.add(layer.index, "kv_fraction", n, offset=1, scale=1 / (full_past(layer, store.seen - 1) + 1))
        self.stats.add(layer.index, "selected", n[:, :1])
        # after_step has nothing else to do here: no pool evicts, and recall needs every key (decode mode only)
        return out

    def before_step(self, session, layer, store):
        self.sync_store(session, layer, store)

    def after_step(self, session, layer, q, store, keep):
        past, position = keep.shape[-1], store.seen - 1
        self.stats.add(layer.index, "selected", keep[:, :1].sum(-1))
        if self.track_recall and store.keys is not None:  # needs every key: decode mode only
            keys = store.kv()[0]
            mask = torch.cat([keep, keep.new_ones(*keep.shape[:2], 1)], dim=-1)[:, :, None]  # (b, hk, 1, s)
            self._record_recall(layer, q, keys, torch.ones_like(mask), mask)
        limit = self.pool_size(session)
        if limit is None:  # nothing is ever evicted: no counter to keep
            return
        store.entries["count"][..., :past] += keep
        store.entries["last"][..., :past].masked_fill_(keep, position)
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
