"""A selective-attention decode step's selection in static shapes: the speculated (or true) query against a layer's
partial key cache, the alpha rule, the ranking and top-k, as few ops as the math needs and none that reads a value
back, so that on CUDA it can run as one captured graph (`CapturedSelection`; `capture=graph|compile`).

Layouts (b batch rows, h_kv KV heads, g query heads per KV head, c score channels, L = the longest sequence):

    query      (b*h_kv, g, c + 1)  scaled by the layer's logit scale; channel c is 1
    keys       (b, h_kv, L, c + 1) allocated once per store (`StepBuffers`); channel c is 0 for an entry the row may
               fetch (written) and the score dtype's minimum for the rest, so one batched product gives every
               unwritten entry a score no threshold counts and no softmax weighs, with no mask op per step
    thresholds (W + 1,) long       entry i of the top W is kept iff thresholds[i] <= the layer's count (below); the
               last is 0: the current token, always attended
    keep       (b, h_kv, W + 1)    the top W's valid ranks, then the current token: the attention's mask as it is,
               and `valid` = keep[..., :W] for the gather

InfiniGen's dynamic count, per batch row: n = min(floor(sum over the layer's h_kv x g query heads of the entries
within alpha of that head's best / (h_kv x g)), limit), limit = the row's budget cap (at most what it holds). Rank i
(best first) is fetched iff i < n, i.e. iff (i + 1) x h_kv x g <= the summed count and i < limit: `thresholds`
holds (i + 1) x h_kv x g below the limit and the largest long above it, so one comparison gives `valid` (alpha = inf:
0 below the limit, every entry counts). The top W is taken at the widest cap of the sequence, W = the budget cap at
its last position, whatever this step's limit: the shapes are the same every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infinigen.adapter import KVStore
from infinigen.attention import attend_rows, score_dtype, widen
from infinigen.rows import full_past
from infinigen.shared.select_evict import reduce_query_heads

BIG = torch.iinfo(torch.long).max  # a threshold no count reaches


def speculated_query(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rope: torch.Tensor | None,
                     proj: torch.Tensor | None, one: torch.Tensor | None, hk: int, g: int, norm=None) -> torch.Tensor:
    """InfiniGen's speculated partial query in one projection: x (b, hidden) -> (b*h_kv, g, c + 1) in the score dtype.

    Without rotary embeddings (OPT) `weight` (hidden, h*(c + 1)) and `bias` already hold each head's skewed partial
    columns, the query scale and the constant channel c (a zero column, bias 1). With them, `weight` is the layer's
    own query weight (hidden, h*d) (transposed, not copied), `rope` (b, 1, 1, 2, d) = [cos | sin with its halves
    swapped] in the score dtype and `proj` (b*h_kv, 2d, c + 1) = [P; J^T P] x the logit scale, where P is the skew
    and column choice and J rotate_half: rope(y) . P = (y * cos) . P + (y * sin') . J^T P, so the rotation folds
    into the projection and rotate_half is never computed. `one` (1, 1, c + 1) adds the constant channel.
    `norm` (QK-norm layers): applied to each (b, h, 1, d) head before the rotation."""
    b = x.shape[0]
    y = torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)  # (b, h * w)
    if rope is None:
        return y.view(b * hk, g, -1).to(torch.promote_types(y.dtype, torch.float32))
    d = rope.shape[-1]
    if norm is not None:
        y = norm(y.view(b, hk * g, 1, d))
    z = y.view(b, hk, g, 1, d) * rope  # (b, hk, g, 2, d): y * cos, y * sin'
    return torch.baddbmm(one, z.view(b * hk, g, 2 * d), proj)  # (b*hk, g, c + 1)


def select_step(query: torch.Tensor, keys_t: torch.Tensor, live: torch.Tensor, thresholds: torch.Tensor, *,
                alpha: float, width: int, batch: int, reduce: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks every entry of the static partial key cache and keeps the top `width`: query (b*h_kv, g, c + 1),
    keys_t (b*h_kv, c + 1, L), live (b*h_kv, L) (0 for a written entry, the minimum for the rest: the keys' channel
    c), thresholds (b, h_kv, width + 1) long (a view of (width + 1,)). Returns the index (b, h_kv, width) of the top
    `width` entries per (row, KV head), best first, and keep (b, h_kv, width + 1): which of them are fetched, then
    the current token (True)."""
    scores = torch.bmm(query, keys_t)  # (b*hk, g, L): unwritten entries score the minimum
    if alpha == float("inf"):
        count = 0  # every rank below the limit is fetched (its thresholds are 0)
    else:
        top = scores.amax(-1, keepdim=True)  # (b*hk, g, 1)
        # per batch row, over its h_kv x g query heads: the entries within alpha of each head's best
        count = (scores > top - alpha).view(batch, 1, -1).sum(-1, keepdim=True)  # (b, 1, 1)
    keep = thresholds <= count  # (b, hk, width + 1): rank i kept iff (i + 1) x hk x g <= count and i < limit
    agg = reduce_query_heads(scores, reduce, dim=1)  # (b*hk, width-or-more entries)
    # a written entry's softmax weight may underflow to the 0 an unwritten one gets: `live` ranks those last
    index = (agg + live).topk(width, dim=-1).indices  # (b*hk, width), best first
    return index.view(batch, -1, width), keep


def thresholds(limit: int, width: int, heads: int, finite: bool, device) -> torch.Tensor:
    """(width + 1,) long: (i + 1) x heads (0 with alpha = inf) for the ranks i below `limit`, the largest long
    above, then 0 (the current token)."""
    rank = torch.arange(width + 1, device=device)
    return torch.where(rank < limit, (rank + 1) * heads if finite else 0, BIG).index_fill_(0, rank[-1:], 0)


@dataclass
class StepBuffers:
    """Views of one layer's static partial key cache (b, h_kv, L, c + 1), allocated once per store (its batch and
    longest sequence) with every entry unwritten (`new`)."""

    keys: torch.Tensor

    def __post_init__(self):
        b, hk, L, c1 = self.keys.shape
        flat = self.keys.view(b * hk, L, c1)
        self.rows = flat  # (b*hk, L, c + 1): where fresh partial keys are written
        self.keys_t = flat.transpose(1, 2)  # (b*hk, c + 1, L)
        self.live = flat[..., -1]  # (b*hk, L)

    @staticmethod
    def new(b: int, hk: int, length: int, channels: int, dtype, device) -> torch.Tensor:
        keys = torch.zeros(b, hk, length, channels + 1, dtype=dtype, device=device)
        keys[..., -1] = torch.finfo(dtype).min
        return keys


class CapturedSelection:
    """`speculated_query` + `select_step` of one layer on a CUDA device as one CUDA graph (capture "compile": the
    function compiled with torch.compile first, its kernels fused), replayed once per step: the host copies the
    speculation input and reads nothing back. Static inputs: `x` (b, hidden) (copied in), the rotary factors
    and the thresholds (shared buffers the caller updates in place), the layer's weights and `StepBuffers`.
    graph=False runs the same static-buffer calls eagerly (any device; what the tests check on a CPU)."""

    def __init__(self, fn, x: torch.Tensor, capture: str = "graph", graph: bool = True):
        self.x = torch.empty_like(x)
        self.x.copy_(x)
        if capture == "compile":
            fn = torch.compile(fn, fullgraph=True, dynamic=False)
        self.fn = fn
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.graph = None
        if not graph:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and compilation) outside the capture, as CUDA graphs require
            for _ in range(2):
                fn(self.x)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the runtime's link workers keep issuing copies on their own streams while this captures
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = fn(self.x)

    def __call__(self, x: torch.Tensor):
        self.x.copy_(x)
        if self.graph is None:
            return self.fn(self.x)
        self.graph.replay()
        return self.out


