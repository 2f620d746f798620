"""Quest: query-aware page selection (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", ICML'24)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.adapter import KVStore
from infinigen.attention import grouped_matmul, widen
from infinigen.budget import check_budget
from infinigen.contract import GatheringMethod
from infinigen.shared.select_evict import budget_cap, cap_of, top_n

GQA_REDUCE = ("max", "sum")


def page_minmax(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys (b, h_kv, n, d) of positions 0..n-1 -> per-channel (min, max) of each page, (b, h_kv, ceil(n / P), d).
    A last page that is not full gets the min/max of its filled part."""
    n_full = keys.shape[2] // page_size
    full = n_full * page_size
    pages = keys[:, :, :full].unflatten(2, (n_full, page_size))  # (b, h_kv, n_full, P, d)
    lo, hi = [pages.amin(3)], [pages.amax(3)]
    if full < keys.shape[2]:
        tail = keys[:, :, full:]
        lo.append(tail.amin(2, keepdim=True))
        hi.append(tail.amax(2, keepdim=True))
    return torch.cat(lo, 2), torch.cat(hi, 2)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's criticality: sum_c max(q_c * min_c, q_c * max_c), an upper bound of q.k over the page's keys.
    q (b, h_kv, g, r, d); kmin/kmax (b, h_kv, n_pages, d) -> (b, h_kv, g, r, n_pages).
    max(q*lo, q*hi) is q*hi for q >= 0 and q*lo for q < 0 (lo <= hi), so it is two matmuls. In float32 at least
    (`widen`): half-precision bounds of two pages a few per mille apart would tie, and the page kept would follow
    the rounding of each mode's product."""
    q, kmin, kmax = widen(q), widen(kmin), widen(kmax)
    pos = q.clamp(min=0)
    return grouped_matmul(pos, kmax) + grouped_matmul(q - pos, kmin)


def page_metadata(store: KVStore) -> dict:
    """The per-page key metadata a Quest layer keeps next to its KV (`store.state`, on the compute device, also in
    the offloading runtime): min/max of every complete page, (b, h_kv, n_pages, d), and the running min/max of
    the page being filled, (b, h_kv, 1, d)."""
    return store.state.setdefault("quest", {})


