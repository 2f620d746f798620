"""Decode performance model of the offloading runtime: what `task=latency` would measure on hardware we may not
have, replayed from a hardware profile instead of a clock.

Per decode step and layer it follows what infinigen/offload/ does (executors.py, runtime.py): where the layer's KV
lives (the method's `offload_kind`), when its fetch is issued (held: at the previous layer's attention start, the
next step's layer 0 at the last layer; gather: at the method's `speculation_point`), what crosses the link (the
pool's rows at the method's `codec` width: the same bytes the runtime's counters report), the host-side gather,
and where the compute stream waits for it. Each segment's device time is a roofline, max(FLOPs / peak, bytes /
memory bandwidth), over what the segment reads (weights, the KV it attends, the selection's per-entry vectors:
`GatheringMethod.selection_flops`), plus the ops the runtime's own code dispatches (counted once on a small stand-in
of the model, in the model's dtype: infinigen/offload/census.py) times the profile's per-op cost. On a GPU, ops
are queued ahead of the device between the host synchronisations the census counts in each segment, so a stretch
costs the larger of its dispatch and its device time and at each sync the host waits for the device; the host
also waits where the runtime joins a job of its link worker (a fetch's host work, a write-back queued on the
fetch worker), and does host tensor work (indices read back and compacted) on its own clock; a gather's host job
starts once its selection's indices exist on the device. On a CPU (`h2d_gbps: null`, host == device) they add,
and the host-side work of fetches runs inline, as the runtime runs it there.

Nothing here loads weights: an OPT-13B point computes from its config in well under a second (after the census,
cached per method config and model structure).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# profile field -> (unit, may be null)
HARDWARE_FIELDS = {
    "matmul_tflops": ("TFLOP/s, dense matmul at the model's dtype", False),
    "memory_gbps": ("GB/s, device memory", False),
    "h2d_gbps": ("GB/s, pinned host->device copies; null: the host is the device", True),
    "d2h_gbps": ("GB/s, device->host copies; null: the host is the device", True),
    "launch_us": ("microseconds per dispatched op", False),
    "copy_gbps": ("GB/s, elementwise ops and copies on the device, bytes read + written", False),
    "gather_gbps": ("GB/s, indexed ops (gather, scatter, index_select) on the device", False),
    "host_gbps": ("GB/s, host memory copy rate of gathers", False),
    "device_memory_gib": ("GiB of device memory", False),
    # a CPU runs the LM head's (vocab x hidden) matmul at a few rows slower than the layers' shapes (smollm2-135m's
    # 49152 x 576 at 8 rows: 0.57-0.76x their FLOP/s here), and it is a fifth of the step's matmul FLOPs; a GPU's
    # tensor cores run it at their peak
    "head_tflops": ("TFLOP/s, the LM head's matmul; null or absent: matmul_tflops", True),
    # host-side tensor work that is not the gather (the launching thread's compaction of indices read back from
    # the device, a worker's bookkeeping): one thread's rate, bytes read + written
    "host_op_gbps": ("GB/s, host tensor ops besides the gather, bytes read + written; null or absent: host_gbps",
                     True),
    # a blocking device->host read (`.cpu()` of selected indices) lands in pageable memory
    "pageable_gbps": ("GB/s, blocking copies through pageable host memory; null or absent: d2h_gbps", True),
    # a job of the link's worker costs host time beyond its ops: the hand-off to the thread, its Python, the event
    # and stream calls around its copies
    "job_us": ("microseconds of host time per link job beyond its ops; null or absent: 0", True),
    # the paper's runtime (infinigen/offload/paper.py) copies contiguous slices on the host (a pageable cache into
    # pinned staging) and gathers on its launching thread with torch's intra-op threads
    "host_copy_gbps": ("GB/s, a contiguous host copy, bytes read + written; null or absent: the host gather's",
                       True),
}
OPTIONAL_FIELDS = ("head_tflops", "host_op_gbps", "pageable_gbps", "job_us", "host_copy_gbps")
# How a profile prices the ops the runtime dispatches: `ops` = launch_us each (a GPU: launches queue ahead of the
# device); `stand_in` = the seconds the runtime's code takes per segment on this machine, timed on the stand-in at
# the run's size (a CPU profile calibrated here: per-op costs differ by op and by tensor size, and the harness's
# Python between ops counts too)
DISPATCH = ("ops", "stand_in")


@dataclass(frozen=True)
class Hardware:
    name: str
    matmul_tflops: float
    memory_gbps: float
    h2d_gbps: float | None
    d2h_gbps: float | None
    launch_us: float
    copy_gbps: float
    gather_gbps: float
    host_gbps: float
    device_memory_gib: float
    dispatch: str = "ops"
    head_tflops: float | None = None
    host_op_gbps: float | None = None
    pageable_gbps: float | None = None
    job_us: float | None = None
    host_copy_gbps: float | None = None
    host_gbps_threads: dict | None = None  # the host gather's rate by thread count (informational for overlapped)

    @property
    def host_is_device(self) -> bool:
        return self.h2d_gbps is None

    @property
    def host_op_rate(self) -> float:
        """Bytes/s of host tensor work besides the gather."""
        return (self.host_op_gbps or self.host_gbps) * 1e9

    @property
    def readback_rate(self) -> float:
        """Bytes/s of a blocking device->host read."""
        return (self.pageable_gbps or self.d2h_gbps or self.host_gbps) * 1e9


def hardware(cfg) -> Hardware:
    """A conf/hardware profile -> Hardware; ValueError naming the field for a missing or non-positive number."""
    if cfg is None:
        raise ValueError("hardware is not set: choose a profile, e.g. hardware=a6000_pcie3 (conf/hardware/*.yaml), "
                         "or calibrate this machine with `python -m experiments.calibrate`")
    values = {}
    for name, (unit, nullable) in HARDWARE_FIELDS.items():
        if name not in cfg and name in OPTIONAL_FIELDS:
            values[name] = None
            continue
        if name not in cfg:
            raise ValueError(f"hardware.{name} is missing from profile {cfg.get('name')!r} ({unit})")
        value = cfg[name]
        if value is None and nullable:
            values[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise ValueError(f"hardware.{name} must be a positive number ({unit}), got {value!r}")
        values[name] = float(value)
    dispatch = cfg.get("dispatch", "ops")
    if dispatch not in DISPATCH:
        raise ValueError(f"hardware.dispatch must be one of {DISPATCH}, got {dispatch!r}")
    values["dispatch"] = dispatch
    threads = cfg.get("host_gbps_threads")
    if threads is not None:
        if not hasattr(threads, "items") or not all(isinstance(k, int) and not isinstance(v, bool)
                                                    and isinstance(v, (int, float)) and v > 0
                                                    for k, v in threads.items()):
            raise ValueError(f"hardware.host_gbps_threads must map thread counts to positive GB/s, got {threads!r}")
        values["host_gbps_threads"] = {int(k): float(v) for k, v in threads.items()}
    if (values["h2d_gbps"] is None) != (values["d2h_gbps"] is None):
        raise ValueError("hardware.h2d_gbps and hardware.d2h_gbps must both be numbers or both null")
    return Hardware(name=str(cfg.get("name")), **values)


@dataclass(frozen=True)
class LayerSpec:
    """What a method's offload declarations read of a layer (duck-types adapter.AttentionLayer's fields)."""

    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    sliding_window: int | None = None  # a local layer's window W (Gemma 3's sliding_attention); None: global

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def layer_windows(arch: dict, layers: int) -> tuple:
    """Per layer the sliding window W of a local layer, None for a global one, as transformers reads the config:
    `layer_types` names each layer (Gemma 3: sliding_attention / full_attention); a `sliding_window` without
    them applies to every layer (Mistral); neither: every layer global."""
    window = arch.get("sliding_window")
    if not window:
        return ()
    types = arch.get("layer_types")
    if types is None:
        return (int(window),) * layers
    if len(types) != layers:
        raise ValueError(f"model.arch.layer_types names {len(types)} layers, num_hidden_layers is {layers}")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class Shape:
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    ffn_matrices: int  # 3: gated (Llama), 2: OPT
    vocab: int
    elem: int  # bytes per element of the model's dtype
    dtype: str
    tied: bool
    windows: tuple = ()  # per layer, a local layer's window W or None (empty: every layer global)

    @classmethod
    def of(cls, model_cfg) -> "Shape":
        arch = dict(model_cfg.arch)
        heads = int(arch["num_attention_heads"])
        hidden = int(arch["hidden_size"])
        opt = arch["model_type"] == "opt"
        layers = int(arch["num_hidden_layers"])
        return cls(
            family="opt" if opt else "llama", layers=int(arch["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(arch.get("num_key_value_heads") or heads),
            head_dim=int(arch.get("head_dim") or hidden // heads),
            ffn=int(arch["ffn_dim"] if opt else arch["intermediate_size"]), ffn_matrices=2 if opt else 3,
            vocab=int(arch["vocab_size"]), elem=DTYPE_BYTES[str(model_cfg.dtype)], dtype=str(model_cfg.dtype),
            tied=bool(arch.get("tie_word_embeddings", opt)), windows=layer_windows(arch, layers),
        )

    def layer(self, i: int) -> LayerSpec:
        window = self.windows[i] if self.windows else None
        return LayerSpec(i, self.heads, self.kv_heads, self.head_dim, self.hidden, window)

    @property
    def attn_weights(self) -> int:
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def ffn_weights(self) -> int:
        return self.ffn_matrices * self.hidden * self.ffn

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (self.attn_weights + self.ffn_weights) + embed


@dataclass
class Plan:
    """Per layer: the offload kind, and for pools the row width (bytes) and slots."""

    kinds: list[str]
    row_bytes: list[int]  # bytes of one entry of one KV head as the pool stores it (0: resident)
    slots: list[int]
    evicting: list[bool]
    decodes: list[bool]  # the codec is not plain K|V: its rows are decoded into a fresh K, V before attending
    windows: list = field(default_factory=list)  # a local layer's window W, None: global (empty: all global)

    def visible(self, i: int, seen: int) -> int:
        """Positions the row that makes `seen` tokens attends on layer i (itself included): all of them on a
        global layer, at most W on a local one (what kv_fraction counts against)."""
        window = self.windows[i] if self.windows else None
        return seen if window is None else min(seen, window)


def plan(method, shape: Shape, runtime: str, max_len: int) -> Plan:
    """What the runtime sets up per layer (OffloadRuntime.generate + PoolExecutor.new_store), from declarations."""
    import torch

    from infinigen.offload.runtime import layer_kind

    dtype = getattr(torch, shape.dtype)
    out = Plan([], [], [], [], [], [shape.layer(i).sliding_window for i in range(shape.layers)])
    for i in range(shape.layers):
        layer = shape.layer(i)
        kind = layer_kind(method, layer, runtime)
        out.kinds.append(kind)
        if kind == "resident":
            out.row_bytes.append(0), out.slots.append(0), out.evicting.append(False), out.decodes.append(False)
            continue
        codec = method.codec(layer, dtype)
        width, cdtype = (2 * shape.head_dim, dtype) if codec is None else (codec.width, codec.dtype)
        slots = min(max_len, method.max_held(max_len))
        out.row_bytes.append(width * torch.empty((), dtype=cdtype).element_size())
        out.slots.append(slots)
        out.evicting.append(slots < max_len)
        out.decodes.append(codec is not None)
    return out


def held_rows(method, plan_: Plan, i: int, past: int, prompt_len: int) -> int:
    """Rows a held layer's fetch carries at a step with `past` earlier tokens: every written row of a pool that
    never evicts (of a local layer, those in its window); an evicting pool's high-water mark: what the prefill
    kept (max_held(P) - 1: max_held counts the current token on top), or the most held at once by an earlier step
    (max_held of its length)."""
    if not plan_.evicting[i]:
        return plan_.visible(i, past + 1) - 1  # entry n in slot n: a local layer sends its window's rows only
    kept = method.max_held(prompt_len) - 1
    return min(plan_.slots[i], kept if past == prompt_len else max(kept, method.max_held(past - 1)))


def step_bytes(method, shape: Shape, plan_: Plan, batch: int, past: int, prompt_len: int,
               selected: list[float]) -> list[float]:
    """Host->device bytes per layer of the step with `past` earlier tokens; `selected[i]` is the mean number of
    past entries a (row, KV head) of gather layer i selects."""
    out = []
    for i, kind in enumerate(plan_.kinds):
        bh = batch * shape.kv_heads
        if kind == "held":
            out.append(held_rows(method, plan_, i, past, prompt_len) * bh * plan_.row_bytes[i])
        elif kind == "gather":
            out.append(selected[i] * bh * plan_.row_bytes[i])
        else:
            out.append(0.0)
    return out


# ---------------------------------------------------------------------------------------------- timing


def roofline(hw: Hardware, flops: float, nbytes: float, tflops: float | None = None) -> float:
    """Seconds for a kernel of `flops` reading/writing `nbytes` at the profile's peaks (`tflops`: another rate)."""
    return max(flops / ((tflops or hw.matmul_tflops) * 1e12), nbytes / (hw.memory_gbps * 1e9))


