"""How one layer's decode step runs in the offloading runtime, per offload kind (infinigen/runtime_needs.py
OFFLOAD_KINDS). Every executor calls the method's own decode-step code; what differs is where the KV lives and
when it crosses the link:

  resident  the method's decode step on a device cache (nothing crosses)
  held      the pool's occupied rows cross, issued one layer ahead (the next step's layer 0 at the last layer),
            land in position order as the store's keys/values, then the method's decode step runs on them
  gather    `select_indices` runs at the method's speculation point (layer i-1's attention start or end, or layer
            i's own query), the selected rows are gathered on the host and cross, then `attend_gathered` runs on
            them
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from infinigen.adapter import KVStore
from infinigen.offload.codecs import FpCodec, head_major
from infinigen.offload.link import Fetched
from infinigen.offload.pool import HostPool, PoolStore
from infinigen.rows import full_past


def decode_pool(codec, rows: torch.Tensor, b: int, hk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major rows (n, b*h_kv, W) -> K, V (b, h_kv, n, d): the codec's own pass over the pool's layout where
    it has one (a fused dequantisation), else its decode of the permuted rows (views for K|V rows)."""
    own = getattr(codec, "decode_pool", None)
    return own(rows, b, hk) if own is not None else codec.decode(head_major(rows, b, hk))


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
        self.rt.tally(i, attended=torch.full((b, hk), float(self.attended(store))), fetched=0)
        return self.method.decode_attention(session, self.layer, q, store)

    def attended(self, store: KVStore) -> int:
        """Past entries the current row attends of those `store` holds: on a local layer, those in its window
        (exact for a store that never evicts, whose entries are its positions; a bound for one that evicts)."""
        return min(store.stored - 1, full_past(self.layer, store.seen - 1))

    # ------------------------------------------------------------------ fetches
    def submit(self, job, *extra) -> None:
        self.pending = (self.link.submit(job), self.rt.timer.issue(), *extra)

    def issued(self, fetched: Fetched, *extra) -> None:
        """A fetch already on its way with nothing left for a host thread (a device program reads the pool)."""
        done: Future = Future()
        done.set_result(fetched)
        self.pending = (done, self.rt.timer.issue(), *extra)

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
        self.rt.account(i, fetched.nbytes, fetched.moved)
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
        store = PoolStore(HostPool(self.link, slots, bh, codec.width, codec.dtype), codec, evicting=slots < max_len)
        store.reserve(max_len)
        return store

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
        self.fetch(store, position=store.seen)  # ahead of the layer: its token is not stored yet

    def fetch(self, store: PoolStore, position: int) -> None:
        """The rows the token at `position` attends cross (of a local layer, those in its window)."""
        if store.evicting:  # slots are not in position order: the whole occupied range crosses
            self.submit(store.pool.prefix_job(None, self.next_landing()))
            return
        first = position - full_past(self.layer, position)  # entry n in slot n: the window's first row
        self.submit(store.pool.prefix_job(store.stored, self.next_landing(), first))

    def landed(self, fetched: Fetched, store: PoolStore) -> torch.Tensor:
        """The fetched rows with the current token's row in its slot, (slots, b*h_kv, W) on the device, so the
        attention reads past + current without concatenating the cache. CPU: the fetched rows are the pool,
        where update() already put the token."""
        pool = store.pool
        if fetched.slot is None:  # attention reads the pool itself: the current token's scatter must have landed
            pool.settle(wait=True)
            return pool.data
        buffer = fetched.slot.dev[: pool.slots * pool.bh * pool.width].view(pool.slots, pool.bh, pool.width)
        heads = torch.arange(pool.bh, device=buffer.device)
        slot = store.entries["slot"][..., -1].reshape(-1)  # (b*h_kv,) the current token's slot per head
        buffer.view(-1, pool.width).index_copy_(0, slot * pool.bh + heads, store.fresh.reshape(pool.bh, pool.width))
        return buffer

    def prepare(self, session, q, store):
        if self.pending is None:  # the first step: nothing earlier to overlap this copy with
            self.fetch(store, position=store.seen - 1)  # the token is stored: it is the row that attends

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
            store.keys, store.values = store.codec.decode(rows)  # (b, h_kv, s, d)
        else:  # a pool that never evicts holds entry n in slot n
            store.keys, store.values = decode_pool(store.codec, rows[: store.stored], b, hk)
        self.rt.tally(self.layer.index, attended=torch.full((b, hk), float(self.attended(store))), fetched=None)
        out = self.method.decode_attention(session, self.layer, q, store)
        store.keys = store.values = None
        self.release(fetched)
        return out


