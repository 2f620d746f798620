"""RULER heatmap (beyond the paper)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from analysis.apart import as_text, varying
from analysis.columns import column, curve_labels, metric, models_by_size, of_task
from analysis.draw import empty_figure, grid, run_hint, titled


RULER_INFORMATIVE = 0.1  # a (model, task, length) where full attention scores below this says nothing of a method


def ruler_cells(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, method setting, RULER task, length): score (lm-eval's RULER string match, pooled over
    runs by samples), measured kv_fraction, samples, full attention's score at that cell (pooled over its runs) and
    whether the cell is `informative` (full >= RULER_INFORMATIVE: where full fails, a KV method cannot be judged).
    Runs of one setting whose task parameters differ (task.limit, ...) where they share a cell are not pooled: the
    setting names those parameters in brackets."""

    cols = ["model", "method", "setting", "task", "length", "score", "kv_fraction", "n", "full_score", "informative"]
    rows = of_task(df, "lm_eval")
    if rows.empty or "metrics.benchmark" not in rows:
        return pd.DataFrame(columns=cols)
    rows = rows[rows["metrics.benchmark"] == "ruler"].copy()
    if rows.empty:
        return pd.DataFrame(columns=cols)
    rows["setting"] = curve_labels(rows)
    rows["task_name"], rows["length"] = rows["metrics.task"], metric(rows, "length")
    cell = rows[["model", "setting", "task_name"]].astype(str).agg(" | ".join, axis=1) + rows["length"].astype(str)
    split = varying(rows, cell, among=[c for c in rows.columns if c.startswith("task_params.")])
    if split:
        rows["setting"] += " [" + rows[split].apply(as_text).apply(
            lambda r: ", ".join(f"{c.split('.', 1)[1]}={v}" for c, v in r.items() if v), axis=1) + "]"
    rows["n"], rows["score"], rows["kv_fraction"] = metric(rows, "n"), metric(rows, "score"), metric(rows, "kv_fraction")
    rows["points"], rows["kv_n"] = rows["score"] * rows["n"], rows["kv_fraction"] * rows["n"]
    keys = ["model", "method", "setting", "task_name", "length"]
    out = rows.groupby(keys, as_index=False)[["points", "kv_n", "n"]].sum(min_count=1)
    out["score"], out["kv_fraction"] = out["points"] / out["n"], out["kv_n"] / out["n"]
    full = out[out["method"] == "full"].groupby(["model", "task_name", "length"])[["points", "n"]].sum(min_count=1)
    full = full["points"] / full["n"]
    out["full_score"] = [full.get((m, t, n), np.nan) for m, t, n in zip(out["model"], out["task_name"], out["length"])]
    out["informative"] = out["full_score"] >= RULER_INFORMATIVE
    out = out.rename(columns={"task_name": "task"})
    return out[cols].sort_values(["model", "setting", "task", "length"]).reset_index(drop=True)


def ruler_heatmap(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """RULER score as a task x length heatmap, one panel per (model, method setting) with its mean measured
    kv_fraction; cells where full attention scores below RULER_INFORMATIVE are hatched (no verdict there)."""
    title = "RULER: score by task and length (decode mode; hatched: full attention < 0.1, no verdict)"
    cells = ruler_cells(df)
    if cells.empty:
        return empty_figure(title, "RULER rows (task=lm_eval, RULER tasks)", run_hint("ruler_smollm2_smoke", "ruler_smollm2")), cells
    order = {m: i for i, m in enumerate(models_by_size(cells["model"]))}
    panels = sorted(cells.groupby(["model", "setting"]).groups, key=lambda k: (order[k[0]], k[1] != "full", k[1]))
    tasks = sorted(cells["task"].unique())
    fig, axes = grid(len(panels), cols=4, size=(3.4, 0.45 * len(tasks) + 1.6))
    for ax, (model, setting) in zip(axes, panels):
        part = cells[(cells["model"] == model) & (cells["setting"] == setting)]
        table = part.pivot(index="task", columns="length", values="score").reindex(tasks).sort_index(axis=1)
        useful = part.pivot(index="task", columns="length", values="informative").reindex(tasks).sort_index(axis=1)
        image = ax.imshow(table.to_numpy(dtype=float), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (y, x), value in np.ndenumerate(table.to_numpy(dtype=float)):
            if not np.isnan(value):
                ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
            if isinstance(useful.iloc[y, x], (bool, np.bool_)) and not useful.iloc[y, x]:
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="///", lw=0, alpha=0.4))
        ax.set_xticks(range(len(table.columns)), [f"{n:.0f}" for n in table.columns])
        ax.set_yticks(range(len(tasks)), tasks, fontsize=7)
        ax.set_xlabel("max_seq_length (tokens)")
        ax.set_ylabel("RULER task")
        kv = part["kv_fraction"].mean()
        ax.set_title(f"{model}:\n{setting}" + (f" (kv {kv:.2f})" if np.isfinite(kv) else ""), fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="score")
    titled(fig, title, of_task(df, "lm_eval")[lambda r: column(r, "metrics.benchmark") == "ruler"])
    return fig, cells