def head_seconds(hw: Hardware, shape: Shape, rows: int) -> float:
    """The LM head over `rows` hidden states, at the profile's head rate."""
    return roofline(hw, 2 * rows * shape.hidden * shape.vocab, (shape.hidden + rows) * shape.vocab * shape.elem,
                    hw.head_tflops)


@dataclass
class Segments:
    """Per-segment device seconds of one layer's decode step (roofline terms, no dispatch)."""

    projections: float = 0.0  # q/k/v (before the fetch is needed)
    attention: float = 0.0  # attention over what is attended + o_proj
    speculation: float = 0.0
    ffn: float = 0.0
    norms: float = 0.0


def layer_work(hw: Hardware, shape: Shape, plan_: Plan, method, i: int, batch: int, seen: int, attended: float,
               context_s: dict, timed_at: int = 0) -> Segments:
    """Roofline seconds of layer i's segments at a step where `seen` tokens exist and each (row, KV head) attends
    `attended` entries (itself included). Weights and FLOPs from the shapes; what grows with the context
    (`context_s`: seconds per batch row and context token per segment, `context_seconds`) past `timed_at` (the
    context the dispatch seconds were timed at, which hold what it cost there) on top."""
    b, e, d, h = batch, shape.elem, shape.head_dim, shape.heads
    q_w = shape.hidden * h * d
    kv_w = 2 * shape.hidden * shape.kv_heads * d
    ctx = b * (seen - timed_at)

    def seg(name: str, flops: float, weights: float) -> float:
        # matmuls over the weights at the roofline; what the context adds (attention's copies, scores, the
        # method's per-entry state) on top
        return roofline(hw, flops, weights * e) + ctx * context_s[name]

    # a profile of this machine (dispatch: stand_in) timed what each token of context costs, the scores and the
    # weighted sum over it included: its roofline prices the weights only, or that work would count twice
    per_entry = hw.dispatch != "stand_in"
    out = Segments()
    out.projections = roofline(hw, 2 * b * (q_w + kv_w), (q_w + kv_w) * e)
    out.attention = seg("attention", per_entry * 4 * b * h * attended * d + 2 * b * q_w, q_w)
    if plan_.kinds[i] == "gather":
        # what the selection spends however long the past (InfiniGen: the speculated query through the query
        # weight) is matmuls over weights, read once: flops / 2 of them per row
        fixed = method.selection_flops(shape.layer(i), 0)
        out.speculation = seg("speculation", b * method.selection_flops(shape.layer(i), seen - 1) if per_entry
                              else b * fixed, fixed / 2)
    out.ffn = seg("ffn", 2 * b * shape.ffn_weights, shape.ffn_weights)
    out.norms = seg("norms", 0, 0)
    return out


