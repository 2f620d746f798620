"""Sim-mode cost of KV methods against the model's own forward (SDPA and eager attention) on smollm2-135m.

    python experiments/bench_sim.py                                   # every conf/method/*.yaml, 2048 tokens
    python experiments/bench_sim.py --methods full h2o --scaling 1024 2048 4096 8192 --repeats 1
    python experiments/bench_sim.py --methods h2o --set h2o.heavy=0.2 --tokens 1024 --scaling

Loads the model once and takes the first tokens of WikiText-2 (DATA_DIR, default ../shared/data from the repo
root). Table 1 (at --tokens): median seconds of --repeats runs of the model's SDPA forward, its eager forward and
`modes.sim_logits` per method, the ratio to the SDPA forward, the peak memory above the loaded model, and
kv_fraction. Table 2 (--scaling lengths, default 1k/2k/4k/8k; none = skipped): seconds and peak memory of each of
them per length. Peak memory on CPU is the process's high-water RSS (VmHWM, reset through /proc/self/clear_refs
after freed memory is returned with malloc_trim) minus the RSS before the run; on CUDA, max_memory_allocated
minus the memory allocated before. A benchmark script, not a test: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    names, overrides = chosen_methods(args.methods, args.set)
    methods = {name: build_method(name, overrides.get(name, []), args.data_dir) for name in names}  # fail early
    if not args.dense_rows:  # a prompt-compressing method (SnapKV) has no prompt to compress at dense_rows=0
        skipped = [name for name, m in methods.items() if m.needs_prompt]
        if skipped and args.methods:
            raise SystemExit(f"{skipped} compress a prompt: give --dense-rows > 0")
        for name in skipped:
            print(f"# {name}: skipped (compresses a prompt; run with --dense-rows > 0)")
            del methods[name]
        names = [n for n in names if n not in skipped]
    labels = {name: name + "".join(f" {o}" for o in overrides.get(name, [])) for name in names}

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = adapter.load(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml"), device=device)
    limit = getattr(model.config, "max_position_embeddings", None)
    lengths = sorted({args.tokens, *args.scaling})
    if limit is not None and max(lengths) > limit:
        raise SystemExit(f"{max(lengths)} tokens exceed the model's max_position_embeddings={limit}")
    ids = text_ids(tokenizer, args.data_dir, max(lengths), model.config.vocab_size).to(device)

    def reference(implementation: str, x):
        with torch.inference_mode(), adapter.attn_implementation(model, implementation):
            model(x, use_cache=False)

    def sim(method, x):
        method.reset_stats()
        modes.sim_logits(model, method, x, dense_rows=args.dense_rows, attention=args.attention)

    runs = {"model sdpa": lambda x: reference("sdpa", x), "model eager": lambda x: reference("eager", x)}
    runs |= {labels[name]: (lambda x, m=methods[name]: sim(m, x)) for name in names}
    reference("sdpa", ids[:, : min(lengths)])  # warm-up (allocator, thread pool)
    print(f"# {args.model}, dense_rows={args.dense_rows}, attention={args.attention}, device={device}, "
          f"threads={torch.get_num_threads()}, median of {args.repeats}", flush=True)
    results: dict[tuple[int, str], dict] = {}
    for n in [args.tokens] + [n for n in args.scaling if n != args.tokens]:
        for label, fn in runs.items():
            seconds, peak = measure(lambda: fn(ids[:, :n]), args.repeats, device)
            name = label.split(" ")[0]
            kv = methods[name].stats.summary().get("kv_fraction", float("nan")) if name in methods else 1.0
            results[(n, label)] = {"seconds": seconds, "peak_mib": peak, "kv_fraction": kv}
            print(f"  {n} tokens, {label}: {seconds:.2f} s, +{peak:.0f} MiB", file=sys.stderr, flush=True)

    width = max(len(label) for label in runs)
    sdpa = results[(args.tokens, "model sdpa")]
    print(f"\n{args.tokens} tokens\n{'':<{width}}  {'seconds':>8}  {'x sdpa':>7}  {'peak MiB':>8}  {'x sdpa':>7}  "
          f"{'kv_fraction':>11}")
    for label in runs:
        r = results[(args.tokens, label)]
        print(f"{label:<{width}}  {r['seconds']:8.2f}  {r['seconds'] / sdpa['seconds']:7.2f}  {r['peak_mib']:8.0f}  "
              f"{r['peak_mib'] / max(sdpa['peak_mib'], 1):7.2f}  {r['kv_fraction']:11.4f}")
    if args.scaling:
        print("\nscaling: seconds / peak MiB above the loaded model")
        print(f"{'':<{width}}" + "".join(f"  {f'{n} tokens':>16}" for n in args.scaling))
        for label in runs:
            cells = [f"{results[(n, label)]['seconds']:.2f} s / {results[(n, label)]['peak_mib']:.0f}" for n in args.scaling]
            print(f"{label:<{width}}" + "".join(f"  {c:>16}" for c in cells))
    return results


if __name__ == "__main__":
    main()
