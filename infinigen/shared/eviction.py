"""Sim mode of the sequential evictions (H2O, TOVA): the decoded rows replayed in order, each row's step a few ops
of static shape that read nothing back.

Decode mode evicts one entry per step once a budget binds, and which one depends on every earlier step's
attention, so sim mode replays the rows in order. What a row does is known on the host before anything runs (the
budgets are host arithmetic): a `Schedule` lists per row the first key past its eviction candidates and whether
it evicts. The rows go in blocks of `block_rows()`; a block's logits against the keys its rows can see (c = its
last row + 1) go into one float32 buffer, laid out per (batch, KV head) n of N = b x h_kv:

    [ pad: c x -inf | state: c | row 0 head 0: c | row 0 head 1: c | ... | row r-1 head g-1: c ]

`state` is the method's value per key (H2O: minus the accumulated attention; TOVA: 0 held, -inf evicted). An
evicted key is -inf in the state and in every logit row, so every later row's softmax gives it exactly 0. A row:

    p = softmax(its logits)                              (N, g, c)
    H2O: state -= reduce(p) / TOVA: score = state - sum(p)   one baddbmm (max, mean: two ops)
    d = argmax(window)                                   (N, 1): the least attended candidate, earliest on ties
    index_put(shifted, d, -inf)                          evicts d from the state and from every row of the block

The window and the shifted view are strided views of the buffer starting o floats in (o: the first key past the
candidates): the window's first c - o elements are pad, so the argmax runs over keys 0..o-1 with no mask (an
evicted key's -inf loses to any candidate), and column d of the shifted view is one key in the state and in every
logit row. All of a block's views come from one as_strided + unbind each, so a row dispatches four ops when it
evicts and H2O's one or two (TOVA's none) when it does not: the op count per row does not depend on t.

`capture` ("graph" or "compile") runs the same replay on a CUDA device through `CapturedReplay`: one static-shape
step (device-side row counter, the schedule as device vectors), captured as a CUDA graph of a whole block and
replayed once per block; "compile" first compiles the step with torch.compile. Off CUDA it falls back to the
eager replay above (identical results; `capture_used` says which ran).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from infinigen import rows as chunks  # its SIM_CHUNK read at call time (tests shrink it)

NEG = float("-inf")
BLOCK = 256  # decoded rows per block: their logits are held at once, (N, r x g, c) float32
CAPTURE = ("none", "graph", "compile")


def block_rows() -> int:
    """Rows per block: BLOCK, or fewer when tests shrink infinigen.rows.SIM_CHUNK (read at call time) to cross
    blocks."""
    return max(1, min(BLOCK, chunks.SIM_CHUNK))


@contextmanager
def one_thread():
    """The row loop runs thousands of small ops per layer: on CPU, OpenMP fork/join costs more than their work
    (milliseconds each when the cores are shared), so they run on one thread; restored on exit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_capture(capture: str) -> None:
    if capture not in CAPTURE:
        raise ValueError(f"capture must be one of {CAPTURE}, got {capture!r}")


@dataclass
class Schedule:
    """What each decoded row does, known on the host before any of them runs: rows (their sequence positions),
    per row the window offset (keys 0..offset-1 are its eviction candidates) and whether it evicts one entry."""

    rows: range
    offsets: list[int] = field(default_factory=list)
    evicts: list[bool] = field(default_factory=list)

    def add(self, offset: int, evicts: bool) -> None:
        self.offsets.append(offset)
        self.evicts.append(evicts)


