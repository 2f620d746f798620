"""Calibrate the performance model to this machine: a hardware profile measured, not looked up.

    python -m experiments.calibrate                 # writes conf/hardware/local.yaml (hardware=local)
    python -m experiments.calibrate --device cuda --model opt-13b --out conf/hardware/h200_pcie5_measured.yaml
                                                    # this machine's GPU (~40 s on an H200): see `cuda_profile`

What it measures (median of --repeats, at torch's thread count here):
  matmul_tflops      8 rows through distinct weights of the model's own shapes (--model: every layer's
                     projections and MLP; nn.Linear): decode-shaped matmuls, not a square GEMM's peak (skinny
                     matmuls reach a fraction of it on a CPU)
  head_tflops        the same through the LM head's (vocab, hidden) weight alone: a CPU runs that shape at
                     0.57-0.76x the layers' rate, and it is a fifth of smollm2-135m's matmul FLOPs per step
  memory_gbps        1 row through the same weights: how a decode step streams that model (a CPU streams a
                     576-wide projection at well under the rate of a 1024-wide one: per-call costs, threading)
  launch_us          the offloading runtime's own decode step on a 16-wide stand-in of smollm2-135m (full
                     attention): seconds per step / ops it dispatched (dispatch + the harness's Python per op)
  copy_gbps          the runtime's decode attention (full, real heads and head_dim, 256 vs 1024 tokens of context):
                     the extra bytes the census counts over the extra seconds: the rate context-dependent ops reach
  gather_gbps        torch.gather of rows out of a 25 MB cache (source + index + output bytes per second)
  host_gbps          rows of a 256 MB pool gathered by index_select (bytes read + written per second)
  device_memory_gib  this machine's memory
  dispatch           stand_in: the performance model times each method's own code per segment on a stand-in here:
                     at the run's prompt, batch and head_dim with a narrow residual stream (what its ops cost at
                     that size beyond the weights; launch_us above is only their mean for full attention; census
                     `point_seconds`), and at two context lengths (what each further token of context costs that
                     method here: census `context_seconds`). copy_gbps and gather_gbps
                     are then reported, not used: one bandwidth would price a 4-bit unpack like a copy
On a CPU the host is the device: h2d_gbps and d2h_gbps are null (nothing crosses a link).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# glibc hands tensors over 128 KB to mmap and gives them back at free: every decode step then page-faults its
# transient K/V copies anew, and the same run measured 80 to 136 ms/token here. Fixed thresholds keep freed memory
# in the heap, so repeated steps reuse it (what a steady server's allocator does).
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184",
                 "MALLOC_TOP_PAD_": "536870912"}


def steady_allocator() -> None:
    """Re-executes this process with STEADY_MALLOC set (glibc reads it only at start)."""
    if all(os.environ.get(k) == v for k, v in STEADY_MALLOC.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **STEADY_MALLOC})


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weights_of(model: str, dtype=torch.float32) -> list[torch.Tensor]:
    """Distinct (out, in) weights of the model's shapes, as a decode step reads them, the LM head last (random
    values)."""
    from omegaconf import OmegaConf

    from infinigen.offload.plan import Shape

    shape = Shape.of(OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml"))
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layer = [(q, shape.hidden), (kv, shape.hidden), (kv, shape.hidden), (shape.hidden, q)]
    layer += [(shape.ffn, shape.hidden)] * (shape.ffn_matrices - 1) + [(shape.hidden, shape.ffn)]
    return [torch.randn(o, i, dtype=dtype) for o, i in layer * shape.layers + [(shape.vocab, shape.hidden)]]


def _linear_s(weights: list[torch.Tensor], batch: int, repeats: int) -> float:
    x = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}
    return best(lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights], repeats)


def matmul_tflops(repeats: int, weights: list[torch.Tensor]) -> float:
    """FLOP/s of decode-shaped matmuls: a batch of 8 rows through each weight (nn.Linear's kernel)."""
    flops = sum(2 * 8 * w.numel() for w in weights)
    return flops / _linear_s(weights, 8, repeats) / 1e12


def memory_gbps(repeats: int, weights: list[torch.Tensor]) -> float:
    """Bytes/s of weights streamed through batch-1 matmuls (what bounds a decode step's projections)."""
    return sum(w.numel() * w.element_size() for w in weights) / _linear_s(weights, 1, repeats) / 1e9


def host_gbps(repeats: int) -> float:
    pool = torch.randn(512 * 1024, 128)  # 256 MB of rows of 128 floats
    idx = torch.randint(0, pool.shape[0], (64 * 1024,))
    out = torch.empty(idx.numel(), 128)
    moved = 2 * out.numel() * out.element_size()
    return moved / best(lambda: torch.index_select(pool, 0, idx, out=out), repeats) / 1e9


def copy_gbps(repeats: int) -> float:
    """The rate at which this machine gets through the bytes a decode step adds per token of context, measured on
    the runtime's own decode attention (full attention on an 8-layer stand-in of smollm2-135m at its real heads
    and head_dim): the extra bytes the census counts from a 256- to a 1024-token context, over the extra seconds
    the attention segment takes. One reference workload for every method: theirs are priced at this rate."""
    from omegaconf import OmegaConf

    from baselines.full import Full
    from infinigen.offload.census import _count

    model_cfg = OmegaConf.load(ROOT / "conf" / "model" / "smollm2-135m.yaml")
    d = int(model_cfg.arch.head_dim)

    def attention(measure: str, prompt: int) -> float:
        runs = [_count(model_cfg, Full(), "auto", 1, 8, measure, prompt=prompt, head_dim=d)
                for _ in range(repeats if measure == "seconds" else 1)]
        return statistics.median(sum(layer["attention"] for layer in run) for run in runs)

    extra_bytes = attention("stream", 1024) - attention("stream", 256)
    return extra_bytes / max(attention("seconds", 1024) - attention("seconds", 256), 1e-9) / 1e9


def gather_gbps(repeats: int) -> float:
    """torch.gather of held rows out of a (8, 3, 2048, 128) cache, priced as the census counts an op: source,
    index and output bytes."""
    src = torch.randn(8, 3, 2048, 128)
    index = torch.randint(0, 2048, (8, 3, 410, 1)).expand(8, 3, 410, 128)
    out = torch.empty(8, 3, 410, 128)
    moved = sum(t.numel() * t.element_size() for t in (src, index, out))
    return moved / best(lambda: torch.gather(src, 2, index, out=out), repeats) / 1e9


def launch_us(repeats: int) -> float:
    from omegaconf import OmegaConf

    from baselines.full import Full
    from infinigen import adapter
    from infinigen.offload.census import stand_in_arch
    from infinigen.offload.op_counter import OpCounter
    from infinigen.offload.runtime import OffloadRuntime

    model_cfg = OmegaConf.load(ROOT / "conf" / "model" / "smollm2-135m.yaml")
    cfg = OmegaConf.create({"name": "stand-in", "dtype": "float32", "random_init": True, "seed": 0,
                            "arch": stand_in_arch(dict(model_cfg.arch), int(model_cfg.arch.num_hidden_layers))})
    model, _ = adapter.load(cfg, device="cpu")
    ids = torch.randint(0, 128, (1, 64))
    counter = OpCounter()
    with counter:
        OffloadRuntime(model, Full()).generate(ids, 4)
    ops_4 = counter.value
    counter = OpCounter()
    with counter:
        OffloadRuntime(model, Full()).generate(ids, 2)
    per_step_ops = (ops_4 - counter.value) / 2
    rt = OffloadRuntime(model, Full())
    rt.generate(ids, 2)
    steps = []
    for _ in range(repeats):
        report = rt.generate(ids, 8)
        steps += [r["step_ms"] for r in report.breakdown[2:]]
    return statistics.median(steps) * 1e3 / per_step_ops


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 16.0


def rates(repeats: int, weights: list[torch.Tensor]) -> dict:
    """The profile's rates a CPU profile (dispatch: stand_in) prices with: a few seconds to measure, so
    validation measures them again beside every measured run (this VM's speed drifts over minutes)."""
    *layers, head = weights  # weights_of: the LM head last
    return {"matmul_tflops": round(matmul_tflops(repeats, layers), 5),
            "head_tflops": round(matmul_tflops(repeats, [head]), 5),
            "memory_gbps": round(memory_gbps(repeats, weights), 3), "host_gbps": round(host_gbps(repeats), 3)}


def calibrate(repeats: int = 5, model: str = "smollm2-135m") -> dict:
    measured = rates(repeats, weights_of(model))
    return {
        "name": "local",
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "weights_of": model,
        "matmul_tflops": measured["matmul_tflops"],
        "head_tflops": measured["head_tflops"],
        "memory_gbps": measured["memory_gbps"],
        "h2d_gbps": None,
        "d2h_gbps": None,
        "launch_us": round(launch_us(repeats), 3),
        "copy_gbps": round(copy_gbps(repeats), 3),
        "gather_gbps": round(gather_gbps(repeats), 3),
        "host_gbps": measured["host_gbps"],
        "device_memory_gib": round(memory_gib(), 2),
        "dispatch": "stand_in",  # per segment: the runtime's code timed here at the run's size (profile.DISPATCH)
    }


# ----------------------------------------------------------------------------------------------- a GPU


def _timer(device: torch.device):
    """seconds of fn() on `device` (CUDA events on a GPU, after a synchronisation), the median of `repeats`."""
    cuda = device.type == "cuda"

    def timed(fn, repeats: int) -> float:
        fn()
        out = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return statistics.median(out)

    return timed


def _layer_weights(shape, dtype, device, layers: int) -> list[torch.Tensor]:
    """Distinct (out, in) weights of `layers` of the model's layers (enough to stream from memory, not cache)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layer = [(q, shape.hidden), (kv, shape.hidden), (kv, shape.hidden), (shape.hidden, q)]
    layer += [(shape.ffn, shape.hidden)] * (shape.ffn_matrices - 1) + [(shape.hidden, shape.ffn)]
    return [torch.randn(o, i, dtype=dtype, device=device) * 0.02 for o, i in layer * layers]


def _stand_in(model_cfg, layers: int, head_dim: int, positions: int, device, narrow: bool = False):
    from omegaconf import OmegaConf

    from infinigen import adapter
    from infinigen.offload.census import stand_in_arch

    arch = stand_in_arch(dict(model_cfg.arch), layers, head_dim, positions=positions, narrow=narrow)
    cfg = OmegaConf.create({"name": "stand-in", "dtype": str(model_cfg.dtype), "random_init": True, "seed": 0,
                            "arch": arch})
    return adapter.load(cfg, device=str(device))[0]


def _method(name: str, **overrides):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "method" / f"{name}.yaml"), overrides)
    return instantiate(OmegaConf.create({"data_dir": None, "m": cfg}).m).stand_in()


def _steps(model, method, ids, gen: int, runtime: str = "auto") -> list[dict]:
    """The runtime's own per-step breakdown (CUDA events on a GPU) after one warm-up run."""
    from infinigen.offload.runtime import OffloadRuntime

    rt = OffloadRuntime(model, method, runtime=runtime)
    rt.generate(ids[:, : min(ids.shape[1], 64)], 2)
    return rt.generate(ids, gen).breakdown[2:]


def _per_step(model, method, ids, measure: str | tuple, threaded: bool | None = None, runtime: str = "auto"):
    """What the census's OpCounter counts (`measure`, or a tuple of them) per steady decode step of the runtime on
    this device, on the launching thread (the link's worker threads are not counted; threaded=False runs their
    jobs inline): counts between the runtime's Timer.begin and Timer.end, the median over steps 1..3."""
    from infinigen.offload import timing
    from infinigen.offload.op_counter import OpCounter
    from infinigen.offload.runtime import OffloadRuntime

    counter = OpCounter(measure)
    marks = []
    begin, end = timing.Timer.begin, timing.Timer.end

    def counted_begin(self):
        marks.append(list(counter.counts))
        begin(self)

    def counted_end(self):
        end(self)
        marks[-1] = [b - a for a, b in zip(marks[-1], counter.counts)]

    timing.Timer.begin, timing.Timer.end = counted_begin, counted_end
    try:
        with counter:
            OffloadRuntime(model, method, runtime=runtime, threaded=threaded).generate(ids, 5)
    finally:
        timing.Timer.begin, timing.Timer.end = begin, end
    per = [statistics.median(step[k] for step in marks[1:4]) for k in range(len(counter.measures))]
    return per if isinstance(measure, tuple) else per[0]


def launch_and_job_us(model_cfg, device, scale: dict) -> tuple[float, float]:
    """(launch_us, job_us): the offloading runtime's decode step on a 16-wide stand-in of the model (its real layer
    count, the model's dtype) on this device, where the device's work is negligible: seconds per step / the ops
    the launching thread dispatches, for full attention; and a held layer's fetch job (offload) on the link's
    worker: its host time beyond its own ops at launch_us."""
    from baselines.full import Full
    from infinigen.offload.plan import Shape

    shape = Shape.of(model_cfg)
    model = _stand_in(model_cfg, shape.layers, 16, 512, device)
    ids = torch.randint(0, 128, (1, 64), device=device)
    ops = _per_step(model, Full(), ids, "ops")
    launch = statistics.median(r["step_ms"] for r in _steps(model, Full(), ids, scale["steps"])) * 1e3 / ops
    offload = _method("offload")
    job_ops = (_per_step(model, offload, ids, "ops", threaded=False) - _per_step(model, offload, ids, "ops")) \
        / shape.layers
    per_job = statistics.median(r["link_host_ms"] for r in _steps(model, offload, ids, scale["steps"])) * 1e3 \
        / shape.layers
    return launch, max(0.0, per_job - job_ops * launch)


def context_rate(model_cfg, device, scale: dict, gather_gbps: float) -> tuple[float, dict]:
    """copy_gbps: the rate the runtime's context-proportional ops reach on this device: its decode step on a
    stand-in at the model's heads and head_dim (2 layers, a narrow residual stream, the KV on the device) at two
    context lengths, for full attention (matmuls over the KV) and 4-bit quantisation (elementwise dequantisation,
    then attention): the extra bytes the census's counter counts streaming per step, over the step's extra
    seconds (CUDA events) less what its extra indexed bytes take at gather_gbps. One rate for every method's
    streamed bytes; the batch makes the device's work, not the host's dispatch, set both steps' time."""
    from infinigen.offload.plan import Shape
    from infinigen.offload.runtime import OffloadRuntime

    shape = Shape.of(model_cfg)
    lo, hi = scale["contexts"]
    batch = scale["batch"]
    model = _stand_in(model_cfg, 2, shape.head_dim, 2 * (hi + 64), device, narrow=True)
    total_bytes = total_s = 0.0
    detail = {}
    for name, method in (("full", _method("full")), ("quant-int4", _method("quant", bits=4, group_size=64))):
        at = {}
        for ctx in (lo, hi):
            ids = torch.randint(0, 128, (batch, ctx), device=device)
            rt = OffloadRuntime(model, method, runtime="ideal")
            rt.generate(ids[:, :64], 2)
            seconds = statistics.median(r["step_ms"] for r in rt.generate(ids, scale["steps"]).breakdown[2:]) / 1e3
            at[ctx] = (seconds, *_per_step(model, method, ids, ("stream", "indexed"), runtime="ideal"))
            del rt
            if device.type == "cuda":
                torch.cuda.empty_cache()
        streamed = at[hi][1] - at[lo][1]
        dt = at[hi][0] - at[lo][0] - (at[hi][2] - at[lo][2]) / (gather_gbps * 1e9)
        detail[name] = round(streamed / dt / 1e9, 1) if dt > 0 else None
        total_bytes += streamed
        total_s += max(dt, 0.0)
    if total_s <= 0:
        raise RuntimeError(f"context_rate: the longer context was not slower ({detail}): a host-bound device?")
    return total_bytes / total_s / 1e9, detail


def device_gather_gbps(device, dtype, scale: dict, timed) -> float:
    """index_select of a fifth of the rows of a (batch * heads, context, head_dim) cache on the device (source,
    index and output bytes per second, as the census counts an indexed op)."""
    rows, width = scale["gather_rows"], 128
    src = torch.randn(rows, width, dtype=dtype, device=device)
    index = torch.randint(0, rows, (rows // 5,), device=device)
    out = torch.empty(index.numel(), width, dtype=dtype, device=device)
    moved = sum(t.numel() * t.element_size() for t in (src, index, out))
    return moved / timed(lambda: torch.index_select(src, 0, index, out=out), 5) / 1e9


def link_gbps(device, nbytes: int, timed) -> dict:
    """Host<->device copies of `nbytes`: pinned both ways, pageable host->device."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    nb = device.type == "cuda"
    return {"h2d_gbps": nbytes / timed(lambda: dev.copy_(pinned, non_blocking=nb), 3) / 1e9,
            "d2h_gbps": nbytes / timed(lambda: pinned.copy_(dev, non_blocking=nb), 3) / 1e9,
            "pageable_gbps": nbytes / timed(lambda: dev.copy_(pageable), 3) / 1e9}


def host_gather_rates(dtype, scale: dict, threads: list[int], busy: bool = False) -> dict:
    """Rows of a host pool gathered into a pinned-size landing buffer as the runtime's host gather does it
    (`Link.gather`: sorted row indices split over gather threads, one intra-op thread each), per thread count
    (bytes read + written per second); a runtime without a split gather: one index_select at torch's threads.
    busy: beside a busy launching thread (`beside_busy_thread`), as the runtime gathers."""
    from infinigen.offload import link as link_module

    rows, width = scale["pool_rows"], 256  # 512-byte float16 rows (K|V of head_dim 128)
    pool = torch.empty(rows, width, dtype=dtype).fill_(1.0)  # every page touched (randn of 4 GB takes seconds)
    index = torch.randint(0, rows, (rows // 4,)).sort().values
    out = torch.empty(index.numel(), width, dtype=dtype)
    moved = 2 * out.numel() * out.element_size()
    timed = beside_busy_thread if busy else _timer(torch.device("cpu"))
    rates = {}
    for t in threads:
        if t == 1:  # one thread's rate: no intra-op threads either
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                rates[1] = moved / timed(lambda: torch.index_select(pool, 0, index, out=out), 3) / 1e9
            finally:
                torch.set_num_threads(before)
        elif hasattr(link_module.Link, "gather"):
            link = link_module.Link("cpu", threaded=True, gather_threads=t)
            try:
                on_worker = lambda: link.submit(lambda: link.gather(pool, index, out, None)).result()  # noqa: E731
                rates[t] = moved / timed(on_worker, 3) / 1e9
            finally:
                link.close()
        else:
            before = torch.get_num_threads()
            torch.set_num_threads(t)
            try:
                rates[t] = moved / timed(lambda: torch.index_select(pool, 0, index, out=out), 3) / 1e9
            finally:
                torch.set_num_threads(before)
    return rates


def beside_busy_thread(fn, repeats: int) -> float:
    """Median seconds of fn() while another thread keeps one core busy without holding the GIL, as the runtime's
    launching thread does through a decode step (dispatching ops, or spin-waiting at a synchronisation or an event:
    CUDA spins while a process has fewer contexts than cores). A gather whose threads take every core then shares
    one of them (this CPU, 2 cores: 0.64-0.67 of its rate alone at 2 threads, unchanged at 1)."""
    data = bytes(1 << 20)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()  # releases the GIL for buffers this large

    neighbour = threading.Thread(target=busy, daemon=True)
    neighbour.start()
    try:
        return best(fn, repeats)
    finally:
        stop.set()
        neighbour.join()


def physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs of /proc/cpuinfo: the cores torch's intra-op threads default to."""
    try:
        pairs, phys = set(), None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                phys = value.strip()
            elif key.strip() == "core id":
                pairs.add((phys, value.strip()))
        return len(pairs) or None
    except OSError:
        return None


SCALES = {  # cuda: the real thing (~40 s on an H200); smoke: the same code at toy sizes on a CPU (CI)
    "cuda": {"weight_layers": 8, "rows": 1024, "link_bytes": 1 << 30, "gather_rows": 1 << 22, "pool_rows": 1 << 23,
             "contexts": (1024, 4096), "batch": 96, "steps": 8},
    "smoke": {"weight_layers": 1, "rows": 16, "link_bytes": 1 << 20, "gather_rows": 1 << 12, "pool_rows": 1 << 14,
              "contexts": (64, 1024), "batch": 2, "steps": 6},
}


def cuda_profile(model: str = "opt-13b", device: str = "cuda", smoke: bool = False) -> dict:
    """A profile of this machine's GPU (dispatch: ops) for the performance model; each field measured here:

      launch_us          the runtime's decode step on a 16-wide stand-in of --model (its layer count, the model's
                         dtype): seconds per step / ops dispatched (host-bound: the device's work is negligible)
      job_us             a held layer's fetch job on the link's worker: host time beyond its ops
      matmul_tflops      1024 rows through distinct weights of --model's layers (the tensor cores' rate at its
                         shapes and dtype); memory_gbps: 1 row through the same weights (how decode streams them)
      h2d_gbps, d2h_gbps 1 GiB pinned copies; pageable_gbps: 1 GiB pageable host->device
      copy_gbps          the runtime's context-proportional ops (full attention, 4-bit dequantisation; the KV
                         on the device, batch 96, 1024 and 4096 tokens): the census counter's extra streamed bytes
                         per step over the step's extra seconds (`context_rate`)
      gather_gbps        index_select of rows on the device (source + index + output bytes)
      host_gbps          the runtime's host gather at its gather thread count (bytes read + written) beside a
                         busy launching thread, as it runs; host_op_gbps one thread alone; host_gbps_threads per
                         thread count alone; host_gbps_threads_busy beside a busy thread, at the runtime's
                         threads and at every core (the 2f67c00 runtime's arrangement)
      device_memory_gib  the device's memory
    """
    from omegaconf import OmegaConf

    from infinigen.offload.plan import Shape

    t_start = time.perf_counter()
    dev = torch.device(device)
    scale = SCALES["smoke" if smoke else "cuda"]
    model_cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml")
    dtype = getattr(torch, str(model_cfg.dtype))
    shape = Shape.of(model_cfg)
    timed = _timer(dev)

    def progress(what: str) -> None:
        print(f"  [{time.perf_counter() - t_start:5.1f} s] {what}", flush=True)

    out: dict = {"name": f"{torch.cuda.get_device_name(dev).lower().replace(' ', '_')}_measured"
                 if dev.type == "cuda" else "smoke"}
    weights = _layer_weights(shape, dtype, dev, min(shape.layers, scale["weight_layers"]))
    x = {w.shape[1]: torch.randn(scale["rows"], w.shape[1], dtype=dtype, device=dev) for w in weights}
    x1 = {k: v[:1] for k, v in x.items()}
    flops = sum(2 * scale["rows"] * w.numel() for w in weights)
    out["matmul_tflops"] = round(flops / timed(lambda: [torch.nn.functional.linear(x[w.shape[1]], w)
                                                         for w in weights], 5) / 1e12, 2)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    out["memory_gbps"] = round(nbytes / timed(lambda: [torch.nn.functional.linear(x1[w.shape[1]], w)
                                                        for w in weights], 5) / 1e9, 1)
    del weights, x, x1
    progress(f"matmul {out['matmul_tflops']} TFLOP/s, weights streamed at {out['memory_gbps']} GB/s")
    out.update({k: round(v, 2) for k, v in link_gbps(dev, scale["link_bytes"], timed).items()})
    progress(f"pinned h2d {out['h2d_gbps']} / d2h {out['d2h_gbps']} GB/s, pageable h2d {out['pageable_gbps']} GB/s")
    if dev.type != "cuda":
        out["h2d_gbps"] = out["d2h_gbps"] = None  # (a smoke run: the host is the device)
    launch, job = launch_and_job_us(model_cfg, dev, scale)
    out["launch_us"], out["job_us"] = round(launch, 2), round(job, 1)
    progress(f"launch {out['launch_us']} us/op, link job {out['job_us']} us")
    out["gather_gbps"] = round(device_gather_gbps(dev, dtype, scale, timed), 1)
    copy, detail = context_rate(model_cfg, dev, scale, out["gather_gbps"])
    out["copy_gbps"] = round(copy, 1)
    progress(f"device gather {out['gather_gbps']} GB/s, context ops {out['copy_gbps']} GB/s ({detail})")
    from infinigen.offload import link as link_module

    threads = getattr(link_module, "default_gather_threads", torch.get_num_threads)()
    rates = host_gather_rates(dtype, scale, sorted({1, 4, 8, threads, torch.get_num_threads()}))
    out["host_gbps"], out["host_op_gbps"] = round(rates[threads], 2), round(rates[1], 2)
    out["host_gbps_threads"] = {t: round(r, 2) for t, r in rates.items()}
    cores = physical_cores() or os.cpu_count() or threads
    busy = host_gather_rates(dtype, scale, sorted({threads, cores}), busy=True)
    out["host_gbps_threads_busy"] = {t: round(r, 2) for t, r in busy.items()}
    out["host_gbps"] = out["host_gbps_threads_busy"][threads]  # as the runtime gathers: its launching thread busy
    progress(f"host gather {out['host_gbps_threads']} GB/s by threads (runtime: {threads}); beside a busy "
             f"launching thread {out['host_gbps_threads_busy']}")
    out["device_memory_gib"] = round((torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda"
                                      else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30, 1)
    out["dispatch"] = "ops"
    out["machine"] = (f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor()}; host "
                      f"{os.cpu_count()} CPUs, {physical_cores()} physical cores, torch {torch.__version__} with "
                      f"{torch.get_num_threads()} intra-op threads; runtime gather threads {threads}")
    out["weights_of"] = model
    out["calibrate_s"] = round(time.perf_counter() - t_start, 1)
    return out


def main(argv=None) -> dict:
    steady_allocator()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "conf" / "hardware" / "local.yaml"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default=None, help="conf/model whose weight shapes the matmul rates use (default: "
                   "smollm2-135m; --device cuda: opt-13b)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: this machine as host and device (dispatch: stand_in); cuda: its GPU (dispatch: ops)")
    p.add_argument("--smoke", action="store_true", help="--device cuda's code at toy sizes on the CPU (a dry run)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda" or args.smoke
    args.model = args.model or ("opt-13b" if gpu else "smollm2-135m")
    if not (ROOT / "conf" / "model" / f"{args.model}.yaml").is_file():
        sys.exit(f"error: --model: conf/model/{args.model}.yaml does not exist")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no CUDA device is visible")
    if gpu:
        if args.out == p.get_default("out"):
            args.out = str(ROOT / "conf" / "hardware" / ("cuda_measured.yaml" if not args.smoke else "smoke.yaml"))
        profile = cuda_profile(args.model, "cpu" if args.smoke else "cuda", smoke=args.smoke)
        text = (f"# Measured on this machine's GPU by `python -m experiments.calibrate --device cuda --model "
                f"{args.model}` ({profile['calibrate_s']} s).\n" if not args.smoke else
                "# A dry run of `calibrate --device cuda` at toy sizes on a CPU: not a profile of anything.\n")
        return write_profile(args.out, text, profile)
    profile = calibrate(args.repeats, args.model)
    text = "# Measured on this machine by `python -m experiments.calibrate` (a CPU: the host is the device).\n"
    return write_profile(args.out, text, profile)


def write_profile(out: str, header: str, profile: dict) -> dict:
    """The profile as YAML under its header comment, and printed."""
    import yaml

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(header + yaml.safe_dump(profile, sort_keys=False))
    for k, v in profile.items():
        print(f"{k:>18}: {v}")
    print(f"-> {out}")
    return profile


if __name__ == "__main__":
    main()