@dataclass
class Clock:
    """The host thread (dispatching ops) and the device stream. On a CPU both are one clock. `busy` splits the
    device's timeline (what it ran or waited for); `waits` the host's time not spent dispatching (at host
    synchronisations, joining the link's jobs, host tensor work)."""

    overlap: bool
    host: float = 0.0
    device: float = 0.0
    lead: float = 0.0  # seconds to dispatch one op: a stretch's device work starts once its first op is queued
    busy: dict = field(default_factory=lambda: {"compute": 0.0, "speculation": 0.0, "exposed_transfer": 0.0,
                                                 "host": 0.0})
    waits: dict = field(default_factory=lambda: {"sync_wait": 0.0, "join_wait": 0.0, "host_work": 0.0,
                                                  "syncs": 0.0})

    def run(self, dispatch_s: float, device_s: float, kind: str = "compute") -> None:
        """Ops taking `dispatch_s` to dispatch, carrying `device_s` of device work."""
        if not self.overlap:
            self.host = self.device = self.host + dispatch_s + device_s
            self.busy[kind] += dispatch_s + device_s
            return
        first = self.host + min(self.lead, dispatch_s)  # (after a sync the device waits for it)
        self.host += dispatch_s
        start = self.device
        self.device = max(max(self.device, first) + device_s, self.host)
        self.busy[kind] += self.device - start

    def segment(self, dispatch_s: float, device_s: float, syncs: float = 0.0, kind: str = "compute",
                lo: float = 0.0, hi: float = 1.0) -> None:
        """The part [lo, hi) of a segment's ops, taking `dispatch_s` to dispatch and carrying `device_s` of device
        work, the host waiting for the device at each of the segment's `syncs` that falls in it (spread evenly
        over the segment's ops, the last at its end)."""
        k = round(syncs)
        at = lo
        for point in [i / k for i in range(1, k + 1) if lo < i / k <= hi] if k else []:
            share = (point - at) / (hi - lo)
            self.run(dispatch_s * share, device_s * share, kind)
            self.sync()
            at = point
        if hi > at:
            share = (hi - at) / (hi - lo)
            self.run(dispatch_s * share, device_s * share, kind)

    def sync(self, counted: bool = True) -> None:
        """The host waits for the device (a scalar read, a blocking copy, a data-dependent shape)."""
        if self.overlap and counted:
            self.waits["syncs"] += 1
            self.waits["sync_wait"] += max(0.0, self.device - self.host)
        self.host = max(self.host, self.device)

    def join(self, t: float) -> None:
        """The host blocks until a job of the link's worker, done at t, is."""
        if self.overlap and t > self.host:
            self.waits["join_wait"] += t - self.host
            self.host = t

    def host_work(self, seconds: float) -> None:
        """Host tensor work on the launching thread: the device runs what is queued meanwhile."""
        if seconds <= 0:
            return
        self.waits["host_work"] += seconds
        if self.overlap:
            self.host += seconds
        else:
            self.host = self.device = self.host + seconds
            self.busy["compute"] += seconds

    def wait_for(self, t: float, host_share: float = 0.0) -> None:
        """The device (CPU: the thread) waits for a fetch that lands at t; `host_share` of the fetch's time was
        host-side gathering (the exposed wait is split in that proportion)."""
        now = self.device
        if t > now:
            self.busy["host"] += (t - now) * host_share
            self.busy["exposed_transfer"] += (t - now) * (1 - host_share)
            self.device = t
            if not self.overlap:
                self.host = t


