"""Fig. 17: InfiniGen's alpha and partial-weight-ratio ablation (claim C6)."""

from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis import paired as P
from analysis.columns import column, metric, of_task, param_columns, short, with_kv
from analysis.draw import MARKERS, draw_curves, grid, no_data, run_hint, titled
from analysis.figures.fig14_16 import latency_rows


def ablation_rows(df: pd.DataFrame, task: str, along: str, sweep: int = 3) -> pd.DataFrame:
    """InfiniGen rows of `task` in groups (same model, task setting and every other hyperparameter) where
    method_params.<along> takes at least `sweep` values (two budget pairs sharing a budget are no sweep)."""
    rows = with_kv(of_task(df, task))
    rows = rows[rows["method"].isin(("infinigen", "infinigen_reference"))]
    col = f"method_params.{along}"
    if rows.empty or col not in rows:
        return rows.iloc[0:0]
    task_cols = [c for c in rows.columns if c.startswith("task_params.")]
    fixed = ["model", "method", *task_cols, *[c for c in param_columns(rows) if c != col]]
    if task == "lm_eval":
        fixed.append("metrics.task")
    rows = rows.copy()
    rows["group"] = rows[fixed].map(short).agg(" | ".join, axis=1)
    rows[along] = pd.to_numeric(rows[col], errors="coerce")
    rows = rows[rows.groupby("group")[along].transform("nunique") >= sweep]
    first = {g: rows.loc[rows["group"] == g].iloc[0] for g in rows["group"].unique()}
    names = {g: setting_name(row, task) for g, row in first.items()}
    for name in set(names.values()):  # two sweeps on one task setting: named by the hyperparameters they differ in
        same = [g for g in names if names[g] == name]
        differ = [c for c in param_columns(rows) if c != col and len({short(first[g][c]) for g in same}) > 1]
        for g in same if len(same) > 1 else ():
            names[g] += " (" + ", ".join(f"{c.split('.', 1)[1]}={short(first[g][c])}" for c in differ) + ")"
    rows["curve"] = rows["group"].map(names)
    return rows


def over_best(data: pd.DataFrame) -> pd.DataFrame:
    """Each point's perplexity over its sweep's (`group`) best, paired over the windows both scored, with the
    interval's ends (`low`, `high`); the best is 1."""
    out = []
    for _, part in data.groupby("group", sort=False):
        best = part.loc[part["ppl"].idxmin()]
        for i, row in part.iterrows():
            try:
                e = P.Effect(1.0, 1.0, 1.0, 0, "perplexity") if i == best.name else P.perplexity_ratio(
                    row["metrics.units"], best["metrics.units"])
            except P.Unpaired:
                continue
            out.append(row.to_frame().T.assign(over_best=e.value, low=e.low, high=e.high))
    return pd.concat(out).infer_objects() if out else data.iloc[0:0].assign(over_best=[], low=[], high=[])


def measured_sweeps(df: pd.DataFrame) -> pd.DataFrame:
    """InfiniGen's decode steps timed on this machine (`decode_ms_median`: the step's wall time, no modelled link)
    swept over >= 3 values of alpha, labelled measured."""
    rows, _ = latency_rows(df)
    rows = ablation_rows(rows, "latency", "alpha")
    if rows.empty:
        return rows
    return rows.assign(measured_ms=metric(rows, "decode_ms_median"), curve="measured: " + rows["curve"]).dropna(
        subset=["measured_ms"])


def modelled_sweeps(df: pd.DataFrame) -> pd.DataFrame:
    """The performance model's InfiniGen latency rows (task.timing=modelled, infinigen/offload/perf.py) swept over
    >= 3 values of alpha, each curve named by its model, shape and hardware profile, and labelled modelled."""
    rows = of_task(df, "latency")
    rows = ablation_rows(rows[column(rows, "metrics.timing") == "modelled"], "latency", "alpha")
    if rows.empty:
        return rows
    hardware = column(rows, "metrics.hardware").astype(str)
    return rows.assign(modelled_ms=metric(rows, "modelled_decode_ms_per_token"),
                       curve="modelled: " + rows["curve"] + " on " + hardware)


def setting_name(row: pd.Series, task: str) -> str:
    """What an ablation curve holds fixed, in words."""
    get = lambda name: short(row.get(f"task_params.{name}"))  # noqa: E731
    if task == "lm_eval":
        return f"{row['model']} / {row['metrics.task']} / {short(row.get('metrics.num_fewshot'))}-shot"
    if task == "ppl":
        return f"{row['model']} / {get('dataset')} / seq {get('seq_len')}"
    return f"{row['model']} / batch {get('batch_size')}, prompt {get('prompt_len')}"


