"""Op and host-sync census: what each method's code dispatches on the thread that launches kernels.

    python experiments/bench_ops.py                                    # decode + sim, every conf/method
    python experiments/bench_ops.py --part decode --methods full infinigen --prompts 512 --batches 1
    python experiments/bench_ops.py --set h2o.heavy=0.2 --methods h2o --results results   # + store rows
    make bench-ops                                                     # = the first line, rows into results/

On a GPU every dispatched aten op is a kernel launch (~5-10 us of host time) and every host synchronisation
makes the host wait for the device: the launch queue drains and the next kernels start late. Both are properties
of the code path, not of the hardware, so they are counted here on a CPU, with a TorchDispatchMode on the main
thread (`SyncCounter`, infinigen/offload/op_counter.py: the census's sync rule, `sync_name`):

  ops     aten ops dispatched (views included, as infinigen/offload/census.py counts them; `nonview_ops` in the
          rows leaves views out). Under inference_mode a composite op (item, einsum, repeat_interleave, sdpa)
          reaches the mode whole: it is counted by the ops its decomposition runs, as outside inference_mode
  syncs   ops that make the host wait for the device: `.item()`/int/float/bool of a tensor
          (aten._local_scalar_dense), is_nonzero, equal, allclose, nonzero/argwhere/torch.where(mask),
          masked_select, unique*, bincount, one_hot without num_classes, repeat_interleave with tensor repeats and
          no output_size, indexing and index_put with a bool/uint8 mask, every op aten tags dynamic_output_shape
          or data_dependent_output, and blocking device->host copies (`_to_copy`/`copy_` from a device tensor into
          host memory without non_blocking, or into memory that is not pinned). On a CPU run every tensor stands
          in for a device tensor, and a main-thread `.cpu()`, `.to("cpu")` (a string target: `.to(x.device)`
          is the device itself), `.tolist()` or `.numpy()` (no op of its own on a CPU tensor) is counted as the
          device->host copy it is on CUDA. With `--device cuda` only ops on device tensors count (an `.item()`
          of a host tensor waits for nothing). Each sync is also counted by where the repository's code asked
          for it (`sync_sites`: "op @ file:line").
  waits   the main thread blocking on the runtime's link: `concurrent.futures.Future.result` (a fetch's host
          work on the worker thread, a pool's queued scatters) and event / stream / device synchronisations
          (`NoEvent.synchronize`, their CPU stand-in). Counted by wrapping those calls from outside.

Dispatch modes are thread-local: ops run on the runtime's worker thread (host-side gathers and scatters into
pinned buffers) are host-side work that never delays a launch, and are not counted. Decode points run the
runtime's CUDA code path on the CPU (`threaded=True, copies=True`: the link's host work on its worker thread,
fetched rows landing in staging slots), so the main thread does here what it does on a GPU; `--inline` runs the
CPU default instead (host work inline on the main thread, counted).

Two parts:

  decode  OffloadRuntime.generate (runtime="auto"; full also under runtime="ideal") on tiny-llama-gqa and
          tiny-opt (random weights; max_position_embeddings raised to fit the prompt), at each --prompts x
          --batches: per steady decode step (the runtime's Timer.begin .. Timer.end, after --skip steps, the last
          step dropped: it prefetches nothing for a next one) ops, syncs and waits, in total and per layer
  sim     one sim-mode forward (modes.sim_logits, dense_rows=0; methods that compress a prompt get half the
          tokens as their prompt) at each --sim-tokens on tiny-llama-gqa and smollm2-135m's shape with random
          weights (model.random_init=true). The method's bind (InfiniGen's calibration) runs once before and is
          not counted. A sim forward syncs the host once, in transformers (SIM_MASK_SYNC); closed-form methods
          dispatch as many ops at every length from 1024 to 8192 tokens (rows.chunk_rows); H2O (both readings) and TOVA (SEQUENTIAL)
          replay their decoded rows in order, a few ops per row and layer, and a point whose projected time exceeds
          --sim-budget seconds is skipped (said so in the table and in its row)

Every method runs as its `stand_in()` (the contract's copy for random weights: InfiniGen calibrates on random
ids, no data folder is read). With --results DIR every point is a row of that store (task `ops`,
metrics.benchmark = "ops"); `make export WHERE="task=ops"` copies them into docs/store and `make report` turns
them into the op/sync sections of docs/results.md (analysis/ops.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from analysis import store  # noqa: E402
from experiments import identity  # noqa: E402
from experiments.bench_sim import build_method, chosen_methods  # noqa: E402
from infinigen import adapter, modes  # noqa: E402
from infinigen.offload import timing  # noqa: E402
from infinigen.offload.op_counter import SyncCounter  # noqa: E402
from infinigen.offload.runtime import OffloadRuntime  # noqa: E402

METHOD_DIR = ROOT / "conf" / "method"
MODEL_DIR = ROOT / "conf" / "model"
DECODE_MODELS = ("tiny-llama-gqa", "tiny-opt")
SIM_MODELS = ("tiny-llama-gqa", "smollm2-135m")
PROMPTS, BATCHES, SIM_TOKENS = (512, 2048), (1, 8), (512, 1024, 2048)
STEPS, SKIP = 12, 2  # decode steps per point; steady = steps [SKIP, STEPS - 1) (an evicting method does not evict
# at every step: H2O's budgets grow every 1/fraction tokens, and its nonzero runs only at the steps that evict)
SIM_BUDGET = 120.0  # seconds a sim point may be projected to take before it is skipped
# The one host sync a sim forward keeps, whatever the method (full attention's too): transformers'
# create_causal_mask, given no attention mask and no cache, checks the position ids for packed sequences
# (masking_utils.find_packed_sequence_indices: `(packed_sequence_mask[:, -1] == 0).all()` read on the host), once
# per forward, before it calls the mask function the adapter registers, so no mask function avoids it.
# `modes.sim_*` through `adapter.final_hidden` is where the repository's code asks for it.
SIM_MASK_SYNC = {"is_nonzero": 1}
SIM_MASK_SITE = "infinigen/adapter/layers.py"
# methods whose exact semantics evict in order, one decoded row at a time (infinigen/shared/eviction.py replays their
# rows): their ops grow with t by a few per decoded row and layer; every other method's sim forward is closed-form
SEQUENTIAL = ("h2o", "tova", "h2o_reference")
# the paper's rows: (method, runtime) whose steady decode step must not synchronise the host (tests/test_bench_ops)
PAPER_ROWS = (("full", "ideal"), ("full", "auto"), ("offload", "auto"), ("quant", "auto"), ("h2o", "auto"),
              ("infinigen", "auto"))


# ----------------------------------------------------------------------------------------------- decode


@contextmanager
def step_snapshots(counter: SyncCounter, out: list):
    """(begin, end) snapshots of the counter around each decode step: the runtime's own step, Timer.begin ..
    Timer.end (its marks are CUDA events on a GPU, so they cannot carry counts themselves)."""
    Timer = timing.Timer
    begin, end = Timer.begin, Timer.end

    def counted_begin(self):
        out.append([counter.snapshot(), None])
        begin(self)

    def counted_end(self):
        end(self)
        out[-1][1] = counter.snapshot()

    Timer.begin, Timer.end = counted_begin, counted_end
    try:
        yield
    finally:
        Timer.begin, Timer.end = begin, end


def model_config(name: str, positions: int = 0, random_init: bool = True):
    cfg = OmegaConf.load(MODEL_DIR / f"{name}.yaml")
    cfg.random_init = random_init
    if positions > int(cfg.arch.get("max_position_embeddings") or 0):
        cfg.arch.max_position_embeddings = positions
    return cfg


def layers_of(model) -> int:
    return len(adapter.attention_layers(model))


def decode_point(model, method, runtime: str, batch: int, prompt: int, steps: int = STEPS, skip: int = SKIP,
                 inline: bool = False, seed: int = 0) -> dict:
    """Counts of the steady decode steps of one OffloadRuntime.generate run (a fresh stand-in of `method`)."""
    if steps < skip + 2:
        raise ValueError(f"steps must be >= skip + 2 (skip={skip}: the steady steps lie between), got {steps}")
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(seed)).to(device)
    extra = {} if inline else {"threaded": True, "copies": True}  # the CUDA code path
    rt = OffloadRuntime(model, method.stand_in(), runtime=runtime, **extra)
    counter, marks = SyncCounter(device), []
    t0 = time.perf_counter()
    with step_snapshots(counter, marks), counter:
        report = rt.generate(ids, steps)
    seconds = time.perf_counter() - t0
    if len(marks) != steps or any(end is None for _, end in marks):
        raise RuntimeError(f"expected {steps} decode steps between Timer.begin/end, saw {len(marks)}")
    deltas = [end - begin for begin, end in marks][skip:-1]
    n, layers = len(deltas), layers_of(model)
    ops = statistics.median(d.ops for d in deltas)
    syncs = [sum(d.syncs.values()) for d in deltas]
    waits = [sum(d.waits.values()) for d in deltas]
    total_syncs, total_waits = sum((d.syncs for d in deltas), Counter()), sum((d.waits for d in deltas), Counter())
    return {
        "kind": report.kind, "layers": layers, "steps_counted": n, "seconds": seconds,
        "ops_per_step": ops, "ops_per_layer_step": ops / layers,
        "nonview_ops_per_step": statistics.median(d.nonview for d in deltas),
        "ops_steps": [d.ops for d in deltas],
        "syncs_per_step": sum(syncs) / n, "syncs_per_layer_step": sum(syncs) / n / layers, "syncs_max_step": max(syncs),
        "sync_ops": {k: v / n for k, v in sorted(total_syncs.items())},
        "sync_sites": {k: v / n for k, v in sorted(sum((d.sites for d in deltas), Counter()).items())},
        "waits_per_step": sum(waits) / n, "waits_per_layer_step": sum(waits) / n / layers,
        "wait_calls": {k: v / n for k, v in sorted(total_waits.items())},
    }


# ----------------------------------------------------------------------------------------------- sim


def sim_point(model, method, tokens: int, dense_rows: int = 0, seed: int = 0) -> dict:
    """Counts of one sim-mode forward (modes.sim_logits) of `tokens` random ids; the method's bind has run once
    before (a calibration is cached per model), so it is not counted."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    method = method.stand_in()
    with adapter.install(model, method, mode="sim", dense_rows=dense_rows, max_len=tokens):
        pass  # bind: calibrations happen (and are cached) here, outside the count
    method.reset_stats()
    counter = SyncCounter(device)
    t0 = time.perf_counter()
    with counter:
        modes.sim_logits(model, method, ids, dense_rows=dense_rows)
    seconds = time.perf_counter() - t0
    layers = layers_of(model)
    return {"layers": layers, "seconds": seconds, "ops": counter.ops, "ops_per_layer": counter.ops / layers,
            "nonview_ops": counter.nonview, "syncs": counter.sync_total, "syncs_per_layer": counter.sync_total / layers,
            "sync_ops": dict(sorted(counter.syncs.items())), "sync_sites": dict(sorted(counter.sites.items())),
            "waits": sum(counter.waits.values()),
            "kv_fraction": method.stats.summary().get("kv_fraction")}


