"""Fig. 11: accuracy vs relative KV cache size (claims C1, C2)."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis.columns import (column, metric, models_by_size, of_task, param_columns, per_panel, short, size_params,
                              with_kv)
from analysis.draw import draw_curves, draw_error_bars, empty_figure, grid, run_hint, titled


def fig11_accuracy(df: pd.DataFrame, x: str = "kv_pct") -> tuple[Figure, pd.DataFrame]:
    """Accuracy vs relative KV cache size, one panel per (model, lm-eval task, shots, docs, protocol); full
    attention is the dashed reference, its 95% interval shaded; each point's 95% interval (1.96 x lm-eval's
    acc_stderr) is its error bar. x = "kv_pct" (measured kv_fraction x bytes per entry vs 16 bits, see
    `with_kv`) or "retain_pct" (the InfiniGen artifact's retain ratio, 1 - sqrt(1 - density), in %, density being
    the kept entries over the causal area of the method's selecting layers: infinigen/stats.py; rows written
    before it was recorded have none)."""
    title = "Fig. 11: accuracy vs relative KV cache size"
    hint = run_hint("fig11_accuracy_smoke", "fig11_accuracy_smollm2", "fig11_accuracy_opt", "fig11_accuracy_llama")
    rows = with_kv(of_task(df, "lm_eval"))
    rows["acc_pct"] = 100 * metric(rows, "acc")
    rows["ci_pct"] = 100 * 1.96 * metric(rows, "acc_stderr")
    rows["retain_pct"] = 100 * metric(rows, "retain")
    rows = rows.dropna(subset=["acc_pct", x])
    if rows.empty:
        return empty_figure(title, "lm_eval rows", hint), pd.DataFrame(columns=["panel", "curve", x, "acc_pct"])
    limit = column(rows, "metrics.limit").map(lambda v: "all docs" if v is None or pd.isna(v) else f"{short(v)} docs")
    rows["panel"] = (rows["model"] + " / " + column(rows, "metrics.task").astype(str) + " / "
                     + column(rows, "metrics.num_fewshot").map(short) + "-shot, " + limit + ", "
                     + column(rows, "metrics.protocol").astype(str))
    rows["curve"] = per_panel(rows, size_params)
    order = models_by_size(rows["model"])
    panels = sorted(rows["panel"].unique(), key=lambda p: (order.index(p.split(" / ")[0]), p))
    fig, axes = grid(len(panels))
    for ax, panel in zip(axes, panels):
        data = rows[rows["panel"] == panel]
        full = data[data["method"] == "full"]
        for acc, ci in full[["acc_pct", "ci_pct"]].drop_duplicates("acc_pct").itertuples(index=False):
            ax.axhline(acc, color="black", linestyle="--", linewidth=1, label="full")
            if pd.notna(ci):
                ax.axhspan(acc - ci, acc + ci, color="black", alpha=0.08, linewidth=0)
        draw_curves(ax, data[data["method"] != "full"], x, "acc_pct")
        draw_error_bars(ax, data[data["method"] != "full"], x, "acc_pct", "ci_pct")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("relative KV cache size (%, measured)" if x == "kv_pct" else "retain ratio (%)")
        ax.set_ylabel("accuracy (%, bars: 95% interval)")
        low, high = ax.get_ylim()
        ax.set_ylim(max(low, 0.0), min(high, 100.0))  # a small n's Wald interval reaches past 0 or 100
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    titled(fig, title, rows)
    cols = ["panel", "model", "curve", "method", x, "acc_pct", "ci_pct", "recall", "config_hash"]
    return fig, rows[cols + param_columns(rows)].sort_values(["panel", "curve", x]).reset_index(drop=True)
