"""lm-eval speed: this harness's `task=lm_eval` (full attention, at the batch size a command gets when it names
none; and each of `--methods`) against lm-eval's own HF backend (HFLM) at several batch sizes, on the same model
object, docs and shots.

    python -m experiments.bench_lm_eval                              # piqa, 200 docs, 0- and 5-shot (issue 70)
    python -m experiments.bench_lm_eval --shots 5 --hf-batch-sizes 8 16 --ours default 1 --repeats 2
    python -m experiments.bench_lm_eval --forwards                   # + a forward's ms/token against its tokens

The harness runs what `python run.py task=lm_eval 'task.tasks=[piqa]' task.limit=200 task.num_fewshot=S` runs
(composed from conf/ as run.py composes it, `--ours 1` adds task.batch_size=1, `--methods` names method=); HFLM gets
the very model object and tokenizer the harness loaded (smollm2-135m from its bundled GGUF, offline) and runs it with
transformers' SDPA attention, as lm-eval's own loading of a model would (the harness's model is loaded with eager
attention; its forwards replace the attention anyway). Both are timed around `lm_eval.simple_evaluate` alone
(request building, forwards, metrics): the seconds each row of the store records. With --repeats, the points run in
turn that many times and the fastest run of each counts (other load on the machine only slows a run down).

Prints, per number of shots, the seconds and acc of each, the ratio of the harness's full at its default to lm-eval
at its best batch size and whether that is within 1.0x (issue 70), on how many docs the acc is the same through both
(the same model must score alike, and the harness at another batch size as at its default), and each method's time
over the harness's full (within 1.3x?); then the Fig. 11 preset's wall time per point for full, H2O and InfiniGen,
from each task's seconds per doc on its first --fig11-docs docs (`fig11_per_point`). --forwards: the sim-mode forward's ms per token against the tokens a forward
holds, at a few input lengths: where it stops falling is experiments/lm_eval_protocols.py AUTO_TOKENS, what
`task.batch_size=auto` fills. --threads: torch's threads (on a machine other jobs share, one thread each keeps their
OpenMP threads from spinning against each other). A benchmark script, not a test: run it on an otherwise idle
machine.
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
# run as a file, its folder would come first on the path and experiments/lm_eval.py would shadow the lm_eval package
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "experiments"]

import torch  # noqa: E402

from baselines.full import Full  # noqa: E402
from experiments import lm_eval as task_module  # noqa: E402
from experiments.lm_eval_protocols import AUTO_TOKENS  # noqa: E402
from infinigen import adapter, modes  # noqa: E402

WITHIN = 1.0  # issue 70: the harness's full at its default at most lm-eval's HF backend at its best batch size
METHOD_WITHIN = 1.3  # issue 70: a budget method's lm-eval at most this factor of the harness's full


def compose_run(overrides: list[str], data_dir: str):
    """The config `python run.py <overrides>` runs, and its method, checked as the runner checks them."""
    from hydra import compose, initialize_config_dir

    from experiments import validation

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"data_dir={data_dir}"])
    _, method = validation.validate(cfg)
    return cfg, method


def harness(model, tokenizer, overrides: list[str], data_dir: str) -> tuple[float, dict]:
    cfg, method = compose_run(overrides, data_dir)
    (row,) = task_module.run(model, tokenizer, method, cfg.task, cfg.data_dir)
    return row["seconds"], {"acc": row["acc"], "per_doc": row["units"]["acc"], "batch_size": cfg.task.batch_size,
                            "forwards": row["forwards"]}


def hf_backend(model, tokenizer, batch_size: int, task: str, limit: int, shots: int,
               data_dir: str) -> tuple[float, dict]:
    """lm-eval's own HF backend on the same model object, docs and shots, timed as the harness times itself."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    (name,), manager = task_module.lm_eval_setup([task], data_dir)
    with adapter.attn_implementation(model, "sdpa"):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
        t0 = time.perf_counter()
        results = lm_eval.simple_evaluate(model=lm, tasks=[name], num_fewshot=shots, limit=limit, task_manager=manager,
                                          bootstrap_iters=task_module.BOOTSTRAP_ITERS, log_samples=True)
        seconds = time.perf_counter() - t0
    units = task_module.units_of(results["samples"][name])
    return seconds, {"acc": results["results"][name]["acc,none"], "per_doc": units["acc"]}


def same_docs(a: list, b: list) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)} docs"


