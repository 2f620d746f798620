"""Decode performance model of the offloading runtime: what `task=latency` would measure on hardware we may not
have, replayed from a hardware profile instead of a clock.

Per decode step and layer it follows what infinigen/offload/ does (executors.py, runtime.py): where the layer's KV
lives (the method's `offload_kind`), when its fetch is issued (held: at the previous layer's attention start, the
next step's layer 0 at the last layer; gather: at the method's `speculation_point`), what crosses the link (the
pool's rows at the method's `codec` width: the same bytes the runtime's counters report), the host-side gather,
and where the compute stream waits for it. Each segment's device time is a roofline, max(FLOPs / peak, bytes /
memory bandwidth), over what the segment reads (weights, the KV it attends, the selection's per-entry vectors:
`GatheringMethod.selection_work`), plus the ops the runtime's own code dispatches (counted once on a small stand-in
of the model: infinigen/offload/census.py) times the profile's per-op cost. On a GPU, ops are queued ahead of the
device between host synchronisations (a gather's indices must reach the host), so a stretch costs the larger of
its dispatch and its device time; on a CPU (`h2d_gbps: null`, host == device) they add, and the host-side work
of fetches runs inline, as the runtime runs it there.

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
}
OPTIONAL_FIELDS = ("head_tflops",)
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

    @property
    def host_is_device(self) -> bool:
        return self.h2d_gbps is None


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

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


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

    @classmethod
    def of(cls, model_cfg) -> "Shape":
        arch = dict(model_cfg.arch)
        heads = int(arch["num_attention_heads"])
        hidden = int(arch["hidden_size"])
        opt = arch["model_type"] == "opt"
        return cls(
            family="opt" if opt else "llama", layers=int(arch["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(arch.get("num_key_value_heads") or heads),
            head_dim=int(arch.get("head_dim") or hidden // heads),
            ffn=int(arch["ffn_dim"] if opt else arch["intermediate_size"]), ffn_matrices=2 if opt else 3,
            vocab=int(arch["vocab_size"]), elem=DTYPE_BYTES[str(model_cfg.dtype)], dtype=str(model_cfg.dtype),
            tied=bool(arch.get("tie_word_embeddings", opt)),
        )

    def layer(self, i: int) -> LayerSpec:
        return LayerSpec(i, self.heads, self.kv_heads, self.head_dim, self.hidden)

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


def plan(method, shape: Shape, runtime: str, max_len: int) -> Plan:
    """What the runtime sets up per layer (OffloadRuntime.generate + PoolExecutor.new_store), from declarations."""
    import torch

    from infinigen.offload.runtime import layer_kind

    dtype = getattr(torch, shape.dtype)
    out = Plan([], [], [], [], [])
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
    never evicts; an evicting pool's high-water mark: what the prefill kept (max_held(P) - 1: max_held counts the
    current token on top), or the most held at once by an earlier step (max_held of its length)."""
    if not plan_.evicting[i]:
        return past
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
    """The host thread (dispatching ops) and the device stream. On a CPU both are one clock."""

    overlap: bool
    host: float = 0.0
    device: float = 0.0
    busy: dict = field(default_factory=lambda: {"compute": 0.0, "speculation": 0.0, "exposed_transfer": 0.0,
                                                 "host": 0.0})

    def run(self, dispatch_s: float, device_s: float, kind: str = "compute") -> None:
        """Ops taking `dispatch_s` to dispatch, carrying `device_s` of device work."""
        if not self.overlap:
            self.host = self.device = self.host + dispatch_s + device_s
            self.busy[kind] += dispatch_s + device_s
            return
        self.host += dispatch_s
        start = self.device
        self.device = max(self.device + device_s, self.host)
        self.busy[kind] += self.device - start

    def sync(self) -> None:
        """The host waits for the device (a gather's indices are read on the host)."""
        self.host = max(self.host, self.device)

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
    """One host worker (gathers, in issue order) feeding one host->device copy engine."""

    hw: Hardware
    worker: float = float("-inf")
    engine: float = float("-inf")
    busy_s: float = 0.0

    def fetch(self, clock: Clock, issued: float, host_dispatch_s: float, nbytes: float,
              gathered: bool) -> tuple[float, float]:
        """(time at which a fetch issued at `issued` has landed on the device, the host-side share of its time)."""
        host_s = host_dispatch_s + (2 * nbytes / (self.hw.host_gbps * 1e9) if gathered else 0.0)
        if self.hw.host_is_device:  # inline on the one thread: nothing crosses, the host work is the step's
            clock.host = clock.device = clock.host + host_s
            clock.busy["host"] += host_s
            return clock.host, 0.0
        self.worker = max(issued, self.worker) + host_s
        copy = nbytes / (self.hw.h2d_gbps * 1e9)
        self.engine = max(self.worker, self.engine) + copy
        self.busy_s += copy
        return self.engine, host_s / (host_s + copy) if host_s + copy > 0 else 0.0


def selected_counts(fractions: list[float] | None, plan_: Plan, seen: int) -> list[float]:
    """Mean past entries a (row, KV head) of each gather layer selects when `seen` tokens exist, from the layer's
    kv_fraction (selected past + itself, over seen)."""
    if fractions is None:
        return [0.0] * len(plan_.kinds)
    return [min(seen - 1.0, max(0.0, f * seen - 1)) if k == "gather" else 0.0 for f, k in zip(fractions, plan_.kinds)]


