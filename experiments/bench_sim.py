"""Sim-mode cost of KV methods against the model's own forward (SDPA and eager attention) on smollm2-135m.

    python experiments/bench_sim.py                                   # every conf/method/*.yaml, 2048 tokens
    python experiments/bench_sim.py --methods full h2o --scaling 1024 2048 4096 8192 --repeats 1
    python experiments/bench_sim.py --methods h2o --set h2o.heavy=0.2 --tokens 1024 --scaling
    python experiments/bench_sim.py --methods full infinigen --variant infinigen:capacity=0.8,eviction=lru

Loads the model once and takes the first tokens of WikiText-2 (DATA_DIR, default ../shared/data from the repo
root). Table 1 (at --tokens): median seconds of --repeats runs of the model's SDPA forward, its eager forward and
`modes.sim_logits` per method, the ratio to the SDPA forward, the peak memory above the loaded model, and
kv_fraction. Table 2 (--scaling lengths, default 1k/2k/4k/8k; none = skipped): seconds and peak memory of each of
them per length. Peak memory on CPU is the process's high-water RSS (VmHWM, reset through /proc/self/clear_refs
after freed memory is returned with malloc_trim) minus the RSS before the run; on CUDA, max_memory_allocated
minus the memory allocated before. A benchmark script, not a test: run it on an otherwise idle machine.

For a GPU (experiments/gpu_check.sh --sim):

    python experiments/bench_sim.py --device cuda --random-init --tokens 8192 --scaling 2048 --repeats 1 \
        --prompt-for-compressors --capture-variants --budget 240 --out OUT/sim_seconds.jsonl

--random-init: the model's shape with random weights and random ids (no weights, tokenizer or text needed;
methods run as their `stand_in()`, InfiniGen calibrating on random ids). --prompt-for-compressors: a method that
compresses a prompt (SnapKV, ShadowKV) gets half the tokens as its prompt instead of being skipped.
--capture-variants: H2O and TOVA also with `capture=graph` and `capture=compile` (their row loop through a
captured CUDA graph; infinigen/shared/eviction.py); on a device where it captures, such a label's first call at a
length (the capture, the compilation) is untimed and reported as first_seconds. --out: one JSON line per point as
it finishes (seconds, x full: the `full` method's sim forward at the same length, x sdpa, peak MiB, kv_fraction,
whether the captured path ran). --budget: no point starts after this many seconds (the rest are written as
skipped), so a time-limited run still returns what it measured.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from infinigen.corpora import corpus_text  # noqa: E402
from infinigen.adapter import encode  # noqa: E402
from infinigen import adapter, modes  # noqa: E402

METHOD_DIR = ROOT / "conf" / "method"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="*", default=None, help="conf/method names (default: all of them)")
    p.add_argument("--set", action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="override a method hyperparameter, e.g. infinigen.capacity=0.8 (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="METHOD:KEY=VALUE[,KEY=VALUE]",
                   help="one more label: a conf/method with these overrides, beside the method itself, e.g. "
                        "infinigen:capacity=0.8,eviction=lru (repeatable)")
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--tokens", type=int, default=2048, help="sequence length of table 1")
    p.add_argument("--scaling", type=int, nargs="*", default=[1024, 2048, 4096, 8192],
                   help="sequence lengths of table 2 (seconds and peak memory); give none to skip it")
    p.add_argument("--dense-rows", type=int, default=0, help="rows attending densely (0: every row is 'decoded')")
    p.add_argument("--attention", default="fused", choices=adapter.ATTENTION_KERNELS,
                   help="sim-mode kernel: fused SDPA per row chunk, or transformers' eager math")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cuda if available else cpu")
    p.add_argument("--data-dir", default=os.environ.get("DATA_DIR") or str(ROOT.parent / "shared" / "data"))
    p.add_argument("--random-init", action="store_true",
                   help="the model's shape with random weights and random ids (no weights or text needed)")
    p.add_argument("--prompt-for-compressors", action="store_true",
                   help="methods that compress a prompt get half the tokens as their prompt instead of being skipped")
    p.add_argument("--capture-variants", action="store_true",
                   help="also run each method that has a `capture` option with capture=graph and capture=compile")
    p.add_argument("--budget", type=float, default=None, help="start no point after this many seconds")
    p.add_argument("--out", default=None, help="append one JSON line per point here")
    p.add_argument("--results", default=None, metavar="STORE",
                   help="also write each point as a store row (metrics.benchmark=sim) into this results store, e.g. "
                        "docs/store: the report's sim-cost table and the lines of README and docs/scaling.md")
    return p.parse_args(argv)


def method_overrides(sets: list[str], names: list[str]) -> dict[str, list[str]]:
    """'h2o.heavy=0.2' -> {'h2o': ['heavy=0.2']}; refuses methods that are not benchmarked."""
    out: dict[str, list[str]] = {}
    for item in sets:
        target, eq, value = item.partition("=")
        name, dot, key = target.partition(".")
        if not (eq and dot and key):
            raise SystemExit(f"--set expects METHOD.KEY=VALUE, got {item!r}")
        if name not in names:
            raise SystemExit(f"--set {item!r}: method {name!r} is not among --methods {names}")
        out.setdefault(name, []).append(f"{key}={value}")
    return out


def chosen_methods(requested: list[str] | None, sets: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The conf/method names asked for (None: all of them) and each one's --set overrides; unknown names exit."""
    available = sorted(p.stem for p in METHOD_DIR.glob("*.yaml"))
    names = requested or available
    unknown = sorted(set(names) - set(available))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; conf/method has {available}")
    return names, method_overrides(sets, names)