class StaticStep:
    """The static decode step of a selective-attention method (`SelectiveAttention`, which mixes it in): where it
    applies (`static_step`), its buffers, its selection through `select_step` and its attention over the gathered
    rows. Both paths select the same entries (tests/test_infinigen_step.py)."""

    def static_step(self, session, layer) -> bool:
        """Whether `layer`'s decode steps select through `step.select_step`, over buffers allocated once per store
        (`StepBuffers`) with the same shapes every step: where entry n stays entry n (a pool that never evicts), no
        window moves over the candidates (a global layer) and the longest sequence is known (the buffers' length).
        The rest take the general path (`_rank_step`); both select the same entries (tests/test_infinigen_step.py)."""
        return (session.mode == "decode" and session.max_len > 0 and layer.sliding_window is None
                and self.pool_size(session) is None
                and (self.budget_of, self.threshold_head, self.current_token) == ("prefix", "own", "kept"))

    def step_buffers(self, session, layer, store: KVStore) -> StepBuffers:
        """The layer's static partial key cache: the tensor is per-entry state of the store (`entries`, its first
        `state["step_written"]` rows written: a store reset drops it, a beam reorder moves its rows with the batch,
        and the runtime counts its bytes), its views here, rebuilt when the tensor was replaced."""
        b, hk = store.positions.shape[:2]
        keys = store.entries.get("step_keys")
        if keys is None or keys.shape[0] != b:
            keys = store.entries["step_keys"] = StepBuffers.new(
                b, hk, session.max_len, int(self.score_channels(layer)), score_dtype(layer.q_proj.weight.dtype),
                store.positions.device)
            store.state["step_written"] = 0
        views = self._views.get(layer.index)
        if views is None or views.keys is not keys:
            views = self._views[layer.index] = StepBuffers(keys)
        return views

    def static_select(self, session, layer, q, store, past, position) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, valid), each (b, h_kv, W), W = `max_selected` of the longest sequence: the ranks below the row's
        count and budget cap are valid (host ints set the cap; nothing is read back)."""
        buf = self.step_buffers(session, layer, store)
        if store.state["step_written"] != past:
            raise RuntimeError(f"layer {layer.index}: {store.state['step_written']} partial keys written, the row "
                               f"ranks {past} entries")
        b, hk = buf.keys.shape[:2]
        width = self.max_selected(session.max_len)
        thr = self.step_thresholds(self._width(session, layer, past, position), (b, hk, width + 1), layer.num_heads,
                                   buf.keys.device)
        index, keep = self.step_select(session, layer, q, buf, thr, width)
        self._keep[layer.index] = keep
        return index, keep[..., :width]

    def step_select(self, session, layer, q, buf: StepBuffers, thr: torch.Tensor, width: int):
        """`select_step` of this layer's query: the top-`width` index and keep."""
        return select_step(self.step_query(session, layer, q), buf.keys_t, buf.live, thr, alpha=self.alpha,
                           width=width, batch=buf.keys.shape[0], reduce=self.gqa_reduce)

    def step_thresholds(self, limit: int, shape, heads: int, device) -> torch.Tensor:
        """The (width + 1,) thresholds of `step.thresholds` viewed as `shape` (b, h_kv, width + 1), one buffer per
        shape, rewritten in place (a captured graph reads it) only when the row's cap changes (every 1 / budget
        positions); heads: the layer's query heads."""
        finite = not math.isinf(self.alpha)
        key = (tuple(shape), heads, finite, device)
        entry = self._thresholds.get(key)
        if entry is None:
            t = thresholds(limit, shape[-1] - 1, heads, finite, device)
            entry = self._thresholds[key] = [limit, t, t.expand(*shape)]
        elif entry[0] != limit:
            entry[1].copy_(thresholds(limit, shape[-1] - 1, heads, finite, device))
            entry[0] = limit
        return entry[2]

    def step_query(self, session, layer, q) -> torch.Tensor:
        """(b*h_kv, g, c + 1) in the score dtype: `score_queries` scaled by the logit scale, then the constant channel
        the static keys' liveness channel is dotted with (a subclass may compute it in fewer ops)."""
        qs = widen(self.score_queries(session, layer, q) * layer.logit_scale)  # (b, hk, g, 1, c)
        b, hk, g = qs.shape[:3]
        key = (b * hk, g, qs.dtype, qs.device)
        if key not in self._ones:
            self._ones[key] = torch.ones(b * hk, g, 1, dtype=qs.dtype, device=qs.device)
        return torch.cat([qs.reshape(b * hk, g, -1), self._ones[key]], dim=-1)

    def step_keys(self, layer, k: torch.Tensor, out: torch.Tensor) -> None:
        """Writes the score keys of k (b, h_kv, n, d) into out (b*h_kv, n, c + 1), the liveness channel c at 0 (a
        subclass may compute them in fewer ops)."""
        keys = widen(self.score_keys(layer, k))  # (b, hk, n, c)
        out[..., :-1].copy_(keys.reshape(out.shape[0], -1, keys.shape[-1]))
        out[..., -1].zero_()

    def attend_gathered(self, session, layer, q, store, index, valid):
        """A static step attends the gathered rows with its selection's keep (the valid ranks, then the current
        token) as the mask, and records its statistics from the runtime's counts: no mask over the past."""
        if not self.static_step(session, layer):
            return super().attend_gathered(session, layer, q, store, index, valid)
        self.before_step(session, layer, store)  # the current token's partial key, for the next step's selection
        keys, values = store.gathered.kv()  # (b, hk, W + 1, d)
        out = attend_rows(q, keys, values, self._keep[layer.index], layer.logit_scale)
        n = store.gathered.counts  # (b, hk)
        full = full_past(layer, store.seen - 1) + 1
        self.stats.add(layer.index, "kv_fraction", n, offset=1, scale=1 / full)
        self.record_kept(layer, n, full, offset=1)
        self.stats.add(layer.index, "selected", n[:, :1])
        # after_step has nothing else to do here: no pool evicts, and recall needs every key (decode mode only)
        return out

