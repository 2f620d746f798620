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
from infinigen.offload.paper import SCHEDULES  # overlapped: this project's runtime (perf.py) | paper: the artifact's

# torch and the runtime are imported where used: `validate` must stay cheap to import
PROMPTS = ("auto", "text", "random")
TIMINGS = ("measured", "modelled")


def positions_needed(task) -> tuple[str, int]:
    """The option that sets the longest sequence this task feeds the model, and its value. The paper's runtime
    never feeds its last generated token (flex_opt.py: "last token, no need to store cache")."""
    if task.get("schedule") == "paper":
        return "task.prompt_len + task.gen_len - 1", task.prompt_len + task.gen_len - 1
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
    if task.get("timing", "measured") not in TIMINGS:
        raise ValueError(f"task.timing must be one of {TIMINGS}, got {task.get('timing')!r}")
    schedule = task.get("schedule", "overlapped")
    if schedule not in SCHEDULES:
        raise ValueError(f"task.schedule must be one of {SCHEDULES}, got {schedule!r}")
    fraction = task.get("fetch_fraction")
    if fraction == "paper" and schedule != "paper":
        raise ValueError("task.fetch_fraction=paper (the paper's reported OPT-13B fetch) needs task.schedule=paper")
    if fraction not in (None, "paper") and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                            or not 0 < fraction <= 1):
        raise ValueError(f"task.fetch_fraction must be null (measured rows: task.fractions_from), paper (with "
                         f"task.schedule=paper) or a fraction in (0, 1], got {fraction!r}")
    if schedule == "paper":
        if task.get("timing", "measured") != "modelled":
            raise ValueError("task.schedule=paper models the paper's runtime: it needs task.timing=modelled")
        if task.gen_len < 2:
            raise ValueError(f"task.gen_len must be an integer >= 2 under task.schedule=paper (the prefill yields "
                             f"the first token, then gen_len - 1 decode steps), got {task.gen_len!r}")
        from infinigen.offload.paper import switches

        switches(task.get("paper"))
    from infinigen.offload.runtime import GATHERS, RUNTIMES  # the runtime owns the lists (imports torch: last)

    if task.get("runtime") not in RUNTIMES:
        raise ValueError(f"task.runtime must be one of {RUNTIMES}, got {task.get('runtime')!r}")
    if task.get("gather", "host") not in GATHERS:
        raise ValueError(f"task.gather must be one of {GATHERS}, got {task.get('gather')!r}")


def needs_model(task) -> bool:
    """A modelled run computes from the model's config and a hardware profile: no weights are loaded."""
    return task.get("timing", "measured") != "modelled"


def validate_config(cfg, method) -> None:
    """What a modelled run needs besides the task: a valid hardware profile and, for a gathering method, the
    fraction of the past each layer fetches (found now, before anything runs)."""
    if needs_model(cfg.task):
        if cfg.task.get("prompt") == "text" and cfg.model.get("random_init"):
            raise ValueError("task.prompt=text needs a model with a tokenizer; a random_init model has none "
                             "(use task.prompt=random or auto)")
        return
    from infinigen.offload import paper
    from infinigen.offload.profile import hardware

    hw = hardware(cfg.get("hardware"))
    if cfg.task.get("schedule", "overlapped") == "paper":
        from experiments.identity import method_name

        if method_name(cfg) not in paper.PAPER_METHODS:
            raise ValueError(f"task.schedule=paper replays the artifact's runtime for the methods the paper ran "
                             f"({', '.join(paper.PAPER_METHODS)}), not method={method_name(cfg)}")
        if hw.host_is_device:
            raise ValueError(f"task.schedule=paper needs a GPU profile (hardware=a6000_pcie3, the paper's), not "
                             f"hardware={hw.name}, a CPU's")
        if cfg.task.get("fetch_fraction") == "paper":
            return
    layer_fractions(cfg, method)


def _method_key(params: dict) -> dict:
    from infinigen.semantic import semantic_method

    return {k: v for k, v in semantic_method(params).items() if k not in ("name", "size_params", "cache_dir")}


