"""Fig. 13: InfiniGen with and without skewing (claim C4)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.columns import column, metric, of_task, param_columns, short, with_kv
from analysis.draw import color, draw_bars, empty_figure, grid, run_hint, titled


SKEW_BARS = ("full", "infinigen (no skew)", "infinigen (skew)")


def skew_twins(rows: pd.DataFrame, setting: list[str]) -> pd.DataFrame:
    """The InfiniGen rows of `rows` that have a twin differing in `skew` alone (same `setting` columns and every
    other hyperparameter); `twin` names the pair, `bar` says which side a row is."""
    gen = rows[rows["method"] == "infinigen"].copy()
    if gen.empty or "method_params.skew" not in gen:
        return gen.iloc[0:0].assign(twin=pd.Series(dtype=object), bar=pd.Series(dtype=object))
    others = [c for c in param_columns(gen) if c != "method_params.skew"]
    gen["twin"] = gen[setting + others].map(short).agg(" | ".join, axis=1)
    gen = gen[gen.groupby("twin")["method_params.skew"].transform(lambda s: s.map(bool).nunique() == 2)]
    gen["bar"] = np.where(gen["method_params.skew"].map(bool), SKEW_BARS[2], SKEW_BARS[1])
    return gen


def skew_params(pair: pd.DataFrame) -> str:
    return ", ".join(f"{c.split('.', 1)[1]}={short(pair.iloc[0][c])}" for c in param_columns(pair)
                     if c.split(".", 1)[1] in ("alpha", "budget", "partial_ratio"))


def fig13_skew(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """InfiniGen with vs without skewing at a fixed budget, full attention alongside: accuracy bars per lm-eval
    task (the paper's Fig. 13), and perplexity + speculation recall bars per ppl setting (the smoke preset). Only
    InfiniGen runs that have a twin differing in `skew` alone are shown."""
    title = "Fig. 13: InfiniGen with and without skewing"
    hint = run_hint("fig13_skew_smoke", "fig13_skew")
    cols = ["panel", "task", "bar", "metric", "value", "kv_pct", "config_hash"]
    lm = with_kv(of_task(df, "lm_eval"))
    lm["acc_pct"] = 100 * metric(lm, "acc")
    lm["lm_task"] = column(lm, "metrics.task").astype(str)
    lm_setting = ["model", "metrics.num_fewshot", "metrics.protocol", "metrics.limit"]
    for c in lm_setting:
        lm[c] = column(lm, c).map(short)
    ppl = with_kv(of_task(df, "ppl"))
    ppl["ppl"] = metric(ppl, "ppl")
    ppl_setting = ["model", *[c for c in ppl.columns if c.startswith("task_params.")]]
    for c in ppl_setting:
        ppl[c] = ppl[c].map(short)
    lm_gen, ppl_gen = skew_twins(lm, lm_setting), skew_twins(ppl, ppl_setting)
    lm_twins, ppl_twins = sorted(lm_gen["twin"].unique()), sorted(ppl_gen["twin"].unique())
    if not lm_twins and not ppl_twins:
        what = "InfiniGen lm_eval or ppl rows with skew=true and skew=false"
        return empty_figure(title, what, hint), pd.DataFrame(columns=cols)
    gap = len(lm_twins) % 2 if ppl_twins else 0  # a ppl panel and its recall panel share a row
    fig, axes = grid(len(lm_twins) + gap + 2 * len(ppl_twins), cols=2, size=(5.5, 3.4))
    for ax in axes[len(lm_twins) : len(lm_twins) + gap]:
        ax.set_axis_off()
    plotted = []
    for ax, twin in zip(axes, lm_twins):
        pair = lm_gen[lm_gen["twin"] == twin]
        key = pair.iloc[0][lm_setting]
        same = (lm[lm_setting] == key).all(axis=1) & lm["lm_task"].isin(pair["lm_task"])
        data = pd.concat([lm[(lm["method"] == "full") & same].assign(bar="full"), pair])
        tasks = sorted(data["lm_task"].unique())
        bars = [b for b in SKEW_BARS if b in set(data["bar"])]
        draw_bars(ax, data, "lm_task", "bar", "acc_pct", tasks, bars)
        panel = f"{key['model']}, {key['metrics.num_fewshot']}-shot, {skew_params(pair)}"
        ax.set_title(panel, fontsize=8)
        ax.set(xlabel="lm-eval task", ylabel="accuracy (%)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
        plotted.append(data.assign(panel=panel, task=data["lm_task"], metric="acc_pct", value=data["acc_pct"]))
    rest = axes[len(lm_twins) + gap :]
    for i, twin in enumerate(ppl_twins):
        pair = ppl_gen[ppl_gen["twin"] == twin]
        key = pair.iloc[0][ppl_setting]
        full = ppl[(ppl["method"] == "full") & (ppl[ppl_setting] == key).all(axis=1)]
        data = pd.concat([full.assign(bar="full"), pair])
        seq = short(key.get("task_params.seq_len"))
        dataset = key.get("task_params.dataset")
        panel = f"{key['model']}, {dataset}, {seq} tokens, {skew_params(pair)}"
        for ax, y, ylabel in ((rest[2 * i], "ppl", "perplexity"),
                              (rest[2 * i + 1], "recall", "recall (attention mass fetched)")):
            shown = data.dropna(subset=[y])
            bars = [b for b in SKEW_BARS if b in set(shown["bar"])]
            heights = [shown.loc[shown["bar"] == b, y].mean() for b in bars]
            ax.bar(range(len(bars)), heights, color=[color(b.split(" ", 1)[0]) for b in bars],
                   hatch=None, edgecolor="white")
            ax.set_xticks(range(len(bars)), bars, fontsize=8)
            for x, h in enumerate(heights):
                ax.annotate(f"{h:.3g}", (x, h), ha="center", va="bottom", fontsize=7)
            ax.set_ylim(0, max(heights, default=1) * 1.12)  # the tallest bar's number inside the frame
            ax.set_title(panel, fontsize=8)
            ax.set(xlabel=f"{dataset}, kv fraction {short(round(pair['kv_pct'].mean(), 1))}% (measured)",
                   ylabel=ylabel)
            ax.grid(alpha=0.3, axis="y")
            plotted.append(shown.assign(panel=panel, task=dataset, metric=y, value=shown[y]))
    titled(fig, title, pd.concat([lm[lm["method"] == "full"], lm_gen, ppl[ppl["method"] == "full"], ppl_gen]))
    return fig, pd.concat(plotted)[cols].sort_values(["panel", "metric", "task", "bar"]).reset_index(drop=True)