def build_method(name: str, dotlist: list[str], data_dir: str):
    cfg = OmegaConf.merge(OmegaConf.load(METHOD_DIR / f"{name}.yaml"), OmegaConf.from_dotlist(dotlist))
    root = OmegaConf.create({"data_dir": data_dir, "method": cfg})  # resolves ${data_dir} as run.py would
    return instantiate(root.method)


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Returns freed memory to the OS, resets the high-water RSS, and gives the current RSS (KiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass  # not glibc: freed memory may stay resident and hide part of the next peak
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS")


def measure(fn, repeats: int, device: str) -> tuple[float, float]:
    """(median seconds, peak MiB above what was resident/allocated before) of `repeats` calls of fn."""
    seconds, peaks = [], []
    cuda = device.startswith("cuda")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = reset_peak() * 1024
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if cuda else rss_kib("VmHWM") * 1024
        peaks.append((peak - base) / 2**20)
    return statistics.median(seconds), max(peaks)


def text_ids(tokenizer, data_dir: str, n: int, vocab: int) -> torch.Tensor:
    text = corpus_text("wikitext2", data_dir)
    ids = encode(tokenizer, text[: 16 * n], vocab)[:n]
    if ids.numel() < n:
        ids = encode(tokenizer, text, vocab)[:n]
    if ids.numel() < n:
        raise SystemExit(f"WikiText-2 has only {ids.numel()} tokens, fewer than {n}")
    return ids[None]


REFERENCES = ("model sdpa", "model eager")
CAPTURE_VARIANTS = ("graph", "compile")


@dataclasses.dataclass
class Entry:
    """One benchmarked label: a conf/method (with --set overrides and, for a capture variant, capture=...)."""

    label: str
    name: str
    method: object
    capture: str = "none"


def parse_variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    """'infinigen:capacity=0.8,eviction=lru' -> ('infinigen', ['capacity=0.8', 'eviction=lru']); bad specs exit."""
    available = {p.stem for p in METHOD_DIR.glob("*.yaml")}
    out = []
    for spec in specs:
        name, colon, sets = spec.partition(":")
        dotlist = [item for item in sets.split(",") if item]
        if not colon or name not in available or not dotlist or not all("=" in item for item in dotlist):
            raise SystemExit(f"--variant expects METHOD:KEY=VALUE[,KEY=VALUE] with METHOD in conf/method, got {spec!r}")
        out.append((name, dotlist))
    return out


def entries_of(names, overrides, data_dir, random_init: bool, variants: bool,
               extra: list[tuple[str, list[str]]] = ()) -> list[Entry]:
    """The labels to run, in order: each method, its capture=graph variant right after it, then the --variant
    labels, capture=compile ones last (they compile, the slowest to start)."""
    out, late = [], []
    for name, dotlist in [(name, overrides.get(name, [])) for name in names] + list(extra):
        method = build_method(name, dotlist, data_dir)
        label = name + "".join(f" {o}" for o in dotlist)
        out.append(Entry(label, name, method.stand_in() if random_init else method, getattr(method, "capture", "none")))
        if variants and "capture" in {f.name for f in dataclasses.fields(method)}:
            for capture in CAPTURE_VARIANTS:
                variant = dataclasses.replace(method, capture=capture)
                entry = Entry(f"{label} capture={capture}", name, variant.stand_in() if random_init else variant,
                              capture)
                (out if capture == "graph" else late).append(entry)
    return out + late


def load_model(args, device: str, positions: int):
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")
    if args.random_init:
        cfg.random_init = True
        if positions > int(cfg.arch.get("max_position_embeddings") or 0):
            cfg.arch.max_position_embeddings = positions
    return adapter.load(cfg, device=device)


def main(argv=None) -> dict:
    args = parse_args(argv)
    names, overrides = chosen_methods(args.methods, args.set)
    entries = entries_of(names, overrides, args.data_dir, args.random_init, args.capture_variants,
                         parse_variants(args.variant))  # fail early
    if not args.dense_rows and not args.prompt_for_compressors:
        # a prompt-compressing method (SnapKV) has no prompt to compress at dense_rows=0
        skipped = sorted({e.name for e in entries if e.method.needs_prompt})
        if skipped and args.methods:
            raise SystemExit(f"{skipped} compress a prompt: give --dense-rows > 0 or --prompt-for-compressors")
        for name in skipped:
            print(f"# {name}: skipped (compresses a prompt; run with --dense-rows > 0)")
        entries = [e for e in entries if e.name not in skipped]

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lengths = sorted({args.tokens, *args.scaling})
    model, tokenizer = load_model(args, device, max(lengths))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(lengths) > limit:
        raise SystemExit(f"{max(lengths)} tokens exceed the model's max_position_embeddings={limit}")
    if args.random_init:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (1, max(lengths)), generator=gen).to(device)
    else:
        ids = text_ids(tokenizer, args.data_dir, max(lengths), model.config.vocab_size).to(device)

    def reference(implementation: str, x):
        with torch.inference_mode(), adapter.attn_implementation(model, implementation):
            model(x, use_cache=False)

    def dense_rows(entry: Entry, n: int) -> int:
        compresses = args.prompt_for_compressors and not args.dense_rows and entry.method.needs_prompt
        return n // 2 if compresses else args.dense_rows

    def sim(entry: Entry, x):
        entry.method.reset_stats()
        modes.sim_logits(model, entry.method, x, dense_rows=dense_rows(entry, x.shape[1]), attention=args.attention)

    runs = {"model sdpa": lambda x: reference("sdpa", x), "model eager": lambda x: reference("eager", x)}
    runs |= {e.label: (lambda x, e=e: sim(e, x)) for e in entries}
    by_label = {e.label: e for e in entries}
    reference("sdpa", ids[:, : min(lengths)])  # warm-up (allocator, thread pool)
    for entry in entries:  # bind once, untimed: InfiniGen calibrates here (cached per model), not in a timed call
        with adapter.install(model, entry.method, mode="sim", dense_rows=0, max_len=max(lengths)):
            pass
    print(f"# {args.model}{' (random init)' if args.random_init else ''}, dense_rows={args.dense_rows}, "
          f"attention={args.attention}, device={device}, threads={torch.get_num_threads()}, median of "
          f"{args.repeats}", flush=True)
    results: dict[tuple[int, str], dict] = {}
    meta = run_meta(args, device)
    t0 = time.perf_counter()
    for n in [args.tokens] + [n for n in args.scaling if n != args.tokens]:
        for label, fn in runs.items():
            entry = by_label.get(label)
            point = {"tokens": n, "label": label, "method": entry.name if entry else label,
                     "capture": entry.capture if entry else "none",
                     "dense_rows": dense_rows(entry, n) if entry else 0}
            if args.budget is not None and time.perf_counter() - t0 > args.budget:
                point["skipped"] = f"--budget {args.budget:g} s spent"
                write_point(args.out, meta, point)
                print(f"  {n} tokens, {label}: skipped ({point['skipped']})", file=sys.stderr, flush=True)
                continue
            if entry is not None and entry.capture != "none" and device.startswith("cuda"):
                first, _ = measure(lambda: fn(ids[:, :n]), 1, device)  # the capture (and compilation): untimed
                point["first_seconds"] = first
            seconds, peak = measure(lambda: fn(ids[:, :n]), args.repeats, device)
            kv = entry.method.stats.summary().get("kv_fraction", float("nan")) if entry else 1.0
            point.update(seconds=seconds, peak_mib=peak, kv_fraction=kv,
                         capture_used=bool(getattr(entry.method, "capture_used", False)) if entry else False)
            results[(n, label)] = point
            for ref in ("full", "model sdpa"):
                if (n, ref) in results:
                    point[f"x_{ref.replace('model ', '')}"] = seconds / results[(n, ref)]["seconds"]
            write_point(args.out, meta, point)
            print(f"  {n} tokens, {label}: {seconds:.2f} s, +{peak:.0f} MiB", file=sys.stderr, flush=True)

    if args.results:
        write_rows(args.results, meta, results.values())
    width = max(len(label) for label in runs)
    sdpa = results.get((args.tokens, "model sdpa"))
    print(f"\n{args.tokens} tokens\n{'':<{width}}  {'seconds':>8}  {'x sdpa':>7}  {'peak MiB':>8}  {'x sdpa':>7}  "
          f"{'kv_fraction':>11}")
    for label in runs:
        r = results.get((args.tokens, label))
        if r is None or sdpa is None:
            print(f"{label:<{width}}  skipped")
            continue
        print(f"{label:<{width}}  {r['seconds']:8.2f}  {r['seconds'] / sdpa['seconds']:7.2f}  {r['peak_mib']:8.0f}  "
              f"{r['peak_mib'] / max(sdpa['peak_mib'], 1):7.2f}  {r['kv_fraction']:11.4f}")
    if args.scaling:
        print("\nscaling: seconds / peak MiB above the loaded model")
        print(f"{'':<{width}}" + "".join(f"  {f'{n} tokens':>16}" for n in args.scaling))
        for label in runs:
            cells = [f"{results[(n, label)]['seconds']:.2f} s / {results[(n, label)]['peak_mib']:.0f}"
                     if (n, label) in results else "skipped" for n in args.scaling]
            print(f"{label:<{width}}" + "".join(f"  {c:>16}" for c in cells))
    if "full" in runs:
        print("\nx full (the full method's sim forward at the same length)")
        for label in runs:
            cells = [f"{results[(n, label)]['seconds'] / results[(n, 'full')]['seconds']:.2f}"
                     if (n, label) in results and (n, "full") in results else "-" for n in lengths]
            print(f"{label:<{width}}" + "".join(f"  {c:>10}" for c in cells) + f"   ({', '.join(map(str, lengths))})")
    return results


