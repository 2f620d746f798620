"""The speculation-input ablation, a Fig. 13-style figure (beyond the paper)."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis.columns import column, metric, of_task, param_columns, per_panel, short, size_params, with_kv
from analysis.draw import draw_curves, empty_figure, grid, run_hint, titled


def speculation_rows(df: pd.DataFrame) -> pd.DataFrame:
    """ppl rows for the speculation-input ablation: InfiniGen rows in groups (same model, task setting and every
    hyperparameter but `speculate_from` and the KV-size ones) holding >= 2 speculate_from values, plus the full
    and oracle rows of the same model and task setting. `panel` names the setting."""
    rows = with_kv(of_task(df, "ppl"))
    if rows.empty:
        return rows
    task_cols = [c for c in rows.columns if c.startswith("task_params.")]
    rows["setting"] = rows[["model", *task_cols]].map(short).agg(" | ".join, axis=1)
    gen = rows[rows["method"] == "infinigen"].copy()
    col = "method_params.speculate_from"
    if gen.empty or col not in gen:
        return rows.iloc[0:0]
    gen[col] = gen[col].fillna("previous")  # the only behaviour before the option existed
    others = [c for c in param_columns(gen) if c != col and c.split(".", 1)[1] not in size_params("infinigen", gen)]
    gen["group"] = gen[["setting", *others]].map(short).agg(" | ".join, axis=1)
    gen = gen[gen.groupby("group")[col].transform("nunique") >= 2]
    if gen.empty:
        return rows.iloc[0:0]
    refs = rows[rows["method"].isin(["full", "oracle"]) & rows["setting"].isin(gen["setting"])]
    out = pd.concat([gen, refs])
    out["ppl"] = metric(out, "ppl")
    seq = metric(out, "seq_len").map(lambda v: f"{v:.0f}")
    windows = metric(out, "windows").fillna(metric(out, "max_windows"))
    out["panel"] = (out["model"] + " / " + column(out, "task_params.dataset").astype(str) + " / "
                    + windows.map(lambda v: f"{v:.0f} x " if not pd.isna(v) else "") + seq)
    return out


def fig13_speculation(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Speculation-input ablation (issue 14, Fig. 13 style): perplexity and recall vs measured KV fraction for
    each InfiniGen `speculate_from` option, the oracle's exact top-k and full attention (dashed)."""
    title = "InfiniGen speculation input: perplexity and recall vs KV fraction"
    hint = run_hint("fig13_speculation_smoke", "fig13_speculation")
    cols = ["panel", "curve", "method", "kv_pct", "ppl", "recall", "config_hash"]
    rows = speculation_rows(df)
    if rows.empty:
        what = "InfiniGen ppl rows with >= 2 values of speculate_from"
        return empty_figure(title, what, hint), pd.DataFrame(columns=cols)
    rows["curve"] = per_panel(rows, size_params)
    panels = sorted(rows["panel"].unique())
    fig, axes = grid(2 * len(panels), cols=2, size=(5.2, 3.6))
    for i, panel in enumerate(panels):
        data = rows[rows["panel"] == panel]
        ppl_ax, recall_ax = axes[2 * i], axes[2 * i + 1]
        for ppl in data.loc[data["method"] == "full", "ppl"].unique():
            ppl_ax.axhline(ppl, color="black", linestyle="--", linewidth=1, label="full")
        selective = data[data["method"] != "full"]
        draw_curves(ppl_ax, selective, "kv_pct", "ppl")
        draw_curves(recall_ax, selective.dropna(subset=["recall"]), "kv_pct", "recall")
        for ax, ylabel in ((ppl_ax, "perplexity"), (recall_ax, "recall (true attention mass fetched)")):
            ax.set_title(panel, fontsize=9)
            ax.set(xlabel="KV fraction attended (%, measured)", ylabel=ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    titled(fig, title, rows)
    return fig, rows[cols].sort_values(["panel", "curve", "kv_pct"]).reset_index(drop=True)
