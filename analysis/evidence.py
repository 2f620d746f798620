"""One command for the report's evidence: every run docs/results.md names, then the store export and the report.

    python -m analysis.evidence             # = make evidence: plan, run what the store lacks, export, report
    python -m analysis.evidence --plan      # the plan only: nothing runs, nothing is written

It composes every section's commands (analysis/report/sections/) into jobs, as run.py would, and looks each job's
config up in the committed store (docs/store) and in results/: a config found in either is skipped, so an interrupted
run resumes where it stopped (run.py skips a config already in results/ as well). Before anything runs it prints the
plan: per section its jobs, how many are stored, how many will run and their estimated seconds, from the store's own
per-unit seconds of the most alike rows (same model, task and method class: seconds per perplexity window, per lm-eval
doc of the same lm-eval task, else per run), scaled to the job's windows or docs. The missing jobs run two at a time
where the machine has the cores (each on half of them), as `python run.py <the job's overrides>`, then
`python -m analysis.store export` copies results/ into docs/store and `python -m analysis.report` rewrites
docs/results.md, its figures and the README's generated blocks. At the end it prints the compute each section's rows
took (the sum of their runs' wall seconds, from the store) and what this invocation ran.

A clean checkout whose store holds every run runs nothing and rewrites the docs byte-identical.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis import columns as C
from analysis.report import discover
from analysis.report.compose import ROOT, compose_all, composed, job_overrides, jobs
from analysis.report.matching import load, target


@dataclass
class Job:
    overrides: list[str]
    config: dict
    key: str  # the semantic config: what a stored row is matched on
    stored: bool
    seconds: float | None = None  # estimated from the store's per-unit seconds (None: no alike row)
    sections: list[str] = field(default_factory=list)


def units(config: dict) -> dict[str, float] | None:
    """What a job's cost scales with: perplexity windows, lm-eval docs per lm-eval task (None: the task's every
    doc), else one run."""
    task = config.get("task", {})
    if task.get("name") == "ppl" and task.get("max_windows"):
        return {"window": float(task["max_windows"])}
    if task.get("name") == "lm_eval":
        return {name: (float(task["limit"]) if task.get("limit") else None) for name in task.get("tasks") or ()}
    return None


def alike(rows: pd.DataFrame, config: dict, same_method: bool = True) -> pd.DataFrame:
    """The store's rows of the same model, task and (`same_method`) method class as `config`; for perplexity the same
    seq_len, for lm-eval the same number of shots."""
    if rows.empty:
        return rows
    task = config.get("task", {})
    same = (rows["model"] == config.get("model", {}).get("name")) & (rows["task"] == task.get("name"))
    if same_method:
        same &= rows["config"].map(target) == target(config)
    if task.get("name") == "ppl":
        same &= C.metric(rows, "seq_len") == task.get("seq_len")
    if task.get("name") == "lm_eval":
        same &= rows["config"].map(lambda c: c.get("task", {}).get("num_fewshot")) == task.get("num_fewshot")
    return rows[same]


def estimate(rows: pd.DataFrame, config: dict) -> float | None:
    """A job's seconds from the store's per-unit seconds of its alike rows (of any method where none of its own
    class is stored; None: no alike row)."""
    near = alike(rows, config)
    near = near if not near.empty else alike(rows, config, same_method=False)
    if near.empty:
        return None
    want = units(config)
    name = config["task"]["name"]
    if name == "ppl" and want:
        per = pd.to_numeric(C.column(near, "metrics.seconds_per_window"), errors="coerce").median()
        return None if pd.isna(per) else float(per * want["window"])
    if name == "lm_eval" and want:
        # per lm-eval task: the seconds (less the model load) of the alike runs that scored it, over the docs they
        # scored, pooled (a run of few docs, whose calibration weighs on each, counts for its few docs only); of
        # any method where no run of the job's method class scored that task
        frames = [lm_eval_runs(alike(rows, config)), lm_eval_runs(alike(rows, config, same_method=False))]
        total = 0.0
        for task, docs in want.items():
            found = next((f for f in frames if (f["task"] == task).any()), None)
            if found is None:
                return None
            runs = found[found["file"].isin(set(found.loc[found["task"] == task, "file"]))]
            rate = runs.drop_duplicates("file")["busy"].sum() / runs["n"].sum()
            total += rate * (docs if docs is not None else runs.loc[runs["task"] == task, "n"].max())
        return float(total)
    runs = near.drop_duplicates("_file")
    seconds = (pd.to_numeric(C.column(runs, "meta.wall_s"), errors="coerce")
               - pd.to_numeric(C.column(runs, "meta.load_s"), errors="coerce").fillna(0)).median()
    return None if pd.isna(seconds) else float(seconds)


def lm_eval_runs(near: pd.DataFrame) -> pd.DataFrame:
    """One line per (run, lm-eval task): docs scored and the run's seconds less its model load."""
    if near.empty:
        return pd.DataFrame(columns=["file", "task", "n", "busy"])
    busy = (pd.to_numeric(C.column(near, "meta.wall_s"), errors="coerce")
            - pd.to_numeric(C.column(near, "meta.load_s"), errors="coerce").fillna(0))
    return pd.DataFrame({"file": near["_file"], "task": C.column(near, "metrics.task"),
                         "n": pd.to_numeric(C.column(near, "metrics.n"), errors="coerce"), "busy": busy})


