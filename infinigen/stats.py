"""What both modes record per layer and row (`KVStats`), above all `kv_fraction`: the mean fraction of the causal
KV entries a decoded query row actually attended.

Kept fraction on the paper's axis: beside kv_fraction (a mean over rows of each row's fraction) every method records
per row the entries it keeps (`kept`) and the causal entries (`causal`), on the layers it does not leave dense
(`MethodDriver.dense_layer`). `density` is their ratio of sums, kept entries over the causal area, as the InfiniGen
artifact counts it (accuracy/perplexity/llama.py: the mean of `kv_cache_mask`'s density over layers 2+), and
`retain` = 1 - sqrt(1 - density), the artifact's "retain ratio" (a fraction here, a percentage there). A row whose
selection keeps fewer entries than it attends (InfiniGen's reference setting, a row that fetched nothing and so, as
the artifact's additive mask does, attends everything) counts what it kept in `kept` and what it attended in
kv_fraction.
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager

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
        self.copies = 1  # each recording counts this many times (`repeated`)

    def add(self, layer: int, name: str, values: torch.Tensor, offset: float = 0.0, scale: float = 1.0) -> None:
        """Records (values + offset) * scale per element. Dispatches nothing and reads nothing back: a decode step
        on a GPU neither launches a kernel nor waits to record (every PENDING recordings are summed into running
        sums on their own device; a mean read brings them to the host)."""
        self._pending.append((layer, name, values, offset, scale, self.copies))
        if len(self._pending) >= self.PENDING:
            self._fold()

    def add_total(self, layer: int, name: str, total: float, count: int) -> None:
        """Records `count` values summing to `total` (host numbers: nothing is dispatched)."""
        self._sums[name][layer] += total * self.copies
        self._counts[name][layer] += count * self.copies

    @contextmanager
    def repeated(self, copies: int):
        """Within the block, each recording counts `copies` times: rows computed once for `copies` sequences that
        begin with them (lm-eval's choices scored from one forward of their shared context) are recorded as that
        many forwards of the whole sequences would record them."""
        previous, self.copies = self.copies, copies
        try:
            yield
        finally:
            self.copies = previous

    def _fold(self) -> None:
        for layer, name, values, offset, scale, copies in self._pending:
            n = values.numel()
            total = (values.detach().double().sum() + offset * n) * scale
            if copies != 1:
                total = total * copies
            key = (name, layer, total.device)
            self._folded[key] = total if key not in self._folded else self._folded[key] + total
            self._counts[name][layer] += n * copies
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

    def density(self) -> float:
        """Kept entries over the causal area, summed over every recorded row and layer (NaN if none)."""
        kept, causal = sum(self.sums["kept"].values()), sum(self.sums["causal"].values())
        return kept / causal if causal else float("nan")

    def summary(self) -> dict:
        out = {name: self.mean(name) for name in self.sums if name not in ("kept", "causal")}
        out["per_layer"] = {name: self.per_layer(name) for name in self.sums if name not in ("kept", "causal")}
        if self.counts["causal"]:
            density = self.density()
            out["density"] = density
            out["retain"] = 1 - math.sqrt(1 - min(max(density, 0.0), 1.0))  # the paper's x-axis (InfiniGen Fig. 11)
            sums = self.sums
            out["per_layer"]["density"] = {i: sums["kept"][i] / sums["causal"][i] for i in sorted(sums["causal"])
                                           if sums["causal"][i]}
            out["per_layer"]["kept"] = {i: sums["kept"][i] for i in sorted(sums["kept"])}
        return out

