"""Host<->device movement for the offloading runtime. CUDA: a side stream for host->device copies, a write-back
stream for device->host copies (new rows, selected indices), one worker thread running fetches in issue order (its
gathers on several intra-op threads), one running write-backs; the thread that launches
kernels never waits for any of them. CPU (host == device): jobs run inline and their time is kept apart, so the
link can be modelled."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import torch

# A gather is cut into at most GATHER_SLICES slices, each copied as soon as it is gathered (the copy of one overlaps
# the gather of the next); slices below MIN_SLICE_ROWS rows are not worth a copy of their own
GATHER_SLICES, MIN_SLICE_ROWS = 4, 4096


def default_gather_threads() -> int:
    """Host threads a gather runs on: the cores left after the launching thread and the write-back worker (a
    gather of scattered rows is bound by memory latency, which more threads in flight hide: 8.8 GB/s on 1 thread,
    69 GB/s on 14 on one H200 host, docs/gpu)."""
    return max(1, min(16, (os.cpu_count() or 1) - 2))


@dataclass
class Slot:
    """One landing buffer on the device (+ a pinned host one for gathers) and the events guarding its reuse."""

    dev: torch.Tensor
    host: torch.Tensor | None  # pinned landing rows of a gather
    host_index: torch.Tensor | None  # pinned: a gather's selected row indices and per-head counts (int32)
    free: "torch.cuda.Event | NoEvent"  # compute stream: the attention that read `dev` is queued
    copied: "torch.cuda.Event | NoEvent"  # side stream: the copy out of `host` is done


@dataclass
class Fetched:
    rows: torch.Tensor  # prefix (n, b*h_kv, W), or gathered (m, W) (CUDA: the landing slot, m rows first)
    moved: int | torch.Tensor  # rows that crossed (a device count where nothing on the host knows it)
    nbytes: int | torch.Tensor
    host_s: float  # host-side work (gather, scatter flush) this fetch took
    ready: torch.cuda.Event | None = None
    start: torch.cuda.Event | None = None
    slot: Slot | None = None
    padded: bool = False  # gathered rows sit at (head, rank) of a (b*h_kv, k) layout, not one head after another
    gather_s: float = 0.0  # of host_s: the host threads gathering rows (not waiting for indices or buffers)


class NoEvent:
    """Stands in for torch.cuda.Event where host and device coincide: everything is already done."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class Link:
    """Host<->device movement. CUDA: a side stream for host->device copies, a write-back stream for device->host
    ones, a fetch worker (its gathers on `gather_threads` intra-op threads) and a write-back worker. CPU (host == device): jobs run
    inline on the calling thread and their time is kept apart (`inline_host_s`); with copies=True fetched rows
    still land in staging buffers (the CUDA code path, for tests) but nothing waits; threaded=True runs the
    workers as on CUDA."""

    def __init__(self, device, threaded: bool | None = None, copies: bool | None = None, clock=time.perf_counter,
                 gather_threads: int | None = None):
        self.clock = clock  # what host-side work and CPU marks are measured in (seconds; a census counts ops)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copies = self.cuda if copies is None else copies or self.cuda
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.back_stream = torch.cuda.Stream(self.device) if self.cuda else None
        threaded = self.cuda if threaded is None else threaded
        self.gather_threads = default_gather_threads() if gather_threads is None else gather_threads
        if self.gather_threads < 1:
            raise ValueError(f"gather_threads must be >= 1, got {self.gather_threads}")
        # the fetch worker's gathers run on gather_threads intra-op threads (torch's thread count is per thread):
        # one call per slice, the threads inside torch's kernel, so no Python thread waits for the interpreter lock
        # the launching thread holds (14 Python threads gathering slices reached 8 GB/s in a decode step on an H200
        # host, where their own benchmark reached 28)
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="kv-link", initializer=torch.set_num_threads,
                                           initargs=(self.gather_threads,)) if threaded else None)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-write") if threaded else None
        self.inline_host_s = 0.0

    def submit(self, job) -> Future:
        """A fetch: jobs run one at a time, in issue order."""
        return self._run(self._worker, job)

    def submit_write(self, job) -> Future:
        """A write-back into a host pool: its own worker, so a fetch never queues behind a write it does not read
        (a fetch that reads a pool waits for that pool's writes itself)."""
        return self._run(self._writer, job)

    def _run(self, executor, job) -> Future:
        if executor is not None:
            return executor.submit(_inference, job)
        fut: Future = Future()
        t0 = self.clock()
        fut.set_result(job())
        self.inline_host_s += self.clock() - t0
        return fut

    def gather(self, flat: torch.Tensor, index: torch.Tensor, host: torch.Tensor, dev: torch.Tensor | None) -> None:
        """host[:m] = flat[index] (m rows) in slices, the calling thread's intra-op threads inside each; with `dev`,
        each slice's host->device copy is issued on the side stream as soon as that slice is gathered."""
        m = index.numel()
        parts = max(1, min(GATHER_SLICES, m // MIN_SLICE_ROWS))
        bounds = [m * i // parts for i in range(parts + 1)]
        for a, b in zip(bounds, bounds[1:]):
            torch.index_select(flat, 0, index[a:b], out=host[a:b])
            if dev is not None:
                with self.side():
                    dev[a:b].copy_(host[a:b], non_blocking=self.cuda)

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else NoEvent()

    def compute_event(self):
        """Recorded on the compute stream now: what a side-stream copy of its outputs must wait for."""
        ev = self.event()
        ev.record()
        return ev

    def side(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def back(self):
        """The write-back stream (device->host), waiting for what the compute stream has queued so far."""
        if not self.cuda:
            return nullcontext()
        self.back_stream.wait_event(self.compute_event())
        return torch.cuda.stream(self.back_stream)

    def side_wait(self, event) -> None:
        if self.cuda:
            self.stream.wait_event(event)

    def compute_wait(self, event) -> None:
        if self.cuda and event is not None:
            torch.cuda.current_stream().wait_event(event)

    def keep_alive(self, *tensors: torch.Tensor, stream=None) -> None:
        """Device tensors a copy on another stream reads: their memory is not reused before the copy has run."""
        if self.cuda:
            for t in tensors:
                t.record_stream(stream or self.stream)

    def staging(self, elems: int, dtype, gather_rows: int = 0, width: int = 0, index_slots: int = 0) -> list[Slot] | None:
        """Two alternating landing slots (fetch k uses slot k % 2), so the copy for the next layer never overwrites
        what the current layer reads. None without copies (CPU), where fetched rows are the pool's own memory.
        Device landing rows start zeroed: rows a gather leaves unwritten are masked, and must not be NaN."""
        if not self.copies:
            return None
        slots = []
        for _ in range(2):
            host = torch.empty(gather_rows * width, dtype=dtype, pin_memory=self.cuda) if gather_rows else None
            index = torch.empty(index_slots, dtype=torch.int32, pin_memory=self.cuda) if index_slots else None
            slots.append(Slot(torch.zeros(elems, dtype=dtype, device=self.device), host, index, self.event(),
                              self.event()))
        return slots

    def close(self) -> None:
        for executor in (self._worker, self._writer):
            if executor is not None:
                executor.shutdown(wait=True)


def _inference(job, *args):
    with torch.inference_mode():  # thread-local: the pools and landing buffers are inference tensors
        return job(*args)
