"""Needle retrieval heatmap (beyond the paper: long context)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.columns import curve_labels, models_by_size, of_task
from analysis.draw import empty_figure, grid, run_hint, titled


def needle_cells(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, length, depth) of the needle task: accuracy (share of keys retrieved exactly by greedy
    decoding) and the keys' mean log-likelihood; `setting` names the method and its size hyperparameters."""
    cols = ["model", "setting", "length", "depth", "accuracy", "loglik", "n", "config_hash"]
    rows = of_task(df, "needle")
    if rows.empty or "metrics.cells" not in rows:
        return pd.DataFrame(columns=cols)
    rows["setting"] = curve_labels(rows)
    out = [{"model": r["model"], "setting": r["setting"], "config_hash": r["config_hash"], **cell}
           for _, r in rows.iterrows() if isinstance(r["metrics.cells"], list) for cell in r["metrics.cells"]]
    return pd.DataFrame(out, columns=cols)


def needle_heatmap(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Needle / passkey retrieval accuracy as a prompt length x needle depth heatmap, one panel per (model,
    method setting); a cell averages its keys (runs of the same setting pooled)."""
    title = "Needle retrieval: exact-match accuracy by prompt length and needle depth"
    cells = needle_cells(df)
    if cells.empty:
        return empty_figure(title, "needle task rows", run_hint("needle_smollm2_smoke", "needle_smollm2")), cells
    cells["correct"] = cells["accuracy"] * cells["n"]
    cells["ll_sum"] = cells["loglik"] * cells["n"]
    pooled = cells.groupby(["model", "setting", "length", "depth"], as_index=False)[["correct", "ll_sum", "n"]].sum()
    pooled["accuracy"] = pooled["correct"] / pooled["n"]
    pooled["loglik"] = pooled["ll_sum"] / pooled["n"]
    order = {m: i for i, m in enumerate(models_by_size(pooled["model"]))}
    panels = sorted(pooled.groupby(["model", "setting"]).groups, key=lambda k: (order[k[0]], k[1] != "full", k[1]))
    fig, axes = grid(len(panels), cols=3, size=(3.6, 2.9))
    for ax, (model, setting) in zip(axes, panels):
        part = pooled[(pooled["model"] == model) & (pooled["setting"] == setting)]
        table = part.pivot(index="length", columns="depth", values="accuracy").sort_index()
        image = ax.imshow(table.to_numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        for (y, x), value in np.ndenumerate(table.to_numpy()):
            if not np.isnan(value):
                ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(table.columns)), [f"{d:g}" for d in table.columns])
        ax.set_yticks(range(len(table.index)), [f"{n:.0f}" for n in table.index])
        ax.set_xlabel("needle depth (fraction of the filler)")
        ax.set_ylabel("prompt tokens")
        ax.set_title(f"{model}: {setting}", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    titled(fig, title, of_task(df, "needle"))
    numbers = pooled[["model", "setting", "length", "depth", "accuracy", "loglik", "n"]]
    return fig, numbers.sort_values(["model", "setting", "length", "depth"]).reset_index(drop=True)