@dataclass
class Link:
    """One host worker (fetches' host work, in issue order) feeding one host->device copy engine."""

    hw: Hardware
    worker: float = float("-inf")
    engine: float = float("-inf")
    busy_s: float = 0.0
    worker_s: float = 0.0  # the worker's busy time (the runtime's `link_host_ms`)

    def fetch(self, clock: Clock, issued: float, host_dispatch_s: float, nbytes: float,
              gathered: bool, host_extra_s: float = 0.0) -> tuple[float, float, float]:
        """(time at which a fetch issued at `issued` has landed on the device, the host-side share of its time,
        the time its host-side job is done). `host_extra_s`: its host tensor work besides the gather."""
        host_s = host_dispatch_s + host_extra_s + (2 * nbytes / (self.hw.host_gbps * 1e9) if gathered else 0.0)
        if self.hw.host_is_device:  # inline on the one thread: nothing crosses, the host work is the step's
            clock.host = clock.device = clock.host + host_s
            clock.busy["host"] += host_s
            return clock.host, 0.0, clock.host
        host_s += (self.hw.job_us or 0.0) * 1e-6
        self.worker = max(issued, self.worker) + host_s
        self.worker_s += host_s
        copy = nbytes / (self.hw.h2d_gbps * 1e9)
        self.engine = max(self.worker, self.engine) + copy
        self.busy_s += copy
        return self.engine, host_s / (host_s + copy) if host_s + copy > 0 else 0.0, self.worker

    def read_from_device(self, clock: Clock, nbytes: float) -> tuple[float, float, float]:
        """A zero-copy gather (the runtime's gather=zero_copy): a device program reads the selected rows from the
        pinned pool over the link once the selection is computed; no host job (the landing time, a host share of
        0, the host's time)."""
        if self.hw.host_is_device:
            return clock.host, 0.0, clock.host
        self.engine = max(clock.device, self.engine) + nbytes / (self.hw.h2d_gbps * 1e9)
        self.busy_s += nbytes / (self.hw.h2d_gbps * 1e9)
        return self.engine, 0.0, clock.host

    def writeback(self, clock: Clock, nbytes: float, host_s: float = 0.0) -> float:
        """A job queued to the fetch worker that writes new rows back into a host pool (the time it is done): its
        device->host copy is queued on the copy stream behind what is already there, once the device has
        computed the rows, and the job waits for it; fetches issued later queue behind the job."""
        if self.hw.host_is_device:
            return clock.host
        copied = max(self.engine, clock.device) + nbytes / (self.hw.d2h_gbps * 1e9)
        self.engine = copied
        host_s += (self.hw.job_us or 0.0) * 1e-6
        self.worker = max(self.worker, clock.host, copied) + host_s
        self.worker_s += host_s
        return self.worker


