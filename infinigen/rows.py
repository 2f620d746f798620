"""Which (query row, KV entry) pairs attention computes: sim mode's and the prefill's chunks of query rows (so memory
stays O(heads x chunk x t), never O(heads x t^2)), a local layer's window (`full_past`, `in_window`: what the model's
own attention lets a row see, which kv_fraction counts against), and a selection's index list as a mask
(`keep_mask`).
"""

from __future__ import annotations

from typing import Iterator

import torch

from infinigen.adapter import AttentionLayer, KVStore

# Query rows attended at once in sim mode and in the decode-mode prefill: a sequence is split into SIM_CHUNKS equal
# chunks of rows, each at most SIM_CHUNK rows (longer sequences: more chunks of SIM_CHUNK rows) and at least
# SIM_CHUNK / SIM_CHUNKS (shorter sequences: fewer chunks). So a chunk holds at most SIM_CHUNK x t (row, key)
# pairs (memory linear in t, never t^2); the ops a forward dispatches per chunk are the same at every length from
# SIM_CHUNK to SIM_CHUNK x SIM_CHUNKS tokens and grow by whole chunks of SIM_CHUNK rows beyond; and each chunk's
# rows see only the keys up to its last row (with 8 chunks, 9/16 of the (t, t) pairs are computed).
SIM_CHUNK = 1024
SIM_CHUNKS = 8


def chunk_rows(t: int) -> int:
    """Rows per sim chunk of a t-row sequence: t / SIM_CHUNKS rounded up, within [SIM_CHUNK / SIM_CHUNKS, SIM_CHUNK]."""
    return min(SIM_CHUNK, max(-(-t // SIM_CHUNKS), -(-SIM_CHUNK // SIM_CHUNKS), 1))


def row_chunks(t: int, split_at: int = 0) -> Iterator[tuple[int, int]]:
    """(r0, r1) query-row chunks of `chunk_rows(t)` rows covering 0..t; none straddles row `split_at` (so a chunk
    is either all dense prefill rows or all decoded rows). SIM_CHUNK is read at call time: tests shrink it to cross
    chunk boundaries on short sequences."""
    size = chunk_rows(t)
    for lo, hi in ((0, min(max(split_at, 0), t)), (min(max(split_at, 0), t), t)):
        for r0 in range(lo, hi, size):
            yield r0, min(hi, r0 + size)


def chunk_allowed(allowed: torch.Tensor, r0: int, r1: int, offset: int, causal: bool = False) -> torch.Tensor:
    """Rows r0..r1-1 of the (b|1, 1, t, s) mask, cut after the last key any of them may see: with a causal mask
    that is key offset + r1 - 1, so a chunk costs what it attends, and the later columns are never built.
    causal: the mask is known to be plain causal (no device value is read to find out)."""
    rows = allowed[..., r0:r1, :]  # (b|1, 1, r, s)
    end = offset + r1
    if not causal and end < rows.shape[-1] and bool(rows[..., end:].any()):
        end = rows.shape[-1]  # not causal (never the case for the models here): keep every key
    return rows[..., :end]


def full_past(layer: AttentionLayer, position):
    """Earlier positions the model's own attention lets the row at `position` (an int, or a tensor of them) see on
    `layer`: all of them on a global layer, the W - 1 before it on a local layer of window W."""
    window = layer.sliding_window
    if window is None:
        return position
    return min(position, window - 1) if isinstance(position, int) else position.clamp(max=window - 1)


def in_window(layer: AttentionLayer, store: KVStore, position: int, past: int | None = None) -> torch.Tensor | None:
    """(b, h_kv, n) bool: which of the store's first `past` entries (all of them: None) the row at `position` may
    attend on a local layer, by each entry's position; None where the layer lets it see every one (a global layer,
    or a row whose window still reaches position 0). Host ints in, nothing read back."""
    start = position - full_past(layer, position)
    if start == 0:
        return None
    return (store.positions if past is None else store.positions[..., :past]) >= start


def count_true(mask: torch.Tensor) -> torch.Tensor:
    """(..., n) bool -> (...,) int32: how many are True, summed as bytes (torch's bool sum takes a kernel ~1.5x
    slower on CPU; the count is the same)."""
    return mask.view(torch.uint8).sum(-1, dtype=torch.int32)


def keep_mask(idx: torch.Tensor, valid: torch.Tensor, past: int) -> torch.Tensor:
    """(..., k) selected entries -> (..., past) bool: a column past collects the unkept ones, so duplicates
    among them never race a kept entry's write."""
    keep = torch.zeros(*idx.shape[:-1], past + 1, dtype=torch.bool, device=idx.device)
    return keep.scatter_(-1, torch.where(valid, idx, past), True)[..., :past]