def measured_fractions(store_dir: Path, model: str, method_name: str, params: dict) -> tuple[list[float], str]:
    """Per-layer kv_fraction of the latest row of `method_name` with these hyperparameters on `model` in a
    results store (sim rows of task=ppl or decode rows of task=latency), and where it came from."""
    best = None
    for path in sorted((store_dir / "rows").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            per_layer = ((row.get("metrics") or {}).get("stats") or {}).get("per_layer", {}).get("kv_fraction")
            if (row.get("model") != model or row.get("method") != method_name or not per_layer
                    or _method_key(row.get("method_params") or {}) != params
                    or (row.get("metrics") or {}).get("timing") == "modelled"):
                continue
            key = (row.get("meta") or {}).get("finished", "")
            if best is None or key > best[0]:
                layers = [per_layer[k] for k in sorted(per_layer, key=int)]
                best = (key, layers, f"{store_dir}:{row['config_hash']} ({row['task']}, {model})")
    if best is None:
        raise ValueError(
            f"task.fractions_from={str(store_dir)!r}: no row of method {method_name} with these settings on "
            f"{model} records per-layer kv_fraction; measure one (python run.py model={model} "
            f"method={method_name} task=latency results_dir={store_dir}) or set task.fetch_fraction")
    return best[1], best[2]


def spread(source: list[float], dense: list[bool]) -> list[float]:
    """Source per-layer fractions onto a model whose layers are `dense` (True: attends everything): the target's
    selecting layers take the source's selecting layers (kv < 1) at the same relative depth."""
    picks = [f for f in source if f < 1.0] or source
    n = sum(not d for d in dense)
    out, k = [], 0
    for d in dense:
        if d:
            out.append(1.0)
            continue
        out.append(picks[round(k * (len(picks) - 1) / max(n - 1, 1))])
        k += 1
    return out


def layer_fractions(cfg, method) -> tuple[list[float] | None, str | None]:
    """Per layer of cfg.model, the fraction of the past a gathering layer fetches, and its source."""
    from infinigen.offload.plan import Shape
    from infinigen.offload.runtime import layer_kind

    shape = Shape.of(cfg.model)
    kinds = [layer_kind(method, shape.layer(i), cfg.task.runtime) for i in range(shape.layers)]
    if "gather" not in kinds:
        return None, None
    if cfg.task.get("fetch_fraction") is not None:
        f = float(cfg.task.fetch_fraction)
        return [f if k == "gather" else 1.0 for k in kinds], f"given: task.fetch_fraction={f}"
    from experiments.identity import method_name, method_params

    store_dir = Path(cfg.task.get("fractions_from") or "docs/store")
    store_dir = store_dir if store_dir.is_absolute() else ROOT / store_dir
    params = _method_key(method_params(cfg, method))
    source, where = measured_fractions(store_dir, cfg.task.get("fractions_model") or cfg.model.name,
                                       method_name(cfg), params)
    return spread(source, [k != "gather" for k in kinds]), where


def run_modelled(cfg, method, fractions: list[float] | None = None, source: str | None = None) -> dict:
    """The latency task's metrics from the performance model (infinigen/offload/perf.py): no weights, no clock.
    `fractions` (per layer kv_fraction) replaces the task's source (validation passes a measured run's own)."""
    from infinigen.offload import census, perf
    from infinigen.offload.plan import Shape, memory, selected_counts
    from infinigen.offload.plan import plan as layer_plan
    from infinigen.offload.profile import hardware
    from infinigen.offload.roofline import prefill_seconds
    from infinigen.offload.runtime import layer_kind, run_kind

    task = cfg.task
    hw = hardware(cfg.get("hardware"))
    shape = Shape.of(cfg.model)
    kinds = [layer_kind(method, shape.layer(i), task.runtime) for i in range(shape.layers)]
    if fractions is None and task.get("fetch_fraction") == "paper":
        fractions, source = "paper", "the paper's reported OPT-13B fetch (infinigen/offload/paper.py)"
    elif fractions is None:
        fractions, source = layer_fractions(cfg, method)
    if task.get("schedule", "overlapped") == "paper":
        from infinigen.offload import paper

        paper_cfg = task.get("paper")
        row = paper.modelled(method, cfg.model, hw, task.runtime, task.batch_size, task.prompt_len, task.gen_len,
                             fractions, None if paper_cfg is None else dict(paper_cfg))
        return {"batch_size": task.batch_size, "prompt_len": task.prompt_len, "gen_len": task.gen_len,
                "timing": "modelled", "hardware": hw.name, "hardware_profile": dict(cfg.hardware),
                "runtime": run_kind(method, task.runtime), "dtype": shape.dtype, "fractions_source": source,
                "layer_fetch_fraction": fractions, **row}
    ops = census.census(cfg.model, method, task.runtime, task.batch_size, kinds)
    steps = perf.modelled_steps(hw, cfg.model, method, task.runtime, task.batch_size, task.prompt_len, task.gen_len,
                                fractions)
    max_len = task.prompt_len + task.gen_len
    plan = layer_plan(method, shape, task.runtime, max_len)
    mem = memory(shape, plan, method, task.batch_size, max_len)
    over = mem["device_bytes"] / 2**30 - hw.device_memory_gib
    seen = [task.prompt_len + s + 1 for s in range(task.gen_len)]
    kv = None if fractions is None else sum(
        sum((selected_counts(fractions, plan, n)[i] + 1) / plan.visible(i, n) if k == "gather" else 1.0
            for i, k in enumerate(kinds)) / len(kinds) for n in seen) / len(seen)
    return {
        "batch_size": task.batch_size, "prompt_len": task.prompt_len, "gen_len": task.gen_len,
        "timing": "modelled", "hardware": hw.name, "hardware_profile": dict(cfg.hardware),
        "runtime": run_kind(method, task.runtime), "dtype": shape.dtype,
        **perf.summarize(steps, task.warmup, task.batch_size),
        "prefill_s": prefill_seconds(hw, shape, plan, task.batch_size, task.prompt_len),
        "d2h_bytes_total": sum(plan.row_bytes[i] * task.batch_size * shape.kv_heads * max_len
                               for i in range(shape.layers)),
        "host_pool_bytes": mem["host_pool_bytes"], "device_bytes": mem["device_bytes"],
        "fits": over <= 0, "over_gib": max(over, 0.0), "ops_per_step": sum(sum(o.values()) for o in ops),
        "fractions_source": source, "kv_fraction": kv if kv is not None else 1.0,
        "layer_fetch_fraction": fractions,
    }


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
    # +task.gather=zero_copy (not in conf/task/latency.yaml: the stored rows' configs, and hashes, stay as they were)
    rt = OffloadRuntime(model, method, runtime=task.runtime, link_gbps=task.link_gbps, gather=task.get("gather", "host"))
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
    # random weights select up to the budget cap: 0.05 stands in for a real model's 4-5% (experiments/gpu_check.sh)
    "infinigen-b0.05": ("infinigen", {"alpha": 4.0, "partial_ratio": 0.2, "budget": 0.05}, {}),
    "infinigen-b0.05-zero-copy": ("infinigen", {"alpha": 4.0, "partial_ratio": 0.2, "budget": 0.05},
                                  {"gather": "zero_copy"}),
}
COLUMNS = [  # (header, metric (None = the row's name), scale, decimals (None = text))
    ("row", None, 1, None), ("runtime", "runtime", 1, None), ("prefill_s", "prefill_s", 1, 2),
    ("ms/tok", "decode_ms_median", 1, 2), ("p90", "decode_ms_p90", 1, 2), ("tok/s", "tokens_per_s", 1, 1),
    ("h2d_MiB/tok", "h2d_bytes_per_token", 2**-20, 1), ("kv_frac", "kv_fraction", 1, 3),
    ("attn", "attention_ms", 1, 2), ("ffn", "ffn_ms", 1, 2), ("spec", "speculation_ms", 1, 2),
    ("xfer", "transfer_ms", 1, 2), ("wait", "wait_ms", 1, 2), ("host", "link_host_ms", 1, 2),
    ("gath_GB/s", "host_gather_gbps", 1, 1), ("peak_GiB", "peak_device_bytes", 2**-30, 2),
    ("host_GiB", "host_pool_bytes", 2**-30, 2), ("modelled_ms/tok", "modelled_decode_ms_per_token", 1, 2),
]
WIDTH = {"row": 26, "runtime": 9}


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