def selected_counts(fractions: list[float] | None, plan_: Plan, seen: int) -> list[float]:
    """Mean past entries a (row, KV head) of each gather layer selects when `seen` tokens exist, from the layer's
    kv_fraction (selected past + itself, over what the row may attend: `Plan.visible`)."""
    if fractions is None:
        return [0.0] * len(plan_.kinds)
    visible = [plan_.visible(i, seen) for i in range(len(plan_.kinds))]
    return [min(v - 1.0, max(0.0, f * v - 1)) if k == "gather" else 0.0
            for f, k, v in zip(fractions, plan_.kinds, visible)]


def attended_entries(method, plan_: Plan, i: int, seen: int, selected: float) -> float:
    """Entries a (row, KV head) of layer i attends at a step where `seen` tokens exist (itself included)."""
    if plan_.kinds[i] == "gather":
        return selected + 1
    if plan_.kinds[i] == "held" and plan_.evicting[i]:
        return min(seen, method.max_held(seen))
    return seen


EVENTS = ("syncs", "joins", "writebacks", "host", "readback")


def no_events(layers: int) -> list[dict]:
    """Per layer (and the step's own last) no host synchronisation, join, write-back or host tensor work: a
    profile of this machine (host == device: its timed seconds hold them) or a test's bare schedule."""
    return [{m: dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 0.0) for m in EVENTS}
            for _ in range(layers + 1)]


