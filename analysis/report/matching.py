"""The store's rows matched to the sections' commands: fresh, missing and stale runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis import columns as C
from analysis import like
from analysis import store
from analysis import tables as T
from analysis.report.compose import composed, difference, jobs, semantic
from infinigen.semantic import semantic_method


def load(store_dir: str | Path) -> pd.DataFrame:
    """The store's rows with `semantic` (the key rows are matched on) and `config` (the recorded config)."""
    df = store.load(store_dir, strict=True)
    if df.empty:
        return df.assign(semantic=pd.Series(dtype=object), config=pd.Series(dtype=object))
    # each run's config as recorded (a flattened frame would turn keys other rows lack, and None, into NaN)
    recorded = {name: json.loads((store.rows_dir(store_dir) / name).read_text().splitlines()[0]).get("config", {})
                for name in df["_file"].unique()}
    configs = [recorded[name] for name in df["_file"]]
    df = df.assign(config=configs, semantic=[semantic(c) for c in configs])
    return df.sort_values(["_file", "metrics.task"] if "metrics.task" in df else ["_file"]).reset_index(drop=True)


@dataclass
class Matched:
    rows: pd.DataFrame  # fresh rows of the section's commands
    missing: dict[str, int]  # command -> jobs without a row
    total: int  # distinct configs the commands compose
    present: int  # of those, the ones with rows


def match(df: pd.DataFrame, commands: tuple[str, ...]) -> Matched:
    wanted, missing = set(), {}
    for command in commands:
        keys = set(composed(command))
        wanted |= keys
        absent = len(keys - set(df["semantic"])) if not df.empty else len(keys)
        if absent:
            missing[command] = absent
    rows = df[df["semantic"].isin(wanted)] if not df.empty else df
    return Matched(rows, missing, len(wanted), rows["semantic"].nunique() if not rows.empty else 0)


def target(config: dict) -> str | None:
    """The method class a config names, a moved one as its rows were written (infinigen/semantic.py)."""
    return semantic_method(config.get("method", {})).get("_target_")


def stale_rows(df: pd.DataFrame, commands: list[str]) -> list[str]:
    """One line per stored run that no command composes today, with its difference from the nearest job."""
    every = [(command, job) for command in commands for job in jobs(command)]
    known = {semantic(job) for _, job in every}
    lines = []
    for name, rows in df[~df["semantic"].isin(known)].groupby("_file", sort=True):
        config = rows.iloc[0]["config"]
        near = [(difference(config, job), command) for command, job in every
                if job.get("model", {}).get("name") == config.get("model", {}).get("name")
                and job.get("task", {}).get("name") == config.get("task", {}).get("name")
                and target(job) == target(config)]
        if near:
            diff, command = min(near, key=lambda d: len(d[0]))
            lines.append(f"* `{name}` ({rows.iloc[0]['method']}): differs from today's config of `{command}` in "
                         + "; ".join(f"`{d}`" for d in diff[:6]) + (" ..." if len(diff) > 6 else ""))
        else:
            lines.append(f"* `{name}` ({rows.iloc[0]['method']}, {rows.iloc[0]['task']}): no command of this report "
                         "produces it (add its command to a section of analysis/report/sections/, or drop it from the "
                         "store)")
    return lines


# the tasks whose rows accuracy verdicts read: such a verdict reads the rows of one clean build (one_build)
ACCURACY_TASKS = ("ppl", "lm_eval", "needle", "generate")


def one_build(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """An accuracy verdict's rows from one clean commit. A section's verdict reads one task of one model
    (perplexity or lm-eval, say), so per (model, task) the rows kept are those of the commit of the newest run (by
    the time in its file name) among the runs of a committed tree. Rows of other commits, of a tree with uncommitted
    changes (-dirty) or without a recorded commit are refused, as speed verdicts refuse them (analysis/like.py), so
    that a verdict never sets rows of two builds side by side. Returns (the rows kept, one line per (model, task)
    that lost runs, naming what was refused and why). Rows of other tasks pass as they are."""
    if rows.empty or "task" not in rows:
        return rows, []
    accuracy = rows["task"].isin(ACCURACY_TASKS)
    kept, lines = [rows[~accuracy]], []
    for (model, task), part in rows[accuracy].groupby(["model", "task"], sort=True):
        runs = part.drop_duplicates("_file")
        commit = C.column(runs, "meta.git_commit")
        clean = commit.map(lambda c: isinstance(c, str) and len(c) == 40)
        if clean.any():
            newest = runs[clean].assign(_when=runs.loc[clean, "_file"].str.split("__").str[-1]).sort_values("_when")
            build = newest["meta.git_commit"].iloc[-1]
            keep = part[C.column(part, "meta.git_commit") == build]
        else:
            build, keep = None, part.iloc[:0]
        kept.append(keep)
        refused = runs[~runs["_file"].isin(set(keep["_file"]))]
        if refused.empty:
            continue
        counts = sorted(C.column(refused, "meta.git_commit").map(like.short_commit).value_counts().items(),
                        key=lambda kv: (-kv[1], kv[0]))
        named = ", ".join(f"{c} ({n} run{'s' * (n != 1)})" for c, n in counts)
        lines.append(f"{model}, {task}: one build per verdict: the rows of commit {like.short_commit(build)} (the newest run's of a "
                     f"committed tree); refused {len(refused)} run{'s' * (len(refused) != 1)} of other builds: {named}"
                     if build is not None else
                     f"{model}, {task}: one build per verdict: refused all {len(refused)} runs, none of a committed tree "
                     f"({named}); re-run the commands below from a clean checkout")
    return pd.concat(kept).sort_index().copy(), lines


def commits(rows: pd.DataFrame) -> str:
    """Which commit produced the rows: each commit (7 hex digits; -dirty: the tree had uncommitted changes on top)
    with its number of runs, most runs first."""
    runs = rows.drop_duplicates("_file")
    commit = C.column(runs, "meta.git_commit").map(like.short_commit)
    counts = sorted(commit.value_counts().items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{c} ({n} run{'s' * (n != 1)})" for c, n in counts)
    return text + ("; -dirty: uncommitted changes on top of the commit" if commit.str.endswith("-dirty").any() else "")


def provenance(rows: pd.DataFrame) -> str:
    """Runs, the commits that produced them, machines, torch versions and data the rows come from."""
    if rows.empty:
        return ""
    devices = sorted(set(C.column(rows, "meta.device").map(str) + " x "
                         + C.column(rows, "meta.threads").map(str) + " threads"))
    torch = sorted(set(C.column(rows, "meta.versions").map(
        lambda v: v.get("torch") if isinstance(v, dict) else None).dropna()))
    data = sorted(set(T.data_id(rows).dropna()))
    runs = rows["_file"].nunique()
    return (f"{runs} run{'s' * (runs != 1)}; rows by commit: {commits(rows)}; device {', '.join(devices)}; "
            f"torch {', '.join(torch)}" + (f"; data sha256 {', '.join(data)}" if data else ""))
