"""What the top-k sparse-attention baselines (ShadowKV, RocketKV) share: a stable top-k (both modes pick the same
entries), gathering along positions, and sim mode's recall of the exact attention mass on what a row attends."""

from __future__ import annotations

import torch

from infinigen.attention import selection_logits

NEG = float("-inf")


def gather_seq(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (b, h, s, d) gathered along s by index (b, h, n)."""
    return x.gather(2, index[..., None].expand(*index.shape, x.shape[-1]))


def stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores along the last axis, ties to the lower index (both modes pick the same)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def record_recall(stats, layer, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor) -> None:
    """Sim mode: the share of each query head's exact attention mass (true keys, causal prefix) on the entries it
    attends. q (b, h, r, d) at positions `rows`; k (b, h_kv, s, d); keep (b, h_kv, r, s) (causality applied here)."""
    s = k.shape[2]
    scores = selection_logits(q, k, layer.logit_scale)  # (b, hk, g, r, s)
    causal = torch.arange(s, device=rows.device)[None, :] <= rows[:, None]  # (r, s)
    full = scores.masked_fill(~causal, NEG).logsumexp(-1)
    held = scores.masked_fill(~(keep & causal).unsqueeze(2), NEG).logsumexp(-1)
    stats.add(layer.index, "recall", (held - full).exp())
