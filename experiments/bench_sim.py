"""Sim-mode cost of KV methods against a dense forward (HF eager attention) on smollm2-135m.

    python experiments/bench_sim.py                              # every conf/method/*.yaml
    python experiments/bench_sim.py --methods h2o streaming --set h2o.heavy=0.2 --tokens 1024

Loads the model once, takes the first --tokens tokens of WikiText-2 (DATA_DIR, default ../shared/data from the
repo root), times the model's own forward (median of --repeats after one warm-up) and `modes.sim_logits` per
method, and prints method, seconds, ratio vs dense eager and kv_fraction. A benchmark script, not a test.
"""

from __future__ import annotations

import argparse
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
from infinigen import adapter, modes  # noqa: E402
from infinigen.adapter import encode  # noqa: E402

METHOD_DIR = ROOT / "conf" / "method"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="*", default=None, help="conf/method names (default: all of them)")
    p.add_argument("--set", action="append", default=[], metavar="METHOD.KEY=VALUE",
                   help="override a method hyperparameter, e.g. infinigen.capacity=0.8 (repeatable)")
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dense-rows", type=int, default=0, help="rows attending densely (0: every row is 'decoded')")
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


def build_method(name: str, dotlist: list[str], data_dir: str):
    cfg = OmegaConf.merge(OmegaConf.load(METHOD_DIR / f"{name}.yaml"), OmegaConf.from_dotlist(dotlist))
    root = OmegaConf.create({"data_dir": data_dir, "method": cfg})  # resolves ${data_dir} as run.py would
    return instantiate(root.method)


def timed(fn, repeats: int, sync) -> float:
    seconds = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    available = sorted(p.stem for p in METHOD_DIR.glob("*.yaml"))
    names = args.methods or available
    unknown = sorted(set(names) - set(available))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; conf/method has {available}")
    overrides = method_overrides(args.set, names)
    methods = {name: build_method(name, overrides.get(name, []), args.data_dir) for name in names}  # fail early

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    model, tokenizer = adapter.load(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml"), device=device)
    text = corpus_text("wikitext2", args.data_dir)
    ids = encode(tokenizer, text[: 16 * args.tokens], model.config.vocab_size)[: args.tokens]
    if ids.numel() < args.tokens:
        ids = encode(tokenizer, text, model.config.vocab_size)[: args.tokens]
    ids = ids[None].to(device)
    assert model.config._attn_implementation == "eager"

    def dense():
        with torch.inference_mode():
            model(ids, use_cache=False)

    dense()  # warm-up (allocator, thread pool)
    dense_s = timed(dense, args.repeats, sync)
    rows = [{"method": "dense eager", "seconds": dense_s, "ratio": 1.0, "kv_fraction": 1.0}]
    print(f"# {args.model}, {ids.shape[1]} tokens, dense_rows={args.dense_rows}, device={device}, "
          f"threads={torch.get_num_threads()}, median of {args.repeats}", flush=True)
    for name, method in methods.items():
        def run():
            method.reset_stats()
            modes.sim_logits(model, method, ids, dense_rows=args.dense_rows)

        seconds = timed(run, args.repeats, sync)
        kv = method.stats.summary().get("kv_fraction", float("nan"))
        label = name + "".join(f" {o}" for o in overrides.get(name, []))
        rows.append({"method": label, "seconds": seconds, "ratio": seconds / dense_s, "kv_fraction": kv})
        print(f"  done {label}: {seconds:.2f} s", file=sys.stderr, flush=True)

    width = max(len(r["method"]) for r in rows)
    print(f"{'method':<{width}}  {'seconds':>8}  {'x dense':>7}  {'kv_fraction':>11}")
    for r in rows:
        print(f"{r['method']:<{width}}  {r['seconds']:8.2f}  {r['ratio']:7.2f}  {r['kv_fraction']:11.4f}")
    return rows


if __name__ == "__main__":
    main()
