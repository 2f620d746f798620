"""Latency task: prefill + greedy decode through the offloading runtime (InfiniGen Figs. 14-17).

The KV of offloading methods lives in host memory and what each method implies crosses to the compute device
every step (infinigen/offload/). On CUDA that traffic is real (pinned pools, side stream, events) and
the times are CUDA-event times. On CPU host and device coincide: the bytes are counted, the compute is measured,
and `modelled_*` columns add the link (task.link_gbps) with the runtime's overlap.

As a runner task (one row per run):

    python run.py model=smollm2-135m method=infinigen task=latency task.prompt_len=2048 task.gen_len=64

As a table over methods with the model loaded once (what experiments/gpu_check.sh runs):

    python -m experiments.latency --model opt-13b --set model.random_init=true --batch 8 --prompt 1920 --gen 128
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from infinigen.corpora import check_dataset, corpus_text

# torch and the runtime are imported where used: `validate` must stay cheap to import
PROMPTS = ("auto", "text", "random")


def positions_needed(task) -> tuple[str, int]:
    """The option that sets the longest sequence this task feeds the model, and its value."""
    return "task.prompt_len + task.gen_len", task.prompt_len + task.gen_len


def validate(task, data_dir) -> None:
    for name, low in (("batch_size", 1), ("prompt_len", 2), ("gen_len", 1)):
        value = task.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"task.{name} must be an integer >= {low}, got {value!r}")
    warmup = task.get("warmup")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < task.gen_len:
        raise ValueError(f"task.warmup must be an integer in 0..gen_len-1 ({task.gen_len - 1}), got {warmup!r}")
    gbps = task.get("link_gbps")
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps > 0 or math.isinf(gbps):
        raise ValueError(f"task.link_gbps must be a positive number of GB/s (1e9 bytes/s), got {gbps!r}")
    if task.get("prompt") not in PROMPTS:
        raise ValueError(f"task.prompt must be one of {PROMPTS}, got {task.get('prompt')!r}")
    if task.prompt == "text":
        check_dataset(task.dataset, data_dir)
    from infinigen.offload.runtime import RUNTIMES  # the runtime owns the list (imports torch: checked last)

    if task.get("runtime") not in RUNTIMES:
        raise ValueError(f"task.runtime must be one of {RUNTIMES}, got {task.get('runtime')!r}")


def prompt_ids(tokenizer, vocab_size: int, task, data_dir) -> tuple[torch.Tensor, str]:
    """(batch, prompt_len) ids and where they came from: consecutive windows of the corpus (models with a
    tokenizer) or seeded random ids (random-init models, or task.prompt=random)."""
    import torch

    b, n = task.batch_size, task.prompt_len
    source = task.prompt
    if source == "auto":
        source = "text" if tokenizer is not None and data_dir else "random"
    if source == "text":
        if tokenizer is None:
            raise ValueError("task.prompt=text needs a model with a tokenizer (random-init models have none)")
        ids = tokenizer(corpus_text(task.dataset, data_dir), return_tensors="pt").input_ids[0]
        if ids.numel() < b * n:
            raise ValueError(f"{task.dataset} has {ids.numel()} tokens, fewer than batch_size x prompt_len = {b * n}")
        return ids[: b * n].view(b, n), f"text:{task.dataset}"
    gen = torch.Generator().manual_seed(task.get("seed", 0))
    return torch.randint(0, vocab_size, (b, n), generator=gen), "random"


def run(model, tokenizer, method, task, data_dir, device="cpu") -> dict:
    from infinigen.offload.runtime import OffloadRuntime

    ids, source = prompt_ids(tokenizer, model.config.vocab_size, task, data_dir)
    ids = ids.to(device)
    rt = OffloadRuntime(model, method, runtime=task.runtime, link_gbps=task.link_gbps)
    if task.warmup:  # kernels, allocators, InfiniGen's calibration: none of it belongs in the measured run
        rt.generate(ids[:, : min(task.prompt_len, 64)], gen_len=2)
    method.reset_stats()
    report = rt.generate(ids, task.gen_len)
    stats = method.stats.summary()
    return {
        "batch_size": task.batch_size,
        "prompt_len": task.prompt_len,
        "gen_len": task.gen_len,
        "random_init": tokenizer is None,  # adapter.load returns no tokenizer exactly for random-init models
        "prompt": source,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **report.metrics(task.warmup, task.link_gbps),
        "kv_fraction": stats.get("kv_fraction"),
        "stats": stats,
    }


# ----------------------------------------------------------------------------------------------- table driver

ROOT = Path(__file__).resolve().parent.parent
# table row -> (conf/method name, method overrides, task overrides); the settings of InfiniGen Figs. 14-16
ROWS = {
    "ideal": ("full", {}, {}),
    "offload": ("offload", {}, {}),
    "quant-int4": ("quant", {"bits": 4, "group_size": 64}, {}),
    "h2o": ("h2o", {"heavy": 0.1, "recent": 0.1}, {}),
    "h2o-resident": ("h2o", {"heavy": 0.1, "recent": 0.1}, {"runtime": "ideal"}),
    "infinigen": ("infinigen", {"alpha": 4.0, "partial_ratio": 0.2, "budget": 0.2}, {}),
}
COLUMNS = [  # (header, metric (None = the row's name), scale, decimals (None = text))
    ("row", None, 1, None), ("runtime", "runtime", 1, None), ("prefill_s", "prefill_s", 1, 2),
    ("ms/tok", "decode_ms_median", 1, 2), ("p90", "decode_ms_p90", 1, 2), ("tok/s", "tokens_per_s", 1, 1),
    ("h2d_MiB/tok", "h2d_bytes_per_token", 2**-20, 1), ("kv_frac", "kv_fraction", 1, 3),
    ("attn", "attention_ms", 1, 2), ("ffn", "ffn_ms", 1, 2), ("spec", "speculation_ms", 1, 2),
    ("xfer", "transfer_ms", 1, 2), ("wait", "wait_ms", 1, 2), ("peak_GiB", "peak_device_bytes", 2**-30, 2),
    ("host_GiB", "host_pool_bytes", 2**-30, 2), ("modelled_ms/tok", "modelled_decode_ms_per_token", 1, 2),
]
WIDTH = {"row": 12, "runtime": 12}


def header() -> str:
    return " ".join(h.ljust(WIDTH[h]) if d is None else h.rjust(max(len(h), 8)) for h, _, _, d in COLUMNS)


def format_row(name: str, metrics: dict) -> str:
    """One line of the table; columns a run does not report (e.g. peak memory on CPU) stay blank."""
    cells = []
    for h, key, scale, decimals in COLUMNS:
        value = name if key is None else metrics.get(key)
        if decimals is None:
            cells.append(str(value if value is not None else "").ljust(WIDTH[h]))
        else:
            cells.append(("" if value is None else f"{value * scale:.{decimals}f}").rjust(max(len(h), 8)))
    return " ".join(cells)


def load_cfg(kind: str, name: str, overrides: dict, data_dir: str | None):
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / kind / f"{name}.yaml"), overrides)
    root = OmegaConf.create({"data_dir": data_dir, kind: cfg})  # resolves ${data_dir} as run.py would
    return root[kind]


def parse_sets(pairs: list[str]) -> dict[str, dict]:
    """["model.dtype=float16", "task.warmup=3"] -> {"model": {"dtype": "float16"}, "task": {"warmup": 3}}"""
    import yaml

    out: dict[str, dict] = {"model": {}, "task": {}}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        group, _, field = key.partition(".")
        if group not in out or not field or not eq:
            raise ValueError(f"--set takes model.KEY=VALUE or task.KEY=VALUE, got {pair!r}")
        out[group][field] = yaml.safe_load(value)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--rows", nargs="+", default=["ideal", "offload", "quant-int4", "h2o", "infinigen"],
                   choices=sorted(ROWS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=384)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--set", nargs="*", default=[], metavar="GROUP.KEY=VALUE",
                   help="model.* / task.* overrides, e.g. model.random_init=true model.dtype=float16 task.warmup=4")
    p.add_argument("--device", default=None, help="default: cuda if available else cpu")
    p.add_argument("--data-dir", default=os.environ.get("DATA_DIR") or str(ROOT.parent / "shared" / "data"))
    p.add_argument("--out", default=None, help="append one JSON line per row here")
    args = p.parse_args(argv)
    args.rows = list(dict.fromkeys(args.rows))

    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from infinigen import adapter

    data_dir = args.data_dir if Path(args.data_dir).is_dir() else None
    sets = parse_sets(args.set)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    task = load_cfg("task", "latency", {"batch_size": args.batch, "prompt_len": args.prompt, "gen_len": args.gen,
                                        **sets["task"]}, data_dir)
    validate(task, data_dir)
    model_cfg = load_cfg("model", args.model, sets["model"], data_dir)
    methods = {row: instantiate(load_cfg("method", ROWS[row][0], ROWS[row][1], data_dir)) for row in args.rows}
    model, tokenizer = adapter.load(model_cfg, device=device)
    print(f"# {args.model} ({'random init' if tokenizer is None else 'weights'}, "
          f"{str(next(model.parameters()).dtype).removeprefix('torch.')}) on {device}"
          f"{' ' + torch.cuda.get_device_name() if device.startswith('cuda') else ''}: batch {args.batch}, prompt "
          f"{args.prompt} + {args.gen} generated, link model {task.link_gbps} GB/s", flush=True)
    print(header(), flush=True)
    failed = []
    for row in args.rows:
        method = methods.pop(row)
        try:
            metrics = run(model, tokenizer, method, OmegaConf.merge(task, ROWS[row][2]), data_dir, device=device)
        except (RuntimeError, ValueError) as err:  # e.g. out of memory: report it, keep the other rows
            failed.append(row)
            print(f"{row:<12} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
            continue
        finally:
            del method
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        print(format_row(row, metrics), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                row_json = {"row": row, "model": args.model, **{k: v for k, v in metrics.items() if k != "stats"}}
                f.write(json.dumps(row_json, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
