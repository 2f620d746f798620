"""Offloading decode runtime: weights on the compute device, the KV cache of offloading methods in host memory,
and the host->device traffic each method implies actually moved (CUDA) or counted and modelled (CPU).

What crosses the link each decode step, per runtime kind (`resolve_kind`):

  ideal      nothing: every layer's KV stays on the device, dense attention (the no-offload bound; method `full`)
  dense      `offload` (FlexGen; Sheng et al., ICML'23): each layer's whole KV; layer i+1's copy is issued when
             layer i's attention starts, so it overlaps layer i's compute (layer 0 of the next step: at the last layer)
  quant      `quant`: packed codes + fp16 scale/zero per group, prefetched the same way, dequantised on the device
  h2o        `h2o`: the pool holds only the entries H2O keeps (its budget), and those cross every step;
             `resident_h2o=True` keeps H2O's cache on the device instead (nothing crosses)
  infinigen  `infinigen` (Lee et al., OSDI'24): while layer i-1 runs, layer i's partial query (from layer i-1's
             attention input) is scored against layer i's partial keys, which stay on the device; the selected rows
             of layer i are gathered from the host pool and copied while layer i-1 finishes. Layers below
             skip_layers attend densely and keep their KV on the device. The pool applies capacity + eviction.

Pools are token-major, (slots, b*h_kv, W), so a prefix is one contiguous DMA; a row is K|V, or for quant
K codes|V codes|scales|zeros. On CUDA pools are pinned, copies run on a side stream ordered by events, and the
host-side work (gathers into pinned landing buffers, scatters of new rows) runs on one worker thread so the thread
that launches kernels never waits for it. On CPU host and device coincide: nothing is copied, the bytes are
counted, and the link is modelled (`Timer.modelled_steps`).

Every kind's decode steps compute what the method's own decode mode computes (tests/test_latency.py checks it
against sim mode), except that InfiniGen's recall statistic is not tracked (it needs every key on the device).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from infinigen import adapter
from infinigen.adapter import KVStore
from infinigen.method import attend
from infinigen.selection import budget_cap, pool_limit, select

RUNTIMES = ("auto", "ideal", "offload")
# Host->device bandwidth the CPU model assumes, in GB/s (1e9 bytes/s): PCIe 4.0 x16 is 31.5 GB/s raw per direction
# (16 GT/s x 16 lanes x 128/130); ~25 GB/s is what pinned cudaMemcpyAsync reaches on such links (FlexGen and
# InfiniGen's A100/RTX machines).
PCIE4_X16_GBPS = 25.0


def resolve_kind(method, runtime: str = "auto", resident_h2o: bool = False) -> str:
    """The runtime kind a method runs under (see the module docstring); ValueError for unsupported pairs."""
    from baselines.full import Full
    from baselines.h2o import H2O
    from baselines.offload import Offload
    from baselines.quant import Quant
    from infinigen.infinigen import InfiniGen

    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    name = type(method).__name__
    if runtime == "ideal":
        if not isinstance(method, (Full, Offload)):
            raise ValueError(f"runtime=ideal is dense attention with every KV entry on the device: it runs method "
                             f"full or offload, not {name}")
        return "ideal"
    if isinstance(method, InfiniGen):
        if method.speculate_from != "previous":
            raise ValueError("the offloading runtime prefetches layer i's selection during layer i-1: it needs "
                             "speculate_from=previous")
        return "infinigen"
    if isinstance(method, H2O):
        return "h2o_resident" if resident_h2o else "h2o"
    if isinstance(method, Quant):
        return "quant"
    if isinstance(method, Offload):
        return "dense"
    if isinstance(method, Full):
        return "ideal" if runtime == "auto" else "dense"
    raise ValueError(f"the offloading runtime runs full, offload, quant, h2o and infinigen; got {name}")


# ----------------------------------------------------------------------------------------------- the link


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

    def __init__(self, device, threaded: bool | None = None, copies: bool | None = None):
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
        t0 = time.perf_counter()
        fut.set_result(job())
        self.inline_host_s += time.perf_counter() - t0
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


class HostPool:
    """One layer's host-resident KV rows, (slots, b*h_kv, W), pinned on CUDA. Rows [0, hwm) have been written."""

    def __init__(self, link: Link, slots: int, bh: int, width: int, dtype):
        self.link, self.slots, self.bh, self.width = link, slots, bh, width
        self.data = torch.empty(slots, bh, width, dtype=dtype, pin_memory=link.cuda)
        self.flat = self.data.view(-1, width)
        self.hwm = 0
        self.written = None  # event after the latest device->host write into `data`
        self.jobs: list[Future] = []  # queued host scatters (their errors surface at the next fetch)
        self._landing: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        self._flip = 0
        self._heads = torch.arange(bh)
        self.d2h_bytes = 0

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, start: int, rows: torch.Tensor) -> None:
        """rows (t, b*h_kv, W) on the device -> slots start..start+t (contiguous pools: slot = entry index)."""
        t = rows.shape[0]
        ready = self.link.compute_event()
        with self.link.side():
            self.link.side_wait(ready)
            self.data[start : start + t].copy_(rows, non_blocking=self.link.cuda)
            done = self.link.event()
            done.record(self.link.stream)
        self.link.keep_alive(rows)
        self.written = done
        self.hwm = max(self.hwm, start + t)
        self.d2h_bytes += rows.numel() * rows.element_size()

    def scatter(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Evicting pools: rows (b*h_kv, W) go to per-head free slots (b*h_kv,), both on the device. The slot
        indices are device values, so the host-side write waits for them on the worker, never on this thread."""
        done = None
        if self.link.cuda:
            k, self._flip = self._flip, self._flip ^ 1  # double-buffered: step t+2 reuses step t's landing pair,
            if self._landing[k] is None:  # whose scatter ran before step t+1's fetch of this layer was consumed
                self._landing[k] = (torch.empty_like(rows, device="cpu", pin_memory=True),
                                    torch.empty_like(slots, device="cpu", pin_memory=True))
            r_host, s_host = self._landing[k]
            ready = self.link.compute_event()
            with self.link.side():
                self.link.side_wait(ready)
                r_host.copy_(rows, non_blocking=True)
                s_host.copy_(slots, non_blocking=True)
                done = self.link.event()
                done.record(self.link.stream)
            self.link.keep_alive(rows, slots)
        else:
            r_host, s_host = rows, slots

        def job():
            if done is not None:
                done.synchronize()
            self.flat.index_copy_(0, s_host * self.bh + self._heads, r_host)
            self.hwm = max(self.hwm, int(s_host.max()) + 1)

        self.jobs.append(self.link.submit(job))
        self.d2h_bytes += rows.numel() * rows.element_size() + slots.numel() * slots.element_size()

    def settle(self) -> None:
        for job in self.jobs:
            job.result()
        self.jobs.clear()

    def prefix_job(self, n: int | None, slot: Slot | None):
        """Rows [0, n) (n=None: every row written so far, read when the job runs, after queued scatters)."""
        link = self.link

        def job() -> Fetched:
            t0 = time.perf_counter()
            src = self.data[: self.hwm if n is None else n]
            nbytes = src.numel() * src.element_size()
            if slot is None:
                return Fetched(src, None, nbytes, time.perf_counter() - t0)
            start, end = link.event(timing=True), link.event(timing=True)
            with link.side():
                link.side_wait(slot.free)
                start.record(link.stream)
                dst = slot.dev[: src.numel()].view(src.shape)
                dst.copy_(src, non_blocking=link.cuda)
                end.record(link.stream)
            return Fetched(dst, None, nbytes, time.perf_counter() - t0, end, start, slot)

        return job

    def gather_job(self, src_idx: torch.Tensor, dest: torch.Tensor | None, slot: Slot | None):
        """Rows at flat indices src_idx (m,) of (slots * b*h_kv, W), gathered on the host, then copied."""
        written, link = self.written, self.link  # writes issued later touch rows this job never reads

        def job() -> Fetched:
            t0 = time.perf_counter()
            if written is not None:
                written.synchronize()
            m = src_idx.numel()
            nbytes = m * self.width * self.flat.element_size()
            if slot is None:
                return Fetched(self.flat.index_select(0, src_idx), dest, nbytes, time.perf_counter() - t0)
            slot.copied.synchronize()  # the landing buffer's previous copy has left it
            host = slot.host[: m * self.width].view(m, self.width)
            torch.index_select(self.flat, 0, src_idx, out=host)
            if dest is not None:
                slot.host_dest[:m].copy_(dest)
            start, end = link.event(timing=True), link.event(timing=True)
            with link.side():
                link.side_wait(slot.free)
                start.record(link.stream)
                dst = slot.dev[: m * self.width].view(m, self.width)
                dst.copy_(host, non_blocking=link.cuda)
                d = None
                if dest is not None:
                    d = slot.dest[:m]
                    d.copy_(slot.host_dest[:m], non_blocking=link.cuda)
                end.record(link.stream)
                slot.copied.record(link.stream)
            return Fetched(dst, d, nbytes, time.perf_counter() - t0, end, start, slot)

        return job


# ----------------------------------------------------------------------------------------------- rows


class FpCodec:
    """A row is K|V in the model's dtype: (..., d) x 2 <-> (..., 2d)."""

    def __init__(self, head_dim: int, dtype):
        self.d, self.width, self.dtype = head_dim, 2 * head_dim, dtype

    def encode(self, k, v):
        return torch.cat([k, v], dim=-1)

    def decode(self, rows):
        return rows[..., : self.d], rows[..., self.d :]


class QuantCodec:
    """A row is K codes|V codes|K scale|K zero|V scale|V zero as bytes (baselines.quant's format and functions,
    so the device sees exactly what QuantStore.dequantized() gives)."""

    def __init__(self, head_dim: int, bits: int, group: int, dtype):
        from baselines.quant import PARAM_DTYPE

        self.bits, self.group, self.out_dtype, self.dtype = bits, group, dtype, torch.uint8
        self.codes = head_dim * bits // 8
        self.params = (head_dim // group) * PARAM_DTYPE.itemsize
        self.width = 2 * self.codes + 4 * self.params

    def encode(self, k, v):
        from baselines.quant import pack, quantize

        kc, ks, kz = quantize(k, self.bits, self.group)
        vc, vs, vz = quantize(v, self.bits, self.group)
        params = [p.contiguous().view(torch.uint8) for p in (ks, kz, vs, vz)]
        return torch.cat([pack(kc, self.bits), pack(vc, self.bits), *params], dim=-1)

    def decode(self, rows):
        from baselines.quant import PARAM_DTYPE, dequantize, unpack

        kc, vc, ks, kz, vs, vz = rows.split([self.codes] * 2 + [self.params] * 4, dim=-1)
        ks, kz, vs, vz = (p.contiguous().view(PARAM_DTYPE) for p in (ks, kz, vs, vz))
        k = dequantize(unpack(kc, self.bits), ks, kz, self.group, self.out_dtype)
        v = dequantize(unpack(vc, self.bits), vs, vz, self.group, self.out_dtype)
        return k, v


def token_major(rows: torch.Tensor) -> torch.Tensor:
    b, hk, t, w = rows.shape
    return rows.permute(2, 0, 1, 3).reshape(t, b * hk, w)  # (t, b*h_kv, W)


def head_major(rows: torch.Tensor, b: int, hk: int) -> torch.Tensor:
    n, _, w = rows.shape
    return rows.view(n, b, hk, w).permute(1, 2, 0, 3)  # (b, h_kv, n, W)


def _gather_entries(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    idx = index.view(*index.shape, *([1] * (x.dim() - 3))).expand(*index.shape, *x.shape[3:])
    return x.gather(2, idx)


# ----------------------------------------------------------------------------------------------- cache layers


class ResidentStore(KVStore):
    """KV on the compute device, in buffers sized for the whole run (no re-allocation per step)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        b, hk, t, d = key_states.shape
        n = self.stored
        if self._k is None:
            self._k = key_states.new_empty(b, hk, self.capacity, d)
            self._v = value_states.new_empty(b, hk, self.capacity, d)
        if n + t > self.capacity:
            raise RuntimeError(f"resident store sized for {self.capacity} tokens, asked for {n + t}")
        pos = torch.arange(self.seen, self.seen + t, device=key_states.device).expand(b, hk, t)
        self.positions = pos if self.positions is None else torch.cat([self.positions, pos], dim=-1)
        self.seen += t
        self._k[:, :, n : n + t] = key_states
        self._v[:, :, n : n + t] = value_states
        self.keys, self.values = self._k[:, :, : n + t], self._v[:, :, : n + t]
        self.device, self.is_initialized = key_states.device, True
        return self.keys, self.values

    def keep(self, index):
        raise RuntimeError("a resident dense layer never evicts")

    def device_bytes(self) -> int:
        own = 0 if self._k is None else 2 * self._k.numel() * self._k.element_size()
        return own + _entry_bytes(self)


class PoolStore(KVStore):
    """A decode-mode cache layer whose KV moves to a HostPool right after the prefill (until then, and during
    the method's after_prefill, it is a plain KVStore on the device). Afterwards positions and per-entry method
    state stay on the device in position order, entries["slot"] says which pool slot holds each entry's row, and
    `fresh` is the current token's row (b, h_kv, 1, W) for this step's attention."""

    def __init__(self, pool: HostPool, codec, evicting: bool):
        super().__init__()
        self.pool, self.codec, self.evicting = pool, codec, evicting
        self.on_host = False
        self.fresh: torch.Tensor | None = None

    @property
    def stored(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def nbytes(self) -> int:
        return 0 if self.on_host else super().nbytes()

    def to_host(self) -> None:
        b, hk, s, _ = self.keys.shape
        self.pool.write(0, token_major(self.codec.encode(self.keys, self.values)))
        self.entries["slot"] = torch.arange(s, device=self.keys.device).expand(b, hk, s).contiguous()
        self.keys = self.values = None
        self.on_host = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.on_host:
            return super().update(key_states, value_states)
        b, hk, t, _ = key_states.shape
        assert t == 1, "after the prefill the pool takes one token per step"
        n, dev = self.stored, key_states.device
        self.positions = torch.cat([self.positions, torch.full((b, hk, 1), self.seen, device=dev)], dim=-1)
        self.seen += 1
        rows = self.codec.encode(key_states, value_states)  # (b, h_kv, 1, W)
        if self.evicting:
            slot = self._free_slot()
            self.pool.scatter(rows.reshape(b * hk, -1), slot.reshape(-1))
        else:
            slot = torch.full((b, hk), n, device=dev)
            self.pool.write(n, rows.reshape(1, b * hk, -1))
        self.entries["slot"] = torch.cat([self.entries["slot"], slot[..., None]], dim=-1)
        self.fresh = rows
        return key_states, value_states

    def _free_slot(self) -> torch.Tensor:
        """(b, h_kv) lowest free pool slot per head (the one the last eviction freed, or the next new one)."""
        slots = self.entries["slot"]
        taken = torch.zeros(*slots.shape[:2], self.pool.slots, dtype=torch.int32, device=slots.device)
        return taken.scatter_(-1, slots, 1).argmin(-1)

    def keep(self, index: torch.Tensor) -> None:
        if not self.on_host:
            return super().keep(index)
        self.positions = self.positions.gather(2, index)
        for name, value in self.entries.items():
            self.entries[name] = _gather_entries(value, index)

    def device_bytes(self) -> int:
        return self.nbytes() + _entry_bytes(self)


def _entry_bytes(store: KVStore) -> int:
    tensors = list(store.entries.values()) + ([store.positions] if store.positions is not None else [])
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------------------------- timing


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
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((name, key, ev))
        else:
            self._marks.append((name, key, time.perf_counter() - self.link.inline_host_s))

    def begin(self) -> None:
        self._marks = []
        self._wall0 = time.perf_counter()
        self.mark("step0")

    def end(self) -> None:
        self.mark("step1")
        self.steps.append(self._marks)
        self.walls.append(time.perf_counter() - self._wall0)
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


# ----------------------------------------------------------------------------------------------- executors


class Executor:
    """Installed as the session's method: the prefill runs through the KV method itself (dense, then its
    after_prefill), decode steps run here against the runtime's stores."""

    def __init__(self, method, rt: "OffloadRuntime"):
        self.method, self.rt, self.link = method, rt, rt.link
        self.fetches: dict[int, tuple] = {}
        self.deferred: list[tuple[int, str, torch.Tensor]] = []
        self.staging: list[Slot] | None = None
        self.session = None

    @property
    def stats(self):
        return self.method.stats

    def bind(self, session) -> None:
        self.session = session
        self.method.bind(session)

    def new_store(self, layer, batch: int, max_len: int, dtype) -> KVStore:
        return ResidentStore(max_len)

    def forward_attention(self, session, layer, q, k, v, allowed):
        out = self.method.forward_attention(session, layer, q, k, v, self.rt.unmask_padding_rows(allowed))
        store = session.cache.layers[layer.index]
        if isinstance(store, PoolStore):
            self.to_host(layer, store)
        return out

    def to_host(self, layer, store: PoolStore) -> None:
        store.to_host()

    def decode_attention(self, session, layer, q, store):
        raise NotImplementedError

    def begin_step(self) -> None:
        """Before a decode step's forward (prefix executors issue the first step's layer-0 copy here)."""

    # ------------------------------------------------------------------ shared pieces
    def submit(self, layer_index: int, job, *extra) -> None:
        self.fetches[layer_index] = (self.link.submit(job), self.rt.timer.issue(), *extra)

    def take(self, layer_index: int, store) -> tuple:
        fut, fid, *extra = self.fetches.pop(layer_index)
        self.rt.timer.need(fid)
        self.rt.timer.mark("wait0", layer_index)
        fetched = fut.result()
        self.link.compute_wait(fetched.ready)
        self.rt.timer.mark("wait1", layer_index)
        store.pool.settle()
        self.rt.timer.landed(fid, fetched)
        self.rt.account(layer_index, fetched.nbytes, fetched.rows.numel() // fetched.rows.shape[-1])
        return (fetched, *extra)

    @staticmethod
    def release(fetched: Fetched) -> None:
        if fetched.slot is not None:
            fetched.slot.free.record()  # the next copy into this slot waits for the attention queued above

    def record(self, layer_index: int, name: str, values: torch.Tensor) -> None:
        self.deferred.append((layer_index, name, values))  # added at the end: no device sync per layer

    def flush_stats(self) -> None:
        for layer_index, name, values in self.deferred:
            self.method.stats.add(layer_index, name, values)
        self.deferred.clear()

    def dense_attention(self, layer, q, k, v, store) -> torch.Tensor:
        """Every non-padding entry; records kv_fraction = 1 per row (what KVMethod.record_decode gives)."""
        out, _ = attend(q, k, v, self.rt.valid_keys(k.shape[2]), layer.logit_scale)
        b = q.shape[0]
        seen = self.rt.row_lengths(store.seen)
        self.record(layer.index, "kv_fraction", (seen / seen)[:, None].expand(b, layer.num_kv_heads))
        self.rt.tally(layer.index, attended=(seen - 1)[:, None].expand(b, layer.num_kv_heads), fetched=0)
        return out


class IdealExecutor(Executor):
    """Every layer's KV resident on the device; dense attention."""

    def decode_attention(self, session, layer, q, store):
        return self.dense_attention(layer, q, store.keys, store.values, store)


class ResidentH2OExecutor(Executor):
    """H2O with its cache on the device: the method's own decode step, nothing crosses the link."""

    def new_store(self, layer, batch, max_len, dtype):
        return self.method.new_store(layer)

    def decode_attention(self, session, layer, q, store):
        attended = torch.full((q.shape[0], layer.num_kv_heads), float(store.stored - 1))  # before it evicts
        self.rt.tally(layer.index, attended=attended, fetched=0)
        return self.method.decode_attention(session, layer, q, store)


class PrefixExecutor(Executor):
    """Pools read as a prefix each step (dense offload, quant, h2o); layer i+1's copy is issued when layer i's
    attention starts, the next step's layer 0 at the last layer."""

    evicting = False

    def codec(self, layer, dtype):
        return FpCodec(layer.head_dim, dtype)

    def pool_slots(self, max_len: int) -> int:
        return max_len

    def new_store(self, layer, batch, max_len, dtype):
        codec = self.codec(layer, dtype)
        slots = self.pool_slots(max_len)
        bh = batch * layer.num_kv_heads
        if self.staging is None:
            self.staging = self.link.staging(slots * bh * codec.width, codec.dtype)
            self._seq = 0
        return PoolStore(HostPool(self.link, slots, bh, codec.width, codec.dtype), codec, self.evicting)

    def issue(self, i: int) -> None:
        store = self.session.cache.layers[i]
        slot = None if self.staging is None else self.staging[self._seq % 2]
        self._seq += 1
        self.submit(i, store.pool.prefix_job(None if self.evicting else store.stored, slot))

    def begin_step(self) -> None:
        if 0 not in self.fetches:  # the first step: nothing earlier to overlap layer 0's copy with
            self.issue(0)

    def fetch(self, layer, store) -> Fetched:
        i, last = layer.index, len(self.session.layers) - 1
        if not (i == last and self.rt.last_step):
            self.issue(0 if i == last else i + 1)
        return self.take(i, store)[0]

    def landed(self, fetched: Fetched, store) -> torch.Tensor:
        """The fetched rows with the current token's row in its slot, (slots, b*h_kv, W) on the device, so the
        attention reads past + current without concatenating the cache. CPU: the fetched rows are the pool,
        where update() already put the token."""
        pool = store.pool
        if fetched.slot is None:
            return pool.data
        buffer = fetched.slot.dev[: pool.slots * pool.bh * pool.width].view(pool.slots, pool.bh, pool.width)
        heads = torch.arange(pool.bh, device=buffer.device)
        slot = store.entries["slot"][..., -1].reshape(-1)  # (b*h_kv,) the current token's slot per head
        buffer.view(-1, pool.width).index_copy_(0, slot * pool.bh + heads, store.fresh.reshape(pool.bh, pool.width))
        return buffer

    def decode_attention(self, session, layer, q, store):
        fetched = self.fetch(layer, store)
        rows = head_major(self.landed(fetched, store)[: store.stored], q.shape[0], layer.num_kv_heads)
        k, v = store.codec.decode(rows)  # (b, h_kv, s, d): slot = entry index in a pool that never evicts
        out, _ = attend(q, k, v, self.rt.valid_keys(k.shape[2]), layer.logit_scale)
        self.release(fetched)
        b = q.shape[0]
        seen = self.rt.row_lengths(store.seen)
        self.record(layer.index, "kv_fraction", (seen / seen)[:, None].expand(b, layer.num_kv_heads))
        self.rt.tally(layer.index, attended=(seen - 1)[:, None].expand(b, layer.num_kv_heads), fetched=None)
        return out


class QuantExecutor(PrefixExecutor):
    def codec(self, layer, dtype):
        return QuantCodec(layer.head_dim, self.method.bits, self.method.group(layer.head_dim), dtype)


class H2OExecutor(PrefixExecutor):
    """The pool holds H2O's kept entries (budget + the current token); the whole occupied slot range crosses
    (the slot freed by the last eviction included, until this step's token fills it)."""

    evicting = True

    def pool_slots(self, max_len: int) -> int:
        return min(max_len, self.method.budget(max_len) + 1)

    def decode_attention(self, session, layer, q, store):
        b, hk = q.shape[0], layer.num_kv_heads
        fetched = self.fetch(layer, store)
        rows = head_major(self.landed(fetched, store), b, hk)  # (b, h_kv, slots, W) in slot order
        slots = store.entries["slot"]  # (b, h_kv, s): past entries in position order, then the current one
        k, v = store.codec.decode(rows.gather(2, slots[..., None].expand(*slots.shape, rows.shape[-1])))
        out, probs = attend(q, k, v, None, layer.logit_scale, need_probs=True)
        self.release(fetched)
        self.method.stats.add(layer.index, "kv_fraction", torch.full((b, hk), store.stored / store.seen))
        self.rt.tally(layer.index, attended=torch.full((b, hk), float(store.stored - 1)), fetched=None)
        acc = store.entries["acc"]
        acc = torch.cat([acc, acc.new_zeros(*acc.shape[:2], 1)], dim=-1)
        store.entries["acc"] = acc + self.method.reduce(probs[:, :, :, 0])
        self.method.evict(store)
        return out


class InfiniGenExecutor(Executor):
    """Speculation for layer i at layer i-1, host gather of the selected rows, attention over them + the current
    token, counters, pool eviction: SelectiveAttention.decode_attention, split across the two layers."""

    def new_store(self, layer, batch, max_len, dtype):
        m = self.method
        self.limit = None if m.capacity == 1 else pool_limit(m.capacity, max_len)
        if layer.index < m.skip_layers:
            return ResidentStore(max_len)
        slots = max_len if self.limit is None else min(max_len, self.limit + 1)
        codec = FpCodec(layer.head_dim, dtype)
        bh = batch * layer.num_kv_heads
        if self.staging is None:  # at most the budget of the longest sequence crosses per layer and head
            cap = int(budget_cap(m.budget, torch.tensor([max_len]), m.max_num_kv)[0])
            rows = bh * max(1, min(slots, cap))
            self.staging = self.link.staging(rows * codec.width, dtype, gather_rows=rows, width=codec.width)
            self._seq = 0
        return PoolStore(HostPool(self.link, slots, bh, codec.width, dtype), codec, self.limit is not None)

    def bind(self, session) -> None:
        super().bind(session)
        skew = self.method.skewing
        self.columns = []  # per layer (h_kv, r): the partial columns, so partial keys are stored compact
        for cols in skew.columns:
            r = int(cols.sum(-1).max())
            self.columns.append(torch.argsort(cols, dim=-1, descending=True, stable=True)[:, :r])

    def kept_columns(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Skewed partial (b, h_kv, ..., d) -> its kept columns (b, h_kv, ..., r); a head with fewer than r
        (partial_select=qk) keeps zero columns, as Skew.partial leaves them."""
        idx = self.columns[i]
        shape = (1, idx.shape[0]) + (1,) * (x.dim() - 3) + (idx.shape[1],)
        return x.gather(-1, idx.view(shape).expand(*x.shape[:-1], idx.shape[1]))

    def compact(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """(b, h_kv, ..., d) -> skewed, partial columns only, stored compact: (b, h_kv, ..., r)."""
        return self.kept_columns(self.method.skewing.partial(x, i), i)

    def to_host(self, layer, store):
        store.entries["pk"] = self.kept_columns(store.entries.pop("partial_keys"), layer.index)  # (b, h_kv, s, r)
        store.to_host()

    def speculate(self, session, j: int) -> None:
        """Select layer j's rows from layer j-1's attention input and start their gather + copy."""
        self.rt.timer.mark("spec0", j)
        m, layer, store = self.method, session.layers[j], session.cache.layers[j]
        past, row = store.stored, store.seen  # this step's token is not in layer j's pool yet
        x = session.attn_inputs[j - 1]
        spec = layer.queries(x, session.position_embeddings)  # (b, h, 1, d), rotated at the current positions
        b, _, _, d = spec.shape
        hk, dev = layer.num_kv_heads, spec.device
        qs = self.compact(spec.view(b, hk, layer.groups, 1, d), j)  # (b, h_kv, g, 1, r)
        scores = torch.matmul(qs, store.entries["pk"].unsqueeze(2).transpose(-1, -2)) * layer.logit_scale
        keep, n = self.rt.select_rows(scores, store, row, m)  # (b, h_kv, 1, past), (b, 1)
        keep = keep[:, :, 0]
        k = int(n.max()) if n.numel() else 0
        order = torch.argsort(keep.to(torch.uint8), dim=-1, descending=True, stable=True)[..., :k]  # kept, ascending
        valid = torch.arange(k, device=dev) < n[:, :, None]  # (b, 1, k)
        heads = torch.arange(b * hk, device=dev).view(b, hk, 1)
        src = store.entries["slot"].gather(-1, order) * (b * hk) + heads  # flat pool rows (b, h_kv, k)
        src, mask = torch.stack([src, valid.expand(b, hk, k).long()]).cpu()
        mask = mask.bool()
        if bool(mask.all()):
            src_idx, dest = src.reshape(-1), None
        else:
            src_idx, dest = src[mask], torch.arange(b * hk * k).view(b, hk, k)[mask]
        slot = None if self.staging is None else self.staging[self._seq % 2]
        self._seq += 1
        self.submit(j, store.pool.gather_job(src_idx, dest, slot), keep, valid, n, k, dest is None)
        self.rt.timer.mark("spec1", j)

    def decode_attention(self, session, layer, q, store):
        m, i = self.method, layer.index
        if i + 1 < len(session.layers) and i + 1 >= m.skip_layers:
            self.speculate(session, i + 1)
        if i < m.skip_layers:
            return self.dense_attention(layer, q, store.keys, store.values, store)
        b, hk = q.shape[0], layer.num_kv_heads
        fetched, keep, valid, n, k, full = self.take(i, store)
        w = store.codec.width
        if full:
            rows = fetched.rows.view(b, hk, k, w)
        else:
            rows = fetched.rows.new_zeros(b * hk * k, w).index_copy_(0, fetched.dest, fetched.rows).view(b, hk, k, w)
        keys, values = store.codec.decode(torch.cat([rows, store.fresh], dim=2))  # (b, h_kv, k + 1, d)
        mask = None
        if not full:
            mask = torch.cat([valid.expand(b, hk, k), valid.new_ones(b, hk, 1)], dim=-1)[:, :, None]  # (b,hk,1,k+1)
        out, _ = attend(q, keys, values, mask, layer.logit_scale)
        self.release(fetched)
        self.sync_entries(layer, store)
        past, row = store.stored - 1, store.seen - 1
        seen = self.rt.row_lengths(store.seen).to(q.device)
        self.record(i, "kv_fraction", ((n[:, 0] + 1) / seen)[:, None].expand(b, hk))
        self.record(i, "selected", n.float())
        self.rt.tally(i, attended=n.expand(b, hk), fetched=n.expand(b, hk))
        store.entries["count"][..., :past] += keep
        store.entries["last"][..., :past].masked_fill_(keep, row)
        if self.limit is not None and store.stored > self.limit:
            m._evict_store(store, store.stored - self.limit)
        return out

    def sync_entries(self, layer, store) -> None:
        """The current token's per-entry state, as SelectiveAttention.sync_store / InfiniGen.sync_store add it."""
        k_cur, _ = store.codec.decode(store.fresh)  # (b, h_kv, 1, d)
        tail = store.positions[:, :, -1:]
        e = store.entries
        e["pk"] = torch.cat([e["pk"], self.compact(k_cur, layer.index)], dim=2)
        e["count"] = torch.cat([e["count"], torch.zeros_like(tail)], dim=-1)
        e["last"] = torch.cat([e["last"], tail.clone()], dim=-1)


EXECUTORS = {"ideal": IdealExecutor, "dense": PrefixExecutor, "quant": QuantExecutor, "h2o": H2OExecutor,
             "h2o_resident": ResidentH2OExecutor, "infinigen": InfiniGenExecutor}


# ----------------------------------------------------------------------------------------------- the runtime


@dataclass
class Report:
    kind: str
    batch: int
    prompt_len: int
    steps: int
    prefill_s: float
    breakdown: list[dict]
    modelled_ms: list[float] | None
    h2d_bytes: list[int]  # per decode step
    d2h_bytes: int
    host_pool_bytes: int
    device_kv_bytes: int
    peak_device_bytes: int | None
    tallies: dict
    logits: torch.Tensor | None = None  # (b, steps (+1 with the prefill's), V) when kept
    tokens: torch.Tensor | None = None  # (b, steps) fed after the prompt
    fetch_log: list[tuple] = field(default_factory=list)  # (step, layer, bytes, rows or None)

    def metrics(self, warmup: int, link_gbps: float) -> dict:
        """Medians/means over the steps after `warmup`; every number the CPU link model produces is modelled_*."""
        keep = slice(min(warmup, max(self.steps - 1, 0)), None)
        rows = self.breakdown[keep]
        steps = [r["step_ms"] for r in rows]
        q = statistics.quantiles(steps, n=10, method="inclusive") if len(steps) > 1 else steps * 9
        h2d = statistics.fmean(self.h2d_bytes[keep]) if rows else 0.0
        out = {
            "runtime": self.kind,
            "measured_steps": len(rows),
            "prefill_s": self.prefill_s,
            "decode_ms_median": statistics.median(steps),
            "decode_ms_p90": q[8],
            "decode_ms_mean": statistics.fmean(steps),
            "tokens_per_s": self.batch * 1e3 / statistics.fmean(steps),
            "h2d_bytes_per_token": h2d,
            "d2h_bytes_total": self.d2h_bytes,
            "host_pool_bytes": self.host_pool_bytes,
            "device_kv_bytes": self.device_kv_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "selected_tokens_mean": _mean(self.tallies["attended"]),
            "fetched_tokens_mean": _mean(self.tallies["fetched"]),
            "link_gbps": link_gbps,
            "modelled_transfer_ms_per_token": h2d / (link_gbps * 1e9) * 1e3,
        }
        for name in ("attention_ms", "ffn_ms", "speculation_ms", "wait_ms", "transfer_ms", "link_host_ms", "other_ms",
                     "compute_ms"):
            if rows and name in rows[0]:
                out[name] = statistics.median(r[name] for r in rows)
        if self.modelled_ms is not None:
            modelled = self.modelled_ms[keep]
            out["modelled_decode_ms_per_token"] = statistics.median(modelled)
            out["modelled_tokens_per_s"] = self.batch * 1e3 / statistics.fmean(modelled)
        return out


def _mean(pair: list) -> float | None:
    total, count = pair
    return total / count if count else None


class OffloadRuntime:
    """Runs a KV method's decode through the offloading runtime kind it resolves to (`resolve_kind`)."""

    def __init__(self, model, method, runtime: str = "auto", resident_h2o: bool = False,
                 link_gbps: float = PCIE4_X16_GBPS, threaded: bool | None = None, copies: bool | None = None):
        if not link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0 (GB/s), got {link_gbps}")
        self.model, self.method = model, method
        self.kind = resolve_kind(method, runtime, resident_h2o)
        self.link_gbps, self.threaded, self.copies = link_gbps, threaded, copies
        self.device = next(model.parameters()).device
        self.layers = adapter.attention_layers(model)

    # ------------------------------------------------------------------ padding
    def row_lengths(self, seen: int) -> torch.Tensor:
        """(b,) float: tokens each row has seen (padding excluded), on the CPU."""
        return seen - self.pad_cpu.double()

    def valid_keys(self, s: int) -> torch.Tensor | None:
        """(b, 1, 1, s) True where a position-ordered, never-evicted cache of s entries holds no padding."""
        if self.pad is None:
            return None
        return (torch.arange(s, device=self.device)[None, :] >= self.pad[:, None])[:, None, None]

    def unmask_padding_rows(self, allowed: torch.Tensor) -> torch.Tensor:
        """Prefill: a padding query row may attend nothing; let it attend itself so no NaN reaches real rows."""
        if self.pad is None:
            return allowed
        q, s = allowed.shape[-2:]
        dead = ~allowed.any(-1, keepdim=True)
        diag = torch.arange(s, device=allowed.device)[None, :] == torch.arange(s - q, s, device=allowed.device)[:, None]
        return allowed | (dead & diag)

    def select_rows(self, scores, store, row: int, m):
        """selection.select with each batch row's own past (left padding: its tokens before this step), padding
        never a candidate. Rows sharing a padding length are selected together."""
        dev = scores.device
        past = scores.shape[-1]
        if self.pad is None:
            cand = torch.ones(1, 1, 1, past, dtype=torch.bool, device=dev)
            return select(scores, cand, torch.tensor([row], device=dev), m.alpha, m.budget, m.gqa_reduce,
                          m.max_num_kv)
        cand = (store.positions >= self.pad[:, None, None])[:, :, None]  # (b, h_kv, 1, past)
        b, hk = scores.shape[:2]
        keep = torch.zeros(b, hk, 1, past, dtype=torch.bool, device=dev)
        n = torch.zeros(b, 1, dtype=torch.long, device=dev)
        for p in sorted(set(self.pad_cpu.tolist())):
            rows = torch.nonzero(self.pad_cpu == p)[:, 0].to(dev)
            k_, n_ = select(scores[rows], cand[rows], torch.tensor([row - p], device=dev), m.alpha, m.budget,
                            m.gqa_reduce, m.max_num_kv)
            keep[rows], n[rows] = k_, n_
        return keep, n

    # ------------------------------------------------------------------ accounting
    def account(self, layer_index: int, nbytes: int, rows: int | None) -> None:
        self.h2d_bytes[-1] += nbytes
        self.fetch_log.append((len(self.h2d_bytes) - 1, layer_index, nbytes, rows))

    def tally(self, layer_index: int, attended, fetched) -> None:
        """Per (row, KV head): past entries attended, and those that crossed (None: all attended ones)."""
        for name, value in (("attended", attended), ("fetched", attended if fetched is None else fetched)):
            if isinstance(value, torch.Tensor):
                self._tally[name].append(value)
            else:
                self._tally[name].append(torch.full_like(attended, float(value), dtype=torch.float64, device="cpu"))

    # ------------------------------------------------------------------ running
    def _hooks(self):
        handles = []
        for i, block in enumerate(adapter.decoder_layers(self.model)):
            first, last = adapter.ffn_span(block)
            for start, end, name in ((block.self_attn, block.self_attn, "attn"), (first, last, "ffn")):
                handles.append(start.register_forward_pre_hook(lambda *_, i=i, n=name: self.timer.mark(n + "0", i)))
                handles.append(end.register_forward_hook(lambda *_, i=i, n=name: self.timer.mark(n + "1", i)))
        return handles

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, gen_len: int, attention_mask: torch.Tensor | None = None,
                 teacher: torch.Tensor | None = None, keep_logits: bool = False) -> Report:
        """Prefill input_ids (b, P) (left-padded where attention_mask has zeros), then `gen_len` decode steps
        feeding the greedy token, or teacher[:, s] when given (b, gen_len)."""
        b, P = input_ids.shape
        if teacher is not None and teacher.shape != (b, gen_len):
            raise ValueError(f"teacher must be (batch, gen_len) = {(b, gen_len)}, got {tuple(teacher.shape)}")
        self._set_padding(attention_mask, b, P)
        max_len = P + gen_len
        self.link = Link(self.device, self.threaded, self.copies)
        self.timer = Timer(self.link)
        self.h2d_bytes, self.fetch_log, self.last_step = [], [], False
        self._tally = {"attended": [], "fetched": []}
        ex = EXECUTORS[self.kind](self.method, self)
        dtype = next(self.model.parameters()).dtype
        stores = [ex.new_store(layer, b, max_len, dtype) for layer in self.layers]  # pools pinned before timing
        cache = adapter.new_cache(stores)
        pos = (torch.arange(P, device=self.device)[None].expand(b, P) if self.pad is None
               else (attention_mask.long().cumsum(-1) - 1).clamp(min=0))
        handles = self._hooks()
        logits_out, fed = [], []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with adapter.install(self.model, ex, mode="decode", dense_rows=P, cache=cache, max_len=max_len):
                self._sync()
                t0 = time.perf_counter()
                mask = attention_mask if self.pad is not None else None
                logits = self.model(input_ids, attention_mask=mask, position_ids=pos, cache=cache,
                                    use_cache=True).logits[:, -1]
                self._sync()
                prefill_s = time.perf_counter() - t0
                position = pos[:, -1:] + 1
                for s in range(gen_len):
                    if keep_logits:
                        logits_out.append(logits.float())
                    token = logits.argmax(-1, keepdim=True) if teacher is None else teacher[:, s : s + 1]
                    fed.append(token)
                    self.last_step = s == gen_len - 1
                    self.h2d_bytes.append(0)
                    self.timer.begin()
                    ex.begin_step()
                    logits = self.model(token, cache=cache, position_ids=position, use_cache=True).logits[:, -1]
                    self.timer.end()
                    position = position + 1
                self._sync()
            if keep_logits:
                logits_out.append(logits.float())
        finally:
            for h in handles:
                h.remove()
            self.link.close()
        ex.flush_stats()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        pools = [s.pool for s in stores if isinstance(s, PoolStore)]
        staging = sum(sl.dev.numel() * sl.dev.element_size() for sl in ex.staging or [])
        device_kv = sum(s.device_bytes() if hasattr(s, "device_bytes") else s.nbytes() for s in stores) + staging
        tallies = {k: self._sum(v) for k, v in self._tally.items()}
        return Report(
            kind=self.kind, batch=b, prompt_len=P, steps=gen_len, prefill_s=prefill_s,
            breakdown=self.timer.breakdown(),
            modelled_ms=None if self.link.cuda else self.timer.modelled_steps(self.link_gbps),
            h2d_bytes=self.h2d_bytes, d2h_bytes=sum(p.d2h_bytes for p in pools),
            host_pool_bytes=sum(p.nbytes for p in pools),
            device_kv_bytes=device_kv,
            peak_device_bytes=peak, tallies=tallies,
            logits=torch.stack(logits_out, dim=1) if keep_logits else None,
            tokens=torch.cat(fed, dim=1) if fed else None, fetch_log=self.fetch_log,
        )

    @staticmethod
    def _sum(values: list) -> list:
        total = sum(float(v.double().sum()) for v in values)
        return [total, sum(v.numel() for v in values)]

    def _set_padding(self, attention_mask, b: int, P: int) -> None:
        self.pad, self.pad_cpu = None, torch.zeros(b, dtype=torch.long)
        if attention_mask is None:
            return
        mask = attention_mask.bool().cpu()
        if mask.shape != (b, P):
            raise ValueError(f"attention_mask must be (batch, prompt_len) = {(b, P)}, got {tuple(mask.shape)}")
        pad = (~mask).sum(-1)
        if not bool((mask == (torch.arange(P)[None] >= pad[:, None])).all()):
            raise ValueError("attention_mask must be left padding: zeros only before each row's first token")
        if not bool(pad.any()):
            return
        if bool((pad >= P).any()):
            raise ValueError("every row needs at least one prompt token")
        if self.kind in ("h2o", "h2o_resident"):
            raise ValueError("H2O's budget is a fraction of each row's own length, so rows of different lengths "
                             "keep different numbers of entries, which one cache tensor per layer cannot hold: "
                             "run left-padded batches with equal prompt lengths, or one row at a time")
        if self.kind == "infinigen" and self.method.capacity != 1:
            raise ValueError("a KV pool with capacity < 1 is sized per row; left-padded rows of different lengths "
                             "would share it: use capacity=1 with padded batches")
        self.pad, self.pad_cpu = pad.to(self.device), pad


@torch.inference_mode()
def teacher_forced_logits(model, method, input_ids: torch.Tensor, dense_rows: int,
                          attention_mask: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, Report]:
    """runtime.decode_logits through the offloading runtime: predictions of tokens dense_rows .. t-1,
    (b, t - dense_rows, V), and the run's report."""
    rt = OffloadRuntime(model, method, **kwargs)
    report = rt.generate(input_ids[:, :dense_rows], input_ids.shape[1] - dense_rows, attention_mask=attention_mask,
                         teacher=input_ids[:, dense_rows:], keep_logits=True)
    return report.logits[:, :-1], report