def attended_entries(method, plan_: Plan, i: int, seen: int, selected: float) -> float:
    """Entries a (row, KV head) of layer i attends at a step where `seen` tokens exist (itself included)."""
    if plan_.kinds[i] == "gather":
        return selected + 1
    if plan_.kinds[i] == "held" and plan_.evicting[i]:
        return min(seen, method.max_held(seen))
    return seen


def decode_steps(method, model_cfg, hw: Hardware, runtime: str, batch: int, prompt_len: int, gen_len: int,
                 fractions: list[float] | None, dispatch: list[dict], context_s: list[dict],
                 timed_at: int = 0) -> list[dict]:
    """Each decode step's modelled seconds and breakdown, replaying OffloadedMethod's order of events: a layer's
    fetch is issued at the previous layer's attention start (held, and gathers speculated at attention_start; the
    next step's layer 0 at the last layer for held), at its attention end (attention_end), or by the layer itself
    before its attention (query, or nothing issued it earlier); the layer's attention waits for it. `dispatch`:
    per layer (and the step's own last) {segment: seconds} of dispatch (`dispatch_seconds`); `context_s`: per layer
    {segment: seconds per batch row and context token} (`context_seconds`), past `timed_at` tokens of context
    (what `dispatch` was timed at; its "host" at none)."""
    shape = Shape.of(model_cfg)
    p = plan(method, shape, runtime, prompt_len + gen_len)
    link, clock = Link(hw), Clock(overlap=not hw.host_is_device)
    L = shape.layers
    point = getattr(method, "speculation_point", "query")
    pending: dict[int, tuple[float, float]] = {}  # layer -> (landing time of its fetch, its host-side share)
    steps = []
    for s in range(gen_len):
        past = prompt_len + s  # entries before this step's token
        seen = past + 1
        sel = selected_counts(fractions, p, seen)
        nbytes = step_bytes(method, shape, p, batch, past, prompt_len, sel)
        work = [layer_work(hw, shape, p, method, j, batch, seen, attended_entries(method, p, j, seen, sel[j]),
                           context_s[j], timed_at) for j in range(L)]
        t0, busy0, link0 = max(clock.host, clock.device), dict(clock.busy), link.busy_s
        def issue(j: int) -> None:
            if p.kinds[j] == "gather":  # the selection on the compute stream, then its indices reach the host
                clock.run(dispatch[j]["speculation"], work[j].speculation, "speculation")
                clock.sync()
            host_s = dispatch[j]["host"]
            if hw.host_is_device and p.kinds[j] == "held":  # the pool's rows copied where attention reads them
                host_s += batch * seen * context_s[j]["host"]
            pending[j] = link.fetch(clock, clock.host, host_s, nbytes[j], p.kinds[j] == "gather")

        for j in range(L):
            ops = dispatch[j]
            clock.run(ops["attention"] / 2, work[j].projections)
            if p.kinds[j] != "resident" and j not in pending:
                issue(j)
            nxt = (j + 1) % L
            ahead = "attention_start" if p.kinds[nxt] == "held" else point if p.kinds[nxt] == "gather" else None
            wrap_ok = nxt != 0 or (p.kinds[0] == "held" and s < gen_len - 1)
            if ahead == "attention_start" and wrap_ok:
                issue(nxt)
            if j in pending:
                clock.wait_for(*pending.pop(j))
            clock.run(ops["attention"] / 2, work[j].attention)
            if ahead == "attention_end" and wrap_ok:
                issue(nxt)
            clock.run(ops["ffn"], work[j].ffn)
            clock.run(ops["norms"], work[j].norms)
        clock.run(dispatch[L]["norms"], head_seconds(hw, shape, batch))
        clock.sync()
        steps.append({"step_s": clock.host - t0, "h2d_bytes": sum(nbytes), "layer_bytes": nbytes,
                      "transfer_s": link.busy_s - link0, **{f"{k}_s": v - busy0[k] for k, v in clock.busy.items()}})
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


def modelled_steps(hw: Hardware, model_cfg, method, runtime: str, batch: int, prompt_len: int, gen_len: int,
                   fractions: list[float] | None) -> list[dict]:
    """decode_steps with the census of the method's code (cached after the first call per configuration)."""
    from infinigen.offload.runtime import layer_kind

    shape = Shape.of(model_cfg)
    kinds = [layer_kind(method, shape.layer(i), runtime) for i in range(shape.layers)]
    dispatch, timed_at = dispatch_seconds(hw, model_cfg, method, runtime, batch, prompt_len, kinds)
    return decode_steps(method, model_cfg, hw, runtime, batch, prompt_len, gen_len, fractions, dispatch,
                        context_seconds(hw, model_cfg, method, runtime, batch, kinds), timed_at)


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
           ("step_s", "compute_s", "speculation_s", "exposed_transfer_s", "host_s", "transfer_s")}
    return {
        "decode_ms_median": med["step_s"], "modelled_decode_ms_per_token": med["step_s"],
        "tokens_per_s": batch * 1e3 / statistics.fmean(r["step_s"] * 1e3 for r in keep),
        "compute_ms": med["compute_s"], "speculation_ms": med["speculation_s"],
        "exposed_transfer_ms": med["exposed_transfer_s"], "host_ms": med["host_s"], "transfer_ms": med["transfer_s"],
        "h2d_bytes_per_token": statistics.fmean(r["h2d_bytes"] for r in keep),
    }