def plan(store_dir: Path, results_dir: Path) -> tuple[dict[str, Job], dict[str, list[str]], pd.DataFrame]:
    """Every section's jobs (shared jobs once), whether each is stored, and its estimate; section -> job keys; the
    committed store's rows."""
    sections = [s for s in discover() if s.commands]
    compose_all([c for s in sections for c in s.commands])
    rows = load(store_dir)
    if not rows.empty:  # script rows (benchmarks: their config says which) are no run.py job and no job's estimate
        rows = rows[~rows["config"].map(lambda c: "benchmark" in c)]
    done = set(rows["semantic"]) if not rows.empty else set()
    if (results_dir / "rows").is_dir() and any((results_dir / "rows").iterdir()):
        local = load(results_dir)
        done |= set(local["semantic"]) if not local.empty else set()
    every: dict[str, Job] = {}
    by_section: dict[str, list[str]] = {}
    for section in sections:
        keys = []
        for command in section.commands:
            for overrides, config, key in zip(job_overrides(command), jobs(command), composed(command)):
                if key not in every:
                    stored = key in done
                    every[key] = Job(overrides, config, key, stored, None if stored else estimate(rows, config))
                every[key].sections.append(section.slug)
                keys.append(key)
        by_section[section.slug] = list(dict.fromkeys(keys))
    return every, by_section, rows


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def plan_lines(every: dict[str, Job], by_section: dict[str, list[str]], workers: int) -> list[str]:
    out = []
    for slug, keys in by_section.items():
        missing = [every[k] for k in keys if not every[k].stored]
        todo = [j for j in missing if j.sections[0] == slug]  # a job two sections share is planned under the first
        known = [j.seconds for j in todo if j.seconds is not None]
        unknown = len(todo) - len(known)
        shared = len(missing) - len(todo)
        out.append(f"[evidence] plan {slug}: {len(keys)} runs, {len(keys) - len(missing)} in the store, {len(todo)} to "
                   f"run, est. {duration(sum(known))}" + (f" + {unknown} without an alike row" if unknown else "")
                   + (f" ({shared} more planned under an earlier section)" if shared else ""))
    todo = [j for j in every.values() if not j.stored]
    total = sum(j.seconds or 0.0 for j in todo)
    out.append(f"[evidence] plan: {len(every)} runs, {len(every) - len(todo)} in the store, {len(todo)} to run: est. "
               f"{duration(total)} of compute, about {duration(total / max(workers, 1))} at {workers} at a time")
    return out


def run_job(job: Job, threads: int) -> tuple[Job, int, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "run.py", *job.overrides], cwd=ROOT, env=env)
    return job, done.returncode, time.perf_counter() - t0


def compute_lines(rows: pd.DataFrame, by_section: dict[str, list[str]], ran: dict[str, float]) -> list[str]:
    """The compute each section's stored rows took (their runs' wall seconds), and what this invocation ran."""
    out = []
    for slug, keys in by_section.items():
        mine = rows[rows["semantic"].isin(set(keys))].drop_duplicates("_file") if not rows.empty else rows
        wall = pd.to_numeric(C.column(mine, "meta.wall_s"), errors="coerce").sum() if not mine.empty else 0.0
        now = sum(seconds for key, seconds in ran.items() if key in set(keys))
        out.append(f"[evidence] compute {slug}: {mine['_file'].nunique() if not mine.empty else 0} stored runs took "
                   f"{duration(float(wall))}; this invocation ran {duration(now) if now else 'nothing'}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", default="docs/store", help="the committed store the report reads")
    p.add_argument("--results", default="results", help="run.py's results_dir (where new runs land)")
    p.add_argument("--plan", action="store_true", help="print the plan only")
    p.add_argument("--workers", type=int, default=None, help="runs at a time (default: 2 where there are >= 2 cores)")
    args = p.parse_args(argv)
    store_dir, results_dir = ROOT / args.store, ROOT / args.results
    cores = os.cpu_count() or 1
    workers = args.workers or (2 if cores >= 2 else 1)
    every, by_section, rows = plan(store_dir, results_dir)
    print("\n".join(plan_lines(every, by_section, workers)), flush=True)
    if args.plan:
        return 0
    todo = [j for j in every.values() if not j.stored]
    ran: dict[str, float] = {}
    failed = []
    with ThreadPoolExecutor(workers) as pool:
        for job, code, seconds in pool.map(lambda j: run_job(j, max(1, cores // workers)), todo):
            ran[job.key] = seconds
            if code:
                failed.append(job)
            print(f"[evidence] {'FAILED' if code else 'done'} ({duration(seconds)}): python run.py "
                  + " ".join(job.overrides), flush=True)
    py = [sys.executable, "-m"]
    for step in (["analysis.store", "export", "--results", args.results, "--to", args.store],
                 ["analysis.report", "--store", args.store, "--out", "docs", "--readme", "README.md"]):
        if not (results_dir / "rows").is_dir() and step[0] == "analysis.store":
            continue  # nothing ran here: nothing to export
        subprocess.run(py + step, cwd=ROOT, check=True)
    print("\n".join(compute_lines(load(store_dir), by_section, ran)))
    if failed:
        print(f"[evidence] {len(failed)} runs failed (their output is above); rerun `make evidence` to retry them")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
