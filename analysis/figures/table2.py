"""Table 2: perplexity with a capped KV pool, by eviction policy (claim C5)."""

from __future__ import annotations

from textwrap import fill

import pandas as pd
from matplotlib.figure import Figure

from analysis.apart import varying
from analysis.columns import column, metric, of_task, param_columns, short, size_params
from analysis.draw import draw_bars, empty_figure, grid, run_hint, titled


def pool_name(capacity, eviction) -> str:
    capacity = float(capacity) if capacity is not None and not pd.isna(capacity) else 1.0
    if capacity == 1.0:
        return "pool 100%"
    size = f"{capacity:.0%}" if capacity < 1 else f"{capacity:.0f} tokens"
    return f"pool {size}, {eviction}"


def eviction_rows(df: pd.DataFrame) -> pd.DataFrame:
    """InfiniGen ppl rows in groups (same model, dataset, seq_len and other hyperparameters) that hold at least
    one run with a capped pool; `pool` names the pool setting, `params` the group's InfiniGen hyperparameters (its
    KV-size ones, partial_ratio and every other that varies among the rows), `setting` the group (model / dataset /
    sequence length, and what sets it apart from another group of the same)."""
    rows = of_task(df, "ppl")
    rows = rows[rows["method"].isin(("infinigen", "infinigen_reference"))].copy()
    if rows.empty or "method_params.capacity" not in rows:
        return rows.iloc[0:0]
    capacity = pd.to_numeric(rows["method_params.capacity"], errors="coerce").fillna(1.0)
    rows["pool"] = [pool_name(c, e) for c, e in zip(capacity, column(rows, "method_params.eviction"))]
    # at a full pool the eviction policy never runs: it must not split the group
    pool_cols = {"method_params.capacity", "method_params.eviction"}
    task_cols = [c for c in rows.columns if c.startswith("task_params.")]
    fixed = ["model", "method", *task_cols, *[c for c in param_columns(rows) if c not in pool_cols]]
    rows["group"] = rows[fixed].map(short).agg(" | ".join, axis=1)
    rows = rows[rows.groupby("group")["pool"].transform(lambda s: (s != "pool 100%").any())]
    if rows.empty:
        return rows
    rows["ppl"] = metric(rows, "ppl")
    rows["dataset"] = column(rows, "task_params.dataset").astype(str)
    seq = metric(rows, "seq_len").map(lambda v: f"{v:.0f}")
    # what tells the groups apart: every hyperparameter and task parameter but the pool's that varies among them
    apart = varying(rows, among=fixed[1:])
    methods = [c for c in fixed if c.startswith("method_params.")]
    sizes = size_params("infinigen", rows) | {"partial_ratio"}
    rows["params"] = rows.apply(lambda r: ", ".join(
        f"{c.split('.', 1)[1]}={short(r[c])}" for c in methods
        if (c.split(".", 1)[1] in sizes or c in apart) and not _missing(r[c])), axis=1)
    rows["setting"] = rows["model"] + " / " + rows["dataset"] + " / seq " + seq
    told = [c for c in apart if c not in ("task_params.dataset", "task_params.seq_len")]
    if told and rows.groupby("setting")["group"].nunique().max() > 1:  # two groups would share a bar
        rows["setting"] += "\n" + rows.apply(lambda r: fill(", ".join(
            f"{c.split('.', 1)[1]}={short(r[c])}" for c in told if not _missing(r[c])), 32), axis=1)
    return rows


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and pd.isna(value))


def table2_eviction(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Perplexity with a capped KV pool (counter / LRU / FIFO eviction) vs the full pool."""
    title = "Table 2: perplexity with an 80% KV pool, by eviction policy"
    cols = ["setting", "pool", "ppl", "config_hash"]
    rows = eviction_rows(df)
    if rows.empty:
        hint = run_hint("table2_eviction_smoke", "table2_eviction_opt", "table2_eviction_llama")
        what = "InfiniGen ppl rows with a capped pool (capacity < 1)"
        return empty_figure(title, what, hint), pd.DataFrame(columns=cols)
    settings = sorted(rows["setting"].unique())
    order = ["pool 100%"] + sorted(p for p in rows["pool"].unique() if p != "pool 100%")
    pools = [p for p in order if p in set(rows["pool"])]
    widest = max(len(line) for s in settings for line in s.split("\n"))  # a tick label's longest line
    fig, axes = grid(1, size=(max(6.0, max(1.8, 0.1 * widest) * len(settings)), 3.6 + 0.2 * settings[0].count("\n")))
    draw_bars(axes[0], rows, "setting", "pool", "ppl", settings, pools)
    for bars in axes[0].containers:  # the policies differ by a few percent: the numbers say by how much
        axes[0].bar_label(bars, fmt="%.4g", fontsize=6)
    axes[0].set_ylim(0, rows["ppl"].max() * 1.4)  # room for the legend above the bars
    axes[0].set(xlabel="model / dataset / sequence length (tokens)", ylabel="perplexity")
    axes[0].grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7, ncols=min(len(pools), 4), loc="upper center")
    titled(fig, title, rows)
    return fig, rows[cols].sort_values(["setting", "pool"]).reset_index(drop=True)