# ----------------------------------------------------------------------------------------------- rows


def method_params(name: str, method_cfg) -> dict:
    cfg = OmegaConf.to_container(method_cfg, resolve=True)
    cfg.pop("calib_data_dir", None)  # a location, not what is computed (infinigen/semantic.py NON_SEMANTIC_METHOD)
    return cfg


def write_row(results: str, model_cfg, method: str, mcfg: dict, overrides: list[str], task: dict, metrics: dict,
              device: str) -> None:
    config = {"benchmark": "ops", "model": OmegaConf.to_container(model_cfg, resolve=True),
              "method": mcfg, "task": task, "device": device}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    meta = {"git_commit": identity.git_commit(), "versions": identity.versions(), "device": device,
            "threads": torch.get_num_threads(), "host": platform.node(),
            "finished": datetime.now(timezone.utc).isoformat()}
    params = {"name": method, **{k: v for k, v in mcfg.items() if k != "_target_"}}
    row = {"config_hash": digest, "model": model_cfg.name, "method": method, "task": "ops", "data": {},
           "method_params": params, "task_params": {"name": "ops", **task, "overrides": overrides},
           "metrics": {"benchmark": "ops", "mode": task["mode"], **metrics}, "config": config, "meta": meta}
    store.append_rows(results, digest, [row])


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("decode", "sim", "both"), default="both")
    p.add_argument("--methods", nargs="*", default=None, help="conf/method names (default: all of them)")
    p.add_argument("--set", action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="override a method hyperparameter, e.g. h2o.heavy=0.2 (repeatable)")
    p.add_argument("--models", nargs="*", default=list(DECODE_MODELS), help="decode: conf/model names (random init)")
    p.add_argument("--prompts", type=int, nargs="*", default=list(PROMPTS), help="decode: prompt lengths")
    p.add_argument("--batches", type=int, nargs="*", default=list(BATCHES), help="decode: batch sizes")
    p.add_argument("--steps", type=int, default=STEPS, help="decode steps per point (prefill excluded)")
    p.add_argument("--skip", type=int, default=SKIP, help="first decode steps not counted (the last never is)")
    p.add_argument("--no-ideal", action="store_true", help="decode: leave out full's runtime=ideal row")
    p.add_argument("--inline", action="store_true",
                   help="decode: the runtime's CPU default (link work inline on the main thread, counted) instead "
                        "of its CUDA code path (worker thread, landing buffers)")
    p.add_argument("--sim-models", nargs="*", default=list(SIM_MODELS), help="sim: conf/model names (random init)")
    p.add_argument("--sim-tokens", type=int, nargs="*", default=list(SIM_TOKENS), help="sim: sequence lengths")
    p.add_argument("--sim-budget", type=float, default=SIM_BUDGET,
                   help="sim: skip a point projected (from the method's previous lengths: `project`) to take "
                        "longer than this many seconds")
    p.add_argument("--sites", action="store_true", help="decode: print where each sync was asked for (file:line)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--data-dir", default=os.environ.get("DATA_DIR") or str(ROOT.parent / "shared" / "data"))
    p.add_argument("--results", default=None, help="also write one row per point into this results store")
    return p.parse_args(argv)


