"""How one layer's decode step runs in the offloading runtime, per offload kind (infinigen/contract.py
OFFLOAD_KINDS). Every executor calls the method's own decode-step code; what differs is where the KV lives and
when it crosses the link:

  resident  the method's decode step on a device cache (nothing crosses)
  held      the pool's occupied rows cross, issued one layer ahead (the next step's layer 0 at the last layer),
            land in position order as the store's keys/values, then the method's decode step runs on them
  gather    `select` runs at the method's speculation point (layer i-1's attention start or end, or layer i's own
            query), the selected rows are gathered on the host and cross, then `attend_selected` runs on them
"""

from __future__ import annotations

import torch

from infinigen.adapter import KVStore
from infinigen.offload.codecs import FpCodec, head_major
from infinigen.offload.link import Fetched
from infinigen.offload.pool import HostPool, PoolStore


class Executor:
    """One layer's decode steps. `ahead` is when its fetch can start before the layer's attention (None: never),
    `wraps` whether layer 0's fetch may be issued at the previous step's last layer."""

    ahead: str | None = None
    wraps = False

    def __init__(self, rt, method, layer):
        self.rt, self.method, self.layer, self.link = rt, method, layer, rt.link
        self.pending: tuple | None = None  # (future, fetch id, what decode needs besides the rows)

    def new_store(self, batch: int, max_len: int, dtype) -> KVStore:
        store = self.method.new_store(self.layer)
        store.reserve(max_len)
        return store

    def after_prefill(self, store: KVStore) -> None:
        """The method's prefill (dense attention + its after_prefill) has filled `store`."""

    def prefetch(self, session) -> None:
        raise NotImplementedError

    def prepare(self, session, q, store: KVStore) -> None:
        """Start this layer's fetch if nothing started it ahead (called before the next layer's prefetch, so at
        most two fetches are ever in flight: the landing slots alternate)."""

    def decode(self, session, q, store: KVStore) -> torch.Tensor:
        i, b, hk = self.layer.index, q.shape[0], self.layer.num_kv_heads
        self.rt.tally(i, attended=torch.full((b, hk), float(store.stored - 1)), fetched=0)
        return self.method.decode_attention(session, self.layer, q, store)

    # ------------------------------------------------------------------ fetches
    def submit(self, job, *extra) -> None:
        self.pending = (self.link.submit(job), self.rt.timer.issue(), *extra)

    def take(self, store: PoolStore) -> tuple:
        """Wait for this layer's fetch: (Fetched, *extra)."""
        i = self.layer.index
        fut, fid, *extra = self.pending
        self.pending = None
        self.rt.timer.need(fid)
        self.rt.timer.mark("wait0", i)
        fetched = fut.result()
        self.link.compute_wait(fetched.ready)
        self.rt.timer.mark("wait1", i)
        store.pool.settle()
        self.rt.timer.landed(fid, fetched)
        self.rt.account(i, fetched.nbytes, fetched.rows.numel() // fetched.rows.shape[-1])
        return (fetched, *extra)

    @staticmethod
    def release(fetched: Fetched) -> None:
        if fetched.slot is not None:
            fetched.slot.free.record()  # the next copy into this slot waits for the attention queued above


class ResidentExecutor(Executor):
    """The method's decode step on its own decode-mode cache, kept on the device."""


class PoolExecutor(Executor):
    """The layer's KV in a host pool of `max_held` rows, each row as the method's codec stores it."""

    def new_store(self, batch, max_len, dtype):
        codec = self.method.codec(self.layer, dtype) or FpCodec(self.layer.head_dim, dtype)
        slots = min(max_len, self.method.max_held(max_len))
        bh = batch * self.layer.num_kv_heads
        self.landing = self.staging_slots(codec, slots, bh, max_len)
        return PoolStore(HostPool(self.link, slots, bh, codec.width, codec.dtype), codec, evicting=slots < max_len)

    def staging_slots(self, codec, slots: int, bh: int, max_len: int):
        raise NotImplementedError

    def after_prefill(self, store):
        store.to_host()

    def next_landing(self):
        """The landing slot of this layer's next fetch (None without copies: rows stay where they are)."""
        return None if self.landing is None else self.rt.next_slot(self.landing)


class HeldExecutor(PoolExecutor):
    """Every held entry crosses each step (the whole occupied slot range of an evicting pool)."""

    ahead = "attention_start"
    wraps = True

    def staging_slots(self, codec, slots, bh, max_len):
        return self.rt.staging("held", slots * bh * codec.width, codec.dtype)

    def prefetch(self, session):
        store = session.cache.layers[self.layer.index]
        self.submit(store.pool.prefix_job(None if store.evicting else store.stored, self.next_landing()))

    def landed(self, fetched: Fetched, store: PoolStore) -> torch.Tensor:
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

    def prepare(self, session, q, store):
        if self.pending is None:  # the first step: nothing earlier to overlap this copy with
            self.prefetch(session)

    def decode(self, session, q, store):
        b, hk = q.shape[0], self.layer.num_kv_heads
        fetched, = self.take(store)
        rows = self.landed(fetched, store)
        if store.evicting:  # (slots, b*h_kv, W) in slot order -> the held entries in position order, (b, h_kv, n, W)
            bh, width = b * hk, rows.shape[-1]
            # row (slot, head) of the slot-major pool, copied W elements at a time (a gather over the permuted
            # pool copies element by element: 20 ms of a 100 ms step at 1 x 2048)
            flat = store.entries["slot"].reshape(bh, -1) * bh + torch.arange(bh, device=rows.device)[:, None]
            rows = rows.reshape(-1, width).index_select(0, flat.view(-1)).view(b, hk, -1, width)
        else:  # a pool that never evicts holds entry n in slot n
            rows = head_major(rows[: store.stored], b, hk)
        store.keys, store.values = store.codec.decode(rows)  # (b, h_kv, s, d)
        self.rt.tally(self.layer.index, attended=torch.full((b, hk), float(store.stored - 1)), fetched=None)
        out = self.method.decode_attention(session, self.layer, q, store)
        store.keys = store.values = None
        self.release(fetched)
        return out


class GatherExecutor(PoolExecutor):
    """The rows `select` picks cross; per-entry state stays on the device."""

    wraps = False  # layer 0 has no earlier layer in the same step to speculate from

    def __init__(self, rt, method, layer):
        super().__init__(rt, method, layer)
        point = method.speculation_point
        self.ahead = None if point == "query" else point

    def staging_slots(self, codec, slots, bh, max_len):
        rows = bh * max(1, min(slots, self.method.max_selected(max_len)))
        return self.rt.staging("gather", rows * codec.width, codec.dtype, gather_rows=rows, width=codec.width)

    def prefetch(self, session):
        """Speculation: select this layer's rows before its turn (its current token is not stored yet)."""
        i = self.layer.index
        self.rt.timer.mark("spec0", i)
        store = session.cache.layers[i]
        keep = self.method.select(session, self.layer, None, store, past=store.stored, position=store.seen)
        self.gather(store, keep)
        self.rt.timer.mark("spec1", i)

    def gather(self, store: PoolStore, keep: torch.Tensor) -> None:
        """Start the host gather + copy of the `keep` (b, h_kv, past) rows, packed per head in position order."""
        b, hk, _ = keep.shape
        dev = keep.device
        n = keep.sum(-1)  # (b, h_kv)
        k = int(n.max()) if n.numel() else 0
        order = torch.argsort(keep.to(torch.uint8), dim=-1, descending=True, stable=True)[..., :k]  # kept first
        valid = torch.arange(k, device=dev) < n[..., None]  # (b, h_kv, k)
        heads = torch.arange(b * hk, device=dev).view(b, hk, 1)
        src = store.entries["slot"].gather(-1, order) * (b * hk) + heads  # flat pool rows (b, h_kv, k)
        src, mask = torch.stack([src, valid.long()]).cpu()
        mask = mask.bool()
        if bool(mask.all()):
            src_idx, dest = src.reshape(-1), None
        else:
            src_idx, dest = src[mask], torch.arange(b * hk * k).view(b, hk, k)[mask]
        self.submit(store.pool.gather_job(src_idx, dest, self.next_landing()), keep, valid, k)

    def prepare(self, session, q, store):
        if self.pending is None:  # the selection needs this layer's own query: a synchronous gather
            keep = self.method.select(session, self.layer, q, store, past=store.stored - 1, position=store.seen - 1)
            self.gather(store, keep)

    def decode(self, session, q, store):
        b, hk = q.shape[0], self.layer.num_kv_heads
        fetched, keep, valid, k = self.take(store)
        w = store.codec.width
        if fetched.dest is None:
            rows = fetched.rows.view(b, hk, k, w)
        else:
            rows = fetched.rows.new_zeros(b * hk * k, w).index_copy_(0, fetched.dest, fetched.rows).view(b, hk, k, w)
        store.gathered = (rows, None if fetched.dest is None else valid)
        out = self.method.attend_selected(session, self.layer, q, store, keep)
        store.gathered = None
        self.release(fetched)
        n = keep.sum(-1)
        self.rt.tally(self.layer.index, attended=n, fetched=n)
        return out


EXECUTORS = {"resident": ResidentExecutor, "held": HeldExecutor, "gather": GatherExecutor}
