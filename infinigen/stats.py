"""What both modes record per layer and row (`KVStats`), above all `kv_fraction`: the mean fraction of the causal
KV entries a decoded query row actually attended."""

from __future__ import annotations

import math
from collections import defaultdict

import torch



class KVStats:
    """Per-layer running means of named per-row quantities (kv_fraction, recall, selected, ...). `add` keeps each
    batch's sum as a tensor and reads them only when asked, so recording never waits for the device."""

    PENDING = 4096  # recordings kept unread at most (each holds its tensor): memory stays bounded over long runs

    def __init__(self):
        self._sums: dict = defaultdict(lambda: defaultdict(float))
        self._counts: dict = defaultdict(lambda: defaultdict(int))
        self._pending: list = []
        self._folded: dict = {}  # (name, layer, device) -> a running sum, where the recordings are

    def add(self, layer: int, name: str, values: torch.Tensor, offset: float = 0.0, scale: float = 1.0) -> None:
        """Records (values + offset) * scale per element. Dispatches nothing and reads nothing back: a decode step
        on a GPU neither launches a kernel nor waits to record (every PENDING recordings are summed into running
        sums on their own device; a mean read brings them to the host)."""
        self._pending.append((layer, name, values, offset, scale))
        if len(self._pending) >= self.PENDING:
            self._fold()

    def _fold(self) -> None:
        for layer, name, values, offset, scale in self._pending:
            n = values.numel()
            total = (values.detach().double().sum() + offset * n) * scale
            key = (name, layer, total.device)
            self._folded[key] = total if key not in self._folded else self._folded[key] + total
            self._counts[name][layer] += n
        self._pending.clear()

    def _settle(self) -> None:
        self._fold()
        for (name, layer, _), total in self._folded.items():
            self._sums[name][layer] += float(total)
        self._folded.clear()

    @property
    def sums(self) -> dict:
        self._settle()
        return self._sums

    @property
    def counts(self) -> dict:
        self._settle()
        return self._counts

    def per_layer(self, name: str) -> dict[int, float]:
        sums, counts = self.sums[name], self.counts[name]
        return {i: sums[i] / counts[i] for i in sorted(sums) if counts[i]}

    def mean(self, name: str) -> float:
        n = sum(self.counts[name].values())
        return sum(self.sums[name].values()) / n if n else float("nan")

    def summary(self) -> dict:
        out = {name: self.mean(name) for name in self.sums}
        if "kv_fraction" in out:
            density = min(max(out["kv_fraction"], 0.0), 1.0)
            out["retain_ratio"] = (1 - math.sqrt(1 - density)) * 100  # the paper's x-axis (InfiniGen Fig. 11)
        out["per_layer"] = {name: self.per_layer(name) for name in self.sums}
        return out

