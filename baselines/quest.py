"""Quest: query-aware page selection (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", ICML'24)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infinigen.adapter import KVStore
from infinigen.method import KVMethod, attend
from infinigen.selection import budget_cap, top_n

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
    max(q*lo, q*hi) is q*hi for q >= 0 and q*lo for q < 0 (lo <= hi), so it is two matmuls."""
    pos = q.clamp(min=0)
    return torch.matmul(pos, kmax.unsqueeze(2).transpose(-1, -2)) + torch.matmul(q - pos, kmin.unsqueeze(2).transpose(-1, -2))


class QuestStore(KVStore):
    """Every token's KV (Quest never evicts) plus each page's per-channel key min/max (`kmin`, `kmax`,
    (b, h_kv, n_pages, d)), updated as keys are appended: the metadata a runtime keeps next to the query."""

    def __init__(self, page_size: int):
        super().__init__()
        self.page_size = page_size
        self.kmin = self.kmax = None

    def update(self, key_states, value_states, *args, **kwargs):
        first_page = self.seen // self.page_size  # the first page the new keys touch (maybe partly filled)
        out = super().update(key_states, value_states, *args, **kwargs)
        lo, hi = page_minmax(self.keys[:, :, first_page * self.page_size :], self.page_size)
        if self.kmin is None:
            self.kmin, self.kmax = lo, hi
        else:
            self.kmin = torch.cat([self.kmin[:, :, :first_page], lo], 2)
            self.kmax = torch.cat([self.kmax[:, :, :first_page], hi], 2)
        return out

    def nbytes(self) -> int:
        meta = 0 if self.kmin is None else 2 * self.kmin.numel() * self.kmin.element_size()
        return super().nbytes() + meta


@dataclass
class Quest(KVMethod):
    """Keys are grouped in pages of `page_size` consecutive positions; each page keeps the per-channel min and
    max of its keys. A decoded query scores every complete page before its own by sum_c max(q_c*min_c,
    q_c*max_c) (an upper bound of its best q.k in the page) and attends the top pages; nothing is evicted.

    Budget: a row with `past` earlier tokens attends K = ceil(ceil(budget * past) / page_size) pages (the token
    cap of InfiniGen/the oracle, rounded up to whole pages). The page holding the row itself is always one of the
    K: it is the only page that can be partly filled (pages are formed over positions), and it counts as a whole
    page of the budget although only its filled part (the row included) is attended. The other K-1 are the
    top-scoring complete pages; a page is scored only once complete, so its min/max come from keys every later
    row can see, in both modes. Layers below `skip_layers` attend densely (Quest skips the first 2).

    GQA (per KV head, the unit stored and moved): a page's score is the max over the query heads sharing the
    KV head (`gqa_reduce=max`, default), which is still an upper bound of the group's best q.k in the page,
    so a page any head needs ranks high; `sum` ranks by the group's total.
    """

    budget: float = 0.2
    page_size: int = 16
    skip_layers: int = 2
    gqa_reduce: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not 0 < self.budget <= 1:
            raise ValueError(f"budget must be a fraction in (0, 1] of the past tokens, got {self.budget!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1 (tokens per page), got {self.page_size!r}")
        if isinstance(self.skip_layers, bool) or not isinstance(self.skip_layers, int) or self.skip_layers < 0:
            raise ValueError(f"skip_layers must be an int >= 0 (first layers attending densely), got {self.skip_layers!r}")
        if self.gqa_reduce not in GQA_REDUCE:
            raise ValueError(f"gqa_reduce must be one of {GQA_REDUCE}, got {self.gqa_reduce!r}")

    def dense_layer(self, layer) -> bool:
        return layer.index < self.skip_layers

    def new_store(self, layer) -> KVStore:
        return KVStore() if self.dense_layer(layer) else QuestStore(self.page_size)

    # ------------------------------------------------------------------ selection (both modes)
    def pages_kept(self, q_rows, kmin, kmax, rows: torch.Tensor) -> torch.Tensor:
        """Which pages each row attends besides its own: q_rows (b, h, r, d) at positions `rows` (r,); kmin/kmax
        (b, h_kv, n_pages, d) of (at least) the pages before each row's own -> (b, h_kv, r, n_pages) bool."""
        b, h, r, d = q_rows.shape
        hk, n_pages = kmin.shape[1], kmin.shape[2]
        scores = page_scores(q_rows.view(b, hk, h // hk, r, d), kmin, kmax)  # (b, hk, g, r, n_pages)
        agg = scores.amax(2) if self.gqa_reduce == "max" else scores.sum(2)  # (b, hk, r, n_pages)
        own = rows // self.page_size  # (r,)
        complete = torch.arange(n_pages, device=rows.device)[None, :] < own[:, None]  # (r, n_pages)
        pages = torch.ceil(budget_cap(self.budget, rows).double() / self.page_size).long()  # K, own page included
        n = torch.minimum((pages - 1).clamp(min=0), own).expand(b, r)
        agg = agg.masked_fill(~complete, -math.inf)
        return top_n(agg, n) & complete

    def tokens_kept(self, pages_kept: torch.Tensor, rows: torch.Tensor, s: int) -> torch.Tensor:
        """(b, h_kv, r, n_pages) kept pages -> (b, h_kv, r, s) kept positions: those pages + the row's own page
        (causality is the caller's: positions after the row are never attended)."""
        page_of = torch.arange(s, device=rows.device) // self.page_size  # (s,)
        missing = (s - 1) // self.page_size + 1 - pages_kept.shape[-1]  # sim: the last, incomplete page
        if missing > 0:
            pages_kept = torch.cat([pages_kept, pages_kept.new_zeros(*pages_kept.shape[:-1], missing)], -1)
        keep = pages_kept[..., page_of]  # (b, h_kv, r, s)
        return keep | (page_of[None, :] == (rows // self.page_size)[:, None])

    # ------------------------------------------------------------------ sim mode
    def sim_keep(self, session, layer, q, k, allowed):
        if self.dense_layer(layer):
            return None
        t, s = q.shape[2], k.shape[2]
        if s != t:
            raise ValueError(f"Quest sim mode expects one forward over the whole sequence (t == s), got t={t}, s={s}")
        return self._sim_keep_rows(layer, q, k, 0, t)

    def _sim_keep_rows(self, layer, q_rows, k, r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1-1 (q_rows (b, h, r1-r0, d)) against keys 0..s-1 -> (b, h_kv, r1-r0, s) keep. Only complete
        pages are scored, so their min/max over all of k equal what each row could have seen."""
        s = k.shape[2]
        complete = s // self.page_size * self.page_size
        kmin, kmax = page_minmax(k[:, :, :complete], self.page_size)  # (b, hk, n_complete, d)
        rows = torch.arange(r0, r1, device=k.device)
        return self.tokens_kept(self.pages_kept(q_rows, kmin, kmax, rows), rows, s)

    # ------------------------------------------------------------------ decode mode
    def decode_attention(self, session, layer, q, store):
        if self.dense_layer(layer):
            return super().decode_attention(session, layer, q, store)
        row = torch.tensor([store.seen - 1], device=q.device)  # Quest never evicts: entry index = position
        keep = self.tokens_kept(self.pages_kept(q, store.kmin, store.kmax, row), row, store.stored)  # (b, hk, 1, s)
        out, _ = attend(q, store.keys, store.values, keep, layer.logit_scale)
        self.record_decode(layer, store, keep[:, :, 0].sum(-1))
        return out
