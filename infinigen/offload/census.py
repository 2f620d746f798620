"""Kernel census: what the offloading runtime's own code does per layer, segment and decode step for a method,
counted by running it on a small stand-in of the model (same family, heads and KV heads, layer count up to the
method's steady state; tiny head_dim, FFN and vocabulary, random weights):

  ops      torch ops dispatched (a property of the code path, not of tensor sizes: the stand-in's are the model's)
  stream   bytes read and written by ops that are not views, per token of context and KV head width unit: the
           census runs at two context lengths and two head_dims, and the part that grows with the context is
           extrapolated (attention over what is attended, the method's per-entry state, its selection, copies)
  indexed  the same for indexed ops (gather, index_select, scatter, ...): random access, priced at a gather rate
  seconds  for a profile of this machine (dispatch: stand_in): each segment's time here on the stand-in at a
           short prompt, where the arithmetic is negligible: the model takes the host segment from it (what
           dispatching a fetch costs; its bytes are priced from the real selection's, not the stand-in's)
  point_seconds  for the same profile: each segment's time here on the stand-in at the run's own prompt length,
           batch (up to 8) and head_dim (a narrow residual stream: the weights are the model's to price): what the
           method's code costs at the run's size, which a zero-width time plus a slope missed by a third for
           InfiniGen's selection at batch 8 (ops over (rows, heads, context) tensors run in another regime than
           over tiny ones: their fixed cost grows with the batch and the head width, and is not linear in context)
  context_seconds  for the same profile: each segment's seconds per (batch row, context token), timed here on
           the stand-in at the model's real heads and head_dim at two context lengths and the run's batch (up to
           8): what the method's context-proportional work costs on this machine (dequantising, scoring, copying,
           attending) past the context point_seconds timed, where one
           bandwidth would price every op alike (a CPU runs a 4-bit unpack far slower per byte than a copy)

  syncs    host synchronisations on the thread that launches kernels (`SYNC_OPS`: a scalar read of a device
           tensor, nonzero, a bool-mask index, a blocking device->host copy, ...): where a GPU's host waits for
           the device to drain, so the ops queued after it start late; per segment
  joins    the same thread blocking on a job of the runtime's link worker (`Future.result`): at a fetch's wait
           (its host work must be done), or elsewhere (the host waits for the worker's queue)
  writebacks  jobs that thread submits to the fetch worker that are not fetches (a pool's write-back of new
           rows): they queue with the fetches, behind the copies already issued
  host     bytes read and written by ops on host tensors, per (batch row, context token) as `stream`: host work
           on the thread that launches kernels (a compaction of indices read back from the device) or on the
           worker besides the gather itself (whose bytes are the selection's, priced from the rows it moves)
  readback bytes the launching thread reads back from the device by a blocking copy (`.cpu()`), per (batch row,
           context token)

The counting measures run the runtime's CUDA code path on the CPU (`copies=True`: fetched rows land in staging
slots, as on a GPU; host work inline, so its ops are kept apart from the launching thread's) with the stand-in
in the model's own dtype (a float16 model's KV bytes are float16 bytes, its casts the ops they are), and tell host
tensors from device ones by where they come from (`HostTensors`): host pools and staging, `.cpu()` results, tensors
made without a device, and what ops on them return. The timed measures run the CPU path as the latency task does.
The counter (`OpCounter`), the sync rule (`SYNC_OPS`) and `HostTensors` live in infinigen/offload/op_counter.py,
shared with experiments/bench_ops.py.

The performance model (infinigen/offload/perf.py) prices ops at the profile's dispatch cost and bytes at its
bandwidths; the weights' bytes and the FLOPs come from the real shapes. Results are cached per method config and
model structure and the source of the code they time (`code_files`: not the performance model, which only reads them).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from infinigen import adapter
from infinigen.offload.op_counter import ROOT, OpCounter, part
from infinigen.offload.runtime import OffloadRuntime

SEGMENTS = ("attention", "speculation", "ffn", "norms", "host")
# steps per stand-in run; the first and the last are dropped and the median of the rest taken, as the latency
# task takes the median of its steps: an evicting method does not evict at every step (H2O's heavy and recent
# counts grow every 1/fraction tokens), and with 3 steps which of them evict depended on the prompt length:
# H2O's stand-in measured a cheaper step at 2048 tokens than at 1024 and the model put it at 0.60x its measured
# batch-8 step; with 10 its typical step is timed
CENSUS_PROMPT, CENSUS_STEPS = 64, 12
# context lengths of the context_seconds slope: the range decode runs here span (an extrapolation past 1024 read
# 10.7-21.2 us/token for full attention's 30 layers in three runs; 256-2048 read 13.2-19.8, the real model 19.6)
CONTEXT_PROMPTS = (256, 2048)
CONTEXT_ROUNDS = 3  # slopes measured in turn; their median (this VM's speed drifts between seconds)
TIMED_REPEATS = 7  # runs of the stand-in per timed census (the median of their steady steps)
CACHE = Path(".cache/infinigen/census")


COUNTS = ("ops", "syncs", "joins", "writebacks")  # per step, counted in one run
BYTES = ("stream", "indexed", "host", "readback")  # per (row, token), counted in the same four runs
MEASURES = COUNTS + BYTES


def stand_in_arch(arch: dict, layers: int, head_dim: int = 16, positions: int = 256, narrow: bool = False) -> dict:
    """The model's structure at toy width: same family, heads, KV heads and layer pattern. narrow: the residual
    stream 16 wide per head whatever the head_dim (Llama's head_dim is its own field; OPT's is hidden / heads), so
    the projections' weights, which the model prices from the real shapes, take next to no time here."""
    heads = int(arch["num_attention_heads"])
    out = {"model_type": arch["model_type"], "num_hidden_layers": layers, "num_attention_heads": heads,
           "vocab_size": 128, "max_position_embeddings": positions}
    if arch["model_type"] == "opt":
        out.update(hidden_size=heads * head_dim, ffn_dim=32, word_embed_proj_dim=heads * head_dim)
    else:
        out.update(hidden_size=heads * (16 if narrow else head_dim), intermediate_size=32, head_dim=head_dim,
                   num_key_value_heads=int(arch.get("num_key_value_heads") or heads),
                   rope_theta=float(arch.get("rope_theta", 10000.0)))
    return out


