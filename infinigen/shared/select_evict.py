"""Token selection and KV-pool eviction shared by sim mode, decode mode, InfiniGen and the oracle.

Layout: scores are (b, h_kv, g, r, L): g query heads share each KV head, r query rows, L candidate entries.
Every function works for any r, so the same code picks tokens for a whole sim-mode sequence at once
(r = t) and for a single decode step (r = 1).
"""

from __future__ import annotations

import math

import torch

from infinigen.adapter import AttentionLayer, Session
from infinigen.rows import count_true, full_past

GQA_REDUCE = ("prob_sum", "logit_max", "logit_mean")
EVICTION = ("counter", "lru", "fifo")
NEG = float("-inf")



def reduce_query_heads(scores: torch.Tensor, how: str, dim: int) -> torch.Tensor:
    """Each KV head's per-entry score from its query heads' (along `dim`): the attention mass they would give it
    (prob_sum), their largest logit or their mean logit."""
    if how == "prob_sum":
        return torch.softmax(scores, dim=-1).sum(dim)
    if how == "logit_max":
        return scores.amax(dim)
    if how == "logit_mean":
        return scores.mean(dim)
    raise ValueError(f"gqa_reduce must be one of {GQA_REDUCE}, got {how!r}")

def budget_cap(budget: float, past: torch.Tensor, max_num_kv: int | None = None) -> torch.Tensor:
    """Most past tokens a row may fetch: ceil(budget * past) (at least one when there is a past), optionally
    capped by an absolute max_num_kv. past: (...,) number of tokens before the row."""
    cap = torch.ceil(past.double() * budget - 1e-9).long()
    if max_num_kv is not None:
        cap = cap.clamp(max=max_num_kv)
    return cap


def cap_of(budget: float, past: int, max_num_kv: int | None = None) -> int:
    """`budget_cap` of one row, on the host: the same IEEE double arithmetic, so the two never disagree. What a
    row may fetch is known before its scores are: it sizes top-k statically (no host sync on a device value)."""
    cap = math.ceil(past * budget - 1e-9)
    return cap if max_num_kv is None else min(cap, max_num_kv)


def sequence_cap(budget: float, length: int, max_num_kv: int | None = None) -> int:
    """The fixed cap of budget_of="sequence": int(budget * length), as the InfiniGen artifact truncates it
    (`fetch_max = int(src_len * self.budget)`), optionally capped by max_num_kv."""
    cap = int(length * budget)
    return cap if max_num_kv is None else min(cap, max_num_kv)


def rank(
    scores: torch.Tensor,
    candidates: torch.Tensor | None,
    cap,
    alpha: float,
    gqa_reduce: str,
    first: int | None = None,
    threshold_head: str = "own",
) -> tuple[torch.Tensor, torch.Tensor]:
    """How each row ranks its candidates, and how many it fetches: agg (b, hk, r, L) float (-inf: not a
    candidate), n (b, r).

    scores (b, hk, g, r, L) speculated (or true) logits, consumed (overwritten) here; candidates
    (b|1, hk|1, r, L) bool (None: all of them, for one row); cap the most each row may fetch: (r,) long, or an int
    with candidates=None (the selection's `row_caps` / `row_cap`);
    first: how many leading columns are candidates of every row, when the caller knows it (None: computed here,
    which reads a device value on the host).

    Count (InfiniGen's dynamic fetch): per query head the candidates scoring above (max - alpha), averaged
    over all heads of the layer and floored, capped by `cap` and by what the pool holds. The max is each head's own
    (threshold_head="own") or the layer's first query head's for every head ("first": the InfiniGen artifact's
    Llama code, accuracy/src/modeling_llama_ours.py `kv_cache_mask`).
    Rank per KV head (GQA) by `gqa_reduce` over its g query heads: prob_sum = the sum of their softmax
    probabilities (the attention mass the entry would get across the heads); logit_max / logit_mean.
    """
    b, hk, L = scores.shape[0], scores.shape[1], scores.shape[-1]
    masked = scores
    if candidates is None:  # every entry of one decode row: nothing to mask
        tail = held = None
    else:
        # leading columns every row may fetch (a causal chunk's past) need no masking: only the rest is touched
        first = complete_columns(candidates) if first is None else first
        candidates = candidates.expand(b, hk, *candidates.shape[2:])
        tail = ~candidates[..., first:]  # (b, hk, r, L - first)
        # finite, so a row without candidates stays NaN-free; the scores' own dtype's (float32 in a half model)
        masked[..., first:].masked_fill_(tail.unsqueeze(2), torch.finfo(masked.dtype).min)  # (b, hk, g, r, L)
        held = first + count_true(~tail).long()  # (b, hk, r)
    if math.isinf(alpha):
        n = None
    else:
        top = masked.amax(-1, keepdim=True)  # (b, hk, g, r, 1)
        if threshold_head == "first":
            top = top[:, :1, :1]  # (b, 1, 1, r, 1): the first query head's max, for every head
        count = count_true(masked > top - alpha)  # (b, hk, g, r); masked entries never count
        n = count.sum(dim=(1, 2)) // (hk * scores.shape[2])  # the floor of the mean over heads, in integers
    if isinstance(cap, int):  # one row, every entry a candidate: the caps are host numbers
        limit = min(cap, L)
        n = torch.full((b, 1), limit, device=scores.device) if n is None else n.clamp(max=limit)
    else:
        n = held.amin(1) if n is None else n
        n = torch.minimum(torch.minimum(n, cap[None]), held.amin(1))
    agg = reduce_query_heads(masked, gqa_reduce, dim=2)
    if tail is not None:
        agg[..., first:].masked_fill_(tail, NEG)  # (b, hk, r, L)
    # n never exceeds a head's candidates, which all outrank the -inf of the others: the top n are candidates
    return agg, n