def decode_steps(method, model_cfg, hw: Hardware, runtime: str, batch: int, prompt_len: int, gen_len: int,
                 fractions: list[float] | None, dispatch: list[dict], context_s: list[dict],
                 timed_at: int = 0, events: list[dict] | None = None, gather: str = "host") -> list[dict]:
    """Each decode step's modelled seconds and breakdown, replaying OffloadedMethod's order of events: a layer's
    fetch is issued at the previous layer's attention start (held, and gathers speculated at attention_start; the
    next step's layer 0 at the last layer for held), at its attention end (attention_end), or by the layer itself
    before its attention (query, or nothing issued it earlier); the layer's attention waits for it. `dispatch`:
    per layer (and the step's own last) {segment: seconds} of dispatch (`dispatch_seconds`); `context_s`: per layer
    {segment: seconds per batch row and context token} (`context_seconds`), past `timed_at` tokens of context
    (what `dispatch` was timed at; its "host" at none). `events` (`census_events`): per layer {measure:
    {segment: value}} of what the launching thread does besides dispatching: host synchronisations (the host
    waits for the device, spread over the segment's ops), joins of the link's jobs (at a fetch's wait: its host
    work; elsewhere: the latest write-back), write-back jobs on the fetch worker, host tensor work and blocking
    reads (bytes per (row, token), on the host clock, at the segment's end). `gather`: how a gathering layer's rows
    cross (the runtime's GATHERS: a host job then a copy, or a device program reading the pool)."""
    shape = Shape.of(model_cfg)
    p = plan(method, shape, runtime, prompt_len + gen_len)
    link, clock = Link(hw), Clock(overlap=not hw.host_is_device, lead=hw.launch_us * 1e-6 * (hw.dispatch == "ops"))
    L = shape.layers
    ev = events or no_events(L)
    point = getattr(method, "speculation_point", "query")
    pending: dict[int, tuple[float, float, float]] = {}  # layer -> (landing, host-side share, host job done)
    steps = []
    for s in range(gen_len):
        past = prompt_len + s  # entries before this step's token
        seen = past + 1
        sel = selected_counts(fractions, p, seen)
        nbytes = step_bytes(method, shape, p, batch, past, prompt_len, sel)
        work = [layer_work(hw, shape, p, method, j, batch, seen, attended_entries(method, p, j, seen, sel[j]),
                           context_s[j], timed_at) for j in range(L)]
        t0, busy0, waits0, link0, worker0 = (max(clock.host, clock.device), dict(clock.busy), dict(clock.waits),
                                             link.busy_s, link.worker_s)
        wrote = clock.host  # the latest write-back job's end

        def host_tail(j: int, seg: str) -> None:
            """The segment's host tensor work and blocking reads, which grow with the context."""
            rows = batch * seen
            clock.host_work(rows * (ev[j]["host"][seg] / hw.host_op_rate + ev[j]["readback"][seg] / hw.readback_rate))

        def issue(j: int) -> None:
            if p.kinds[j] == "gather":  # the selection on the compute stream, then its indices reach the host
                clock.segment(dispatch[j]["speculation"], work[j].speculation, ev[j]["syncs"]["speculation"],
                              "speculation")
                host_tail(j, "speculation")
            host_s = dispatch[j]["host"]
            if hw.host_is_device and p.kinds[j] == "held":  # the pool's rows copied where attention reads them
                host_s += batch * seen * context_s[j]["host"]
            extra = batch * seen * ev[j]["host"]["host"] / hw.host_op_rate
            # a gather's host job needs its selection's indices: the device must have computed them (the host waited
            # for them at a sync, or the worker waits for their copy's event); a held prefix needs nothing
            issued = max(clock.host, clock.device) if p.kinds[j] == "gather" else clock.host
            if p.kinds[j] == "gather" and gather == "zero_copy":
                pending[j] = link.read_from_device(clock, nbytes[j])
                return
            pending[j] = link.fetch(clock, issued, host_s, nbytes[j], p.kinds[j] == "gather", extra)

        for j in range(L):
            ops, e = dispatch[j], ev[j]
            clock.segment(ops["attention"] / 2, work[j].projections, e["syncs"]["attention"], lo=0.0, hi=0.5)
            for _ in range(round(e["writebacks"]["attention"])):  # the new token's rows, written back
                wrote = link.writeback(clock, p.row_bytes[j] * batch * shape.kv_heads)
            if p.kinds[j] != "resident" and j not in pending:
                issue(j)
            nxt = (j + 1) % L
            ahead = "attention_start" if p.kinds[nxt] == "held" else point if p.kinds[nxt] == "gather" else None
            wrap_ok = nxt != 0 or (p.kinds[0] == "held" and s < gen_len - 1)
            if ahead == "attention_start" and wrap_ok:
                issue(nxt)
            if j in pending:
                landed, share, job = pending.pop(j)
                if e["joins"]["host"]:  # the host blocks on the fetch's job (its host work) before the device waits
                    clock.join(job)
                clock.wait_for(landed, share)
            if e["joins"]["attention"]:  # e.g. a pool's queued write-backs, settled before attending
                clock.join(wrote)
            clock.segment(ops["attention"] / 2, work[j].attention, e["syncs"]["attention"], lo=0.5, hi=1.0)
            host_tail(j, "attention")
            if ahead == "attention_end" and wrap_ok:
                issue(nxt)
            clock.segment(ops["ffn"], work[j].ffn, e["syncs"]["ffn"])
            clock.segment(ops["norms"], work[j].norms, e["syncs"]["norms"])
        clock.segment(dispatch[L]["norms"], head_seconds(hw, shape, batch), ev[L]["syncs"]["norms"])
        clock.sync(counted=False)  # a step's time: until the device has run it (the runtime's events measure it)
        steps.append({"step_s": clock.host - t0, "h2d_bytes": sum(nbytes), "layer_bytes": nbytes,
                      "transfer_s": link.busy_s - link0, "host_busy_s": link.worker_s - worker0,
                      **{f"{k}_s": v - busy0[k] for k, v in clock.busy.items()},
                      **{f"{k}_s" if k != "syncs" else k: v - waits0[k] for k, v in clock.waits.items()}})
    return steps


