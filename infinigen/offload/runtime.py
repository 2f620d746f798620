"""Offloading decode runtime: weights on the compute device, the KV cache of offloading methods in host memory,
and the host->device traffic each method implies actually moved (CUDA) or counted and modelled (CPU).

Each method declares per layer what it needs (`KVMethod.offload_kind`: resident | held | gather, see
infinigen/runtime_needs.py); `runtime` overrides it: ideal keeps every layer resident, offload moves a resident
method's KV to the host (held). The executors (infinigen/offload/executors.py) run the method's own decode-step
code around the transfers, so a run computes what the method's decode mode computes (tests/test_latency.py checks
it against sim mode for every method in conf/method/). InfiniGen's recall statistic needs every key on the
device and is not tracked here.

Pools are token-major, (slots, b*h_kv, W), so a prefix is one contiguous DMA; a row is whatever the method's
codec stores (K|V by default). On CUDA pools are pinned, host->device copies run on a side stream and
device->host ones (new rows, selected indices) on a write-back stream, ordered by events; host-side work runs on
worker threads (fetches in issue order, a gather's slices on `gather_threads` intra-op threads; write-backs on
their own), and the thread that launches kernels never waits for the device: a gathering method's selection has static shapes
(`GatheringMethod.select_indices`), its indices reach the host on the gather's own copy, and the gathered rows
are put in place on the device (gather=zero_copy: a device program reads them from the pinned pool instead).
On CPU host and device coincide: nothing is copied, the bytes are counted, and the link is modelled
(`Timer.modelled_steps`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from infinigen import adapter
from infinigen.offload.executors import EXECUTORS, Executor
from infinigen.offload.link import Link, Slot
from infinigen.offload.pool import PoolStore
from infinigen.offload.timing import PCIE4_X16_GBPS, Timer
from infinigen.runtime_needs import OFFLOAD_KINDS, SPECULATION_POINTS

RUNTIMES = ("auto", "ideal", "offload")
# How a gathering layer's selected rows reach the device: `host` threads gather them into pinned staging, then
# copies cross (the paper's runtime); `zero_copy` a device program reads them from the pinned pool (CUDA;
# ShadowKV's gather), with no host thread and no index copy
GATHERS = ("host", "zero_copy")


def run_kind(method, runtime: str = "auto") -> str:
    """What a run of `method` under `runtime` is called (its layers' kinds, dense layers aside); ValueError for
    a runtime or method declaration this runtime cannot run. Needs no model: callable before one loads."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    if method.offload not in OFFLOAD_KINDS:
        raise ValueError(f"{type(method).__name__}.offload must be one of {OFFLOAD_KINDS}, got {method.offload!r}")
    if method.offload == "gather" and method.speculation_point not in SPECULATION_POINTS:
        raise ValueError(f"{type(method).__name__}.speculation_point must be one of {SPECULATION_POINTS}, "
                         f"got {method.speculation_point!r}")
    if runtime == "ideal":
        return "resident"
    if runtime == "offload" and method.offload == "resident":
        return "held"
    return method.offload


def layer_kind(method, layer, runtime: str) -> str:
    """One layer's kind: the run's, except where the method keeps a layer resident (e.g. InfiniGen's dense ones)."""
    if runtime == "ideal":
        return "resident"
    if runtime == "offload" and method.offload == "resident":
        return "held"
    return method.offload_kind(layer)


class OffloadedMethod:
    """What the runtime installs into the model in place of the method: the prefill runs through the method
    itself, decode steps through each layer's executor, and fetches start at the points their executors name."""

    def __init__(self, rt: "OffloadRuntime", method, executors: list[Executor]):
        self.rt, self.method, self.executors = rt, method, executors
        self.decoding = False

    @property
    def captures(self) -> tuple[str, ...]:
        """What the adapter records for the method (its speculation may read the residual stream)."""
        return getattr(self.method, "captures", ())

    def bind(self, session) -> None:
        self.method.bind(session)

    def forward_attention(self, session, layer, q, k, v, allowed):
        out = self.method.forward_attention(session, layer, q, k, v, allowed)
        self.executors[layer.index].after_prefill(session.cache.layers[layer.index])
        return out

    def begin_step(self, session) -> None:
        self.decoding = True
        first = self.executors[0]
        if first.wraps and first.pending is None:
            first.prefetch(session)

    def decode_attention(self, session, layer, q, store):
        ex = self.executors[layer.index]
        ex.prepare(session, q, store)
        self.start_next(session, layer.index, "attention_start")
        return ex.decode(session, q, store)

    def attention_end(self, session, layer) -> None:
        if self.decoding:
            self.start_next(session, layer.index, "attention_end")

    def start_next(self, session, i: int, point: str) -> None:
        """Start the next layer's fetch (the next step's layer 0 after the last layer) if it is due at `point`."""
        j = (i + 1) % len(self.executors)
        ex = self.executors[j]
        if ex.ahead != point or (j == 0 and (not ex.wraps or self.rt.last_step)):
            return
        ex.prefetch(session)


@dataclass
class Report:
    kind: str
    batch: int
    prompt_len: int
    steps: int
    prefill_s: float
    breakdown: list[dict]
    modelled_ms: list[float] | None
    h2d_bytes: list[int]  # per decode step
    d2h_bytes: int
    host_pool_bytes: int
    device_kv_bytes: int
    peak_device_bytes: int | None
    tallies: dict
    logits: torch.Tensor | None = None  # (b, steps (+1 with the prefill's), V) when kept
    tokens: torch.Tensor | None = None  # (b, steps) fed after the prompt
    fetch_log: list[tuple] = field(default_factory=list)  # (step, layer, bytes, rows or None)
    host_gather_gbps: float | None = None  # selected rows' bytes over the host threads' gather seconds

    def metrics(self, warmup: int, link_gbps: float) -> dict:
        """Medians/means over the steps after `warmup`; every number the CPU link model produces is modelled_*."""
        keep = slice(min(warmup, max(self.steps - 1, 0)), None)
        rows = self.breakdown[keep]
        steps = [r["step_ms"] for r in rows]
        q = statistics.quantiles(steps, n=10, method="inclusive") if len(steps) > 1 else steps * 9
        h2d = statistics.fmean(self.h2d_bytes[keep]) if rows else 0.0
        out = {
            "runtime": self.kind,
            "measured_steps": len(rows),
            "prefill_s": self.prefill_s,
            "decode_ms_median": statistics.median(steps),
            "decode_ms_steps": steps,
            "decode_ms_p90": q[8],
            "decode_ms_mean": statistics.fmean(steps),
            "tokens_per_s": self.batch * 1e3 / statistics.fmean(steps),
            "h2d_bytes_per_token": h2d,
            "d2h_bytes_total": self.d2h_bytes,
            "host_pool_bytes": self.host_pool_bytes,
            "device_kv_bytes": self.device_kv_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "selected_tokens_mean": _mean(self.tallies["attended"]),
            "fetched_tokens_mean": _mean(self.tallies["fetched"]),
            "link_gbps": link_gbps,
            "modelled_transfer_ms_per_token": h2d / (link_gbps * 1e9) * 1e3,
        }
        if self.host_gather_gbps is not None:
            out["host_gather_gbps"] = self.host_gather_gbps
        for name in ("attention_ms", "ffn_ms", "speculation_ms", "wait_ms", "transfer_ms", "link_host_ms", "other_ms",
                     "compute_ms"):
            if rows and name in rows[0]:
                out[name] = statistics.median(r[name] for r in rows)
        if self.modelled_ms is not None:
            modelled = self.modelled_ms[keep]
            out["modelled_decode_ms_per_token"] = statistics.median(modelled)
            out["modelled_tokens_per_s"] = self.batch * 1e3 / statistics.fmean(modelled)
        return out


def _mean(pair: list) -> float | None:
    total, count = pair
    return total / count if count else None


class OffloadRuntime:
    """Runs a KV method's decode with its KV where its declaration (and `runtime`) puts it."""

    def __init__(self, model, method, runtime: str = "auto", link_gbps: float = PCIE4_X16_GBPS,
                 threaded: bool | None = None, copies: bool | None = None, clock=time.perf_counter,
                 gather_threads: int | None = None, gather: str = "host"):
        if not link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0 (GB/s), got {link_gbps}")
        if gather not in GATHERS:
            raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
        self.gather = gather
        self.kind = run_kind(method, runtime)
        self.model, self.method, self.runtime = model, method, runtime
        self.link_gbps, self.threaded, self.copies, self.clock = link_gbps, threaded, copies, clock
        self.gather_threads = gather_threads
        self.device = next(model.parameters()).device
        self.layers = adapter.attention_layers(model)

    # ------------------------------------------------------------------ shared by the executors
    def staging(self, name: str, elems: int, dtype, gather_rows: int = 0, width: int = 0,
                index_slots: int = 0) -> list[Slot] | None:
        """The two landing slots every fetch of one executor kind alternates between (None without copies)."""
        if name not in self._staging:
            self._staging[name] = self.link.staging(elems, dtype, gather_rows, width, index_slots)
        return self._staging[name]

    def gathered_rows(self, n: int, width: int, dtype, device, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, width) and its view as `shape`: where a gathering layer's landed rows are put in (head, rank) order
        before it attends, made once per shape and shared by the layers (each reads it before the next one's rows
        go in, in stream order)."""
        key = (n, width, dtype, device, shape)
        if self._rows_key != key:
            rows = torch.zeros(n, width, dtype=dtype, device=device)
            self._rows, self._rows_key = (rows, rows.view(shape)), key
        return self._rows

    def next_slot(self, slots: list[Slot]) -> Slot:
        k = self._flips.get(id(slots), 0)
        self._flips[id(slots)] = k + 1
        return slots[k % 2]

    def account(self, layer_index: int, nbytes, rows) -> None:
        """A fetch's bytes and rows (ints, or device counts read once the run is over)."""
        self.h2d_bytes[-1] += nbytes
        self.fetch_log.append((len(self.h2d_bytes) - 1, layer_index, nbytes, rows))

    def tally(self, layer_index: int, attended, fetched) -> None:
        """Per (row, KV head): past entries attended, and those that crossed (None: all attended ones)."""
        for name, value in (("attended", attended), ("fetched", attended if fetched is None else fetched)):
            if isinstance(value, torch.Tensor):
                self._tally[name].append(value)
            else:
                self._tally[name].append(torch.full_like(attended, float(value), dtype=torch.float64, device="cpu"))

    # ------------------------------------------------------------------ running
    def _hooks(self):
        handles = []
        for i, block in enumerate(adapter.decoder_layers(self.model)):
            first, last = adapter.ffn_span(block)
            for start, end, name in ((block.self_attn, block.self_attn, "attn"), (first, last, "ffn")):
                handles.append(start.register_forward_pre_hook(lambda *_, i=i, n=name: self.timer.mark(n + "0", i)))
                handles.append(end.register_forward_hook(lambda *_, i=i, n=name: self.timer.mark(n + "1", i)))
        return handles

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, gen_len: int, teacher: torch.Tensor | None = None,
                 keep_logits: bool = False) -> Report:
        """Prefill input_ids (b, P), then `gen_len` decode steps feeding the greedy token, or teacher[:, s] when
        given (b, gen_len)."""
        b, P = input_ids.shape
        if teacher is not None and teacher.shape != (b, gen_len):
            raise ValueError(f"teacher must be (batch, gen_len) = {(b, gen_len)}, got {tuple(teacher.shape)}")
        max_len = P + gen_len
        self.link = Link(self.device, self.threaded, self.copies, self.clock, self.gather_threads)
        self.timer = Timer(self.link)
        self.h2d_bytes, self.fetch_log, self.last_step = [], [], False
        self.gathers: list[tuple] = []  # (bytes, host seconds) of each host gather
        self._tally = {"attended": [], "fetched": []}
        self._staging, self._flips = {}, {}
        self._rows, self._rows_key = None, None
        executors = [EXECUTORS[layer_kind(self.method, layer, self.runtime)](self, self.method, layer)
                     for layer in self.layers]
        dtype = next(self.model.parameters()).dtype
        stores = [ex.new_store(b, max_len, dtype) for ex in executors]  # pools pinned before timing
        cache = adapter.new_cache(stores)
        installed = OffloadedMethod(self, self.method, executors)
        pos = torch.arange(P, device=self.device)[None].expand(b, P)
        handles = self._hooks()
        logits_out, fed = [], []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with adapter.install(self.model, installed, mode="decode", dense_rows=P, cache=cache,
                                 max_len=max_len) as session:
                self._sync()
                t0 = time.perf_counter()
                # the last row only, as decode mode's prefill: no (b, P, vocab) logits (3.2 GB at b=8, P=2048)
                logits = self.model(input_ids, position_ids=pos, cache=cache, use_cache=True,
                                    logits_to_keep=1).logits[:, -1]
                self._sync()
                prefill_s = time.perf_counter() - t0
                position = pos[:, -1:] + 1
                for s in range(gen_len):
                    if keep_logits:
                        logits_out.append(logits.float())
                    token = logits.argmax(-1, keepdim=True) if teacher is None else teacher[:, s : s + 1]
                    fed.append(token)
                    self.last_step = s == gen_len - 1
                    self.h2d_bytes.append(0)
                    self.timer.begin()
                    installed.begin_step(session)
                    logits = self.model(token, cache=cache, position_ids=position, use_cache=True).logits[:, -1]
                    self.timer.end()
                    position = position + 1
                self._sync()
            if keep_logits:
                logits_out.append(logits.float())
        finally:
            for h in handles:
                h.remove()
            self.link.close()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        # counts a device program left on the device (a zero-copy gather's), read now that the run is over
        self.h2d_bytes = [int(x) for x in self.h2d_bytes]
        self.fetch_log = [(s, i, int(n), None if r is None else int(r)) for s, i, n, r in self.fetch_log]
        for f in self.timer.fetches.values():
            f["bytes"] = int(f["bytes"])
        gathered = [(int(n), t) for n, t in self.gathers]
        pools = [s.pool for s in stores if isinstance(s, PoolStore)]
        staging = sum(sl.dev.numel() * sl.dev.element_size() for slots in self._staging.values() for sl in slots or [])
        return Report(
            kind=self.kind, batch=b, prompt_len=P, steps=gen_len, prefill_s=prefill_s,
            breakdown=self.timer.breakdown(),
            modelled_ms=None if self.link.cuda else self.timer.modelled_steps(self.link_gbps),
            h2d_bytes=self.h2d_bytes, d2h_bytes=sum(p.d2h_bytes for p in pools),
            host_pool_bytes=sum(p.nbytes for p in pools),
            # the method's own count: the KV its stores hold on the device plus its per-layer state (Quest's page
            # min/max, ShadowKV's low-rank factors), then the per-entry bookkeeping and the landing buffers
            device_kv_bytes=self.method.store_bytes(stores) + sum(s.entry_bytes() for s in stores) + staging,
            peak_device_bytes=peak, tallies={k: _sum(v) for k, v in self._tally.items()},
            logits=torch.stack(logits_out, dim=1) if keep_logits else None,
            tokens=torch.cat(fed, dim=1) if fed else None, fetch_log=self.fetch_log,
            host_gather_gbps=(sum(n for n, _ in gathered) / sum(t for _, t in gathered) / 1e9
                              if gathered and sum(t for _, t in gathered) > 0 else None),
        )


def _sum(values: list) -> list:
    total = sum(float(v.double().sum()) for v in values)
    return [total, sum(v.numel() for v in values)]


@torch.inference_mode()
def teacher_forced_logits(model, method, input_ids: torch.Tensor, dense_rows: int, **kwargs) -> tuple[torch.Tensor, "Report"]:
    """modes.decode_logits through the offloading runtime: predictions of tokens dense_rows .. t-1,
    (b, t - dense_rows, V), and the run's report."""
    rt = OffloadRuntime(model, method, **kwargs)
    report = rt.generate(input_ids[:, :dense_rows], input_ids.shape[1] - dense_rows,
                         teacher=input_ids[:, dense_rows:], keep_logits=True)
    return report.logits[:, :-1], report
