"""The reproduction report: docs/results.md and the figures it links, from the committed store alone.

    python -m analysis.report --store docs/store --out docs     # = make report (offline, seconds)

One section per claim of the InfiniGen paper (C1-C7) and per finding beyond it. A section is declared in
`SECTIONS`: the commands whose rows it shows (`python run.py ...`, expanded exactly as Hydra's sweeper would),
a table, a figure (a function of analysis/figures.py, or one of this module) and a verdict computed from its rows.
Every number in the report comes from the store; a config missing from the store is named with the command that
fills it. A stored row is *stale* when its recorded config differs from what its command composes today (a
method's default changed, a preset moved): it is listed with the difference and left out of every table, figure
and verdict. The README's headline paragraph (between the `report:headline` markers) is rewritten from the same
numbers. Output is byte-identical from run to run (sorted rows, no dates, PNG without software metadata).
Composing every command takes Hydra ~20 s on one core; the rest (tables, figures) a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import shlex
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis import figures as F
from analysis import ops as O
from analysis import speed as S
from analysis import store
from analysis import tables as T
from experiments.runner import semantic_config

ROOT = Path(__file__).resolve().parent.parent
# every generated block of the README: <!-- report:NAME --> ... <!-- /report:NAME -->
BLOCK = re.compile(r"(<!-- report:(\w+) -->\n)(.*?)(<!-- /report:\2 -->)", re.DOTALL)
# the perplexity setting of the comparisons: one 1024-token WikiText-2 window (what a shared 2-core CPU affords)
PPL = "python run.py -m model=smollm2-135m task=ppl task.seq_len=1024 task.max_windows=1"
SKEW_PPL = f"{PPL} +point=infinigen_a99_b0.2_p0.1,infinigen_a99_b0.2_p0.1_noskew"


# ----------------------------------------------------------------------------------------------- configs


def semantic(config: dict) -> str:
    """What a run computes, as text: the config without locations and bookkeeping (the runner's config hash
    without the data identity, which needs the data folder)."""
    return json.dumps(semantic_config(config), sort_keys=True, default=str)


def overrides_of(command: str) -> tuple[list[str], bool]:
    """The Hydra overrides of a `python run.py [-m] ...` command line, and whether it sweeps (-m)."""
    words = shlex.split(command)
    if words[:2] != ["python", "run.py"]:
        raise ValueError(f"a section command starts with `python run.py`, got {command!r}")
    words = words[2:]
    multirun = any(w in ("-m", "--multirun") for w in words)
    return [w for w in words if w not in ("-m", "--multirun")], multirun


def compose_jobs(command: str) -> list[dict]:
    """The config of every job the command runs today, as run.py composes it (sweeps expanded as Hydra's basic
    sweeper does: the preset's hydra.sweeper.params, then the command line)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    overrides, multirun = overrides_of(command)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        batches = [overrides]
        if multirun:
            hydra_cfg = GlobalHydra.instance().hydra.compose_config(
                "config", overrides, run_mode=RunMode.MULTIRUN, from_shell=True).hydra
            params = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.get("params") or {}).items()]
            parsed = OverridesParser.create().parse_overrides(params + overrides)
            batches = BasicSweeper.split_arguments(parsed, None)[0]
        return [OmegaConf.to_container(compose("config", overrides=list(job)), resolve=True) for job in batches]


_COMPOSED: dict[str, tuple[str, ...]] = {}


def _semantic_jobs(command: str) -> tuple[str, ...]:
    return tuple(semantic(job) for job in compose_jobs(command))


def composed(command: str) -> tuple[str, ...]:
    """`compose_jobs` in semantic form, once per process (Hydra takes ~0.2 s per job)."""
    if command not in _COMPOSED:
        _COMPOSED[command] = _semantic_jobs(command)
    return _COMPOSED[command]


def compose_all(commands: list[str]) -> None:
    """Composes every command's jobs in worker processes, one command at a time each: the report composes some
    250 jobs, which on one core took most of its minute."""
    todo = [c for c in dict.fromkeys(commands) if c not in _COMPOSED]
    workers = min(len(todo), os.cpu_count() or 1)
    if workers < 2:
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        _COMPOSED.update(zip(todo, pool.map(_semantic_jobs, todo)))


def jobs(command: str) -> list[dict]:
    return [json.loads(text) for text in composed(command)]


def flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def difference(row_config: dict, job: dict) -> list[str]:
    """The leaves where a row's recorded config and today's composed config differ."""
    row, now = flat(json.loads(semantic(row_config))), flat(json.loads(semantic(job)))
    return [f"{k}: row {row.get(k, '(absent)')!r}, now {now.get(k, '(absent)')!r}"
            for k in sorted(set(row) | set(now)) if row.get(k, "(absent)") != now.get(k, "(absent)")]


# ----------------------------------------------------------------------------------------------- rows


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
                and job.get("method", {}).get("_target_") == config.get("method", {}).get("_target_")]
        if near:
            diff, command = min(near, key=lambda d: len(d[0]))
            lines.append(f"* `{name}` ({rows.iloc[0]['method']}): differs from today's config of `{command}` in "
                         + "; ".join(f"`{d}`" for d in diff[:6]) + (" ..." if len(diff) > 6 else ""))
        else:
            lines.append(f"* `{name}` ({rows.iloc[0]['method']}, {rows.iloc[0]['task']}): no command of this report "
                         "produces it (add its command to a section of analysis/report.py, or drop it from the store)")
    return lines


# ----------------------------------------------------------------------------------------------- numbers