def dispatch_seconds(hw: Hardware, model_cfg, method, runtime: str, batch: int, prompt_len: int,
                     kinds: list[str]) -> tuple[list[dict], int]:
    """(per layer {segment: seconds} the runtime's ops take beyond the weights' roofline, the context length
    they were timed at). A GPU profile: each dispatched op at launch_us, at no context (what grows with it is
    priced from bytes). A profile of this machine: the stand-in timed here at the run's prompt, batch and head
    width; the host segment at the census's short prompt (host work is priced from the bytes the real selection
    moves, not the stand-in's own)."""
    from infinigen.offload import census

    if hw.dispatch == "stand_in":
        point = census.census(model_cfg, method, runtime, batch, kinds, "point_seconds", prompt=prompt_len)
        short = census.census(model_cfg, method, runtime, batch, kinds, measure="seconds")
        return [{**p, "host": s["host"]} for p, s in zip(point, short)], census.timed_context(prompt_len)
    ops = census.census(model_cfg, method, runtime, batch, kinds)
    return [{seg: n * hw.launch_us * 1e-6 for seg, n in layer.items()} for layer in ops], 0


def census_events(hw: Hardware, model_cfg, method, runtime: str, batch: int, kinds: list[str]) -> list[dict]:
    """Per layer {measure: {segment: value}} of what the launching thread does besides dispatching (the census's
    syncs, joins, writebacks, host and readback). A profile of this machine has none to add: host and device are
    one thread there, and its timed seconds hold that work."""
    from infinigen.offload import census

    if hw.host_is_device:
        return no_events(len(kinds))
    per = {m: census.census(model_cfg, method, runtime, batch, kinds, measure=m) for m in EVENTS}
    return [{m: per[m][i] for m in EVENTS} for i in range(len(kinds) + 1)]


def context_seconds(hw: Hardware, model_cfg, method, runtime: str, batch: int, kinds: list[str]) -> list[dict]:
    """Per layer {segment: seconds per (batch row, context token)}. A profile of this machine (dispatch: stand_in)
    times the method's code at two context lengths here; any other prices the bytes the census counts that grow
    with the context: streamed at the profile's copy rate, indexed at its gather rate."""
    from infinigen.offload import census

    if hw.dispatch == "stand_in":
        return census.census(model_cfg, method, runtime, batch, kinds, measure="context_seconds")
    stream, indexed = (census.census(model_cfg, method, runtime, batch, kinds, measure=m) for m in ("stream", "indexed"))
    return [{seg: s[seg] / (hw.copy_gbps * 1e9) + x[seg] / (hw.gather_gbps * 1e9) for seg in s}
            for s, x in zip(stream, indexed)]


GPU_MEASURES = ("ops", "stream", "indexed") + EVENTS  # what a profile that is not this machine reads of a census


def census_of(model_cfg, method, runtime: str, batch: int, kinds: list[str]) -> dict:
    """{measure: per layer {segment: value}}: the census a GPU profile's model reads (`from_census`); JSON, so the
    census of one version of the runtime can be kept and modelled by another version of this model."""
    from infinigen.offload import census

    return {m: census.census(model_cfg, method, runtime, batch, kinds, measure=m) for m in GPU_MEASURES}