def select(scores, candidates, cap, alpha, gqa_reduce, width: int, first: int | None = None,
           threshold_head: str = "own") -> tuple[torch.Tensor, torch.Tensor]:
    """Which candidates each row fetches, and how many: keep (b, hk, r, L) bool, n (b, r). See `rank`; width:
    a host bound on n (the widest cap among the rows)."""
    agg, n = rank(scores, candidates, cap, alpha, gqa_reduce, first, threshold_head)
    return top_n(agg, n, width), n


def complete_columns(candidates: torch.Tensor) -> int:
    """How many leading columns of candidates (..., L) are True in every row."""
    complete = candidates.reshape(-1, candidates.shape[-1]).all(0)  # (L,)
    return candidates.shape[-1] if bool(complete.all()) else int((~complete).int().argmax())


def top_k(agg: torch.Tensor, n: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` best entries of each (b, hk, r) row of agg (b, hk, r, L), best first, and which of them are
    kept (rank < n (b, r)): static shapes, whatever n holds."""
    width = min(width, agg.shape[-1])
    idx = agg.topk(width, dim=-1).indices  # (b, hk, r, width)
    return idx, (torch.arange(width, device=agg.device) < n[:, None, :, None]).expand_as(idx)


def top_n(agg: torch.Tensor, n: torch.Tensor, width: int) -> torch.Tensor:
    """Keep mask of the n(b, r) highest-scoring entries per (b, hk, r) row of agg (b, hk, r, L); width >= n.max(),
    a host number (the widest budget cap), so no count is read back from the device."""
    keep = torch.zeros_like(agg, dtype=torch.bool)
    if width == 0:
        return keep
    idx, valid = top_k(agg, n, width)
    return keep.scatter_(-1, idx, valid)


def _oldest_of_least(primary: torch.Tensor, positions: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """argmin over the last axis of `primary` among eligible entries, ties broken by the smallest position."""
    big = torch.iinfo(torch.long).max
    primary = primary.masked_fill(~eligible, big)
    least = eligible & (primary == primary.amin(-1, keepdim=True))
    return positions.masked_fill(~least, big).argmin(-1)


def victim(positions, counts, last_used, valid, policy: str) -> torch.Tensor:
    """Index (b, hk) of the pool entry to evict, per KV head. All inputs (b, hk, L); valid marks pool entries;
    positions ascend along L (sim mode's pool is in position order, and a store keeps its entries in it).

    counter: the least-fetched entry among the older half of the pool (ties: the oldest);
    lru: the entry fetched longest ago (never-fetched entries count from their insertion);
    fifo: the oldest entry.
    """
    if policy == "fifo":
        return _oldest_of_least(positions, positions, valid)
    if policy == "lru":
        return _oldest_of_least(last_used, positions, valid)
    if policy == "counter":
        # the older half: positions ascend, so an entry's age rank among the pool's is the count of entries
        # up to it (a running sum, not two sorts per eviction)
        held = valid.cumsum(-1)  # (b, hk, L): entries up to and including each
        older = held <= (held[..., -1:] + 1) // 2
        return _oldest_of_least(counts, positions, valid & older)
    raise ValueError(f"eviction must be one of {EVICTION}, got {policy!r}")


def pool_limit(capacity: float | int, max_len: int) -> int:
    """Pool size in tokens: a fraction (<= 1) of the longest sequence, or an absolute count (> 1)."""
    if capacity <= 1:
        return max(1, math.ceil(capacity * max_len - 1e-9))
    return int(capacity)


class RowCaps:
    """How many entries a row may fetch, by `budget_of` (a selective-attention method's `budget`, `max_num_kv` and
    `budget_of` fields; infinigen/shared/selective_attention.py says what each value means)."""

    def row_caps(self, session: Session, layer: AttentionLayer, past: torch.Tensor) -> torch.Tensor:
        """(r,) long: the most each row with `past` (r,) entries before it may fetch."""
        if self.budget_of == "sequence":
            return torch.full_like(past, self.layer_cap(session, layer))
        return budget_cap(self.budget, past, self.max_num_kv)

    def row_cap(self, session: Session, layer: AttentionLayer, past: int) -> int:
        """`row_caps` of one row, on the host."""
        if self.budget_of == "sequence":
            return self.layer_cap(session, layer)
        return cap_of(self.budget, past, self.max_num_kv)

    def layer_cap(self, session: Session, layer: AttentionLayer) -> int:
        """budget_of="sequence": int(budget x what the model's attention lets the sequence's last row see on
        `layer`) (the whole sequence on a global layer)."""
        length = session.longest("budget_of='sequence'")
        return sequence_cap(self.budget, full_past(layer, length - 1) + 1, self.max_num_kv)

    def dense_rows(self, session: Session, layer: AttentionLayer, past):
        """Which rows (`past` entries before each: a tensor or an int) attend every entry: under
        budget_of="sequence" those with fewer than the cap (the artifact's first `fetch_max` rows); None
        otherwise."""
        if self.budget_of != "sequence":
            return None
        return past < self.layer_cap(session, layer)
