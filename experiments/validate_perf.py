"""Validate the performance model on this machine: predicted vs measured decode ms/token of the latency task.

    python -m experiments.calibrate                          # once: conf/hardware/local.yaml
    python -m experiments.validate_perf --results docs/store # the table (and its rows in a store)

The model (smollm2-135m) is loaded once. For each batch size and method, in turn: the method's census is timed
(infinigen/offload/census.py, into a fresh cache), then the method runs through the offloading runtime
(task=latency, timing=measured): once untimed at the longest prompt, then at each prompt length `--rounds` times,
each run after the profile's drifting rates (matmul, LM head, weight streaming, host gathers:
experiments/calibrate.py `rates`) are measured again. Measured: the
median of the rounds' median decode step after `--warmup` steps, and the rounds' range. Modelled
(infinigen/offload/perf.py): the calibrated profile with the median of those rates, the census just timed and, for
gathering methods, the per-layer fractions the measured run fetched. Both sides of each ratio are thus measured
within a few minutes of each other: this VM's speed drifts by 10-25% over tens of minutes, and a profile or
census from another hour compares two machines. Timings need a quiet machine: other processes on the cores slow
the measured side and the census alike, but not at the same moments.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# row -> (conf/method, overrides): the list
POINTS = {
    "full": ("full", {}),
    "offload": ("offload", {}),
    "quant4": ("quant", {"bits": 4}),
    "h2o": ("h2o", {}),
    "streaming": ("streaming", {}),
    "infinigen-b0.05": ("infinigen", {"budget": 0.05}),
    "infinigen-b0.2": ("infinigen", {"budget": 0.2}),
    "oracle": ("oracle", {}),
    "quest": ("quest", {}),
}


def compose(method: str, overrides: dict, task: dict, hardware: dict | None, data_dir: str | None):
    from omegaconf import OmegaConf

    conf = ROOT / "conf"
    cfg = OmegaConf.create({
        "model": OmegaConf.load(conf / "model" / "smollm2-135m.yaml"),
        "method": OmegaConf.merge(OmegaConf.load(conf / "method" / f"{method}.yaml"), overrides),
        "task": OmegaConf.merge(OmegaConf.load(conf / "task" / "latency.yaml"), task),
        "logger": {"backends": []}, "data_dir": data_dir, "results_dir": "unused", "force": False, "seed": 0,
        "device": "cpu",
    })
    if hardware is not None:
        cfg.hardware = hardware
    return cfg


def per_layer(stats: dict) -> list[float]:
    layers = stats["per_layer"]["kv_fraction"]
    return [layers[k] for k in sorted(layers, key=int)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(ROOT / "conf" / "hardware" / "local.yaml"))
    p.add_argument("--points", nargs="+", default=list(POINTS), choices=list(POINTS))
    p.add_argument("--prompts", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    # 22 timed steps a round, not 10: one point's rounds differed by up to 30% (offload at 1 x 1024: 108-141
    # ms/token at a08cb6c), and 12 more steps cost less than a round's prefill
    p.add_argument("--gen", type=int, default=24)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="measured runs per point and prompt length")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--device", default="cpu", help="cpu, or cuda with a profile of that GPU (--profile)")
    p.add_argument("--results", default=None, help="also write each point's measured and modelled rows here")
    p.add_argument("--remodel", action="store_true",
                   help="measure nothing: model again the measured validation rows in --results with --profile")
    args = p.parse_args(argv)
    from experiments.calibrate import steady_allocator

    steady_allocator()
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from experiments import calibrate, latency
    from infinigen import adapter
    from infinigen.offload import census, perf, profile

    if not Path(args.profile).is_file():
        sys.exit(f"error: --profile: {args.profile} does not exist; run `python -m experiments.calibrate` first")
    hardware = OmegaConf.to_container(OmegaConf.load(args.profile))
    data_dir = args.data_dir if Path(args.data_dir).is_dir() else None
    print(f"# smollm2-135m (float32) on {args.device}, {torch.get_num_threads()} threads; profile {args.profile}: "
          + ", ".join(f"{k}={v}" for k, v in hardware.items() if k not in ("name", "machine")), flush=True)
    print(f"{'point':<16} {'batch':>5} {'prompt':>6} {'measured':>9} {'rounds':>15} {'modelled':>9} {'ratio':>6}  "
          f"modelled terms (ms): compute / speculation / host / exposed link; memory GB/s", flush=True)
    if args.remodel:
        return remodel(args, hardware, data_dir)
    model, tokenizer = adapter.load(compose("full", {}, {}, None, data_dir).model, device=args.device)
    weights = calibrate.weights_of(hardware.get("weights_of") or "smollm2-135m") if args.device == "cpu" else None
    census_root = Path(tempfile.mkdtemp(prefix="validate-census-"))
    ratios = []
    for batch in args.batches:
        for name in args.points:
            method_cfg, overrides = POINTS[name]
            # this point's census, timed now: the rounds below follow within minutes (a census from another
            # hour timed a machine 10-25% faster or slower than the one measured)
            census.CACHE = census_root / f"{name}-b{batch}"
            base = compose(method_cfg, overrides, {}, None, data_dir)
            t0 = time.perf_counter()  # one modelled step per prompt runs (and caches) every census the model reads
            for prompt in args.prompts:
                perf.modelled_steps(profile.hardware(hardware), base.model, instantiate(base.method), base.task.runtime,
                                    batch, prompt, 1, None)
            census_s = time.perf_counter() - t0
            # one untimed run at the longest prompt first: the first run after a census measured full attention
            # at 8 x 1024 at 267 ms/token, the next at 219 (the model: 227), the heap then holds what rounds use
            warm = compose(method_cfg, overrides, {"batch_size": batch, "prompt_len": max(args.prompts),
                                                   "gen_len": args.gen, "warmup": args.warmup}, None, data_dir)
            latency.run(model, tokenizer, instantiate(warm.method), warm.task, data_dir, device=args.device)
            for prompt in args.prompts:
                task = {"batch_size": batch, "prompt_len": prompt, "gen_len": args.gen, "warmup": args.warmup}
                cfg = compose(method_cfg, overrides, task, None, data_dir)
                runs, probes = [], []
                for _ in range(args.rounds):
                    if weights is not None:  # the rates the profile prices weights and gathers at, measured now
                        probes.append(calibrate.rates(5, weights))
                    t0 = time.perf_counter()
                    result = latency.run(model, tokenizer, instantiate(cfg.method), cfg.task, data_dir,
                                         device=args.device)
                    runs.append({**result, "wall_s": time.perf_counter() - t0})
                medians = [r["decode_ms_median"] for r in runs]
                measured = dict(runs[0], decode_ms_median=statistics.median(medians), decode_ms_rounds=medians)
                paired = {k: statistics.median(p[k] for p in probes) for k in probes[0]} if probes else {}
                mcfg = compose(method_cfg, overrides, {**task, "timing": "modelled", "fetch_fraction": None},
                               {**hardware, **paired}, data_dir)
                method = instantiate(mcfg.method)
                fractions = per_layer(measured["stats"]) if "kv_fraction" in measured["stats"].get("per_layer", {}) \
                    else None
                modelled = latency.run_modelled(mcfg, method, fractions=fractions,
                                                source=f"measured run of this point ({name})")
                modelled.update(census_s=census_s, rate_rounds=probes)
                ratio = modelled["decode_ms_median"] / measured["decode_ms_median"]
                ratios.append(ratio)
                print(f"{name:<16} {batch:>5} {prompt:>6} {measured['decode_ms_median']:>9.1f} "
                      f"{min(medians):>7.1f}..{max(medians):<7.1f} {modelled['decode_ms_median']:>9.1f} {ratio:>6.2f}  "
                      f"{modelled['compute_ms']:.1f} / {modelled['speculation_ms']:.1f} / {modelled['host_ms']:.1f} / "
                      f"{modelled['exposed_transfer_ms']:.1f}  {paired.get('memory_gbps', hardware['memory_gbps']):.2f}",
                      flush=True)
                if args.results:
                    write_rows(args.results, cfg, mcfg, method, measured, modelled, name, ratio,
                               sum(r["wall_s"] for r in runs), args.device)
    worst = max(abs(r - 1) for r in ratios)
    print(f"# {len(ratios)} points; worst |predicted / measured - 1| = {worst:.3f}", flush=True)
    return 0


def write_rows(results, cfg, mcfg, method, measured, modelled, name, ratio, wall_s, device) -> None:
    import platform

    import torch

    from analysis import store
    from experiments import identity

    meta = {"git_commit": identity.git_commit(), "versions": identity.versions(), "device": device,
            "threads": torch.get_num_threads(), "wall_s": wall_s, "host": platform.node(),
            "finished": datetime.now(timezone.utc).isoformat(), "random_init": False}
    measured.update(validation_point=name)
    modelled.update(validation_point=name, measured_decode_ms=measured["decode_ms_median"], ratio=ratio)
    for c, metrics in ((cfg, measured), (mcfg, modelled)):
        digest = identity.config_hash(c)
        rows = identity.make_rows(c, method, digest, [metrics], meta)
        for row in rows:
            row["method"] = row["method_params"]["name"] = POINTS[name][0]
        store.append_rows(results, digest, rows)


def remodel(args, hardware: dict, data_dir) -> int:
    """The measured validation rows of args.results modelled again with the profile (modelled rows replaced)."""
    import json

    from hydra.utils import instantiate

    from analysis import store
    from analysis.store import rows_dir
    from experiments import identity, latency

    measured_rows = []
    for path in sorted(rows_dir(args.results).glob("*.jsonl")):
        row = json.loads(path.read_text().splitlines()[0])
        metrics = row.get("metrics") or {}
        if row.get("task") != "latency" or "validation_point" not in metrics:
            continue
        if metrics.get("timing") == "modelled":
            path.unlink()  # replaced below
        else:
            measured_rows.append(row)
    ratios = []
    for row in sorted(measured_rows, key=lambda r: (r["metrics"]["batch_size"], r["metrics"]["prompt_len"])):
        measured, name = row["metrics"], row["metrics"]["validation_point"]
        task = {k: measured[k] for k in ("batch_size", "prompt_len", "gen_len")} | {"warmup": args.warmup}
        method_cfg, overrides = POINTS[name]
        cfg = compose(method_cfg, overrides, task, None, data_dir)
        mcfg = compose(method_cfg, overrides, {**task, "timing": "modelled", "fetch_fraction": None}, hardware,
                       data_dir)
        method = instantiate(mcfg.method)
        fractions = per_layer(measured["stats"]) if "kv_fraction" in measured["stats"].get("per_layer", {}) else None
        modelled = latency.run_modelled(mcfg, method, fractions=fractions,
                                        source=f"measured run of this point ({name})")
        ratio = modelled["decode_ms_median"] / measured["decode_ms_median"]
        ratios.append(ratio)
        print(f"{name:<16} {task['batch_size']:>5} {task['prompt_len']:>6} {measured['decode_ms_median']:>9.1f} "
              f"{'':>15} {modelled['decode_ms_median']:>9.1f} {ratio:>6.2f}", flush=True)
        modelled.update(validation_point=name, measured_decode_ms=measured["decode_ms_median"], ratio=ratio)
        digest = identity.config_hash(mcfg)
        meta = {**row["meta"], "git_commit": identity.git_commit(), "measured_commit": row["meta"]["git_commit"],
                "finished": datetime.now(timezone.utc).isoformat()}  # modelled now, of a run measured then
        rows = identity.make_rows(mcfg, method, digest, [modelled], meta)
        for r in rows:
            r["method"] = r["method_params"]["name"] = method_cfg
        store.append_rows(args.results, digest, rows)
    print(f"# {len(ratios)} points; worst |predicted / measured - 1| = {max(abs(r - 1) for r in ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