def from_census(hw: Hardware, cen: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """A census (`census_of`) priced on a profile: (dispatch seconds, context seconds, events) per layer, as
    `dispatch_seconds`, `context_seconds` and `census_events` give them for a profile that is not this machine."""
    dispatch = [{seg: n * hw.launch_us * 1e-6 for seg, n in layer.items()} for layer in cen["ops"]]
    context = [{seg: st[seg] / (hw.copy_gbps * 1e9) + ix[seg] / (hw.gather_gbps * 1e9) for seg in st}
               for st, ix in zip(cen["stream"], cen["indexed"])]
    events = [{m: cen[m][i] for m in EVENTS} for i in range(len(cen["ops"]))]
    return dispatch, context, events


def modelled_steps(hw: Hardware, model_cfg, method, runtime: str, batch: int, prompt_len: int, gen_len: int,
                   fractions: list[float] | None, cen: dict | None = None, gather: str = "host") -> list[dict]:
    """decode_steps with the census of the method's code (cached after the first call per configuration), or,
    on a profile that is not this machine, the census `cen` given (`census_of`, e.g. of another runtime)."""
    from infinigen.offload.runtime import layer_kind

    shape = Shape.of(model_cfg)
    kinds = [layer_kind(method, shape.layer(i), runtime) for i in range(shape.layers)]
    if hw.dispatch == "stand_in":
        dispatch, timed_at = dispatch_seconds(hw, model_cfg, method, runtime, batch, prompt_len, kinds)
        return decode_steps(method, model_cfg, hw, runtime, batch, prompt_len, gen_len, fractions, dispatch,
                            context_seconds(hw, model_cfg, method, runtime, batch, kinds), timed_at,
                            census_events(hw, model_cfg, method, runtime, batch, kinds))
    dispatch, context, events = from_census(hw, cen or census_of(model_cfg, method, runtime, batch, kinds))
    return decode_steps(method, model_cfg, hw, runtime, batch, prompt_len, gen_len, fractions, dispatch, context,
                        0, events, gather)


def prefill_seconds(hw: Hardware, shape: Shape, plan_: Plan, batch: int, prompt_len: int) -> float:
    """Dense prefill (all layers' matmuls and causal attention, logits for the last position) plus the offloaded
    layers' KV written to the host, each write overlapped with the next layer's compute."""
    b, P, e = batch, prompt_len, shape.elem
    per_layer = roofline(hw, 2 * b * P * (shape.attn_weights + shape.ffn_weights)
                         + 2 * b * shape.heads * P * P * shape.head_dim,
                         (shape.attn_weights + shape.ffn_weights) * e + 12 * b * P * shape.hidden * e)
    head = head_seconds(hw, shape, b)
    if hw.host_is_device:
        return shape.layers * per_layer + head
    t = 0.0
    for i in range(shape.layers):
        write = b * shape.kv_heads * P * plan_.row_bytes[i] / (hw.d2h_gbps * 1e9)
        t = max(t + per_layer, t + write) if i else per_layer
    return t + head


def memory(shape: Shape, plan_: Plan, method, batch: int, max_len: int) -> dict:
    """Device and host bytes: weights, resident KV, landing buffers (two per executor kind) and per-entry state."""
    bh = batch * shape.kv_heads
    kv = 2 * shape.head_dim * shape.elem
    device = shape.params * shape.elem
    host = 0
    staging = {"held": 0, "gather": 0}
    for i, kind in enumerate(plan_.kinds):
        if kind == "resident":
            device += bh * max_len * kv
            continue
        host += plan_.slots[i] * bh * plan_.row_bytes[i]
        if kind == "held":
            staging["held"] = max(staging["held"], plan_.slots[i] * bh * plan_.row_bytes[i])
        else:
            rows = max(1, min(plan_.slots[i], method.max_selected(max_len)))
            staging["gather"] = max(staging["gather"], rows * bh * plan_.row_bytes[i])
            # the selection's vectors, counters and slots stay on the device
            device += bh * plan_.slots[i] * (method.score_channels(shape.layer(i)) * shape.elem + 24)
    device += 2 * sum(staging.values())
    return {"device_bytes": device, "host_pool_bytes": host}


def summarize(steps: list[dict], warmup: int, batch: int) -> dict:
    keep = steps[min(warmup, max(len(steps) - 1, 0)):]
    med = {k: statistics.median(r[k] for r in keep) * 1e3 for k in
           ("step_s", "compute_s", "speculation_s", "exposed_transfer_s", "host_s", "transfer_s", "sync_wait_s",
            "join_wait_s", "host_work_s", "host_busy_s")}
    return {
        "decode_ms_median": med["step_s"], "modelled_decode_ms_per_token": med["step_s"],
        "tokens_per_s": batch * 1e3 / statistics.fmean(r["step_s"] * 1e3 for r in keep),
        "compute_ms": med["compute_s"], "speculation_ms": med["speculation_s"],
        "exposed_transfer_ms": med["exposed_transfer_s"], "host_ms": med["host_s"], "transfer_ms": med["transfer_s"],
        # the launching thread's time not spent dispatching: waiting for the device at host synchronisations,
        # blocked on the link's jobs, host tensor work (compactions, blocking reads)
        "sync_wait_ms": med["sync_wait_s"], "syncs_per_step": statistics.median(r["syncs"] for r in keep),
        "join_wait_ms": med["join_wait_s"], "host_work_ms": med["host_work_s"],
        "host_busy_ms": med["host_busy_s"],  # the link worker's host work, hidden or not
        "h2d_bytes_per_token": statistics.fmean(r["h2d_bytes"] for r in keep),
    }
