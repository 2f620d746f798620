"""Host<->device movement for the offloading runtime: a side stream and one worker thread for host-side work on
CUDA; on CPU (host == device) jobs run inline and their time is kept apart, so the link can be modelled."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import torch

@dataclass
class Slot:
    """One landing buffer on the device (+ a pinned host one for gathers) and the events guarding its reuse."""

    dev: torch.Tensor
    dest: torch.Tensor  # gathered rows' destinations, on the device
    host: torch.Tensor | None
    host_dest: torch.Tensor | None
    free: "torch.cuda.Event | NoEvent"  # compute stream: the attention that read `dev` is queued
    copied: "torch.cuda.Event | NoEvent"  # side stream: the copy out of `host` is done


@dataclass
class Fetched:
    rows: torch.Tensor  # prefix (n, b*h_kv, W) or gathered (m, W), on the device
    dest: torch.Tensor | None  # gathered: flat (b*h_kv*k) destination of each row; None = already in place
    nbytes: int
    host_s: float  # host-side work (gather, scatter flush) this fetch took
    ready: torch.cuda.Event | None = None
    start: torch.cuda.Event | None = None
    slot: Slot | None = None


class NoEvent:
    """Stands in for torch.cuda.Event where host and device coincide: everything is already done."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class Link:
    """Host<->device movement. CUDA: a side stream for the copies and one worker thread for host-side work.
    CPU (host == device): jobs run inline on the calling thread and their time is kept apart (`inline_host_s`);
    with copies=True fetched rows still land in staging buffers (the CUDA code path, for tests) but nothing waits.
    """

    def __init__(self, device, threaded: bool | None = None, copies: bool | None = None, clock=time.perf_counter):
        self.clock = clock  # what host-side work and CPU marks are measured in (seconds; a census counts ops)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copies = self.cuda if copies is None else copies or self.cuda
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        threaded = self.cuda if threaded is None else threaded
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-link") if threaded else None
        self.inline_host_s = 0.0

    def submit(self, job) -> Future:
        if self._worker is not None:
            return self._worker.submit(_inference, job)
        fut: Future = Future()
        t0 = self.clock()
        fut.set_result(job())
        self.inline_host_s += self.clock() - t0
        return fut

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else NoEvent()

    def compute_event(self):
        """Recorded on the compute stream now: what a side-stream copy of its outputs must wait for."""
        ev = self.event()
        ev.record()
        return ev

    def side(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def side_wait(self, event) -> None:
        if self.cuda:
            self.stream.wait_event(event)

    def compute_wait(self, event) -> None:
        if self.cuda and event is not None:
            torch.cuda.current_stream().wait_event(event)

    def keep_alive(self, *tensors: torch.Tensor) -> None:
        """Device tensors a side-stream copy reads: their memory is not reused before the copy has run."""
        if self.cuda:
            for t in tensors:
                t.record_stream(self.stream)

    def staging(self, elems: int, dtype, gather_rows: int = 0, width: int = 0) -> list[Slot] | None:
        """Two alternating landing slots (fetch k uses slot k % 2), so the copy for the next layer never overwrites
        what the current layer reads. None without copies (CPU), where fetched rows are the pool's own memory."""
        if not self.copies:
            return None
        slots = []
        for _ in range(2):
            host = torch.empty(gather_rows * width, dtype=dtype, pin_memory=self.cuda) if gather_rows else None
            host_dest = torch.empty(gather_rows, dtype=torch.long, pin_memory=self.cuda) if gather_rows else None
            slots.append(Slot(torch.empty(elems, dtype=dtype, device=self.device),
                              torch.empty(max(gather_rows, 1), dtype=torch.long, device=self.device),
                              host, host_dest, self.event(), self.event()))
        return slots

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


def _inference(job):
    with torch.inference_mode():  # thread-local: the pools and landing buffers are inference tensors
        return job()