def forward_curve(model, lengths: list[int], budgets: list[int]) -> None:
    """ms per token of one sim-mode forward (full attention) of b inputs of t tokens, for b*t up to each budget."""
    print(f"\nsim-mode forward, full attention, ms per token (median of 3) by tokens per forward (AUTO_TOKENS = "
          f"{AUTO_TOKENS}):")
    print("| input tokens | " + " | ".join(str(n) for n in budgets) + " |")
    print("|---:|" + "---:|" * len(budgets))
    gen = torch.Generator().manual_seed(0)
    for t in lengths:
        cells = []
        for budget in budgets:
            b = budget // t
            if b < 1:
                cells.append("")
                continue
            ids = torch.randint(0, model.config.vocab_size, (b, t), generator=gen)
            modes.sim_hidden(model, Full(), ids)  # warm-up
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                modes.sim_hidden(model, Full(), ids)
                times.append(time.perf_counter() - t0)
            cells.append(f"{statistics.median(times) / (b * t) * 1e3:.3f}")
        print(f"| {t} | " + " | ".join(cells) + " |", flush=True)


def bench_shots(model, tokenizer, args, shots: int) -> dict:
    """Every point at `shots` shots, in turn `--repeats` times (the fastest run of each counts: other load on the
    machine only slows a run down), then the ratios."""
    # what `python run.py task=lm_eval 'task.tasks=[piqa]' task.limit=200 task.num_fewshot=S` composes
    base = ["task=lm_eval", f"task.tasks=[{args.task}]", f"task.limit={args.limit}", f"task.num_fewshot={shots}",
            *([f"model={args.model}"] if args.model else [])]
    cfg, _ = compose_run(base, args.data_dir)
    docs = f"{args.task}, {args.limit} docs, {shots}-shot, {cfg.model.name}, {torch.get_num_threads()} threads"

    def run(point: tuple[str, str, int | str]) -> tuple[float, dict]:
        kind, method, size = point
        if kind == "ours":
            extra = [f"method={method}"] + ([] if size == "default" else [f"task.batch_size={size}"])
            return harness(model, tokenizer, base + extra, args.data_dir)
        return hf_backend(model, tokenizer, size, args.task, args.limit, shots, args.data_dir)

    points = [("ours", "full", size) for size in args.ours] + [("ours", m, "default") for m in args.methods]
    points += [("hf", "full", size) for size in args.hf_batch_sizes]
    measured: dict[tuple, tuple[float, dict]] = {}
    for _ in range(args.repeats):
        for point in points:
            seconds, out = run(point)
            if point not in measured or seconds < measured[point][0]:
                measured[point] = (seconds, out)
            kind, method, size = point
            label = (f"lm-eval HF backend (HFLM, sdpa), batch {size}" if kind == "hf" else
                     f"this harness, method={method}, batch_size={out['batch_size']}"
                     f"{' (default)' * (size == 'default')}, {out['forwards']} forwards")
            print(f"{docs}: {label}: {seconds:.1f} s, acc {out['acc']:.4f}", flush=True)
    mine = {size: measured[("ours", "full", size)] for size in args.ours}
    hf = {size: measured[("hf", "full", size)] for size in args.hf_batch_sizes}

    best = min(hf, key=lambda size: hf[size][0])
    reference = mine.get("default") or next(iter(mine.values()))
    ratio = reference[0] / hf[best][0]
    print(f"\n{docs}:")
    print(f"this harness (full) at batch_size={reference[1]['batch_size']}: {reference[0]:.1f} s; lm-eval's HF backend "
          f"at its best batch size ({best}): {hf[best][0]:.1f} s; ratio {ratio:.2f}x ("
          f"{'within' if ratio <= WITHIN else 'NOT within'} {WITHIN}x)")
    print(f"per-doc acc, harness vs lm-eval at batch {best}: the same on "
          f"{same_docs(reference[1]['per_doc'], hf[best][1]['per_doc'])}")
    for size, (_, out) in mine.items():
        if out is not reference[1]:
            print(f"per-doc acc, harness at batch_size={out['batch_size']} vs at {reference[1]['batch_size']}: the "
                  f"same on {same_docs(out['per_doc'], reference[1]['per_doc'])}")
    methods = {}
    for method in args.methods:
        seconds = measured[("ours", method, "default")][0]
        methods[method] = seconds / reference[0]
        print(f"this harness, method={method}: {seconds:.1f} s, {seconds / reference[0]:.2f}x the harness's full "
              f"({'within' if seconds / reference[0] <= METHOD_WITHIN else 'NOT within'} {METHOD_WITHIN}x)")
    same = sum(a == b for a, b in zip(reference[1]["per_doc"], hf[best][1]["per_doc"]))
    return {"kind": "piqa", "task": args.task, "docs": args.limit, "shots": shots, "harness_s": reference[0],
            "hf_s": hf[best][0], "hf_batch": best, "x_hf": ratio, "same_docs": same,
            "compared_docs": len(hf[best][1]["per_doc"]), "x_full": methods}


# the Fig. 11 preset's points timed per point (issue 70): full attention, H2O and InfiniGen at one budget each
FIG11_POINTS = ("full", "h2o_0.25", "infinigen_b0.14")