def _segments(marks: list, fetches: dict, layers: int) -> list[dict]:
    """One step's marks -> per layer {segment: ops}; the ops before layer 0 and after the last layer's MLP (the
    embedding, the final norm, the head) are layer -1's "norms"."""
    per = [dict.fromkeys(SEGMENTS, 0.0) for _ in range(layers + 1)]  # index -1: the step's own ops
    owner, last, layer = ("norms", -1), None, -1
    stack = []
    for name, key, t in marks:
        if last is not None:
            seg, i = owner
            per[i][seg] += t - last
        last = t
        if name == "attn0":
            layer, owner = key, ("attention", key)
        elif name == "attn1":
            owner = ("norms", key)
        elif name == "ffn0":
            owner = ("ffn", key)
        elif name == "ffn1":
            owner = ("norms", key if key < layers - 1 else -1)
        elif name in ("spec0", "wait0"):
            stack.append(owner)
            owner = ("speculation", key) if name == "spec0" else ("host", layer)
        elif name in ("spec1", "wait1"):
            owner = stack.pop()
        elif name == "need":
            per[layer]["host"] += fetches[key]["host_s"]
    return per


def _steady(kinds: list[str]) -> tuple[int, int]:
    steady = next((i for i, k in enumerate(kinds) if k == kinds[-1]), 0)
    return steady, min(len(kinds), steady + 3)


def _spread(small: list[dict], kinds: list[str]) -> list[dict]:
    """Stand-in layers -> the real model's: layer j takes the stand-in layer with its role (dense prefix, first
    steady, middle, last); the step's own entry stays last."""
    steady, n = _steady(kinds)
    real = []
    for j in range(len(kinds)):
        if j < steady + 1:
            real.append(small[j])
        elif j == len(kinds) - 1:
            real.append(small[n - 1])
        else:
            real.append(small[min(steady + 1, n - 2)] if n >= 3 else small[n - 1])
    return real + [small[-1]]


def _cached(ident: list, compute) -> list[dict]:
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = CACHE / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # atomic: concurrent runs (test workers) never read half
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
    return value