class Gathered:
    """What a gathering step attends, put in place by the runtime (`PoolStore.gathered`): rows (b, h_kv, k + 1, W)
    as the codec stores them, each head's selected rows in the order `select_indices` ranked them, the current
    token's last (a slot a head did not select holds a finite row, masked); valid (b, h_kv|1, k). `counts` and
    `mask` are computed once, when first read; `rows, mask = gathered` unpacks as the (rows, mask) pair it was."""

    def __init__(self, rows: torch.Tensor, valid: torch.Tensor, codec):
        self.rows, self.valid, self.codec = rows, valid, codec
        self._counts = self._mask = None

    @property
    def counts(self) -> torch.Tensor:
        """(b, h_kv): selected rows per (batch row, KV head), shared by the runtime's tally and the method's stats."""
        if self._counts is None:
            b, hk = self.rows.shape[:2]
            n = self.valid.sum(-1)
            self._counts = n if n.shape[1] == hk else n.expand(b, hk)
        return self._counts

    @property
    def mask(self) -> torch.Tensor:
        """(b, h_kv, 1, k + 1) bool: what each head attends (its valid rows and the current token)."""
        if self._mask is None:
            b, hk, k = self.rows.shape[0], self.rows.shape[1], self.valid.shape[-1]
            self._mask = torch.cat([self.valid.expand(b, hk, k), self.valid.new_ones(b, hk, 1)], dim=-1)[:, :, None]
        return self._mask

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values), each (b, h_kv, k + 1, d): the codec's decode of the rows (views for K|V rows)."""
        return self.codec.decode(self.rows)

    def __iter__(self):
        return iter((self.rows, self.mask))


