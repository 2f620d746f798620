"""Sim mode's replay of a capped KV pool (`capacity` < 1): what a decoded row may select depends on what earlier
rows fetched (counters, last use) and evicted, so the rows after the first eviction run one by one; those before it
see every entry before them and are selected as whole chunks (`SimPool._sim_pool_fill`)."""

from __future__ import annotations

import torch

from infinigen.rows import full_past
from infinigen.shared.select_evict import select, victim


class SimPool:
    """The pool's state in one sim forward (a dict per layer) and its updates; `SelectiveAttention` mixes it in."""

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
        # rows before the first eviction see every entry before them: selected at once (`_sim_pool_fill`)
        state["free_until"] = min(s, session.dense_rows + limit - state["size"])
        return state

    def _sim_pool_fill(self, session, pool, fetched, rows, r0: int, r1: int) -> None:
        """The pool after rows r0..r1-1 (`rows`) that evict nothing fetched `fetched` (b, hk, r, s), as the row loop
        leaves it: counts summed, each entry's last use its latest fetching row (the prompt's rows fetch nothing)."""
        d0 = max(session.dense_rows, r0)  # the first decoded row (< r1)
        fetched, s = fetched[:, :, d0 - r0 :], fetched.shape[-1]  # (b, hk, decoded rows, s)
        pool["counts"][..., :s] += fetched.sum(2)
        latest = torch.where(fetched, rows[d0 - r0 :, None], -1).amax(2)  # (b, hk, s); -1: fetched by none of them
        torch.maximum(pool["last"][..., :s], latest, out=pool["last"][..., :s])
        pool["in_pool"][..., d0:r1] = True
        pool["size"] += r1 - d0

    def _sim_pool_rows(self, session, layer, scores, candidates, rows, pool, diag):
        """Row by row, because what the pool holds depends on earlier rows' fetches (counters) and evictions.
        The rows' positions come from `session.chunk` (host ints): nothing is read back to branch on."""
        b, hk, g, r, s = scores.shape
        keep = torch.zeros(b, hk, r, s, dtype=torch.bool, device=scores.device)
        held, n = torch.zeros_like(keep), torch.zeros(b, r, dtype=torch.long, device=scores.device)
        ranked = self.current_token == "ranked"
        caps = self.row_caps(session, layer, full_past(layer, rows))  # (r,): each row's, made once
        for i, row in enumerate(range(*session.chunk)):
            if row < session.dense_rows:
                continue
            cand = pool["in_pool"][..., :s] & candidates[:, :, i]  # (b, hk, s)
            if ranked:  # the row itself, not yet in the pool, competes with what the pool holds
                cand = cand | (candidates[:, :, i] & diag[i])
            width = min(s, self.row_cap(session, layer, full_past(layer, row)) + ranked)
            ki, ni = select(scores[:, :, :, i : i + 1], cand[:, :, None], caps[i : i + 1], self.alpha,
                            self.gqa_reduce, width=width, first=0,  # the pool's candidates are no prefix: mask all
                            threshold_head=self.threshold_head)
            keep[:, :, i], held[:, :, i], n[:, i] = ki[:, :, 0], cand, ni[:, 0]
            fetched = ki[:, :, 0] & ~diag[i] if ranked else ki[:, :, 0]
            pool["counts"][..., :s] += fetched
            pool["last"][..., :s].masked_fill_(fetched, row)
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