def resolve_methods(args) -> tuple[list[str], dict[str, list[str]], dict]:
    names, overrides = chosen_methods(args.methods, args.set)
    configs = {}
    for name in names:
        cfg = OmegaConf.merge(OmegaConf.load(METHOD_DIR / f"{name}.yaml"),
                              OmegaConf.from_dotlist(overrides.get(name, [])))
        configs[name] = OmegaConf.create({"data_dir": args.data_dir, "method": cfg}).method
    return names, overrides, configs


def label(name: str, overrides: dict) -> str:
    return name + "".join(f" {o}" for o in overrides.get(name, []))


def fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def sync_text(counts: dict) -> str:
    return ", ".join(f"{k} {fmt(v)}" for k, v in counts.items()) or "-"


def run_decode(args, names, overrides, configs) -> list[dict]:
    out = []
    positions = max(args.prompts) + args.steps + 1
    header = (f"{'method':<24} {'runtime':<7} {'model':<15} {'batch':>5} {'prompt':>6} {'ops/step/layer':>14} "
              f"{'syncs/step/layer':>16} {'ops/step':>8} {'syncs/step':>10} {'waits/step':>10}  sync ops")
    print(f"\n# decode: steady steps {args.skip}..{args.steps - 2} of {args.steps} through OffloadRuntime "
          f"({'inline link work' if args.inline else 'CUDA code path: threaded=True, copies=True'}), "
          f"device={args.device}, main thread only\n{header}", flush=True)
    for model_name in args.models:
        model_cfg = model_config(model_name, positions)
        model, _ = adapter.load(model_cfg, device=args.device)
        for name in names:
            method = build_method(name, overrides.get(name, []), args.data_dir)
            runtimes = ["auto"] + (["ideal"] if name == "full" and not args.no_ideal else [])
            for runtime in runtimes:
                for batch in args.batches:
                    for prompt in args.prompts:
                        m = decode_point(model, method, runtime, batch, prompt, args.steps, args.skip, args.inline)
                        point = {"mode": "decode", "method": name, "label": label(name, overrides), "runtime": runtime,
                                 "model": model_name, "batch": batch, "prompt": prompt, **m}
                        out.append(point)
                        print(f"{point['label']:<24} {runtime:<7} {model_name:<15} {batch:>5} {prompt:>6} "
                              f"{m['ops_per_layer_step']:>14.1f} {m['syncs_per_layer_step']:>16.2f} "
                              f"{fmt(m['ops_per_step']):>8} {fmt(m['syncs_per_step']):>10} "
                              f"{fmt(m['waits_per_step']):>10}  {sync_text(m['sync_ops'])}", flush=True)
                        if args.sites:
                            for site, n in m["sync_sites"].items():
                                print(f"    {fmt(n)}/step  {site}", flush=True)
                        if args.results:
                            task = {"mode": "decode", "runtime": runtime, "batch_size": batch, "prompt_len": prompt,
                                    "steps": args.steps, "skip": args.skip, "inline": args.inline}
                            write_row(args.results, model_cfg, name, method_params(name, configs[name]),
                                      overrides.get(name, []), task, m, args.device)
        del model
    return out