def run_meta(args, device: str) -> dict:
    from experiments import identity

    meta = {"bench": "sim_seconds", "model": args.model, "random_init": args.random_init, "device": device,
            "attention": args.attention, "repeats": args.repeats, "torch": torch.__version__,
            "git_commit": identity.git_commit(), "threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name()
    return meta


def write_rows(results: str, meta: dict, points) -> None:
    """One store row per measured point (a label at a length), keyed by model, device, threads, length and label:
    the newest run of a point replaces an older one in an export, as a run.py config's does."""
    import hashlib
    import platform
    from datetime import datetime, timezone

    from analysis import store
    from experiments import identity

    finished = datetime.now(timezone.utc).isoformat()
    for point in points:
        config = {"benchmark": "sim", "model": {"name": meta["model"]}, "device": meta["device"],
                  "threads": meta["threads"], "attention": meta["attention"], "random_init": meta["random_init"],
                  "tokens": point["tokens"], "label": point["label"], "dense_rows": point["dense_rows"]}
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
        metrics = {"benchmark": "sim", **{k: v for k, v in point.items() if k not in ("method",)},
                   "repeats": meta["repeats"], "attention": meta["attention"]}
        row = {"config_hash": digest, "model": meta["model"], "method": point["method"], "task": "sim_bench",
               "data": {}, "method_params": {"name": point["method"]},
               "task_params": {"name": "sim_bench", "tokens": point["tokens"]}, "metrics": metrics, "config": config,
               "meta": {"git_commit": meta["git_commit"], "versions": identity.versions(), "device": meta["device"],
                        "threads": meta["threads"], "host": platform.node(), "finished": finished}}
        store.append_rows(results, digest, [row])


def write_point(path: str | None, meta: dict, point: dict) -> None:
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({**meta, **point}, default=str) + "\n")


if __name__ == "__main__":
    main()