@dataclass
class Quest(GatheringMethod):
    """Keys are grouped in pages of `page_size` consecutive positions; each page keeps the per-channel min and
    max of its keys. A decoded query scores every complete page before its own by sum_c max(q_c*min_c,
    q_c*max_c) (an upper bound of its best q.k in the page) and attends the top pages; nothing is evicted.

    Budget: a row with `past` earlier tokens attends its own page plus the K = ceil(ceil(budget * past) /
    page_size) top-scoring complete pages before it (the token cap of InfiniGen/the oracle rounded up to whole
    pages, plus the row's own page as they add the row itself). The own page is the only page that can be partly
    filled (pages are formed over positions): its filled part, the row included, is always attended. The K are
    the top-scoring complete pages; a page is scored only once complete, so its min/max come from keys every later
    row can see, in both modes. Layers below `skip_layers` attend densely (Quest skips the first 2).

    Offloading: the page min/max stay on the device; the selected pages' rows are gathered from host memory
    once the layer's own query is known (a synchronous gather: Quest scores with the true query).

    GQA (per KV head, the unit stored and moved): a page's score is the max over the query heads sharing the
    KV head (`gqa_reduce=max`, default), which is still an upper bound of the group's best q.k in the page,
    so a page any head needs ranks high; `sum` ranks by the group's total.
    """

    size_params: ClassVar[tuple[str, ...]] = ("budget", "page_size")
    prefix_resumable: ClassVar[bool] = True
    # the defaults (pages of 16, 2 dense layers) barely act on the tests' 72 tokens and 3 layers
    test_variants: ClassVar[tuple[dict, ...]] = (
        {"page_size": 4, "skip_layers": 0}, {"page_size": 8, "budget": 0.4, "gqa_reduce": "sum", "skip_layers": 1})

    budget: float = 0.2
    page_size: int = 16
    skip_layers: int = 2
    gqa_reduce: str = "max"

    def __post_init__(self):
        super().__post_init__()
        check_budget("budget", self.budget, of="past tokens", counts=False)
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1 (tokens per page), got {self.page_size!r}")
        if isinstance(self.skip_layers, bool) or not isinstance(self.skip_layers, int) or self.skip_layers < 0:
            raise ValueError(f"skip_layers must be an int >= 0 (first layers attending densely), got {self.skip_layers!r}")
        if self.gqa_reduce not in GQA_REDUCE:
            raise ValueError(f"gqa_reduce must be one of {GQA_REDUCE}, got {self.gqa_reduce!r}")

    def dense_layer(self, layer) -> bool:
        return layer.index < self.skip_layers

    def offload_kind(self, layer) -> str:
        return "resident" if self.dense_layer(layer) else "gather"

    def max_selected(self, max_len: int) -> int:
        cap = cap_of(self.budget, max_len)
        return min(max_len, (math.ceil(cap / self.page_size) + 1) * self.page_size)

    def selection_flops(self, layer, past):
        """Pages, not tokens, are scored, each on its min and max (2 x head_dim channels)."""
        return 2 * super().selection_flops(layer, past / self.page_size)

    def store_bytes(self, stores) -> int:
        meta = [page_metadata(s) for s in stores]
        tensors = [m[k] for m in meta for k in ("kmin", "kmax") if k in m] + [t for m in meta for t in m.get("open") or ()]
        return super().store_bytes(stores) + sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ selection (both modes)
    def pages_kept(self, q_rows, kmin, kmax, rows: torch.Tensor, last: int) -> torch.Tensor:
        """Which pages each row attends besides its own: q_rows (b, h, r, d) at positions `rows` (r,), the last of
        them `last` (a host int: the widest budget, so top-k is sized without reading the device); kmin/kmax
        (b, h_kv, n_pages, d) of (at least) the pages before each row's own -> (b, h_kv, r, n_pages) bool."""
        b, h, r, d = q_rows.shape
        hk, n_pages = kmin.shape[1], kmin.shape[2]
        scores = page_scores(q_rows.view(b, hk, h // hk, r, d), kmin, kmax)  # (b, hk, g, r, n_pages)
        agg = scores.amax(2) if self.gqa_reduce == "max" else scores.sum(2)  # (b, hk, r, n_pages)
        own = rows // self.page_size  # (r,)
        complete = torch.arange(n_pages, device=rows.device)[None, :] < own[:, None]  # (r, n_pages)
        pages = torch.ceil(budget_cap(self.budget, rows).double() / self.page_size).long()  # K, besides its own
        n = torch.minimum(pages, own).expand(b, r)
        agg = agg.masked_fill(~complete, -math.inf)
        return top_n(agg, n, min(n_pages, math.ceil(cap_of(self.budget, last) / self.page_size))) & complete

    def tokens_kept(self, pages_kept: torch.Tensor, rows: torch.Tensor, s: int) -> torch.Tensor:
        """(b, h_kv, r, n_pages) kept pages -> (b, h_kv, r, s) kept positions: those pages + the row's own page
        (causality is the caller's: positions after the row are never attended)."""
        ps, n_pages = self.page_size, pages_kept.shape[-1]
        page_of = torch.arange(s, device=rows.device) // ps  # (s,)
        keep = pages_kept.new_zeros(*pages_kept.shape[:-1], s)  # (b, h_kv, r, s); pages not held stay unkept
        whole = min(s // ps, n_pages)  # pages wholly inside the s positions, each one broadcast copy
        keep[..., : whole * ps].view(*keep.shape[:-1], whole, ps).copy_(pages_kept[..., :whole, None])
        if whole < n_pages and whole * ps < s:  # a kept page cut by position s
            keep[..., whole * ps :] = pages_kept[..., whole : whole + 1]
        return keep.logical_or_(page_of[None, :] == (rows // ps)[:, None])

    # ------------------------------------------------------------------ sim mode
    def sim_state(self, session, layer, q, k, v, allowed):
        """The queries and the min/max of every complete page (a page is scored only once complete, so its
        min/max over all of k equal what each later row could have seen). O(t) memory."""
        if self.dense_layer(layer):
            return None
        complete = k.shape[2] // self.page_size * self.page_size
        kmin, kmax = page_minmax(k[:, :, :complete], self.page_size)  # (b, hk, n_complete, d)
        return q, k.shape[2] - q.shape[2], kmin, kmax

    def sim_keep(self, session, layer, state, rows, s):
        if state is None:
            return None
        q, offset, kmin, kmax = state
        first, stop = session.chunk
        q_rows = q[:, :, first - offset : stop - offset]  # (b, h, r, d)
        return self.tokens_kept(self.pages_kept(q_rows, kmin, kmax, rows, stop - 1), rows, s)

    # ------------------------------------------------------------------ decode mode
    def after_prefill(self, session, layer, store, q, mass) -> None:
        if self.dense_layer(layer):
            return
        keys = store.kv()[0]  # (b, h_kv, s, d): the prefill's, still on the device
        meta = page_metadata(store)
        complete = keys.shape[2] // self.page_size * self.page_size
        meta["kmin"], meta["kmax"] = page_minmax(keys[:, :, :complete], self.page_size)
        tail = keys[:, :, complete:]
        meta["open"] = (tail.amin(2, keepdim=True), tail.amax(2, keepdim=True)) if tail.shape[2] else None

    def select(self, session, layer, q, store, past, position):
        """Quest never evicts: entry index = position. keep (b, h_kv, past) over the entries before the row."""
        meta = page_metadata(store)
        row = torch.tensor([position], device=q.device)
        keep = self.tokens_kept(self.pages_kept(q, meta["kmin"], meta["kmax"], row, position), row, past + 1)
        return keep[:, :, 0, :past]

    def before_step(self, session, layer, store) -> None:
        """The current token's key joins the open page's running min/max; a page that fills becomes scorable."""
        key = store.recent_keys(1)  # (b, h_kv, 1, d)
        meta = page_metadata(store)
        lo, hi = (key, key) if meta["open"] is None else (torch.minimum(meta["open"][0], key),
                                                          torch.maximum(meta["open"][1], key))
        meta["open"] = (lo, hi)
        if store.seen % self.page_size == 0:
            meta["kmin"] = torch.cat([meta["kmin"], lo], 2)
            meta["kmax"] = torch.cat([meta["kmax"], hi], 2)
            meta["open"] = None