def project(measured: list[tuple[int, float]], n: int) -> float:
    """Seconds a sim point of n tokens is expected to take: the last measured point's, grown with the exponent
    of the last two (between 1: linear layers, and 2: attention or per-row loops over a growing context), or
    quadratically from a single point."""
    if not measured:
        return 0.0
    (n1, s1), (n2, s2) = measured[-2] if len(measured) > 1 else measured[-1], measured[-1]
    exponent = 2.0 if n1 == n2 else min(2.0, max(1.0, math.log(max(s2, 1e-9) / max(s1, 1e-9)) / math.log(n2 / n1)))
    return s2 * (n / n2) ** exponent


def run_sim(args, names, overrides, configs) -> list[dict]:
    out = []
    tokens = sorted(args.sim_tokens)
    header = (f"{'method':<24} {'model':<15} {'tokens':>6} {'dense':>5} {'ops':>10} {'ops/layer':>10} {'syncs':>8} "
              f"{'seconds':>8}  sync ops")
    print(f"\n# sim: one modes.sim_logits forward of random ids, device={args.device}, main thread only\n{header}",
          flush=True)
    for model_name in args.sim_models:
        model_cfg = model_config(model_name, max(tokens) + 1)
        model, _ = adapter.load(model_cfg, device=args.device)
        for name in names:
            method = build_method(name, overrides.get(name, []), args.data_dir)
            measured = []  # (tokens, seconds) of this method's points so far
            for n in tokens:
                dense = n // 2 if method.needs_prompt else 0
                point = {"mode": "sim", "method": name, "label": label(name, overrides), "model": model_name,
                         "tokens": n, "dense_rows": dense}
                projected = project(measured, n)
                if projected > args.sim_budget:
                    point.update(skipped=f"projected {projected:.0f} s > --sim-budget {args.sim_budget:g} s")
                    m = {"skipped": point["skipped"], "projected_seconds": projected}
                    print(f"{point['label']:<24} {model_name:<15} {n:>6} {dense:>5}  skipped: {point['skipped']}",
                          flush=True)
                else:
                    m = sim_point(model, method, n, dense)
                    measured.append((n, m["seconds"]))
                    point.update(m)
                    print(f"{point['label']:<24} {model_name:<15} {n:>6} {dense:>5} {m['ops']:>10} "
                          f"{m['ops_per_layer']:>10.1f} {m['syncs']:>8} {m['seconds']:>8.1f}  "
                          f"{sync_text(m['sync_ops'])}", flush=True)
                out.append(point)
                if args.results:
                    task = {"mode": "sim", "tokens": n, "dense_rows": dense, "budget_s": args.sim_budget}
                    write_row(args.results, model_cfg, name, method_params(name, configs[name]),
                              overrides.get(name, []), task, m, args.device)
        del model
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    names, overrides, configs = resolve_methods(args)
    print(f"# bench_ops: torch {torch.__version__}, threads={torch.get_num_threads()}, methods: "
          + ", ".join(label(n, overrides) for n in names), flush=True)
    out = []
    if args.part in ("decode", "both"):
        out += run_decode(args, names, overrides, configs)
    if args.part in ("sim", "both"):
        out += run_sim(args, names, overrides, configs)
    if args.results:
        print(f"\n[bench_ops] {len(out)} row(s) written to {Path(args.results) / 'rows'}")
    return out


if __name__ == "__main__":
    main()
