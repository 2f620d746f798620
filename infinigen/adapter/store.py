"""The cache: `KVStore`, the transformers cache layer (a `DynamicLayer`) holding exactly the KV a method keeps for
one layer, with the per-entry positions and state it evicts and reorders alongside; `new_cache` wraps one per layer
into the `Cache` a forward or `model.generate` is given.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# Only the cache classes at import time: the model classes, tokenizers and attention registries cost seconds
# to import and are imported where they are used, so a bad config is refused before any of that.
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


def _gather_seq(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (b, h, s, ...) gathered along s by index (b, h, n)."""
    extra = x.shape[3:]
    idx = index.view(*index.shape, *([1] * len(extra))).expand(*index.shape, *extra)
    return x.gather(2, idx)


class KVStore(DynamicLayer):
    """A transformers cache layer holding exactly the KV a method keeps for one layer.

    keys/values are (b, h_kv, s, d); `positions` (b, h_kv, s) holds each stored entry's token position, so a
    method that evicts per head can still say which tokens it holds. `seen` counts every token ever appended
    (what positions/masks are derived from); `stored` is what is physically kept. `reserve(n)` preallocates room
    for n entries, so appending a token writes into a buffer instead of re-allocating the cache.
    """

    def __init__(self):
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.seen = 0
        self.entries: dict[str, torch.Tensor] = {}  # per stored entry, (b, h_kv, s, ...)
        self.state: dict[str, Any] = {}
        self._room = 0
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: dict[str, torch.Tensor] = {}  # per-entry tensors' preallocated (b, h_kv, room, ...) buffers

    def reserve(self, entries: int) -> None:
        self._room = entries

    def _appended(self, name: str, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """old (b, h_kv, n, ...) with new (b, h_kv, t, ...) after it. Written into a buffer reserved for `room`
        entries while old is still that buffer's prefix (a decode step then allocates nothing and its op count
        does not grow); concatenated once something replaced it (an eviction's gather)."""
        n = 0 if old is None else old.shape[2]
        t = new.shape[2]
        buf = self._rows.get(name)
        chained = old is None or (buf is not None and old.data_ptr() == buf.data_ptr() and old.shape[3:] == buf.shape[3:]
                                  and old.dtype == buf.dtype and old.shape[:2] == buf.shape[:2])
        if not self._room or n + t > self._room or not chained:
            self._rows.pop(name, None)
            return new if old is None else torch.cat([old, new], dim=2)
        if old is None:
            buf = new.new_empty(*new.shape[:2], self._room, *new.shape[3:])
            self._rows[name] = buf
        buf[:, :, n : n + t] = new
        return buf[:, :, : n + t]

    def append_entries(self, **new: torch.Tensor) -> None:
        """Per-entry state (b, h_kv, t, ...) for the t newest entries, after what `entries` holds."""
        for name, value in new.items():
            self.entries[name] = self._appended(name, self.entries.get(name), value)

    def append_positions(self, b: int, hk: int, t: int, device) -> None:
        pos = torch.arange(self.seen, self.seen + t, device=device).expand(b, hk, t)
        self.positions = self._appended(" positions", self.positions, pos)
        self.seen += t

    def update(self, key_states, value_states, *args, **kwargs):
        b, hk, t, _ = key_states.shape
        self.append_positions(b, hk, t, key_states.device)
        n = self.stored
        if self._room and self._buffers is None and n == 0:
            self._buffers = tuple(x.new_empty(b, hk, self._room, x.shape[-1]) for x in (key_states, value_states))
        if self._buffers is None or n + t > self._room:
            self._buffers = None
            return super().update(key_states, value_states)
        kb, vb = self._buffers
        kb[:, :, n : n + t] = key_states
        vb[:, :, n : n + t] = value_states
        self.keys, self.values = kb[:, :, : n + t], vb[:, :, : n + t]
        self.device, self.is_initialized = key_states.device, True
        return self.keys, self.values

    @property
    def stored(self) -> int:
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as attention sees them, (b, h_kv, s, d)."""
        return self.keys, self.values

    def recent_keys(self, n: int) -> torch.Tensor:
        """Keys of the last n stored entries as attention sees them, (b, h_kv, n, d)."""
        return self.kv()[0][:, :, -n:]

    def selected(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a query attends when it selected `keep` (b, h_kv, past) of the entries before the current (last)
        one: (keys, values, mask (b, h_kv, 1, s) or None). Here every entry is resident, so the selection is a
        mask over them all; the offloading runtime's store returns just the gathered rows."""
        keys, values = self.kv()
        current = keep.new_ones(*keep.shape[:2], 1)
        return keys, values, torch.cat([keep, current], dim=-1)[:, :, None]

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the entries at `index` (b, h_kv, n) along the sequence axis (per head); per-entry method
        state in `entries` ((b, h_kv, s, ...) tensors) is gathered alongside."""
        self._buffers = None
        self._rows.clear()
        if self.keys is not None:
            self.keys = _gather_seq(self.keys, index)
            self.values = _gather_seq(self.values, index)
        self.positions = self.positions.gather(2, index)
        for name, value in self.entries.items():
            self.entries[name] = _gather_seq(value, index)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored + query_length, 0

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def entry_bytes(self) -> int:
        """Bytes of the per-entry bookkeeping (positions, method state) kept beside the KV."""
        tensors = list(self.entries.values()) + ([self.positions] if self.positions is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ transformers' cache operations
    # What `model.generate` may ask of a cache layer besides `update`. Beam search reorders the batch rows every
    # step (`reorder_cache`); the batch is repeated or narrowed by `batch_repeat_interleave` / `batch_select_indices`.
    # A method's per-row state must follow its keys, so every batch-indexed tensor of the store moves with them:
    # keys, values, positions, `entries`, whatever `state` holds (nested in dicts, lists, tuples) and the tensors a
    # subclass keeps as attributes, i.e. every such tensor whose first dimension is the batch. `crop` (assisted
    # decoding's rollback, a DeferredStopCheck's undo) is refused: an evicting or compressing store cannot give
    # back what it dropped.
    is_croppable = False

    def _each_row_tensor(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.positions is None:
            return
        batch = self.positions.shape[0]

        def walk(x):
            if isinstance(x, torch.Tensor):
                return fn(x) if x.dim() and x.shape[0] == batch else x
            if isinstance(x, dict):
                return {k: walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(walk(v) for v in x)
            return x

        self._buffers = None  # preallocated rows belong to the old batch order: the next append concatenates
        self._rows.clear()
        for name, value in list(vars(self).items()):
            if name not in ("_buffers", "_rows"):
                setattr(self, name, walk(value))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._each_row_tensor(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._each_row_tensor(lambda x: x[indices.to(x.device) if isinstance(indices, torch.Tensor) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each_row_tensor(lambda x: x.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(f"a KV method's cache cannot be cropped (asked to drop {abs(tokens_to_remove)} tokens): "
                             "what it evicted or compressed cannot be given back (assisted / prompt-lookup decoding "
                             "is not supported)")

    def reset(self) -> None:
        """Empty, as new: a reset cache starts another sequence."""
        self.keys = self.values = None
        self.is_initialized = False
        self.positions, self.seen = None, 0
        self.entries, self.state = {}, {}
        self._buffers = None
        self._rows = {}


def new_cache(stores: list[KVStore]) -> Cache:
    return Cache(layers=stores)


def prefix_cache() -> Cache:
    """An empty cache that keeps every layer's whole past, sliding-window layers included (a config-built cache
    would crop those to their window: a later forward's rows would then not sit at the past's length), for a
    forward whose keys and values later forwards resume from (`resume_cache`)."""
    return DynamicCache()


def resume_cache(cache: Cache, index: torch.Tensor) -> Cache:
    """A new cache holding the past of `cache`'s batch rows `index` (n,) in every layer, for a forward of n inputs
    that continue those rows' sequences; `cache` itself is left as it is (each resumed forward appends to its own)."""
    resumed = DynamicCache()
    for i, layer in enumerate(cache.layers):
        resumed.update(layer.keys.index_select(0, index), layer.values.index_select(0, index), i)
    return resumed
