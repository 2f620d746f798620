"""The simulated timeline of decode steps: the host thread that dispatches ops and the device stream (`Clock`),
the link (`Link`: one host worker feeding one host->device copy engine), and `decode_steps`, which replays
OffloadedMethod's order of events on them. Per decode step and layer it follows what infinigen/offload/ does
(executors.py, runtime.py): where the layer's KV lives (the method's `offload_kind`), when its fetch is issued
(held: at the previous layer's attention start, the next step's layer 0 at the last layer; gather: at the
method's `speculation_point`), what crosses the link (plan.py's bytes), the host-side gather, and where the
compute stream waits for it. On a GPU, ops are queued ahead of the device between the host synchronisations the
census counts in each segment, so a stretch costs the larger of its dispatch and its device time and at each
sync the host waits for the device; the host also waits where the runtime joins a job of its link worker (a
fetch's host work, a write-back queued on the fetch worker), and does host tensor work (indices read back and
compacted) on its own clock; a gather's host job starts once its selection's indices exist on the device. On a
CPU (`h2d_gbps: null`, host == device) they add, and the host-side work of fetches runs inline, as the runtime
runs it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infinigen.offload.plan import Shape, attended_entries, plan, selected_counts, step_bytes
from infinigen.offload.profile import Hardware
from infinigen.offload.roofline import head_seconds, layer_work


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
