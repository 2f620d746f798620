"""Calibrate the performance model to this machine: a hardware profile measured, not looked up.

    python -m experiments.calibrate                 # writes conf/hardware/local.yaml (hardware=local)

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
import os
import platform
import statistics
import sys
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

    from infinigen.offload.perf import Shape

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
    from infinigen.offload.census import OpCounter, stand_in_arch
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
        "dispatch": "stand_in",  # per segment: the runtime's code timed here at the run's size (perf.DISPATCH)
    }


def main(argv=None) -> dict:
    steady_allocator()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "conf" / "hardware" / "local.yaml"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m", help="conf/model whose weight shapes the matmul rates use")
    args = p.parse_args(argv)
    if not (ROOT / "conf" / "model" / f"{args.model}.yaml").is_file():
        sys.exit(f"error: --model: conf/model/{args.model}.yaml does not exist")
    profile = calibrate(args.repeats, args.model)
    import yaml

    text = "# Measured on this machine by `python -m experiments.calibrate` (a CPU: the host is the device).\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + yaml.safe_dump(profile, sort_keys=False))
    for k, v in profile.items():
        print(f"{k:>18}: {v}")
    print(f"-> {args.out}")
    return profile


if __name__ == "__main__":
    main()