def fig11_per_point(model, tokenizer, args) -> dict:
    """The wall time of one point of `+experiment=fig11_accuracy_smollm2` (five tasks, 5-shot, the first
    task.limit docs of each), estimated from each task's seconds per doc on its first --fig11-docs docs times the
    docs the preset scores of it: never from a whole process (its model load and first calibration are no doc's)."""
    from lm_eval.tasks import get_task_dict

    preset = ["+experiment=fig11_accuracy_smollm2", *([f"model={args.model}"] if args.model else [])]
    cfg, _ = compose_run(preset, args.data_dir)
    names, manager = task_module.lm_eval_setup(list(cfg.task.tasks), args.data_dir)
    sizes = {task: len(get_task_dict([name], manager)[name].eval_docs) for task, name in zip(cfg.task.tasks, names)}
    scored = {task: min(size, cfg.task.limit) for task, size in sizes.items()}
    print(f"\nFig. 11 preset ({cfg.model.name}, {cfg.task.num_fewshot}-shot, docs a point scores: {scored}), "
          f"{torch.get_num_threads()} threads, seconds per doc on the first {args.fig11_docs} docs of each task:")
    minutes = {}
    for point in FIG11_POINTS:
        per_doc = {}
        for task in cfg.task.tasks:
            seconds, out = harness(model, tokenizer, [*preset, f"+point={point}", f"task.tasks=[{task}]",
                                                      f"task.limit={args.fig11_docs}"], args.data_dir)
            per_doc[task] = seconds / len(out["per_doc"])
        total = sum(per_doc[task] * n for task, n in scored.items())
        cells = ", ".join(f"{task} {per_doc[task]:.2f}" for task in cfg.task.tasks)
        print(f"  {point}: {cells}; a point: {total / 60:.0f} min", flush=True)
        minutes[point] = total / 60
    return {"kind": "fig11", "docs_timed": args.fig11_docs, "shots": int(cfg.task.num_fewshot), "minutes": minutes}


def write_rows(results: str, model: str, summaries: list[dict]) -> None:
    """One store row per comparison (PIQA at a number of shots; the Fig. 11 preset's minutes per point), keyed by
    model, threads and what it compares: a newer run replaces an older one in an export."""
    import hashlib
    import json
    import platform
    from datetime import datetime, timezone

    from analysis import store
    from experiments import identity

    meta = {"git_commit": identity.git_commit(), "versions": identity.versions(), "device": "cpu",
            "threads": torch.get_num_threads(), "host": platform.node(),
            "finished": datetime.now(timezone.utc).isoformat()}
    for summary in summaries:
        config = {"benchmark": "lm_eval_speed", "model": {"name": model}, "threads": meta["threads"],
                  **{k: summary[k] for k in ("kind", "shots", "task", "docs", "docs_timed") if k in summary}}
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
        row = {"config_hash": digest, "model": model, "method": "full", "task": "lm_eval_speed", "data": {},
               "method_params": {"name": "full"}, "task_params": {"name": "lm_eval_speed"}, "config": config,
               "metrics": {"benchmark": "lm_eval_speed", **summary}, "meta": meta}
        store.append_rows(results, digest, [row])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="piqa")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--shots", type=int, nargs="*", default=[0, 5], help="shots of the PIQA comparison (none: skip it)")
    ap.add_argument("--model", default=None, help="a conf/model name (default: the config's, smollm2-135m)")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--ours", nargs="+", default=["default"],
                    help="the harness's batch sizes under full: default (the command names none), an integer or auto")
    ap.add_argument("--methods", nargs="*", default=["infinigen"],
                    help="conf/method names also timed at the default batch size, each against the harness's full")
    ap.add_argument("--fig11-docs", type=int, default=20,
                    help="docs of each task the Fig. 11 preset's per-point time is estimated from (0: not timed)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--forwards", action="store_true", help="also print the forward's ms/token curve")
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own, one per core)")
    ap.add_argument("--results", default=None, metavar="STORE",
                    help="also write each comparison as a store row (metrics.benchmark=lm_eval_speed) into this "
                         "results store, e.g. docs/store: the report's lines in README and docs/scaling.md")
    ap.add_argument("--data-dir", default=os.environ.get("DATA_DIR") or str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, _ = compose_run(["task=lm_eval", *([f"model={args.model}"] if args.model else [])], args.data_dir)
    model, tokenizer = adapter.load(cfg.model, device="cpu")
    summaries = [bench_shots(model, tokenizer, args, shots) for shots in args.shots]
    if args.fig11_docs:
        summaries.append(fig11_per_point(model, tokenizer, args))
    if args.results:
        write_rows(args.results, cfg.model.name, summaries)
    if args.forwards:
        forward_curve(model, [32, 128, 512, 1024], [128, 256, 512, 1024, 2048, 4096, 8192])


if __name__ == "__main__":
    main()
