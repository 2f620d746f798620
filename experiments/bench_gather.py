"""The offloading runtime's host gather against a plain copy of the same bytes, with the same threads.

InfiniGen's selected rows are scattered over a layer's host pool; the runtime gathers them with `Link.gather`
(index_select in slices into a pinned landing buffer, each slice's host->device copy issued as soon as it is
gathered), on its fetch worker with `gather_threads` intra-op threads. What it can reach is what the same threads
reach copying the same number of bytes contiguously: this prints both rates and their ratio (and, on CUDA, the
landing buffer's copy to the device).

    python -m experiments.bench_gather                      # this machine's cores, the runtime's default threads
    python -m experiments.bench_gather --threads 1 2 --pool-mib 512 --row-bytes 512 --fraction 0.2
    python -m experiments.bench_gather --threads 2 1 --beside-busy-thread  # + the gather while another thread
                    # keeps a core busy, as the runtime's launching thread does (dispatching, or spin-waiting on the
                    # device): a gather on every core shares one (why the runtime leaves one to that thread)
"""

from __future__ import annotations

import argparse

import torch

from experiments.calibrate import beside_busy_thread
from experiments.calibrate import best as timed  # median seconds of repeated calls after an untimed one
from infinigen.offload.link import Link, default_gather_threads


def selection(slots: int, heads: int, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """Flat pool rows (slot * heads + head) of `fraction` of each head's slots, ascending: what the runtime's
    gather job receives (infinigen/offload/executors.py sorted_rows)."""
    k = max(1, int(slots * fraction))
    picks = torch.rand(heads, slots, generator=gen).argsort(-1)[:, :k]  # (heads, k)
    return (picks * heads + torch.arange(heads)[:, None]).reshape(-1).sort().values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[default_gather_threads()])
    p.add_argument("--pool-mib", type=int, default=512, help="one layer's host pool")
    p.add_argument("--row-bytes", type=int, default=512, help="one (token, KV head) row: K|V of head_dim 128, fp16")
    p.add_argument("--heads", type=int, default=64, help="batch x KV heads of the pool")
    p.add_argument("--fraction", type=float, default=0.2, help="share of each head's rows selected")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--beside-busy-thread", action="store_true",
                   help="also the gather while another thread keeps a core busy (the runtime's launching thread)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    width = args.row_bytes // 2
    slots = args.pool_mib * 2**20 // args.row_bytes // args.heads
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(slots * args.heads, width, generator=gen).half()
    if cuda:
        pool = pool.pin_memory()
    index = selection(slots, args.heads, args.fraction, gen)
    m = index.numel()
    nbytes = m * args.row_bytes
    landing = torch.empty(m, width, dtype=pool.dtype, pin_memory=cuda)
    dev = torch.empty(m, width, dtype=pool.dtype, device="cuda") if cuda else None
    print(f"# pool {args.pool_mib} MiB of {args.row_bytes}-byte rows ({args.heads} heads x {slots} slots); "
          f"{m} rows selected ({nbytes / 2**20:.0f} MiB){'; CUDA ' + torch.cuda.get_device_name() if cuda else ''}")
    print(f"{'threads':>7} {'gather GB/s':>11} {'copy GB/s':>9} {'gather/copy':>11}"
          + (f" {'beside a busy thread GB/s':>25}" if args.beside_busy_thread else "")
          + (f" {'gather+copy to device GB/s':>26}" if cuda else ""))
    for threads in args.threads:
        link = Link("cuda" if cuda else "cpu", threaded=True, gather_threads=threads)
        on_worker = lambda fn: link.submit(fn).result()  # the fetch worker, as the runtime runs a gather
        gather_s = timed(lambda: on_worker(lambda: link.gather(pool, index, landing, None)), args.repeats)
        copy_s = timed(lambda: on_worker(lambda: landing.copy_(pool[:m])), args.repeats)
        line = f"{threads:>7} {nbytes / gather_s / 1e9:>11.2f} {nbytes / copy_s / 1e9:>9.2f} {copy_s / gather_s:>11.2f}"
        if args.beside_busy_thread:
            beside_s = beside_busy_thread(lambda: on_worker(lambda: link.gather(pool, index, landing, None)),
                                          args.repeats)
            line += f" {nbytes / beside_s / 1e9:>25.2f}"
        if cuda:
            def to_device():
                link.gather(pool, index, landing, dev)
                torch.cuda.synchronize()
            line += f" {nbytes / timed(lambda: on_worker(to_device), args.repeats) / 1e9:>26.2f}"
        link.close()
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
