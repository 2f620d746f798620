"""Random top-k: each decoded row attends a seeded random `budget` of its past plus itself.

A floor for token selection (any scoring should beat chance at the same kv_fraction), and the smallest complete
method: this file and conf/method/random_topk.yaml are all it takes to run it in sim mode, decode mode,
task=latency (its selection depends on nothing the model computes, so the runtime gathers it a layer ahead) and
the figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.contract import GatheringMethod


@dataclass
class RandomTopK(GatheringMethod):
    """Row at position p (p >= dense_rows) attends ceil(budget x p) of positions 0..p-1, drawn without
    replacement from a generator seeded by (seed, layer, p), the same for every batch row and KV head, plus
    itself. Nothing is evicted, so a store's entry n is position n in both modes."""

    budget: float = 0.2
    seed: int = 0

    speculation_point: ClassVar[str] = "attention_start"
    size_params: ClassVar[tuple[str, ...]] = ("budget",)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.budget, bool) or not 0 < self.budget <= 1:
            raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")

    def count(self, past: int) -> int:
        return min(past, math.ceil(self.budget * past - 1e-9))

    def chosen(self, layer: int, position: int) -> torch.Tensor:
        """(position,) bool: the past positions the row at `position` attends."""
        gen = torch.Generator().manual_seed((self.seed * 4096 + layer) * 2**32 + position)
        keep = torch.zeros(position, dtype=torch.bool)
        return keep.index_fill_(0, torch.randperm(position, generator=gen)[: self.count(position)], True)

    def max_selected(self, max_len: int) -> int:
        return max(1, self.count(max_len))

    def sim_keep(self, session, layer, state, rows, s):
        keep = torch.zeros(len(rows), s, dtype=torch.bool)  # (r, s)
        for i, position in enumerate(rows.tolist()):
            keep[i, position] = True
            if position >= session.dense_rows:
                keep[i, :position] = self.chosen(layer.index, position)
        return keep.to(rows.device)[None, None]  # (1, 1, r, s)

    def select(self, session, layer, q, store, past, position):
        keep = self.chosen(layer.index, position).to(store.positions.device)  # (past,): entry n is position n
        return keep.expand(*store.positions.shape[:2], past)  # (b, h_kv, past)
