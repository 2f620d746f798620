"""Token selection and KV-pool eviction shared by sim mode, decode mode, InfiniGen and the oracle.

Layout: scores are (b, h_kv, g, r, L): g query heads share each KV head, r query rows, L candidate entries.
Every function works for any r, so the same code picks tokens for a whole sim-mode sequence at once
(r = t) and for a single decode step (r = 1).
"""

from __future__ import annotations

import math

import torch

GQA_REDUCE = ("prob_sum", "logit_max", "logit_mean")
EVICTION = ("counter", "lru", "fifo")
NEG = float("-inf")
MIN = torch.finfo(torch.float32).min  # masked logits: finite, so rows without candidates stay NaN-free


def budget_cap(budget: float, past: torch.Tensor, max_num_kv: int | None = None) -> torch.Tensor:
    """Most past tokens a row may fetch: ceil(budget * past) (at least one when there is a past), optionally
    capped by an absolute max_num_kv. past: (...,) number of tokens before the row."""
    cap = torch.ceil(past.double() * budget - 1e-9).long()
    if max_num_kv is not None:
        cap = cap.clamp(max=max_num_kv)
    return cap


def select(
    scores: torch.Tensor,
    candidates: torch.Tensor,
    past: torch.Tensor,
    alpha: float,
    budget: float,
    gqa_reduce: str,
    max_num_kv: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which candidates each row fetches, and how many: keep (b, hk, r, L) bool, n (b, r).

    scores (b, hk, g, r, L) speculated (or true) logits, consumed (overwritten) here; candidates
    (b|1, hk|1, r, L) bool; past (r,) the sequence length before each row (the budget is a fraction of it).

    Count (InfiniGen's dynamic fetch): per query head the candidates scoring above (max - alpha), averaged
    over all heads of the layer and floored, capped by the budget and by what the pool holds.
    Rank per KV head (GQA) by `gqa_reduce` over its g query heads: prob_sum = the sum of their softmax
    probabilities (the attention mass the entry would get across the heads); logit_max / logit_mean.
    """
    b, hk = scores.shape[:2]
    # leading columns every row may fetch (a causal chunk's past) need no masking: only the rest is touched
    first = complete_columns(candidates)
    candidates = candidates.expand(b, hk, *candidates.shape[2:])
    tail = ~candidates[..., first:]  # (b, hk, r, L - first)
    masked = scores
    masked[..., first:].masked_fill_(tail.unsqueeze(2), MIN)  # (b, hk, g, r, L)
    top = masked.amax(-1, keepdim=True)  # (b, hk, g, r, 1)
    held = first + (~tail).sum(-1, dtype=torch.int32).long()  # (b, hk, r)
    if math.isinf(alpha):
        n = held.amin(1)
    else:
        count = (masked > top - alpha).sum(-1, dtype=torch.int32)  # (b, hk, g, r); masked entries (MIN) never count
        n = torch.floor(count.double().mean(dim=(1, 2)) + 1e-9).long()
    n = torch.minimum(torch.minimum(n, budget_cap(budget, past, max_num_kv)[None]), held.amin(1))
    if gqa_reduce == "prob_sum":
        agg = torch.softmax(masked, dim=-1).sum(2)
    elif gqa_reduce == "logit_max":
        agg = masked.amax(2)
    elif gqa_reduce == "logit_mean":
        agg = masked.mean(2)
    else:
        raise ValueError(f"gqa_reduce must be one of {GQA_REDUCE}, got {gqa_reduce!r}")
    agg[..., first:].masked_fill_(tail, NEG)  # (b, hk, r, L)
    # n never exceeds a head's candidates, which all outrank the -inf of the others: the top n are candidates
    return top_n(agg, n), n


def complete_columns(candidates: torch.Tensor) -> int:
    """How many leading columns of candidates (..., L) are True in every row."""
    complete = candidates.reshape(-1, candidates.shape[-1]).all(0)  # (L,)
    return candidates.shape[-1] if bool(complete.all()) else int((~complete).int().argmax())


def top_n(agg: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Keep mask of the n(b, r) highest-scoring entries per (b, hk, r) row of agg (b, hk, r, L)."""
    keep = torch.zeros_like(agg, dtype=torch.bool)
    k = int(n.max()) if n.numel() else 0
    if k == 0:
        return keep
    idx = agg.topk(k, dim=-1).indices  # (b, hk, r, k)
    ranks = torch.arange(k, device=agg.device)
    return keep.scatter_(-1, idx, (ranks < n[:, None, :, None]).expand_as(idx))


def _oldest_of_least(primary: torch.Tensor, positions: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """argmin over the last axis of `primary` among eligible entries, ties broken by the smallest position."""
    big = torch.iinfo(torch.long).max
    primary = primary.masked_fill(~eligible, big)
    least = eligible & (primary == primary.amin(-1, keepdim=True))
    return positions.masked_fill(~least, big).argmin(-1)


def victim(positions, counts, last_used, valid, policy: str) -> torch.Tensor:
    """Index (b, hk) of the pool entry to evict, per KV head. All inputs (b, hk, L); valid marks pool entries.

    counter: the least-fetched entry among the older half of the pool (ties: the oldest);
    lru: the entry fetched longest ago (never-fetched entries count from their insertion);
    fifo: the oldest entry.
    """
    if policy == "fifo":
        return _oldest_of_least(positions, positions, valid)
    if policy == "lru":
        return _oldest_of_least(last_used, positions, valid)
    if policy == "counter":
        size = valid.sum(-1, keepdim=True)  # (b, hk, 1)
        big = torch.iinfo(torch.long).max
        age_rank = positions.masked_fill(~valid, big).argsort(-1).argsort(-1)  # 0 = oldest
        return _oldest_of_least(counts, positions, valid & (age_rank < (size + 1) // 2))
    raise ValueError(f"eviction must be one of {EVICTION}, got {policy!r}")


def pool_limit(capacity: float | int, max_len: int) -> int:
    """Pool size in tokens: a fraction (<= 1) of the longest sequence, or an absolute count (> 1)."""
    if capacity <= 1:
        return max(1, math.ceil(capacity * max_len - 1e-9))
    return int(capacity)
