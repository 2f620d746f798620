"""A layer's KV in host memory: the pool of rows (`HostPool`) and the cache layer backed by it (`PoolStore`)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from infinigen.adapter import KVStore
from infinigen.offload import kernels
from infinigen.offload.codecs import token_major
from infinigen.offload.link import Fetched, Link, Slot


class HostPool:
    """One layer's host-resident KV rows, (slots, b*h_kv, W), pinned on CUDA. Rows [0, hwm) have been written."""

    def __init__(self, link: Link, slots: int, bh: int, width: int, dtype):
        self.link, self.slots, self.bh, self.width = link, slots, bh, width
        self.data = torch.empty(slots, bh, width, dtype=dtype, pin_memory=link.cuda)
        self.flat = self.data.view(-1, width)
        self.hwm = 0
        self.written = None  # event after the latest device->host write into `data`
        self.jobs: list[Future] = []  # queued host scatters: a fetch of this pool waits for them on its worker
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
        with self.link.back():
            self.data[start : start + t].copy_(rows, non_blocking=self.link.cuda)
            done = self.link.event()
            done.record(self.link.back_stream)
        self.link.keep_alive(rows, stream=self.link.back_stream)
        self.written = done
        self.hwm = max(self.hwm, start + t)
        self.d2h_bytes += rows.numel() * rows.element_size()

    def scatter(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Evicting pools: rows (b*h_kv, W) go to per-head free slots (b*h_kv,), both on the device. The slot
        indices are device values, so the host-side write waits for them on the write-back worker, never on
        this thread."""
        done = None
        if self.link.cuda:
            k, self._flip = self._flip, self._flip ^ 1  # double-buffered: step t+2 reuses step t's landing pair,
            if self._landing[k] is None:  # whose scatter ran before step t+1's fetch of this layer was consumed
                self._landing[k] = (torch.empty_like(rows, device="cpu", pin_memory=True),
                                    torch.empty_like(slots, device="cpu", pin_memory=True))
            r_host, s_host = self._landing[k]
            with self.link.back():
                r_host.copy_(rows, non_blocking=True)
                s_host.copy_(slots, non_blocking=True)
                done = self.link.event()
                done.record(self.link.back_stream)
            self.link.keep_alive(rows, slots, stream=self.link.back_stream)
        else:
            r_host, s_host = rows, slots

        def job() -> int:
            if done is not None:
                done.synchronize()
            self.flat.index_copy_(0, s_host * self.bh + self._heads, r_host)
            self.hwm = max(self.hwm, int(s_host.max()) + 1)
            return self.hwm

        self.jobs.append(self.link.submit_write(job))
        self.d2h_bytes += rows.numel() * rows.element_size() + slots.numel() * slots.element_size()

    def settle(self, wait: bool = False) -> None:
        """Forget the scatters that have run (raising what one raised); waits for the others only if asked."""
        running = []
        for job in self.jobs:
            if wait or job.done():
                job.result()
            else:
                running.append(job)
        self.jobs = running

    def prefix_job(self, n: int | None, slot: Slot | None, first: int = 0):
        """Rows [0, n) (n=None: every row this pool's writes issued so far reach, once they have run; a write
        issued later may run first on its own thread, and is not counted). Only rows [first, n) cross, landing at
        their own offsets (a local layer's window: rows before it are masked, and the landing slot's stale rows
        there are finite)."""
        link, writes, hwm = self.link, list(self.jobs), self.hwm

        def job() -> Fetched:
            t0 = link.clock()
            reached = max([hwm] + [w.result() for w in writes])
            src = self.data[: reached if n is None else n]
            crossing = src[first:]
            nbytes = crossing.numel() * crossing.element_size()
            if slot is None:
                return Fetched(src, crossing.shape[0] * crossing.shape[1], nbytes, link.clock() - t0)
            start, end = link.event(timing=True), link.event(timing=True)
            with link.side():
                link.side_wait(slot.free)
                start.record(link.stream)
                dst = slot.dev[: src.numel()].view(src.shape)
                dst[first:].copy_(crossing, non_blocking=link.cuda)
                end.record(link.stream)
            return Fetched(dst, crossing.shape[0] * crossing.shape[1], nbytes, link.clock() - t0, end, start, slot)

        return job

    def gather_job(self, rows: torch.Tensor, slot: Slot | None):
        """rows (n,): flat indices into (slots * b*h_kv, W), ascending, the selected ones first and then values at or
        above the pool's row count (the runtime's `sorted_rows`: fillers, sentinels); the selected rows are gathered
        on the host, then copied: only they cross, and the host sweeps the pool once. How many there are is counted
        where the gather runs (a search of the sorted indices), so nothing is read back for it. With a landing slot
        the indices reach the host by one non-blocking copy (int32) that the job waits for on its worker: the
        thread launching kernels never waits for them."""
        written, writes, link = self.written, list(self.jobs), self.link  # later writes touch rows never read here
        size = self.slots * self.bh  # rows of the pool: every index at or above it is not one
        if slot is None:  # host == device: the indices are already where the gather runs

            def job() -> Fetched:
                t0 = link.clock()
                for w in writes:
                    w.result()
                index = rows[: int(torch.searchsorted(rows, size))]
                t1 = link.clock()
                out = self.flat.index_select(0, index)
                return Fetched(out, out.shape[0], out.numel() * out.element_size(), link.clock() - t0,
                               gather_s=link.clock() - t1)

            return job
        n = rows.numel()
        host_index = slot.host_index if slot.host_index.numel() == n else slot.host_index[:n]
        with link.back():
            host_index.copy_(rows, non_blocking=link.cuda)  # int32 on the host: every value fits
            landed = link.event()
            landed.record(link.back_stream)
        link.keep_alive(rows, stream=link.back_stream)

        def job() -> Fetched:
            t0 = link.clock()
            landed.synchronize()
            if written is not None:
                written.synchronize()
            for w in writes:
                w.result()
            m = int(torch.searchsorted(host_index, size))
            slot.copied.synchronize()  # the landing buffer's previous copy has left it
            start, end = link.event(timing=True), link.event(timing=True)
            with link.side():
                link.side_wait(slot.free)
                start.record(link.stream)
            out = slot.dev[: m * self.width].view(m, self.width)
            t1 = link.clock()
            link.gather(self.flat, host_index[:m], slot.host[: m * self.width].view(m, self.width), out)
            t2 = link.clock()
            with link.side():
                end.record(link.stream)
                slot.copied.record(link.stream)
            return Fetched(slot.dev, m, m * self.width * self.flat.element_size(), link.clock() - t0, end, start,
                           slot, gather_s=t2 - t1)

        return job

    def zero_copy_job(self, src: torch.Tensor, valid: torch.Tensor, slot: Slot) -> Fetched:
        """The rows at src (b*h_kv, k) where valid, read from the pinned pool by a device program on the side stream
        (CUDA's unified addressing): only they cross, no host thread touches them, and nothing waits on the host.
        A pool that evicts is written by a host thread, which the device cannot wait for: host gathers only."""
        link = self.link
        bh, k = src.shape
        rows = slot.dev[: bh * k * self.width].view(bh * k, self.width)
        start, end = link.event(timing=True), link.event(timing=True)
        with link.side():
            link.side_wait(link.compute_event())  # the selection
            link.side_wait(slot.free)
            if self.written is not None:
                link.side_wait(self.written)
            start.record(link.stream)
            kernels.gather_rows(self.flat, src, valid, rows)
            end.record(link.stream)
        link.keep_alive(src, valid)
        moved = valid.sum()
        return Fetched(slot.dev, moved, moved * self.width * self.flat.element_size(), 0.0, end, start, slot,
                       padded=True)


class PoolStore(KVStore):
    """A cache layer whose KV moves to a HostPool right after the prefill (until then, and during the method's
    after_prefill, it is a plain KVStore on the device). Afterwards positions and per-entry method state stay on
    the device in position order, entries["slot"] says which pool slot holds each entry's row, and `fresh` is the
    current token's row (b, h_kv, 1, W). What a decode step attends is put in place by the runtime before the
    method's own step runs: `keys`/`values` (every held entry, position order) or `gathered` (selected rows)."""

    def __init__(self, pool: HostPool, codec, evicting: bool):
        super().__init__()
        self.pool, self.codec, self.evicting = pool, codec, evicting
        self.on_host = False
        self.fresh: torch.Tensor | None = None
        self.fresh_key: torch.Tensor | None = None  # the current token's key as the layer computed it (b, h_kv, 1, d)
        # what a gathering step attends (executors.Gathered): rows (b, h_kv, k + 1, W), the current token's last, and
        # their mask (b, h_kv, 1, k + 1) (False: a row a head did not select); unpacks as (rows, mask)
        self.gathered = None

    @property
    def stored(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def nbytes(self) -> int:
        return 0 if self.on_host else super().nbytes()

    def to_host(self) -> None:
        b, hk, s, _ = self.keys.shape
        self.pool.write(0, token_major(self.codec.encode(self.keys, self.values)))
        self.append_entries(slot=torch.arange(s, device=self.keys.device).expand(b, hk, s))
        self.keys = self.values = self._buffers = None  # the prefill's KV lives in the pool now
        self.on_host = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.on_host:
            return super().update(key_states, value_states)
        b, hk, t, _ = key_states.shape
        assert t == 1, "after the prefill the pool takes one token per step"
        n = self.stored
        self.append_positions(b, hk, 1, key_states.device)
        rows = self.codec.encode(key_states, value_states)  # (b, h_kv, 1, W)
        if self.evicting:
            slot = self._free_slot()
            self.pool.scatter(rows.reshape(b * hk, -1), slot.reshape(-1))
        else:
            slot = torch.full((b, hk), n, device=key_states.device)
            self.pool.write(n, rows.reshape(1, b * hk, -1))
        self.append_entries(slot=slot[..., None])
        self.fresh, self.fresh_key = rows, key_states
        return key_states, value_states

    def _free_slot(self) -> torch.Tensor:
        """(b, h_kv) lowest free pool slot per head (the one the last eviction freed, or the next new one)."""
        slots = self.entries["slot"]
        taken = torch.zeros(*slots.shape[:2], self.pool.slots, dtype=torch.int32, device=slots.device)
        return taken.scatter_(-1, slots, 1).argmin(-1)

    def keep(self, index: torch.Tensor) -> None:
        if self.on_host and not self.evicting:
            raise RuntimeError("this pool was sized for a method that never evicts (KVMethod.max_held)")
        super().keep(index)

    def recent_keys(self, n: int) -> torch.Tensor:
        if not self.on_host:
            return super().recent_keys(n)
        assert n == 1, "after the prefill the pool takes one token per step"
        # kept beside its row, not decoded from it: a codec may store no keys (ShadowKV's rows are values only)
        return self.fresh_key  # (b, h_kv, 1, d)

    def selected(self, keep: torch.Tensor):
        if self.gathered is None:
            return super().selected(keep)
        rows, mask = self.gathered
        keys, values = self.codec.decode(rows)  # (b, h_kv, k + 1, d)
        return keys, values, mask