@dataclass
class Replay:
    """One layer's replay. q (b, h, t, d) and k (b, h_kv, first + t, d) in the dtype logits are computed in (the model's
    for H2O, as its decode step; float32 at least for TOVA); logits are (q . k) x scale, then float32.
    state (N, t) float32 and last_row (N, t) long are updated in place. kind: "h2o" (the state accumulates minus
    reduce(p) every row) or "tova" (evicting rows rank by state - sum(p)); reduce: "sum" | "max" | "mean".
    window: a local layer's sliding window W (None: a global layer): row i's logits of keys before i - W + 1 are
    -inf, as the model's own attention and decode mode's step (`infinigen.rows.in_window`) see them: those keys get
    probability 0 (H2O accumulates nothing for them; TOVA ranks them least attended)."""

    q: torch.Tensor
    k: torch.Tensor
    scale: float
    state: torch.Tensor
    last_row: torch.Tensor
    kind: str
    reduce: str = "sum"
    window: int | None = None
    first: int = 0  # the sequence position of q's row 0 (> 0: rows resumed after a prefix, whose keys k holds)

    def __post_init__(self):
        b, h, t, d = self.q.shape
        self.hk = self.k.shape[1]
        self.g, self.n = h // self.hk, b * self.hk
        # (b, h_kv, t, g, d): a block's rows are a slice, reshaped (one copy) to (N, r x g, d) in (row, head) order
        self.qr = self.q.view(b, self.hk, self.g, t, d).transpose(2, 3)
        self.kk = self.k.reshape(self.n, -1, d)  # (N, t, d)
        dev = self.q.device
        self.nidx = torch.arange(self.n, device=dev)[:, None]  # (N, 1)
        self.neg = torch.tensor(NEG, device=dev)
        weight = -1.0 / self.g if (self.kind, self.reduce) == ("h2o", "mean") else -1.0
        self.weights = torch.full((self.n, 1, self.g), weight, device=dev)  # (N, 1, g): minus the sum over g

    def logits(self, rows: range, out: torch.Tensor) -> None:
        """out (N, r, g, c) <- float32 logits of `rows` against keys 0..c-1: their future and the keys the state
        marks evicted at -inf."""
        a, z = rows.start, rows.stop
        r, c = z - a, out.shape[-1]
        qb = self.qr[:, :, a - self.first : z - self.first].reshape(self.n, r * self.g, -1)  # (N, r x g, d)
        if qb.dtype == torch.float32 and out.dtype == torch.float32:
            # written in place with the scale as the product's alpha: the same float32 values as product x scale
            # (one rounding each), without a (N, r x g, c) temporary, its scaled copy and the copy into the block
            torch.baddbmm(out.view(self.n, r * self.g, c), qb, self.kk[:, :c].transpose(1, 2), beta=0,
                          alpha=self.scale, out=out.view(self.n, r * self.g, c))
        else:  # a half-precision product rounds to its dtype before the scale: as the decode step computes it
            out.copy_((torch.bmm(qb, self.kk[:, :c].transpose(1, 2)) * self.scale).view(self.n, r, self.g, c))
        future = torch.ones(r, r, dtype=torch.bool, device=out.device).triu_(1)  # key a + j after row a + i
        out[..., a:c].masked_fill_(future[None, :, None, :], NEG)
        if self.window is not None and z - self.window > 0:  # some row's window starts after key 0
            position = torch.arange(a, z, device=out.device)[:, None]  # (r, 1)
            outside = torch.arange(c, device=out.device)[None, :] <= position - self.window  # (r, c)
            out.masked_fill_(outside[None, :, None, :], NEG)
        evicted = self.state[:, None, None, :c].isinf()  # (N, 1, 1, c): evicted before the block
        out.masked_fill_(evicted, NEG)

    def run(self, schedule: Schedule, capture: str = "none") -> bool:
        """Replays the schedule's rows; capture "graph" / "compile" on a CUDA device: through `CapturedReplay`.
        Returns whether the captured path ran (False off CUDA: the eager replay, the same results)."""
        if capture != "none" and self.q.device.type == "cuda":
            CapturedReplay(self, capture).run(schedule)
            return True
        size = block_rows()
        rows = schedule.rows
        with one_thread() if self.q.device.type == "cpu" else nullcontext():
            for a in range(rows.start, rows.stop, size):
                block = range(a, min(rows.stop, a + size))
                i0 = a - rows.start
                self.block(block, schedule.offsets[i0 : i0 + len(block)], schedule.evicts[i0 : i0 + len(block)])
        return False

    def block(self, rows: range, offsets: list[int], evicts: list[bool]) -> None:
        r, c, n, g = len(rows), rows.stop, self.n, self.g
        buf = torch.empty(n, (2 + r * g) * c, dtype=torch.float32, device=self.q.device)
        buf[:, :c].fill_(NEG)  # the pad
        slots = buf[:, c:].view(n, 1 + r * g, c)
        state, logits = slots[:, :1], slots[:, 1:].view(n, r, g, c)  # (N, 1, c), (N, r, g, c)
        state[:, 0].copy_(self.state[:, :c])
        self.logits(rows, logits)
        ranked = buf  # what the argmax windows read: H2O's state; TOVA's row score, over a pad of its own
        if self.kind == "tova":
            ranked = torch.empty(n, 2 * c, dtype=torch.float32, device=buf.device)
            ranked[:, :c].fill_(NEG)
            score = ranked[:, c:].unsqueeze(1)  # (N, 1, c)
        lo, hi = min(offsets), max(offsets)
        # every offset's window (N, c) and shifted view (N, 1 + r x g, c), in one view op each
        windows = ranked.as_strided((hi - lo + 1, n, c), (1, ranked.shape[1], 1), lo).unbind(0)
        shifted = buf.as_strided((hi - lo + 1, n, 1 + r * g, c), (1, buf.shape[1], c, 1), lo).unbind(0)
        row_logits = logits.unbind(1)  # r x (N, g, c)
        drops, where, at = [], [], []
        for i, row in enumerate(rows):
            if self.kind == "h2o":
                self.accumulate(state, torch.softmax(row_logits[i], dim=-1))
            if not evicts[i]:
                continue
            if self.kind == "tova":
                torch.baddbmm(state, self.weights, torch.softmax(row_logits[i], dim=-1), out=score)
            o = offsets[i]
            d = windows[o - lo].argmax(-1, keepdim=True)  # (N, 1): window position; the key is o + d - c
            torch.ops.aten.index_put_(shifted[o - lo], [self.nidx, None, d], self.neg)
            drops.append(d)
            where.append(o - c)
            at.append(row)
        self.state[:, :c].copy_(state[:, 0])
        if drops:
            keys = torch.cat(drops, dim=1) + torch.tensor(where, device=buf.device)  # (N, m)
            self.last_row.scatter_(-1, keys, torch.tensor(at, device=buf.device).expand(n, -1))

    def accumulate(self, state: torch.Tensor, p: torch.Tensor) -> None:
        """H2O: state (N, 1, c) -= reduce over the g query heads of p (N, g, c)."""
        if self.reduce == "max":
            state.sub_(p.amax(1, keepdim=True))
        else:  # sum, mean: one batched product with -1 (-1/g) weights
            state.baddbmm_(self.weights, p)


