"""Per-step timing of the offloading runtime (CUDA events or the CPU compute clock) and the CPU link model."""

from __future__ import annotations


import torch

from infinigen.offload.link import Fetched, Link

# Host->device bandwidth the CPU model assumes, in GB/s (1e9 bytes/s): PCIe 4.0 x16 is 31.5 GB/s raw per direction
# (16 GT/s x 16 lanes x 128/130); ~25 GB/s is what pinned cudaMemcpyAsync reaches on such links (FlexGen and
# InfiniGen's A100/RTX machines).
PCIE4_X16_GBPS = 25.0


class Timer:
    """Marks per decode step: CUDA events on the compute stream, or on CPU the compute clock (wall time minus the
    host-side link work run inline, which a real system does on its worker thread)."""

    def __init__(self, link: Link):
        self.link = link
        self.steps: list[list] = []
        self.walls: list[float] = []
        self._marks: list | None = None
        self._wall0 = 0.0
        self.fetches: dict[int, dict] = {}
        self._fid = 0

    def mark(self, name: str, key: int = -1) -> None:
        if self._marks is None:
            return
        if self.link.cuda:
            if name in ("issue", "need"):  # order marks: on CUDA nothing times them (an event costs ~10 us here)
                self._marks.append((name, key, None))
                return
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((name, key, ev))
        else:
            self._marks.append((name, key, self.link.clock() - self.link.inline_host_s))

    def begin(self) -> None:
        self._marks = []
        self._wall0 = self.link.clock()
        self.mark("step0")

    def end(self) -> None:
        self.mark("step1")
        self.steps.append(self._marks)
        self.walls.append(self.link.clock() - self._wall0)
        self._marks = None

    def issue(self) -> int:
        self._fid += 1
        self.mark("issue", self._fid)
        return self._fid

    def need(self, fid: int) -> None:
        self.mark("need", fid)

    def landed(self, fid: int, fetched: Fetched) -> None:
        self.fetches[fid] = {"bytes": fetched.nbytes, "host_s": fetched.host_s, "start": fetched.start,
                             "end": fetched.ready}

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) if self.link.cuda else (b - a) * 1e3  # ms

    def breakdown(self) -> list[dict]:
        """Per step (ms): step, attention (projections and attention, without speculation and waits), ffn,
        speculation, wait (CUDA: the compute stream stalled on a copy), transfer (CUDA: copy time on the side
        stream, overlapped), link_host (host-side gather/scatter work), other (embeddings, norms, head)."""
        out = []
        for marks, wall in zip(self.steps, self.walls):
            opened, sums = {}, {"attn": 0.0, "ffn": 0.0, "spec": 0.0, "wait": 0.0}
            transfer, host = 0.0, 0.0
            for name, key, t in marks:
                if name[-1] == "0":
                    opened[(name[:-1], key)] = t
                elif name[-1] == "1":
                    sums[name[:-1]] = sums.get(name[:-1], 0.0) + self._elapsed(opened.pop((name[:-1], key)), t)
                elif name == "need":
                    f = self.fetches[key]
                    host += f["host_s"] * 1e3
                    if f["start"] is not None:
                        transfer += f["start"].elapsed_time(f["end"])
            step = sums["step"] if self.link.cuda else wall * 1e3
            compute = sums["step"]
            row = {"step_ms": step, "attention_ms": sums["attn"] - sums["spec"] - sums["wait"], "ffn_ms": sums["ffn"],
                   "speculation_ms": sums["spec"], "wait_ms": sums["wait"], "transfer_ms": transfer,
                   "link_host_ms": host}
            row["other_ms"] = compute - sums["attn"] - sums["ffn"]
            if not self.link.cuda:
                row["compute_ms"] = compute
            out.append(row)
        return out

    def modelled_steps(self, gbps: float) -> list[float]:
        """CPU: each step's duration (ms) had its fetches crossed a `gbps` GB/s link. Replays the compute clock;
        a fetch starts when issued (after earlier host work on the one worker), its host work runs, then it
        crosses the link (one copy at a time); a layer that needs a fetch not yet landed stalls until it has."""
        stall, worker_free, link_free, issued = 0.0, float("-inf"), float("-inf"), {}
        out = []
        for marks in self.steps:
            t0 = None
            for name, key, t in marks:
                now = t + stall
                if name == "step0":
                    t0 = now
                elif name == "issue":
                    issued[key] = now
                elif name == "need":  # fetches are needed in the order they were issued (one FIFO worker)
                    f = self.fetches[key]
                    worker_free = max(issued.pop(key), worker_free) + f["host_s"]
                    link_free = max(worker_free, link_free) + f["bytes"] / (gbps * 1e9)
                    if link_free > now:
                        stall += link_free - now
                elif name == "step1":
                    out.append((now - t0) * 1e3)
        return out

