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

from infinigen.budget import check_budget
from infinigen.contract import GatheringMethod

MASK32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # < 2^27: a 32-bit value times it stays below 2^59, so int64 never overflows on any device


def mix32(x):
    """A 32-bit integer hash (two xor-shift-multiply rounds) of int64 values in [0, 2^32), a tensor or a Python
    int: exact integer arithmetic, so every device and every batch of rows computes the same numbers."""
    x = ((x >> 16) ^ x) * MIX & MASK32
    x = ((x >> 16) ^ x) * MIX & MASK32
    return (x >> 16) ^ x


@dataclass
class RandomTopK(GatheringMethod):
    """Row at position p (p >= dense_rows) attends ceil(budget x p) of positions 0..p-1, plus itself: the ones
    with the smallest hash of (seed, layer, p, position), ties broken by position (a pseudo-random draw without
    replacement, the same for every batch row and KV head). The draw is closed-form, so sim mode picks a whole
    chunk of rows with one top-k and decode mode a single row with the same arithmetic. Nothing is evicted, so a
    store's entry n is position n in both modes."""

    budget: float = 0.2
    seed: int = 0

    speculation_point: ClassVar[str] = "attention_start"
    size_params: ClassVar[tuple[str, ...]] = ("budget",)
    prefix_resumable: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        check_budget("budget", self.budget, counts=False)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")

    def count(self, past: int) -> int:
        return min(past, math.ceil(self.budget * past - 1e-9))

    def counts(self, rows: torch.Tensor) -> torch.Tensor:
        """`count` of each row position (r,), on the rows' device (the same float64 steps)."""
        return torch.minimum(rows, torch.ceil(rows.double() * self.budget - 1e-9).long())

    def draw(self, layer: int, rows: torch.Tensor, past: int) -> torch.Tensor:
        """(r, past) int64 sort keys of positions 0..past-1 for the rows at `rows` (r,): hash << 31 | position,
        unique per row, so the k smallest are a draw without replacement with no tie left to a kernel."""
        stream = mix32((self.seed * 4096 + layer) & MASK32)  # a host int
        row_key = mix32((stream ^ rows) & MASK32)  # (r,)
        cols = torch.arange(past, device=rows.device)
        return (mix32(row_key[:, None] ^ cols) << 31) | cols  # (r, past), < 2^63

    def chosen(self, layer: int, rows: torch.Tensor, past: int) -> torch.Tensor:
        """(r, past) bool: which of positions 0..past-1 each row at `rows` attends (only positions before the row
        are ever chosen). The widest count among the rows sizes one top-k (a host number: no count is read back)."""
        keep = torch.zeros(rows.shape[0], past, dtype=torch.bool, device=rows.device)
        width = min(past, self.count(past))
        if width == 0:
            return keep
        keys = self.draw(layer, rows, past).masked_fill(torch.arange(past, device=rows.device) >= rows[:, None],
                                                        torch.iinfo(torch.long).max)  # the row's future: never drawn
        idx = keys.topk(width, dim=-1, largest=False, sorted=True).indices  # (r, width), smallest first
        return keep.scatter_(-1, idx, torch.arange(width, device=rows.device) < self.counts(rows)[:, None])

    def max_selected(self, max_len: int) -> int:
        return max(1, self.count(max_len))

    def sim_keep(self, session, layer, state, rows, s):
        keep = self.chosen(layer.index, rows, s)  # (r, s): rows see at most positions < s
        keep |= rows[:, None] == torch.arange(s, device=rows.device)  # and themselves
        return keep[None, None]  # (1, 1, r, s)

    def select(self, session, layer, q, store, past, position):
        rows = torch.full((1,), position, device=store.positions.device)
        keep = self.chosen(layer.index, rows, past)[0]  # (past,): entry n is position n
        return keep.expand(*store.positions.shape[:2], past)  # (b, h_kv, past)