def num(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def signed(x: float) -> str:
    return f"{x:+.2f}"


def ppl_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """ppl rows with ppl, kv (measured kv_fraction), rel_kv (x bytes per entry vs 16 bits) and a curve label."""
    out = F.with_kv(F.of_task(rows, "ppl"))
    if out.empty:
        return out.assign(ppl=[], kv=[], rel_kv=[], curve=[])
    out["ppl"] = F.metric(out, "ppl")
    out["rel_kv"] = out["kv_pct"] / 100
    out["kv"] = out["rel_kv"] / F.bytes_ratio(out)
    out["curve"] = F.curve_labels(out, F.size_params)
    return out


def interpolate(points: pd.DataFrame, x: str, y: str, at: float) -> float | None:
    """y at x = at, linear between the two neighbouring points; None outside the measured range."""
    points = points.dropna(subset=[x, y]).sort_values(x)
    xs, ys = points[x].to_list(), points[y].to_list()
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= at <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    return ys[xs.index(at)] if at in xs else None


def full_ppl(rows: pd.DataFrame) -> float | None:
    full = rows[rows["method"] == "full"]
    return float(full["ppl"].iloc[0]) if not full.empty else None


def needs(what: str) -> list[str]:
    return [f"not computed: the store has no {what} (run the commands below)"]


# ----------------------------------------------------------------------------------------------- figures


def save(fig: Figure, path: Path) -> None:
    """PNG without the software/version text, so the bytes depend on the data and matplotlib's drawing only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})


def ppl_vs_kv(rows: pd.DataFrame, title: str) -> Figure:
    """Perplexity vs measured relative KV size, one line per method setting, full attention dashed."""
    data = ppl_rows(rows)
    panels = sorted(data.assign(panel=data["model"] + " / " + F.column(data, "task_params.dataset").astype(str)
                                + " / " + F.metric(data, "windows").map(lambda v: f"{v:.0f}") + " x "
                                + F.metric(data, "seq_len").map(lambda v: f"{v:.0f}") + " tokens, dense_rows "
                                + F.metric(data, "dense_rows").fillna(0).map(lambda v: f"{v:.0f}"))
                    .groupby("panel"), key=lambda p: p[0])
    fig, axes = F.grid(len(panels), cols=2, size=(6.0, 3.8))
    for ax, (panel, part) in zip(axes, panels):
        for value in part.loc[part["method"] == "full", "ppl"].unique():
            ax.axhline(value, color="black", linestyle="--", linewidth=1, label="full")
        F.draw_curves(ax, part[part["method"] != "full"], "kv_pct", "ppl")
        ax.set_yscale("log")
        ax.set(xlabel="relative KV cache size (%, measured)", ylabel="perplexity (log scale)")
        ax.set_title(panel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    F.titled(fig, title, data)
    return fig


def cost_bars(rows: pd.DataFrame, title: str) -> Figure:
    data = sim_cost(rows)
    fig, axes = F.grid(1, size=(7.5, 3.6))
    data = data.dropna(subset=["x full"]).sort_values("x full")  # a setting without a matched full: no bar
    axes[0].barh(range(len(data)), data["x full"], color=[F.color(m) for m in data["method"]])
    axes[0].set_yticks(range(len(data)), [f"{m} ({p})" if p else m for m, p in zip(data["method"], data["params"])],
                       fontsize=7)
    axes[0].axvline(1.0, color="black", linestyle="--", linewidth=1)
    axes[0].set(xlabel="seconds per window / full's at the same thread count (shared CPU, one run each)",
                ylabel="method setting")
    axes[0].grid(alpha=0.3, axis="x")
    F.titled(fig, title, F.of_task(rows, "ppl"))
    return fig


# ----------------------------------------------------------------------------------------------- sections


def memory_rows(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[F.column(rows, "metrics.benchmark") == "memory"]


def memory_table(rows: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame({"model": rows["model"], "method": rows["method"],
                        "tokens": F.metric(rows, "seq_len").astype(int),
                        "ppl task peak GB": F.metric(rows, "task_peak_gb").round(3),
                        "model forward peak GB": F.metric(rows, "forward_peak_gb").round(3),
                        "loaded GB": F.metric(rows, "loaded_gb").round(3),
                        "ppl (task)": F.metric(rows, "ppl").round(6), "ppl (forward)": F.metric(rows, "forward_ppl").round(6)})
    return out.sort_values(["model", "method", "tokens"]).reset_index(drop=True)


def memory_verdict(rows: pd.DataFrame) -> list[str]:
    data = memory_table(rows)
    if data["tokens"].nunique() < 2:
        return needs("memory rows at two or more lengths")
    lo, hi = data.iloc[data["tokens"].idxmin()], data.iloc[data["tokens"].idxmax()]
    span = (hi["tokens"] - lo["tokens"]) * 1e-3  # GB per token -> MB per token

    def slope(column: str) -> str:
        return num((hi[column] - lo[column]) / span)

    return [f"peak RSS at {hi['tokens']} tokens: ppl task {num(hi['ppl task peak GB'])} GB, the model's own forward "
            f"{num(hi['model forward peak GB'])} GB; growth {lo['tokens']}..{hi['tokens']} tokens: ppl task "
            f"{slope('ppl task peak GB')} MB/token, forward {slope('model forward peak GB')} MB/token",
            f"perplexity, task vs forward: largest |difference| {num((data['ppl (task)'] - data['ppl (forward)']).abs().max())}"]


def memory_figure(rows: pd.DataFrame) -> Figure:
    data = memory_table(rows)
    fig, axes = F.grid(1, size=(6.0, 3.6))
    for column, style in (("ppl task peak GB", "-o"), ("model forward peak GB", "--s"), ("loaded GB", ":")):
        axes[0].plot(data["tokens"], data[column], style, label=column.replace(" GB", ""))
    axes[0].set(xlabel="tokens in the window", ylabel="peak RSS (GB)", xscale="log")
    axes[0].set_xticks(data["tokens"].tolist(), [str(t) for t in data["tokens"]])
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("evaluation memory: ppl task vs the model's own forward (smollm2-135m, CPU)")
    return fig


@dataclass(frozen=True)
class Section:
    slug: str
    title: str
    claim: str  # what the paper (or the finding) says, in words
    commands: tuple[str, ...]
    table: Callable[[pd.DataFrame], pd.DataFrame]
    verdict: Callable[[pd.DataFrame], list[str]]
    figure: Callable[[pd.DataFrame], Figure] | None = None
    note: str = ""
    # a section fed by a script (not a run.py command): selects its rows among the store's script rows
    script: Callable[[pd.DataFrame], pd.DataFrame] | None = None


def figure_of(name: str) -> Callable[[pd.DataFrame], Figure]:
    """A figure of analysis/figures.py (its numbers are in the section's table)."""
    return lambda rows: F.FIGURES[name](rows)[0]


def ppl_table(rows: pd.DataFrame) -> pd.DataFrame:
    out = T.table(rows, "ppl")
    return out.drop(columns=[c for c in out.columns if c.endswith("(MiB)") or c in ("data", "model")])


def accuracy_table(rows: pd.DataFrame) -> pd.DataFrame:
    out = T.table(rows, "accuracy")
    return out.drop(columns=[c for c in ("model", "protocol") if c in out.columns])


def ppl_and_accuracy(rows: pd.DataFrame) -> pd.DataFrame:
    return pd.concat([ppl_table(rows), accuracy_table(rows)], ignore_index=True)


def nll_table(rows: pd.DataFrame) -> pd.DataFrame:
    _, numbers = F.fig12_ppl_position(rows)
    if numbers.empty:
        return numbers
    wide = numbers.pivot_table(index="position", columns="curve", values="nll").reset_index()
    wide.columns.name = None
    return wide.rename(columns={"position": "chunk start"})


def eviction_table(rows: pd.DataFrame) -> pd.DataFrame:
    out = T.table(rows, "eviction")
    return out.drop(columns=[c for c in ("model",) if c in out.columns])


def needle_table(rows: pd.DataFrame) -> pd.DataFrame:
    _, numbers = F.needle_heatmap(rows)
    if numbers.empty:
        return numbers
    wide = numbers.pivot_table(index=["setting", "length"], columns="depth", values="accuracy").reset_index()
    wide.columns = [c if isinstance(c, str) else f"depth {c:g}" for c in wide.columns]
    return wide


def sim_cost(rows: pd.DataFrame) -> pd.DataFrame:
    """Seconds per ppl window in sim mode (wall time less the model load, over the windows) and the ratio to
    full's on the same task setting."""
    data = F.of_task(rows, "ppl")
    if data.empty:
        return pd.DataFrame(columns=["method", "params", "s / window", "x full"])
    seconds = (pd.to_numeric(data["meta.wall_s"]) - pd.to_numeric(data["meta.load_s"])) / F.metric(data, "windows")
    out = pd.DataFrame({"method": data["method"], "params": T.key_params(data), "s / window": seconds,
                        "threads": pd.to_numeric(F.column(data, "meta.threads")).astype("Int64"),
                        "device": F.column(data, "meta.device")})
    # the same window shape on the same device and thread count: a 1-thread run against a 2-thread full's is
    # no cost ratio
    setting = (F.metric(data, "seq_len").astype(str) + " | " + F.metric(data, "dense_rows").fillna(0).astype(str)
               + " | " + out["device"].astype(str) + " | " + out["threads"].astype(str))
    full = out.loc[out["method"] == "full"].groupby(setting)["s / window"].first()
    out["x full"] = out["s / window"] / setting.map(full)
    return out.sort_values(["x full", "method", "params"]).reset_index(drop=True)


def latency_table(rows: pd.DataFrame) -> pd.DataFrame:
    return T.table(rows, "latency")


# ------------------------------------------------------------------- verdicts


def c1_verdict(rows: pd.DataFrame) -> list[str]:
    out = []
    data = ppl_rows(rows)
    full = full_ppl(data) if not data.empty else None
    gen = data[(data["method"] == "infinigen")] if not data.empty else data
    if full is None or gen.empty:
        out += needs("WikiText-2 ppl rows of full and InfiniGen")
    else:
        for curve, part in gen.groupby("curve"):
            above = part[part["kv"] >= 0.10]
            if above.empty:
                out.append(f"{curve}: no kv_fraction >= 10% (largest {num(100 * part['kv'].max())}%)")
                continue
            worst = above.loc[above["ppl"].idxmax()]
            out.append(f"WikiText-2 perplexity, {curve} at measured kv_fraction >= 10% ({len(above)} budgets): at "
                       f"most {num(100 * (worst['ppl'] / full - 1))}% above full's {num(full, 4)} (worst: "
                       f"{num(worst['ppl'], 4)} at kv_fraction {num(100 * worst['kv'])}%)")
    acc = T.table(rows, "accuracy")
    if acc.empty:
        return out + needs("lm-eval accuracy rows")
    full_acc = acc.loc[acc["method"] == "full", "mean acc"]
    gen = acc[(acc["method"] == "infinigen") & (acc["kv_fraction"] >= 0.10)]
    if full_acc.empty or gen.empty:
        return out + needs("lm-eval rows of full and of InfiniGen at kv_fraction >= 10%")
    n = int(F.metric(F.of_task(rows, "lm_eval"), "n").max())
    out.append(f"lm-eval mean accuracy, InfiniGen at kv_fraction >= 10%: {num(100 * gen['mean acc'].min())}-"
               f"{num(100 * gen['mean acc'].max())}% vs full's {num(100 * full_acc.iloc[0])}% over n = {n} docs per "
               f"task (one doc = {num(100 / n)} points: a smoke test of the path, not an accuracy estimate)")
    return out


def matched_gaps(data: pd.DataFrame, method: str, reference: str, x: str = "rel_kv") -> list[tuple]:
    """(x, method's ppl gap to full, reference's gap interpolated at that x, the method's row, the reference's
    curve) for each row of `method` inside the measured range of a curve of `reference`."""
    full = full_ppl(data)
    out = []
    for ref_curve, ref in data[data["method"] == reference].groupby("curve"):
        for _, row in data[data["method"] == method].sort_values([x, "curve"]).iterrows():
            at = interpolate(ref, x, "ppl", row[x])
            if at is not None:
                out.append((row[x], row["ppl"] - full, at - full, row, ref_curve))
    return out


def c2_verdict(rows: pd.DataFrame) -> list[str]:
    data = ppl_rows(rows)
    if data.empty or full_ppl(data) is None or not (data["method"] == "infinigen").any():
        return needs("WikiText-2 ppl rows of full, InfiniGen, H2O and quant")
    out = []
    for x, gap, ref_gap, row, _ in matched_gaps(data, "infinigen", "h2o"):
        out.append(f"at relative KV size {num(100 * x)}% ({row['curve']}, measured): perplexity gap to full "
                   f"InfiniGen {signed(gap)}, H2O {signed(ref_gap)} (interpolated): H2O's gap / InfiniGen's = "
                   f"{num(ref_gap / gap)}x")
    for x, gap, ref_gap, row, curve in matched_gaps(data, "quant", "infinigen"):
        out.append(f"at relative KV size {num(100 * x)}% ({num(row['method_params.bits'])}-bit quant): gap to full "
                   f"quant {signed(gap)}, {curve} {signed(ref_gap)} (interpolated): quant's gap / InfiniGen's = "
                   f"{num(gap / ref_gap)}x")
    gen = data[data["method"] == "infinigen"]
    for _, row in data[data["method"] == "quant"].iterrows():  # outside InfiniGen's range: its nearest point
        if not any(m[3].name == row.name for m in matched_gaps(data, "quant", "infinigen")):
            near = gen.loc[(gen["rel_kv"] - row["rel_kv"]).abs().idxmin()]
            out.append(f"{num(row['method_params.bits'])}-bit quant at relative KV size {num(100 * row['rel_kv'])}%: "
                       f"gap to full {signed(row['ppl'] - full_ppl(data))}; nearest InfiniGen point ({near['curve']}"
                       f", {num(100 * near['rel_kv'])}%): {signed(near['ppl'] - full_ppl(data))}")
    if not out:
        out.append("no InfiniGen point lies inside H2O's or quant's measured KV-size range (widen the budgets)")
    return out


def c3_verdict(rows: pd.DataFrame) -> list[str]:
    _, numbers = F.fig12_ppl_position(rows)
    if numbers.empty or not (numbers["method"] == "full").any():
        return needs("ppl rows with per-chunk NLL (seq_len >= 2048) of full and the compared methods")
    full = numbers[numbers["method"] == "full"].set_index("position")["nll"]
    mean = {m: (part.set_index("position")["nll"] - full).mean()
            for m, part in numbers[numbers["method"] != "full"].groupby("method")}
    out = []
    if "infinigen" in mean and "h2o" in mean:
        out.append(f"mean NLL gap to full over the window: InfiniGen {num(mean['infinigen'])}, H2O {num(mean['h2o'])} "
                   f"nats/token: InfiniGen's / H2O's = {num(mean['infinigen'] / mean['h2o'])}x")
    for curve, part in numbers[numbers["method"] != "full"].groupby("curve"):
        gap = part.set_index("position")["nll"] - full
        first, second = gap.iloc[:len(gap) // 2].mean(), gap.iloc[len(gap) // 2:].mean()
        out.append(f"{curve}: NLL gap to full {num(first)} nats/token over the first half of the window, "
                   f"{num(second)} over the second ({'grows' if second > first else 'does not grow'} along it)")
    return out


def c4_verdict(rows: pd.DataFrame) -> list[str]:
    out = []
    data = ppl_rows(rows)
    gen = data[data["method"] == "infinigen"] if not data.empty else data
    if gen.empty or gen["method_params.skew"].map(bool).nunique() < 2:
        out += needs("InfiniGen ppl rows with skew on and off")
    else:
        on, off = (gen[gen["method_params.skew"].map(bool) == s].iloc[0] for s in (True, False))
        full = full_ppl(data)
        gap = f" (full {num(full, 4)})" if full is not None else ""
        out.append(f"WikiText-2 perplexity with skewing {num(on['ppl'], 4)}, without {num(off['ppl'], 4)}{gap}; "
                   f"speculation recall {num(on['recall'])} vs {num(off['recall'])} at kv_fraction "
                   f"{num(100 * on['kv'])}% vs {num(100 * off['kv'])}%")
    _, bars = F.fig13_skew(rows)
    bars = bars[bars["metric"] == "acc_pct"].rename(columns={"value": "acc_pct"}) if not bars.empty else bars
    if bars.empty:
        return out + needs("InfiniGen lm-eval rows with skew on and off")
    mean = bars.groupby("bar")["acc_pct"].mean()
    out.append("lm-eval accuracy, mean over " + f"{bars['task'].nunique()} tasks: "
               + ", ".join(f"{b} {num(mean[b])}%" for b in ("full", "infinigen (skew)", "infinigen (no skew)")
                           if b in mean)
               + f" (n = {int(F.metric(F.of_task(rows, 'lm_eval'), 'n').max())} docs per task: smoke size)")
    return out


def c5_verdict(rows: pd.DataFrame) -> list[str]:
    table = T.table(rows, "eviction")
    pools = [c for c in table.columns if str(c).startswith("pool ") and c != "pool 100%"]
    if table.empty or "pool 100%" not in table or not pools:
        return needs("InfiniGen ppl rows with a 100% and an 80% pool")
    out = []
    for _, row in table.iterrows():
        deltas = sorted((row[p] - row["pool 100%"], p.split(", ")[-1]) for p in pools if not pd.isna(row[p]))
        out.append(f"{row['dataset']} seq {row['seq_len']}: perplexity with the capped pool, vs the full pool's "
                   f"{num(row['pool 100%'], 4)}: " + ", ".join(f"{name} {signed(d)}" for d, name in deltas)
                   + f" (best: {deltas[0][1]})")
    return out


def plateau(rows: pd.DataFrame, along: str, tolerance: float = 0.02) -> list[str]:
    """Per swept setting: the smallest value of `along` from which every perplexity is within `tolerance` of the
    sweep's best, and the kv_fraction there and at the largest value."""
    data = F.ablation_rows(rows, "ppl", along)
    out = []
    for curve, part in data.groupby("curve"):
        part = part.assign(ppl=F.metric(part, "ppl"), kv=F.metric(part, "kv_fraction")).sort_values(along)
        best = part["ppl"].min()
        within = (part["ppl"] <= best * (1 + tolerance)).astype(int)[::-1].cummin()[::-1] == 1  # from its start on
        last = part.iloc[-1]
        if not within.any():
            out.append(f"{along} ({curve}): no plateau: at {along} = {num(last[along])} perplexity is "
                       f"{num(100 * (last['ppl'] / best - 1))}% above the sweep's best ({num(best, 4)})")
            continue
        first = part[within].iloc[0]
        if len(part) > 1 and first[along] == last[along]:  # only the last point: still falling, no plateau
            before = part.iloc[-2]
            out.append(f"{along} ({curve}): no plateau within {num(100 * tolerance)}% yet: perplexity still falls "
                       f"from {num(before['ppl'], 4)} at {along} = {num(before[along])} to {num(last['ppl'], 4)} at "
                       f"{along} = {num(last[along])}, the largest swept ({num(part[along].min())}-"
                       f"{num(last[along])}); kv_fraction {num(100 * before['kv'])}% -> {num(100 * last['kv'])}%")
            continue
        out.append(f"{along} ({curve}): perplexity within {num(100 * tolerance)}% of the sweep's best "
                   f"({num(best, 4)}) from {along} = {num(first[along])} on (swept {num(part[along].min())}-"
                   f"{num(part[along].max())}); kv_fraction {num(100 * first['kv'])}% there, "
                   f"{num(100 * last['kv'])}% at {along} = {num(last[along])}")
    return out


def c6_verdict(rows: pd.DataFrame) -> list[str]:
    out = plateau(rows, "alpha") + plateau(rows, "partial_ratio")
    return out or needs("InfiniGen ppl rows over >= 3 values of alpha or partial_ratio")


def c7_verdict(rows: pd.DataFrame) -> list[str]:
    data, y = F.latency_rows(rows)
    if y is None or not (data["method"] == "infinigen").any():
        return needs("latency rows of InfiniGen and the baselines")
    out = []
    for (model, batch, prompt), part in data.groupby(["model", "batch_size", "prompt_len"]):
        ms = part.groupby("method")[y].median()
        if "infinigen" not in ms or len(ms) < 2:
            continue
        source = "; ".join(sorted(set(part["decode_source"])))
        out.append(f"{model}, batch {num(batch)}, prompt {num(prompt, 5)} ({source}; median over a method's "
                   f"settings): decode ms/token InfiniGen {num(ms['infinigen'])}; speed-up of InfiniGen over "
                   + ", ".join(f"{m} {num(v / ms['infinigen'])}x" for m, v in ms.drop("infinigen").items()))
    return out or needs("latency rows of InfiniGen and a baseline at the same batch and prompt")


def speculation_verdict(rows: pd.DataFrame) -> list[str]:
    data = ppl_rows(rows)
    if data.empty or full_ppl(data) is None or not (data["method"] == "infinigen").any():
        return needs("ppl rows of full and InfiniGen's speculate_from options")
    out = []
    gen = data[data["method"] == "infinigen"]
    full = full_ppl(data)
    by = gen.assign(budget=pd.to_numeric(gen["method_params.budget"]), source=gen["method_params.speculate_from"])
    for budget, part in by.groupby("budget"):
        ppl = part.set_index("source")["ppl"]
        if {"previous", "block_input"} <= set(ppl.index):
            out.append(f"at budget {num(budget)}: gap to full `block_input` {signed(ppl['block_input'] - full)}, the "
                       f"paper's `previous` {signed(ppl['previous'] - full)}: block_input's gap / previous's = "
                       f"{num((ppl['block_input'] - full) / (ppl['previous'] - full))}x")
    for x, gap, ref_gap, row, _ in matched_gaps(data, "infinigen", "oracle", x="kv"):
        out.append(f"`{row['method_params.speculate_from']}` at budget {num(row['method_params.budget'])} "
                   f"(kv_fraction {num(100 * x)}%): gap to full {signed(gap)}, the oracle's at that kv_fraction "
                   f"{signed(ref_gap)}: InfiniGen's gap / the oracle's = {num(gap / ref_gap)}x")
    outside = len(gen) - len(matched_gaps(data, "infinigen", "oracle", x="kv"))
    if not (data["method"] == "oracle").any():
        out.append("no oracle rows: the matched comparison needs them (the second command below)")
    elif outside:
        out.append(f"{outside} InfiniGen setting(s) lie outside the oracle's measured kv_fraction range (no matched "
                   "comparison)")
    return out or needs("InfiniGen rows of two speculate_from options at one budget")


def others_verdict(rows: pd.DataFrame) -> list[str]:
    data = ppl_rows(rows)
    if data.empty or full_ppl(data) is None:
        return needs("ppl rows of full and the compared methods")
    out = []
    plain = data[F.metric(data, "dense_rows").fillna(0) == 0]
    for x, gap, ref_gap, row, _ in matched_gaps(plain, "quest", "oracle", x="kv"):
        out.append(f"Quest at budget {num(row['method_params.budget'])} (kv_fraction {num(100 * x)}%): gap to "
                   f"full {signed(gap)}, the oracle's there {signed(ref_gap)}: {num(gap / ref_gap)}x the oracle's")
    for bits in (2, 4):
        kivi = plain[(plain["method"] == "kivi") & (pd.to_numeric(F.column(plain, "method_params.bits")) == bits)]
        quant = plain[(plain["method"] == "quant") & (pd.to_numeric(F.column(plain, "method_params.bits")) == bits)]
        full = full_ppl(plain)
        if not kivi.empty and not quant.empty and full is not None:
            out.append(f"{bits}-bit: KIVI gap to full {signed(kivi['ppl'].iloc[0] - full)}, per-token quant "
                       f"{signed(quant['ppl'].iloc[0] - full)}")
    prompt = data[F.metric(data, "dense_rows").fillna(0) > 0]
    if not prompt.empty and full_ppl(prompt) is not None:
        for x, gap, ref_gap, row, _ in matched_gaps(prompt, "snapkv", "oracle", x="kv"):
            out.append(f"SnapKV at budget {num(row['method_params.budget'])} with a "
                       f"{num(F.metric(row.to_frame().T, 'dense_rows').iloc[0], 5)}-token prompt (kv_fraction "
                       f"{num(100 * x)}%): gap to full {signed(gap)}, the oracle's there {signed(ref_gap)}: "
                       f"{num(gap / ref_gap)}x the oracle's")
    return out or needs("ppl rows of Quest, KIVI or SnapKV")


def long_verdict(rows: pd.DataFrame) -> list[str]:
    out = []
    _, cells = F.needle_heatmap(rows)
    if cells.empty:
        out += needs("needle rows")
    else:
        acc = cells.groupby("setting").apply(lambda c: (c["accuracy"] * c["n"]).sum() / c["n"].sum(),
                                             include_groups=False)
        n = int(cells.groupby("setting")["n"].sum().max())
        out.append(f"needle retrieval, share of {n} keys retrieved exactly: "
                   + ", ".join(f"{s} {num(100 * a)}%" for s, a in acc.sort_index().items()))
    return out


def ruler_verdict(rows: pd.DataFrame) -> list[str]:
    """Per model: full attention's score per RULER task @ length, which cells are informative (full >=
    figures.RULER_INFORMATIVE), then each method's mean score over the informative cells it ran, as a share of
    full's over the same cells, and what the rows' evaluations took."""
    cells = F.ruler_cells(rows)
    if cells.empty:
        return needs("RULER rows")
    out = []
    for model, part in cells.groupby("model"):
        full = part[part["setting"] == "full"]
        if full.empty:
            out += needs(f"RULER rows of full attention on {model}")
            continue
        out.append(f"{model} with full attention, score per task @ length: "
                   + ", ".join(f"{r.task} @ {r.length:.0f} {num(r.score, 2)}" for r in full.itertuples()))
        useful, useless = full[full["informative"]], full[~full["informative"]]
        out.append(f"informative (full >= {num(F.RULER_INFORMATIVE)}): {len(useful)} of {len(full)} cells"
                   + (f" ({', '.join(sorted(set(useful['task'])))})" if len(useful) else "")
                   + (f"; uninformative, excluded from the comparison: "
                      + ", ".join(f"{r.task} @ {r.length:.0f}" for r in useless.itertuples()) if len(useless) else ""))
        compared = part[part["informative"] & (part["setting"] != "full")]
        if useful.empty or compared.empty:
            out += needs(f"RULER rows of KV methods on the informative cells of {model}")
            continue
        by = compared.groupby("setting").agg(score=("score", "mean"), full=("full_score", "mean"),
                                             kv=("kv_fraction", "mean"), n=("score", "size"))
        by = by.assign(share=by["score"] / by["full"]).sort_values(["share", "kv"], ascending=[False, True])
        out.append(f"on the informative cells (full's mean {num(useful['score'].mean(), 2)} over {len(useful)}), mean "
                   "score and its share of full's on the same cells: "
                   + ", ".join(f"{s} {num(r.score, 2)} ({num(100 * r.share, 3)}%, kv {num(r.kv, 2)}"
                               + (f", {r.n} of {len(useful)} cells" if r.n < len(useful) else "") + ")"
                               for s, r in by.iterrows()))
    data = F.of_task(rows, "lm_eval")
    data = data[F.column(data, "metrics.benchmark") == "ruler"]
    minutes = (F.metric(data, "seconds").groupby(data["_file"]).sum() / 60).groupby(
        data.groupby("_file")["method"].first()).sum().sort_values()
    out.append("wall time in the rows (lm-eval's sample generation, prefill and decode, summed over a run's rows; on "
               "a shared machine it includes time the run was paused, "
               f"{', '.join(sorted(set(F.column(data, 'meta.device').astype(str) + ' x ' + F.column(data, 'meta.threads').astype(str) + ' threads')))}): "
               + ", ".join(f"{m} {num(v, 2)} min" for m, v in minutes.items()))
    return out


def successors_table(rows: pd.DataFrame) -> pd.DataFrame:
    out = T.table(rows, "successors")
    return out.drop(columns=[c for c in ("model",) if c in out.columns])


def successors_verdict(rows: pd.DataFrame) -> list[str]:
    """Per budget level (each method's lower and higher setting): the decoded rows' perplexity gap to full's, with
    kv_fraction and recall, and the bytes the latency rows of the same settings count."""
    table = T.table(rows, "successors")
    table = table.reindex(columns=list(dict.fromkeys([*table.columns, "decoded ppl", "kv_fraction", "recall",
                                                      "h2d KiB/token", "device KV MiB"])))
    full = table.loc[table["method"] == "full", "decoded ppl"].dropna()
    if full.empty:
        return needs("ppl rows of full and of the compared methods (with task.dense_rows)")
    parts = table[(table["method"] != "full") & table["kv_fraction"].notna()]
    if parts.empty:
        return needs("ppl rows of the compared methods")
    parts = parts.assign(level=parts.groupby("method")["kv_fraction"].rank(method="first").astype(int))
    out = []
    for level, part in parts.groupby("level"):
        part = part.assign(gap=part["decoded ppl"] - full.iloc[0]).sort_values(["gap", "method"])
        name = {1: "lower", 2: "higher"}.get(level, f"setting {level}")
        line = (f"{name} budgets (kv_fraction {num(part['kv_fraction'].min(), 2)}-{num(part['kv_fraction'].max(), 2)}"
                f" on the decoded rows): decoded-row perplexity gap to full's {num(full.iloc[0], 4)}: "
                + ", ".join(f"{r.method} {signed(r.gap)} (kv {num(r.kv_fraction, 2)}"
                            + (f", recall {num(r.recall, 2)})" if pd.notna(r.recall) else ")")
                            for r in part.itertuples())
                + f"; most accurate: {part.iloc[0]['method']}")
        others = part[part["method"] != "oracle"]
        if part.iloc[0]["method"] == "oracle" and not others.empty:  # the exact top-k is the bound, not a contender
            line += f" (the exact top-k), of the others {others.iloc[0]['method']}"
        out.append(line)
        moved = part.rename(columns={"h2d KiB/token": "h2d", "device KV MiB": "device"})
        if "h2d" in moved and moved["h2d"].notna().any():
            moved = moved.dropna(subset=["h2d"]).sort_values(["h2d", "method"])
            line = (f"{name} budgets, link bytes per decoded token (2048-token prompt): "
                    + ", ".join(f"{r.method} {r.h2d:,.0f} KiB" for r in moved.itertuples()))
            if "device" in moved and moved["device"].notna().any():
                line += "; held on the device: " + ", ".join(
                    f"{r.method} {num(r.device)} MiB" for r in moved.sort_values(["device", "method"]).itertuples())
            out.append(line)
    return out


def cost_verdict(rows: pd.DataFrame) -> list[str]:
    cost = sim_cost(rows)
    if cost.empty or cost["x full"].isna().all():
        return needs("ppl rows of full and the other methods on the same device and thread count")
    parts = cost[cost["method"] != "full"].dropna(subset=["x full"])
    if parts.empty:
        return needs("ppl rows of methods other than full next to full's")
    by = parts.groupby("method")["x full"].median().sort_values()
    tokens = num(F.metric(F.of_task(rows, "ppl"), "seq_len").max(), 5)
    out = [f"sim-mode seconds per {tokens}-token window / full's on the same device and thread count, median over "
           "each method's settings: " + ", ".join(f"{m} {num(x)}x" for m, x in by.items())]
    unmatched = cost[(cost["method"] != "full") & cost["x full"].isna()]
    if not unmatched.empty:
        out.append(f"{len(unmatched)} setting(s) ({', '.join(sorted(set(unmatched['method'])))}) have no full run at "
                   "their thread count: no ratio")
    return out


COMPARED = (f"{PPL} method=full",
            f"{PPL} method=infinigen method.budget=0.1,0.2",
            "python run.py -m +experiment=fig13_speculation_smoke +point=speculate_previous",
            f"{PPL} +point=h2o_0.0625,h2o_0.1",
            f"{PPL} method=quant method.bits=2,4")
OTHERS = (f"{PPL} method=oracle method.budget=0.1,0.2",
          f"{PPL} method=quest method.budget=0.1,0.2",
          f"{PPL} method=kivi method.bits=2",
          f"{PPL} task.dense_rows=512 method=snapkv method.budget=0.2",
          f"{PPL} task.dense_rows=512 method=full",
          f"{PPL} task.dense_rows=512 method=oracle method.budget=0.1,0.2")
# the protocol is 8 windows (task.max_windows=8); the preset and the rows: one window
SUCCESSORS = ("python run.py -m +experiment=successors_ppl_smoke",
              "python run.py -m +experiment=successors_latency_smoke")
LATENCY = ("python run.py -m +experiment=fig14_15_latency_batch_smoke",
           "python run.py -m +experiment=fig16a_latency_prompt_smoke",
           "python run.py -m +experiment=fig16b_latency_model_smoke",
           "python run.py -m +experiment=fig17_alpha_latency_smoke")

SECTIONS: list[Section] = [
    Section("c1_accuracy", "C1. Accuracy close to full attention above 10% of the KV cache",
            "InfiniGen keeps accuracy within a small margin of full attention once it fetches more than about 10% "
            "of the KV cache (paper Fig. 11).",
            ("python run.py -m +experiment=fig11_accuracy_smoke +point=full,h2o_0.0625,quant_2,infinigen_a5_b0.2,"
             "infinigen_a7_b0.6", *COMPARED[:3]),
            ppl_and_accuracy, c1_verdict, figure_of("fig11_accuracy")),
    Section("c2_baselines", "C2. Better than H2O and quantisation at small KV budgets",
            "At the same (small) relative KV cache size InfiniGen loses less than H2O's eviction and low-bit KV "
            "quantisation (paper Fig. 11). Compared here on WikiText-2 perplexity at the measured relative KV size, "
            "InfiniGen at two settings: conf/method/infinigen.yaml's (the paper's OPT values: alpha 4, partial "
            "ratio 0.2, skip_layers 1) and the Llama-family one of point speculate_previous (alpha 8, partial ratio "
            "0.5, skip_layers 2).",
            COMPARED, ppl_table, c2_verdict, lambda rows: ppl_vs_kv(rows, "C2: perplexity vs relative KV size")),
    Section("c3_position", "C3. Perplexity along the sequence",
            "InfiniGen's loss stays close to full attention's along the whole sequence, while H2O's drifts (paper "
            "Fig. 12).", ("python run.py -m +experiment=fig12_ppl_position_smoke",),
            nll_table, c3_verdict, figure_of("fig12_ppl_position")),
    Section("c4_skewing", "C4. Skewing makes the partial weights speculate better",
            "Skewing the query/key weights concentrates the attention scores in few columns, so the partial "
            "weights speculate better (paper Fig. 13).",
            (SKEW_PPL, "python run.py -m +experiment=fig13_skew_smoke"),
            ppl_and_accuracy, c4_verdict, figure_of("fig13_skew")),
    Section("c5_eviction", "C5. Eviction policies for a capped KV pool",
            "With the KV pool capped at 80% of the sequence, the counter-based policy loses least (paper Table 2).",
            ("python run.py -m +experiment=table2_eviction_smoke task.seq_len=512",),
            eviction_table, c5_verdict, figure_of("table2_eviction")),
    Section("c6_ablation", "C6. Alpha and the partial weight ratio plateau",
            "Accuracy saturates beyond a moderate alpha (while the fetched share keeps growing) and beyond a small "
            "partial weight ratio (paper Fig. 17).",
            ("python run.py -m +experiment=fig17_alpha_smoke method.alpha=1.0,3.0,5.0,7.0,9.0",
             "python run.py -m +experiment=fig17_partial_smoke method.partial_ratio=0.1,0.2,0.5,1.0"),
            ppl_table, c6_verdict, figure_of("fig17_ablation")),
    Section("c7_speed", "C7. Speed",
            "InfiniGen's decode is faster than full offloading, H2O and quantisation at large batches and long "
            "prompts (paper Figs. 14-16).", LATENCY, latency_table, c7_verdict, figure_of("fig14_16_latency"),
            note="Measured CPU latencies are not the paper's setting (a GPU with the KV cache in host memory); "
                 "modelled speed rows are labelled apart in docs/speed.md."),
    Section("c7_modelled", "C7. Speed on the paper's machine, modelled",
            "On OPT-13B with the KV cache in host memory (RTX A6000, PCIe 3.0 x16, batch 20, 1920 + 128), InfiniGen "
            "decodes up to 3.00x faster than prior offloading methods, and the speedup grows with batch size, "
            "prompt length and model size (paper Figs. 14-16). Every number here is MODELLED "
            "(infinigen/offload/perf.py on conf/hardware/a6000_pcie3.yaml; see docs/speed.md); the gathering "
            "methods' fetched fractions are measured rows of smollm2-135m.",
            tuple(f"python run.py -m +experiment={p}" for p in S.PRESETS), S.fig14_table, S.claims,
            lambda rows: S.fig14_16_modelled(rows)[0]),
    Section("c7_validation", "C7. The performance model against this machine",
            "The same model, with a profile calibrated here, predicts what the offloading runtime measures on this "
            "CPU (smollm2-135m; nine methods; prompts 1024 and 2048; batch 1 and 8). Goal: every point within "
            "+-25%.",
            (), S.validation_rows, S.validation_verdict, lambda rows: S.speed_validation(rows)[0],
            script=lambda rows: rows[F.column(rows, "metrics.validation_point").notna()],
            note="Rows from `python -m experiments.calibrate && python -m experiments.validate_perf --results "
                 "docs/store` (not a run.py command). Measured: one untimed run, then the median of 22 decode "
                 "steps after a 2-step warm-up, median over 3 rounds. Modelled: with each method's census timed just "
                 "before its rounds and the profile's rates measured beside each round (both sides within minutes). "
                 "On this 2-vCPU VM the same configuration measured 74-136 ms/token in processes minutes apart, which "
                 "bounds what any validation here can show."),
    Section("speculation", "Beyond the paper: the speculation input",
            "Speculating layer i from layer i's own input norm applied to the residual stream the paper reads "
            "(`block_input`) fetches better tokens than the paper's `previous`, at the same prefetch window.",
            (COMPARED[0], "python run.py -m +experiment=fig13_speculation_smoke "
                          "+point=speculate_previous,speculate_block_input,oracle_skip2"),
            ppl_table, speculation_verdict, figure_of("fig13_speculation")),
    Section("others", "Beyond the paper: Quest, SnapKV, KIVI",
            "Later methods on the same windows: Quest's page bounds and SnapKV's prompt compression against the "
            "oracle's exact top-k at a matched kv_fraction, KIVI's per-channel keys against per-token quantisation "
            "at the same bits. SnapKV compresses a prompt: its rows (and their full / oracle / Quest references) "
            "treat the first 512 tokens as the prompt (task.dense_rows=512).",
            (COMPARED[0], *OTHERS, COMPARED[4]), ppl_table, others_verdict,
            lambda rows: ppl_vs_kv(rows, "Quest, SnapKV, KIVI: perplexity vs relative KV size")),
    Section("successors", "Beyond the paper: ShadowKV and RocketKV",
            "Two offloading-era successors of InfiniGen through the same method interface "
            "(docs/methods_successors.md), next to InfiniGen (block_input speculation), the oracle and Quest at "
            "kv_fraction ~0.1 and ~0.2: ShadowKV moves values only (its keys are rebuilt on the device from a "
            "low-rank copy), RocketKV selects single tokens on the query's own top channels. WikiText-2, each "
            "2048-token window a 1792-token dense prompt and 256 decoded rows (ShadowKV and RocketKV compress a "
            "prompt): `ppl` over every predicted token, `decoded ppl`, kv_fraction and recall over the decoded rows "
            "(sim mode); the bytes from a latency run of the same setting (2048-token prompt + 16 decode steps "
            "through the offloading runtime, fp32): `h2d KiB/token` crossed the host-to-device link per decoded "
            "token (counted), `device KV MiB` the method keeps on the device (stores, per-layer state, landing "
            "buffers), `host pool MiB` in the host pools.",
            SUCCESSORS, successors_table, successors_verdict,
            note="One window per setting (the preset's; the issue asks 8: task.max_windows=8): on the shared 2-core "
                 "machine a config took ~5 min of wall time for one window (model load, the window, the decode-mode "
                 "cache measurement), and 11 settings x (ppl + latency) had to fit one afternoon. The decoded ppl is "
                 "over 256 tokens: differences of a few percent are noise. The latency rows' times mean nothing "
                 "here (a shared CPU; nothing really crosses a link), only their bytes."),
    Section("long_context", "Beyond the paper: long context and needle retrieval",
            "Pass-key retrieval through the method's decode-mode cache: query-aware selection keeps a needle that "
            "eviction (StreamingLLM's window) has dropped. Perplexity at long context: docs/long_context.md.",
            ("python run.py -m +experiment=needle_smollm2_smoke",),
            needle_table,
            long_verdict, figure_of("needle_heatmap")),
    Section("ruler", "Beyond the paper: RULER",
            "lm-eval's RULER tasks (needles, variable tracking, common / frequent word extraction), generated "
            "offline with the model's tokenizer and scored through each method's decode-mode cache: which tasks "
            "SmolLM2-135M can do at all with full attention, and how the KV methods at ~20% of the KV compare on "
            f"those (a cell where full attention scores below {F.RULER_INFORMATIVE:g} says nothing about a method: "
            "hatched in the figure, left out of the table and the comparison). Options and refusals: "
            "docs/long_context.md.",
            ("python run.py -m +experiment=ruler_smollm2_smoke",),
            T.ruler_table, ruler_verdict, figure_of("ruler_heatmap"),
            note="The CPU preset generates one sample per (task, length) (task.limit=1; two took 66 min on 2 cores): "
                 "a single-needle cell is 0 or 1, cwe and the multi-needle tasks give partial credit within the "
                 "sample, and a difference of one cell is one sample. `task.limit=N` on the same preset for more."),
    Section("sim_cost", "Beyond the paper: sim-mode cost",
            "What a perplexity run costs per method in sim mode (all rows of a window in one forward), relative to "
            "full attention: wall time less the model load, per window.",
            COMPARED + OTHERS[:3], sim_cost, cost_verdict, lambda rows: cost_bars(rows, "sim-mode cost per window"),
            note="Wall time as the rows record it (meta.wall_s - meta.load_s), one run per setting. The committed "
                 "rows ran on a 2-core CPU shared with other jobs, which at times paused them: their ratios say "
                 "little about cost. `make bench` measures it in one quiet process (docs/scaling.md)."),
    Section("memory", "Beyond the paper: evaluation memory along the sequence",
            "Scoring a window never forms its (t, vocab) logits: the LM head runs over blocks of rows "
            "(infinigen/modes.py, LOGIT_BLOCK logits at a time), so a perplexity run's peak memory is the model, "
            "the attention working set (linear in t) and one block of logits, below the model's own forward, whose "
            "(t, vocab) logits grow with t.",
            (), memory_table, memory_verdict, memory_figure, script=memory_rows,
            note="Rows from `python experiments/bench_memory.py --results docs/store` (not a run.py command): "
                 "peak RSS of one process each (the kernel's ru_maxrss), the ppl task through run.py (method=full, "
                 "one WikiText-2 window: sim forward, log-probs, the decode-mode cache measurement) and one plain "
                 "transformers SDPA forward of the same tokens with its logits; `loaded` is that process before "
                 "its forward. RSS does not depend on the machine's load."),
    Section("ops_decode", "Beyond the paper: kernel launches and host syncs per decode step",
            "On a GPU each dispatched op is a kernel launch (~5-10 us of host time) and each host synchronisation "
            "(`.item()`, `bool(t)`, `nonzero`, a boolean mask index, a blocking device->host copy) drains the launch "
            "queue. The offloading runtime's steady decode step for the paper's rows (full under runtime ideal and "
            "auto, offload, quant, H2O, InfiniGen) should synchronise the host nowhere, and InfiniGen's ops per "
            "layer-step should not grow with the prompt or the batch (tests/test_bench_ops.py, the gate).",
            (), O.decode_table, O.decode_verdict, script=O.decode_rows,
            note="Rows from `make bench-ops` (`python experiments/bench_ops.py --results results`, then `make "
                 "export WHERE=task=ops`; not a run.py command): each conf/method at its defaults (`auto` runtime; "
                 "full also `ideal`) on tiny-llama-gqa and tiny-opt (random weights), at batch x prompt 1 x 512 to "
                 "8 x 2048. Counted with a TorchDispatchMode on the thread that launches kernels, through the "
                 "runtime's CUDA code path run on the CPU (link work on its worker thread, which is host-side work "
                 "and not counted), over the steady decode steps (Timer.begin..end after 2 steps, the last dropped). "
                 "`ops/layer`: aten ops per step / layers (composite ops counted by what they run); `syncs/layer`: "
                 "host syncs per step / layers (by op and call site in the rows, `metrics.sync_sites`); `waits/layer`: "
                 "the launching thread blocking on the link (a worker's Future, an event). What each counts: the "
                 "module doc of experiments/bench_ops.py."),
    Section("ops_sim", "Beyond the paper: ops and host syncs of a sim-mode forward",
            "A sim-mode forward (perplexity, lm-eval scoring) is one batched pass, so its op count should not grow "
            "with the sequence; methods whose selection loops over rows in Python (H2O, TOVA, ...) dispatch ops per "
            "row, and their counts grow with it.",
            (), O.sim_table, O.sim_verdict, script=O.sim_rows,
            note="Rows from `make bench-ops` (as above): one `modes.sim_logits` forward of random ids (dense_rows=0; "
                 "SnapKV and ShadowKV compress a prompt: half the tokens are theirs) at 512, 1024 and 2048 "
                 "tokens on tiny-llama-gqa and on smollm2-135m's shape with random weights (model.random_init=true), "
                 "every method's bind (InfiniGen's calibration) run before and not counted. A point projected "
                 "(from the growth of the method's previous lengths) to take longer than the benchmark's "
                 "--sim-budget (120 s) on this 2-core machine is skipped and marked so."),
]


# ----------------------------------------------------------------------------------------------- writing


def provenance(rows: pd.DataFrame) -> str:
    """Runs, commits, machines, torch versions and data the rows come from."""
    if rows.empty:
        return ""
    commits = sorted(set(F.column(rows, "meta.git_commit").dropna().map(
        lambda c: c[:7] + ("-dirty" if c.endswith("-dirty") else ""))))
    devices = sorted(set(F.column(rows, "meta.device").astype(str) + " x "
                         + F.column(rows, "meta.threads").astype(str) + " threads"))
    torch = sorted(set(F.column(rows, "meta.versions").map(
        lambda v: v.get("torch") if isinstance(v, dict) else None).dropna()))
    data = sorted(set(T.data_id(rows).dropna()))
    runs = rows["_file"].nunique()
    return (f"{runs} run{'s' * (runs != 1)}; commit {', '.join(commits)}; device {', '.join(devices)}; "
            f"torch {', '.join(torch)}" + (f"; data sha256 {', '.join(data)}" if data else ""))


def verdict(section: Section, rows: pd.DataFrame) -> list[str]:
    return (section.verdict(rows) if not rows.empty else []) or needs("rows of this section")


def render(section: Section, matched: Matched, out: Path, figure_dir: str, figures: bool = True) -> str:
    rows = matched.rows
    lines = [f"## {section.title}", "", f"*Claim.* {section.claim}", ""]
    verdicts = verdict(section, rows)
    lines += [f"**Verdict (computed from the store):** {verdicts[0]}" if len(verdicts) == 1
              else "**Verdict (computed from the store):**", ""]
    if len(verdicts) > 1:
        lines += [f"* {v}" for v in verdicts] + [""]
    if section.commands:  # a script's section names its command in its note
        lines += ["Rows from:", "", "```bash", *section.commands, "```", ""]
    lines.append(f"{matched.present} of {matched.total} configs in the store"
                 + (f" ({provenance(rows)})." if matched.present else "."))
    if matched.missing:
        lines += ["", "Missing (run, then `make export report`):", ""]
        lines += [f"* {n} config(s) of `{command}`" for command, n in matched.missing.items()]
    if section.note:
        lines += ["", section.note]
    lines.append("")
    if not rows.empty:
        if section.figure is not None:
            if figures:
                save(section.figure(rows), out / figure_dir / f"{section.slug}.png")
            lines += [f"![{section.slug}]({figure_dir}/{section.slug}.png)", ""]
        table = section.table(rows)
        if not table.empty:
            table = table.dropna(axis=1, how="all")
            lines += [T.markdown(table, right={c for c in table.columns if c not in T.TEXT and c != "setting"
                                               and pd.api.types.is_numeric_dtype(table[c])}), ""]
    return "\n".join(lines)


def headline(results: dict[str, list[str]]) -> str:
    """The README's one paragraph of numbers: the first verdict line of C1, C2, C3 and the speculation finding."""
    picks = [("C1", "c1_accuracy"), ("C2", "c2_baselines"), ("C3", "c3_position"), ("speculation input", "speculation")]
    parts = [f"{name}: {results[slug][0]}" for name, slug in picks
             if results.get(slug) and not results[slug][0].startswith("not computed")]
    if not parts:
        return ("No headline numbers yet: docs/store has no rows of C1, C2, C3 or the speculation input (see "
                "docs/results.md).\n")
    return ("Headline numbers (SmolLM2-135M on a 2-core CPU, smoke-sized runs; generated by `make report` from "
            "docs/store, details in [docs/results.md](docs/results.md)): " + "; ".join(parts) + ".\n")


def speed_block(results: dict[str, list[str]]) -> str:
    """The README's speed summary: the verdicts of the modelled paper figures and of the model's validation here."""
    picks = [("Modelled (RTX A6000 + PCIe 3.0 profile, OPT shapes)", "c7_modelled"),
             ("The model against this machine (calibrated CPU profile, smollm2-135m)", "c7_validation")]
    lines = []
    for name, slug in picks:
        lines += [f"{name}:", ""] + [f"* {line}" for line in results.get(slug) or ["not computed"]] + [""]
    return "\n".join(lines) + "\n(generated by `make report` from docs/store; tables, figures and commands: " \
        "[docs/results.md](docs/results.md), C7)\n"


def report(store_dir: str | Path, out: str | Path, readme: str | Path | None = None,
           figures: bool = True) -> dict[str, list[str]]:
    """Writes <out>/results.md and <out>/report/*.png; rewrites the README's headline block when given."""
    out = Path(out)
    df = load(store_dir)
    verdicts: dict[str, list[str]] = {}
    # rows written by scripts (experiments/validate_perf.py, bench_memory.py, bench_ops.py), not by a run.py command
    scripted = (F.column(df, "metrics.validation_point").notna() | (F.column(df, "metrics.benchmark") == "memory")
                | O.is_ops(df)
                if not df.empty else pd.Series(dtype=bool))
    script_rows, df = (df[scripted], df[~scripted]) if not df.empty else (df, df)
    commands = list(dict.fromkeys(c for s in SECTIONS for c in s.commands))
    compose_all(commands)
    stale = stale_rows(df, commands)
    fresh = df[~df["_file"].isin({line.split("`")[1] for line in stale})] if stale else df
    body = []
    for section in SECTIONS:
        if section.script is not None:
            rows = section.script(script_rows) if not script_rows.empty else script_rows
            n = int(section.table(rows).shape[0]) if not rows.empty else 0
            matched = Matched(rows, {}, n, n)
        else:
            matched = match(fresh, section.commands)
        verdicts[section.slug] = verdict(section, matched.rows)
        body.append(render(section, matched, out, "report", figures))
    summary = ["| section | verdict (first line) |", "|---|---|"]
    summary += [f"| [{s.title}](#{anchor(s.title)}) | {verdicts[s.slug][0].replace('|', '/')} |" for s in SECTIONS]
    store_name = label(store_dir)
    head = [
        "# Reproduction report", "",
        f"Generated by `make report` (`python -m analysis.report`) from the committed store `{store_name}` only; do "
        "not edit by hand. Every number below is computed from the store's rows; each section names the commands "
        "that produce its rows. Rows land in `results/` (`run.py`'s `results_dir`); `make export` copies them into "
        "docs/store without per-prompt detail (`python -m analysis.store export --results results --to docs/store`).",
        "", "Sizes are what a 2-core CPU affords (SmolLM2-135M, one or two windows, a few lm-eval docs): they test "
        "each claim's direction, not the paper's magnitudes on its 6.7B-30B models.", "",
        "## Stale rows", "",
        *(stale or ["None: every stored run matches what its command composes today."]), "",
        "## Summary", "", *summary, "",
    ]
    text = "\n".join(head + body).rstrip() + "\n"
    (out / "results.md").write_text(text)
    if readme is not None:
        update_readme(Path(readme), {"headline": headline(verdicts), "memory": memory_block(script_rows),
                                     "speed": speed_block(verdicts)})
    return verdicts


def label(path: str | Path) -> str:
    """A path as the report prints it: relative to the repository when inside it (the same text wherever the
    report is written from)."""
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def anchor(title: str) -> str:
    """GitHub's heading anchor."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def memory_block(rows: pd.DataFrame) -> str:
    """The README's evaluation-memory table: peak RSS of the ppl task vs the model's own forward, per length."""
    data = memory_table(memory_rows(rows)) if not rows.empty else pd.DataFrame()
    if data.empty:
        return ("No evaluation-memory rows in docs/store yet: `python experiments/bench_memory.py --results "
                "docs/store`, then `make report`.\n")
    table = data[["model", "tokens", "ppl task peak GB", "model forward peak GB"]].rename(
        columns={"ppl task peak GB": "ppl task (method=full), peak RSS GB",
                 "model forward peak GB": "the model's own forward, peak RSS GB"})
    return (T.markdown(table, right=set(table.columns) - {"model"}) + "\n\n" + memory_verdict(memory_rows(rows))[0]
            + " (measured here; generated by `make report` from docs/store).\n")


def update_readme(path: Path, blocks: dict[str, str]) -> None:
    """Rewrites each named generated block of the README; every block must be there."""
    text = path.read_text()
    for name in blocks:
        if f"<!-- report:{name} -->" not in text:
            raise SystemExit(f"{path} has no <!-- report:{name} --> ... <!-- /report:{name} --> block")
    path.write_text(BLOCK.sub(lambda m: m.group(1) + blocks.get(m.group(2), m.group(3)) + m.group(4), text))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="docs/store", help="the results store the report reads")
    parser.add_argument("--out", default="docs", help="where results.md and report/*.png go")
    parser.add_argument("--readme", default="README.md", help="README whose headline block is rewritten ('' = none)")
    args = parser.parse_args(argv)
    report(args.store, args.out, args.readme or None)
    print(f"[report] {Path(args.out) / 'results.md'}")


if __name__ == "__main__":
    main()