class GatherExecutor(PoolExecutor):
    """The rows `select_indices` picks cross; per-entry state stays on the device. Nothing here reads a device
    value on the host: the selection's shapes are known from the step (its width), the indices reach the host
    on the gather's own copy, and the gathered rows are put in place on the device.

    The hand-off, per step: the selected pool rows, a filler for each unselected slot and one sentinel per head
    (b, h_kv, k + 1), sorted on the device (`sorted_rows`) and copied to the host, which counts and gathers the rows
    before the fillers in one sweep of the pool; the landing slot then holds, in sorted order, the gathered rows,
    stale rows for the fillers and, at the sentinels' places (the end), each head's current-token row, so one
    index_copy_ by the sort's permutation puts every row at its (head, rank) place."""

    wraps = False  # layer 0 has no earlier layer in the same step to speculate from

    def __init__(self, rt, method, layer):
        super().__init__(rt, method, layer)
        point = method.speculation_point
        self.ahead = None if point == "query" else point
        self._shaped: dict = {}  # (b, h_kv, k) -> the hand-off's buffers and landing views of that shape

    def staging_slots(self, codec, slots, bh, max_len):
        if self.rt.gather == "zero_copy" and slots < max_len:
            raise ValueError(f"gather=zero_copy reads the pool from the device, which cannot wait for the host "
                             f"thread an evicting pool's writes run on: {type(self.method).__name__} evicts "
                             f"(capacity < 1 here); use gather=host")
        width = max(1, min(slots, self.method.max_selected(max_len)))
        self.capacity = bh * width  # landing rows of the selected entries; the current token's rows follow them
        return self.rt.staging("gather", (self.capacity + bh) * codec.width, codec.dtype, gather_rows=self.capacity,
                               width=codec.width, index_slots=self.capacity + bh)

    def prefetch(self, session):
        """Speculation: select this layer's rows before its turn (its current token is not stored yet)."""
        i = self.layer.index
        self.rt.timer.mark("spec0", i)
        store = session.cache.layers[i]
        self.gather(store, *self.method.select_indices(session, self.layer, None, store, past=store.stored,
                                                       position=store.seen))
        self.rt.timer.mark("spec1", i)

    def gather(self, store: PoolStore, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Start the host gather + copy of the selected (index, valid: (b, h_kv, k), valid may be broadcast over
        the heads) rows."""
        b, hk, k = index.shape
        heads = self.heads(b * hk, index.device)  # (b, h_kv, 1)
        if store.evicting:  # pool slots are not positions: look each entry's slot up
            src = store.entries["slot"].gather(-1, index) * (b * hk) + heads
        else:  # a pool that never evicts holds entry n in slot n: its row is n * b*h_kv + head
            src = torch.add(heads, index, alpha=b * hk)
        if self.rt.gather == "zero_copy" and self.landing is not None:  # the program reads both as (b*h_kv, k) rows
            job = store.pool.zero_copy_job(src.view(b * hk, k), valid.expand(b, hk, k).reshape(b * hk, k).contiguous(),
                                           self.next_landing())
            self.issued(job, index, valid, None)
            return
        rows, order = sorted_rows(src, valid, self.sort_buffer(b, hk, k, index.device))
        self.submit(store.pool.gather_job(rows, self.next_landing()), index, valid, order)

    def heads(self, bh: int, device) -> torch.Tensor:
        """(b, h_kv, 1) flat head index, made once: every step's gather adds it (one op less per step)."""
        if getattr(self, "_heads", None) is None or self._heads.numel() != bh:
            self._heads = torch.arange(bh, device=device).view(-1, self.layer.num_kv_heads, 1)
        return self._heads

    def sort_buffer(self, b: int, hk: int, k: int, device) -> dict:
        """What `sorted_rows` sorts, made once per shape (a new shape drops the last one's): a (b, h_kv, k + 1) long
        buffer whose slots [0, k) receive each step's rows (or the filler) and slot k the head's sentinel, above
        the filler and in head order (both above every pool row); its views, and the filler."""
        key = (b, hk, k)
        if "sort" not in self._shaped.get(key, {}):
            bh = b * hk
            buf = torch.empty(b, hk, k + 1, dtype=torch.long, device=device)
            buf[..., k:] = FILLER + 1 + torch.arange(bh, device=device).view(b, hk, 1) - bh
            self._shaped = {key: {"sort": buf.view(-1), "rows": buf[..., :k],
                                  "filler": torch.tensor(FILLER - bh, device=device)}}
        return self._shaped[key]

    def prepare(self, session, q, store):
        if self.pending is None:  # the selection needs this layer's own query: the gather starts here
            self.gather(store, *self.method.select_indices(session, self.layer, q, store, past=store.stored - 1,
                                                           position=store.seen - 1))

    def decode(self, session, q, store):
        fetched, index, valid, order = self.take(store)
        store.gathered = Gathered(self.in_place(fetched, store, order, index.shape[-1]), valid, store.codec)
        out = self.method.attend_gathered(session, self.layer, q, store, index, valid)
        n = store.gathered.counts
        store.gathered = None
        self.release(fetched)
        self.rt.tally(self.layer.index, attended=n, fetched=n)
        self.rt.gathers.append((fetched.nbytes, fetched.gather_s))
        return out

    def in_place(self, fetched: Fetched, store: PoolStore, order: torch.Tensor | None, k: int) -> torch.Tensor:
        """The landed rows at their (head, rank) places, (b, h_kv, k + 1, W) with each head's current-token row last,
        in a buffer the layers share (one index_copy_ on the device). The landing slot's rows are in the order the
        hand-off sorted them (`order`: which (head, rank) each is), or, from a device program (order None), at
        (head, rank) already, the current tokens' after them."""
        b, hk = store.fresh.shape[:2]
        bh, w = b * hk, store.codec.width
        n = bh * (k + 1)
        if fetched.slot is None:  # the pool's own rows (host == device): gathered, fillers, then the current tokens'
            m = fetched.rows.shape[0]
            source = torch.cat([fetched.rows, fetched.rows.new_zeros(bh * k - m, w), store.fresh.reshape(bh, w)])
        else:
            views = self.landing_views(fetched.slot, b, hk, k, w)
            views["fresh"].copy_(store.fresh)
            source = views["rows"]
        if order is None:
            order = self.padded_order(b, hk, k, source.device)
        rows, shaped = self.rt.gathered_rows(n, w, source.dtype, source.device, (b, hk, k + 1, w))
        rows.index_copy_(0, order, source)
        return shaped

    def landing_views(self, slot, b: int, hk: int, k: int, w: int) -> dict:
        """A landing slot's first bh x (k + 1) rows, and the current tokens' (the last bh of them) as (b, h_kv, 1, W):
        views made once per slot and shape."""
        cache = self._shaped.setdefault((b, hk, k), {})
        key = ("landing", id(slot))
        if key not in cache:
            bh = b * hk
            rows = slot.dev[: bh * (k + 1) * w].view(bh * (k + 1), w)
            cache[key] = {"rows": rows, "fresh": rows[bh * k :].view(b, hk, 1, w)}
        return cache[key]

    def padded_order(self, b: int, hk: int, k: int, device) -> torch.Tensor:
        """A device program's landing: row (head, j) at head x k + j, then the current tokens': where each goes."""
        cache = self._shaped.setdefault((b, hk, k), {})
        if "padded" not in cache:
            bh = b * hk
            heads = torch.arange(bh, device=device)
            selected = (heads[:, None] * (k + 1) + torch.arange(k, device=device)).view(-1)
            cache["padded"] = torch.cat([selected, heads * (k + 1) + k])
        return cache["padded"]


# Above every pool row (a pool never holds 2^31 rows): unselected slots sort after the selected ones, and the
# current tokens' sentinels (FILLER + 1 .. FILLER + b*h_kv after subtracting b*h_kv) after those; int32 on the host
FILLER = torch.iinfo(torch.int32).max


def sorted_rows(src: torch.Tensor, valid: torch.Tensor, buffers: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected pool rows of src (b, h_kv, k) where valid, ascending, then a filler per unselected slot, then
    each head's sentinel ((b*h_kv*(k + 1),) long), and the permutation that sorted them (which (head, slot) each
    sorted entry is): the host gathers the rows in one sweep of the pool (~1.3x the rate of the heads' rows one head
    after another on a CPU here), and the device, which sorted them, knows where each landed. Static shapes: the
    count stays on the device."""
    torch.where(valid, src, buffers["filler"], out=buffers["rows"])
    return buffers["sort"].sort()


EXECUTORS = {"resident": ResidentExecutor, "held": HeldExecutor, "gather": GatherExecutor}