def accuracy_panel(ax: Axes, df: pd.DataFrame, along: str, xlabel: str, preset: str) -> pd.DataFrame:
    """lm-eval accuracy (or, without lm-eval rows, perplexity) vs `along`, measured kv_fraction dotted on a
    twin axis."""
    acc, ppl = ablation_rows(df, "lm_eval", along), ablation_rows(df, "ppl", along)
    widest = lambda d: d.groupby("group")[along].nunique().max() if not d.empty else 0  # noqa: E731
    data, y, ylabel = (acc, "acc_pct", "accuracy (%)") if widest(acc) >= widest(ppl) else (ppl, "ppl", "perplexity")
    if data.empty:
        no_data(ax, f"InfiniGen ppl or lm_eval rows over >= 3 values of {along}", run_hint(f"{preset}_smoke", preset))
        return data
    data = data.assign(acc_pct=100 * metric(data, "acc"), ppl=metric(data, "ppl"))
    if y == "ppl" and (metric(data, "windows") >= 2).any():
        # sweeps over several windows: each point over its sweep's best, with its 95% paired interval (the
        # verdict's numbers); one-window sweeps, whose spread is not measured, are left to the table
        data = over_best(data[metric(data, "windows") >= 2])
        y, ylabel = "over_best", "perplexity / sweep's best (95% CI)"
    draw_curves(ax, data, along, y)
    if y == "over_best":
        for label, rows in data.groupby("curve", sort=False):
            colour = next(line.get_color() for line in ax.get_lines() if line.get_label() == label)
            ax.errorbar(rows[along], rows[y], yerr=[rows[y] - rows["low"], rows["high"] - rows[y]], fmt="none",
                        ecolor=colour, elinewidth=0.8, capsize=2)
    twin = ax.twinx()
    for i, (label, rows) in enumerate(data.groupby("curve", sort=False)):
        rows = rows.sort_values(along)
        twin.plot(rows[along], rows["kv_pct"], linestyle=":", color="tab:red", marker=MARKERS[i], markersize=3)
    twin.set_ylabel("measured KV fraction (%), dotted", color="tab:red", fontsize=8)
    if y in ("ppl", "over_best") and data[y].max() > 10 * data[y].min():  # a small alpha's perplexity would flatten the rest
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return data.assign(value=data[y], metric=y)


def fig17_ablation(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """(a) accuracy and kv_fraction vs the threshold alpha, (b) decode latency vs alpha, (c) accuracy and
    kv_fraction vs the partial weight ratio."""
    title = "Fig. 17: InfiniGen ablation (alpha, partial weight ratio)"
    cols = ["panel", "curve", "alpha", "partial_ratio", "value", "metric", "kv_pct", "config_hash"]
    fig, axes = grid(3, cols=3, size=(4.6, 3.4))
    plotted = [
        accuracy_panel(axes[0], df, "alpha", "alpha (speculation threshold)", "fig17_alpha")
        .assign(panel="accuracy vs alpha"),
        accuracy_panel(axes[2], df, "partial_ratio", "partial weight ratio", "fig17_partial")
        .assign(panel="accuracy vs partial_ratio"),
    ]
    names = ("(a) accuracy vs alpha", "(b) latency vs alpha", "(c) accuracy vs partial weight ratio")
    for ax, name in zip(axes, names):
        ax.set_title(name, fontsize=9)
    data = measured_sweeps(df)
    model = modelled_sweeps(df)
    if data.empty and model.empty:
        no_data(axes[1], "InfiniGen latency rows over >= 3 values of alpha",
                run_hint("fig17_alpha_latency_smoke", "fig17_alpha_latency"))
    if not data.empty:
        draw_curves(axes[1], data, "alpha", "measured_ms")
        axes[1].set(xlabel="alpha (speculation threshold)", ylabel="measured decode ms/token (median), solid")
        axes[1].grid(alpha=0.3)
        plotted.append(data.assign(panel="latency vs alpha", value=data["measured_ms"], metric="decode_ms_median"))
    if not model.empty:  # another machine's milliseconds: its own axis, dashed, never one line with the measured
        twin = axes[1].twinx() if not data.empty else axes[1]
        for i, (label, part) in enumerate(model.groupby("curve", sort=False)):
            part = part.sort_values("alpha")
            twin.plot(part["alpha"], part["modelled_ms"], linestyle="--", color="tab:purple", marker=MARKERS[i],
                      markersize=3, label=label)
        twin.set_ylabel("MODELLED decode ms/token, dashed", color="tab:purple", fontsize=8)
        axes[1].set_xlabel("alpha (speculation threshold)")
        twin.legend(fontsize=6, loc="lower right")
        plotted.append(model.assign(panel="latency vs alpha (modelled)", value=model["modelled_ms"],
                                    metric="modelled_decode_ms_per_token"))
    if not data.empty:
        axes[1].legend(fontsize=7, loc="upper left")
    titled(fig, title, pd.concat([p for p in plotted if not p.empty]) if any(not p.empty for p in plotted) else df)
    plotted = [p for p in plotted if not p.empty]
    if not plotted:
        return fig, pd.DataFrame(columns=cols)
    out = pd.concat(plotted)
    for name in ("alpha", "partial_ratio"):
        out[name] = pd.to_numeric(column(out, f"method_params.{name}"), errors="coerce")
    return fig, out[cols].reset_index(drop=True)