# ----------------------------------------------------------------------------------------------- captured replay


def static_step(logits, state, drops, counter, offsets, evicts, cols, weights, h2o: bool, reduce: str) -> None:
    """One row of a block, every shape static and every index on the device, so a block of them can be captured
    once and replayed: logits (N, R, g, T + 2) (key T: where a row that evicts nothing writes; key T + 1: a padding
    row's only finite logit), state (N, T + 2) (keys T, T + 1 at -inf), drops (N, R) long, counter () long (the
    row's slot in the block, advanced here), offsets (R,) long, evicts (R,) bool, cols (T + 2,), weights (N, 1, g)."""
    n, _, g, width = logits.shape
    slot = counter.view(1)
    p = torch.softmax(logits.index_select(1, slot)[:, 0], dim=-1)  # (N, g, T + 2)
    if h2o:
        if reduce == "max":
            state.sub_(p.amax(1))
        else:
            state.unsqueeze(1).baddbmm_(weights, p)
        score = state
    else:
        score = torch.baddbmm(state.unsqueeze(1), weights, p)[:, 0]
    candidates = score.masked_fill(cols >= offsets.index_select(0, slot), NEG)  # keys 0..offset-1
    drop = torch.where(evicts.index_select(0, slot), candidates.argmax(-1, keepdim=True), width - 2)  # (N, 1)
    state.scatter_(-1, drop, NEG)
    logits.scatter_(-1, drop.view(n, 1, 1, 1).expand(n, logits.shape[1], g, 1), NEG)
    drops.index_copy_(1, slot, drop)
    counter.add_(1)