@functools.lru_cache(maxsize=None)
def _source(files: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(Path(f).read_bytes())
    return digest.hexdigest()[:16]


# the performance model (infinigen/offload/): it reads a census and never runs in one, so it is not what a census
# measures (a model-only change is checked against the censuses a validation run timed)
MODEL_MODULES = tuple(f"infinigen.offload.{name}" for name in ("perf", "profile", "plan", "roofline", "clock"))


def _module_file(name: str) -> Path | None:
    """The file of project module `name` (a package's __init__.py), None for a name that is not a module (a class
    or function imported from one)."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(path: Path) -> set[str]:
    """Project modules `path` imports, at its top or inside a function, with the packages above each."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in found:
            parts = name.split(".")
            if parts[0] in ("infinigen", "baselines"):
                names |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return names


@functools.lru_cache(maxsize=None)
def _closure(roots: tuple[str, ...]) -> tuple[str, ...]:
    files, todo, seen = set(), list(roots), set()
    while todo:
        name = todo.pop()
        if name in seen or name in MODEL_MODULES:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is not None:
            files.add(str(path))
            todo += sorted(_imported(path))
    return tuple(sorted(files))


def code_files(method) -> list[str]:
    """The code a census of `method` runs: the modules of its class and the classes it builds on, this module (the
    runtime, the adapter), and every project module they import, at any depth, without the performance model. So
    editing one method re-times its own censuses only, and editing the runtime re-times every method's."""
    roots = {c.__module__ for c in type(method).__mro__ if c.__module__.split(".")[0] in ("infinigen", "baselines")}
    roots |= {__name__}
    packages = {".".join(r.split(".")[:i]) for r in roots for i in range(1, r.count(".") + 1)}
    return list(_closure(tuple(sorted(roots | packages))))


def code_fingerprint(method) -> str:
    """A census measures what code_files do: editing them re-measures."""
    return _source(tuple(code_files(method)))


def census(model_cfg, method, runtime: str, batch: int, kinds: list[str], measure: str = "ops",
           prompt: int | None = None) -> list[dict]:
    """Per decode step, for each of the real model's layers {segment: value}, plus the step's own last.
    measure: "ops" / "syncs" / "joins" / "writebacks" (counts per step, at the run's batch up to 2), "seconds"
    (what the runtime's code takes per segment on this machine at zero width: dispatch and Python),
    "point_seconds" (the same at the run's `prompt`, batch up to 8 and head_dim: see the module doc), "stream" /
    "indexed" / "host" (bytes per (batch row, context token), at the real head_dim: see the module doc)."""
    steady, n = _steady(kinds)
    dtype = str(model_cfg.get("dtype") or "float32")
    ident = [type(method).__name__, _params(method), runtime, stand_in_arch(dict(model_cfg.arch), n), measure,
             torch.__version__, code_fingerprint(method)] + ([TIMED_REPEATS] if "seconds" in measure else [])
    ident += [] if dtype == "float32" else [dtype]  # (float32 censuses keep the keys they had)
    d = int(dict(model_cfg.arch).get("head_dim") or model_cfg.arch.hidden_size // model_cfg.arch.num_attention_heads)
    if measure in COUNTS:
        return _spread(_group(ident, COUNTS, measure, [min(batch, 2), "copies"],
                              lambda: _count(model_cfg, method, runtime, min(batch, 2), n, COUNTS)), kinds)
    if measure == "seconds":  # this machine's time per segment at zero width: the host segment's dispatch
        ident += [min(batch, 2), platform.node(), torch.get_num_threads()]
        return _spread(_cached(ident, lambda: _count(model_cfg, method, runtime, min(batch, 2), n, measure)), kinds)
    if measure == "point_seconds":
        rows = min(batch, 8)
        ident += [d, prompt, rows, platform.node(), torch.get_num_threads()]
        return _spread(_cached(ident, lambda: _count(model_cfg, method, runtime, rows, n, "seconds", prompt=prompt,
                                                     head_dim=d, narrow=True)), kinds)
    if measure == "context_seconds":
        # at the run's batch (up to 8): a CPU's caches hold one row's KV and not eight, so the cost per
        # (row, token) depends on the batch
        rows = min(batch, 8)
        ident += [d, CONTEXT_PROMPTS, CONTEXT_ROUNDS, rows, platform.node(), torch.get_num_threads()]

        def timed():
            lo, hi = CONTEXT_PROMPTS
            slopes = []
            for _ in range(CONTEXT_ROUNDS):
                at = {p: _count(model_cfg, method, runtime, rows, n, "seconds", prompt=p, head_dim=d)
                      for p in (lo, hi)}
                slopes.append([{seg: (at[hi][i][seg] - at[lo][i][seg]) / (hi - lo) / rows for seg in SEGMENTS}
                               for i in range(n + 1)])
            return [{seg: max(0.0, statistics.median(s[i][seg] for s in slopes)) for seg in SEGMENTS}
                    for i in range(n + 1)]

        return _spread(_cached(ident, timed), kinds)
    if measure not in MEASURES:
        raise ValueError(f"census measure must be one of {MEASURES} or a timed one, got {measure!r}")
    # at 2 rows: indices read back per row are compacted only where rows select different counts

    def slopes():
        rows = 2
        at = {(p, w): _count(model_cfg, method, runtime, rows, n, BYTES, prompt=p, head_dim=w)
              for p in (CENSUS_PROMPT, 2 * CENSUS_PROMPT) for w in (8, 16)}
        out = {m: [] for m in BYTES}
        for i in range(n + 1):
            for m in BYTES:
                row = {}
                for seg in SEGMENTS:
                    per = {w: (at[(2 * CENSUS_PROMPT, w)][m][i][seg] - at[(CENSUS_PROMPT, w)][m][i][seg])
                           / CENSUS_PROMPT / rows for w in (8, 16)}
                    row[seg] = max(0.0, per[8] + (per[16] - per[8]) / 8 * (d - 8))
                out[m].append(row)
        return out

    return _spread(_group(ident, BYTES, measure, [d, "copies"], slopes), kinds)


def _group(ident: list, group: tuple, measure: str, extra: list, compute) -> list[dict]:
    """One measure of a group counted in the same runs: each cached under its own key, all computed together."""
    keys = {m: [*ident[:4], m, *ident[5:], *extra] for m in group}
    path = {m: CACHE / f"{hashlib.sha256(json.dumps(k, sort_keys=True, default=str).encode()).hexdigest()[:16]}.json"
            for m, k in keys.items()}
    if path[measure].exists():
        return json.loads(path[measure].read_text())
    values = compute()
    for m in group:
        _cached(keys[m], lambda m=m: values[m])
    return values[measure]


def _params(method) -> dict:
    return {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init and f.name not in
            ("calib_data_dir", "cache_dir")}


def timed_context(prompt: int) -> int:
    """The context length of the step a timed census reports: the median of its steady steps."""
    return prompt + 1 + CENSUS_STEPS // 2


def _count(model_cfg, method, runtime: str, batch: int, layers: int, measure: str | tuple,
           prompt: int = CENSUS_PROMPT, head_dim: int = 16, narrow: bool = False) -> list[dict] | dict:
    """Per stand-in layer (and the step's own last) {segment: value} of one measure; of a tuple of counted
    measures, {measure: that}."""
    arch = stand_in_arch(dict(model_cfg.arch), layers, head_dim, positions=max(256, 2 * (prompt + CENSUS_STEPS)),
                         narrow=narrow)
    # the model's dtype: a float16 model's KV is float16 bytes, its casts (float32 softmax, dequantisation) the ops
    # they are; a float32 stand-in counted its KV bytes twice
    cfg = OmegaConf.create({"name": f"{model_cfg.name}-stand-in", "dtype": str(model_cfg.get("dtype") or "float32"),
                            "random_init": True, "seed": 0, "arch": arch})
    model, _ = adapter.load(cfg, device="cpu")
    method = method.stand_in()  # a fresh instance: binding calibrates it on the stand-in
    ids = torch.randint(0, 128, (batch, prompt), generator=torch.Generator().manual_seed(0))
    if measure == "seconds":
        rt = OffloadRuntime(model, method, runtime=runtime, clock=time.perf_counter)
        rt.generate(ids, CENSUS_STEPS)  # warm-up
        steps = []
        for _ in range(TIMED_REPEATS):
            rt.generate(ids, CENSUS_STEPS)
            steps += [_segments(marks, rt.timer.fetches, layers) for marks in rt.timer.steps[1:-1]]
    else:
        counter = OpCounter(measure)
        # the CUDA code path (rows land in staging slots, the launching thread does what it does on a GPU), its
        # host work inline: kept apart from that thread's segments, in the fetch's host segment. Every measure
        # counted at once: the clock is a Tally of them. One intra-op thread: counts do not depend on it, and a
        # stand-in's tiny ops ran 14x slower on two threads of a busy machine
        rt = OffloadRuntime(model, method, runtime=runtime, clock=counter.tally, threaded=False, copies=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with counter:
                rt.generate(ids, CENSUS_STEPS)
        finally:
            torch.set_num_threads(threads)
        steps = [_segments(marks, rt.timer.fetches, layers) for marks in rt.timer.steps[1:-1]]  # steady steps
        per = {m: [{seg: statistics.median(part(s[i][seg], k) for s in steps) for seg in SEGMENTS}
                   for i in range(layers + 1)] for k, m in enumerate(counter.measures)}
        return per if isinstance(measure, tuple) else per[measure]
    return [{seg: statistics.median(s[i][seg] for s in steps) for seg in SEGMENTS} for i in range(layers + 1)]
