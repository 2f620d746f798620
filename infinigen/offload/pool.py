"""A layer's KV in host memory: the pool of rows (`HostPool`) and the cache layer backed by it (`PoolStore`)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from infinigen.adapter import KVStore
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
            t0 = link.clock()
            src = self.data[: self.hwm if n is None else n]
            nbytes = src.numel() * src.element_size()
            if slot is None:
                return Fetched(src, None, nbytes, link.clock() - t0)
            start, end = link.event(timing=True), link.event(timing=True)
            with link.side():
                link.side_wait(slot.free)
                start.record(link.stream)
                dst = slot.dev[: src.numel()].view(src.shape)
                dst.copy_(src, non_blocking=link.cuda)
                end.record(link.stream)
            return Fetched(dst, None, nbytes, link.clock() - t0, end, start, slot)

        return job

    def gather_job(self, src_idx: torch.Tensor, dest: torch.Tensor | None, slot: Slot | None):
        """Rows at flat indices src_idx (m,) of (slots * b*h_kv, W), gathered on the host, then copied."""
        written, link = self.written, self.link  # writes issued later touch rows this job never reads

        def job() -> Fetched:
            t0 = link.clock()
            if written is not None:
                written.synchronize()
            m = src_idx.numel()
            nbytes = m * self.width * self.flat.element_size()
            if slot is None:
                return Fetched(self.flat.index_select(0, src_idx), dest, nbytes, link.clock() - t0)
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
            return Fetched(dst, d, nbytes, link.clock() - t0, end, start, slot)

        return job




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
        self.gathered: tuple[torch.Tensor, torch.Tensor | None] | None = None  # rows (b, h_kv, k, W), valid

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
        n = self.stored
        self.append_positions(b, hk, 1, key_states.device)
        rows = self.codec.encode(key_states, value_states)  # (b, h_kv, 1, W)
        if self.evicting:
            slot = self._free_slot()
            self.pool.scatter(rows.reshape(b * hk, -1), slot.reshape(-1))
        else:
            slot = torch.full((b, hk), n, device=key_states.device)
            self.pool.write(n, rows.reshape(1, b * hk, -1))
        self.entries["slot"] = torch.cat([self.entries["slot"], slot[..., None]], dim=-1)
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
        rows, valid = self.gathered
        keys, values = self.codec.decode(torch.cat([rows, self.fresh], dim=2))  # (b, h_kv, k + 1, d)
        if valid is None:
            return keys, values, None
        return keys, values, torch.cat([valid, valid.new_ones(*valid.shape[:2], 1)], dim=-1)[:, :, None]