class CapturedReplay:
    """`Replay` on a CUDA device through one captured block: static buffers sized for BLOCK rows against all T
    keys, `static_step` recorded BLOCK times into a CUDA graph (capture "compile": the step compiled with
    torch.compile first, its kernels fused), replayed once per block. Per block the host fills the buffers (the
    block's logits, the schedule's slice) and reads nothing back. Graphs and buffers are kept per shape in
    `_CAPTURED` (all layers of a forward share one). graph=False runs the recorded steps eagerly: the same
    arithmetic on any device (tests check it against the eager replay on CPU)."""

    def __init__(self, replay: Replay, capture: str = "graph", graph: bool = True):
        self.r, self.capture, self.graph = replay, capture, graph
        self.t = replay.state.shape[1]
        self.rows = block_rows()
        key = (replay.n, replay.g, self.rows, self.t, replay.kind, replay.reduce, str(replay.q.device), capture, graph)
        if key not in _CAPTURED:
            _CAPTURED.clear()  # one shape at a time: a new length frees the previous one's buffers and graph
            _CAPTURED[key] = self._build()
        self.buffers, self.replay = _CAPTURED[key]

    def _build(self):
        r, n, g, t = self.r, self.r.n, self.r.g, self.t
        dev = r.q.device
        buffers = {
            "logits": torch.full((n, self.rows, g, t + 2), NEG, device=dev),
            "state": torch.full((n, t + 2), NEG, device=dev),
            "drops": torch.zeros(n, self.rows, dtype=torch.long, device=dev),
            "counter": torch.zeros((), dtype=torch.long, device=dev),
            "offsets": torch.zeros(self.rows, dtype=torch.long, device=dev),
            "evicts": torch.zeros(self.rows, dtype=torch.bool, device=dev),
            "cols": torch.arange(t + 2, device=dev),
            "weights": r.weights,
        }
        step = static_step
        if self.capture == "compile":
            step = torch.compile(static_step, fullgraph=True, dynamic=False)

        def steps():
            for _ in range(self.rows):
                step(**buffers, h2o=r.kind == "h2o", reduce=r.reduce)

        if not self.graph:
            return buffers, steps
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and compilation) outside the capture, as CUDA graphs require
            steps()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            steps()
        return buffers, graph.replay

    def run(self, schedule: Schedule) -> None:
        b, t = self.buffers, self.t
        b["state"][:, :t].copy_(self.r.state)
        b["state"][:, t:].fill_(NEG)
        rows = schedule.rows
        for a in range(rows.start, rows.stop, self.rows):
            block = range(a, min(rows.stop, a + self.rows))
            i0 = a - rows.start
            self.block(block, schedule.offsets[i0 : i0 + len(block)], schedule.evicts[i0 : i0 + len(block)])
        self.r.state.copy_(b["state"][:, :t])

    def block(self, rows: range, offsets: list[int], evicts: list[bool]) -> None:
        b, r, c, n = self.buffers, len(rows), rows.stop, self.r.n
        logits = b["logits"]
        logits.fill_(NEG)
        # the eager replay's masking reads evictions from the Replay's state: this block's start is in ours
        self.r.state.copy_(b["state"][:, : self.t])
        self.r.logits(rows, logits[:, :r, :, :c])
        logits[:, r:, :, -1] = 0.0  # padding rows: one finite logit, on a key no row reads
        pad = self.rows - r
        schedule = torch.tensor([offsets + [0] * pad, [int(e) for e in evicts] + [0] * pad])
        schedule = schedule.to(b["offsets"].device, non_blocking=True)
        b["offsets"].copy_(schedule[0])
        b["evicts"].copy_(schedule[1].bool())
        b["counter"].zero_()
        self.replay()
        at = [i for i, e in enumerate(evicts) if e]
        if at:
            slots = torch.tensor(at, device=logits.device)
            keys = b["drops"].index_select(1, slots)  # (N, m)
            self.r.last_row.scatter_(-1, keys, (slots + rows.start).expand(n, -1))


_CAPTURED: dict = {}


def remaining(drop: torch.Tensor, held: int) -> torch.Tensor:
    """(b, h_kv, held - n) ascending indices of the entries left when `drop` (b, h_kv, n) go: a static shape
    (n and held are known on the host), so an eviction never waits for the device (nonzero would)."""
    n = drop.shape[-1]
    if n == 1:  # every decode step once the budget binds: entries after the dropped one shift down by one
        ahead = torch.arange(held - 1, device=drop.device)
        return ahead + (ahead >= drop).long()
    keep = torch.ones(*drop.shape[:-1], held, dtype=torch.bool, device=drop.device).scatter_(-1, drop, False)
    return torch.argsort(keep.to(torch.uint8), dim=-1, descending=True, stable=True)[..., : held - n]
