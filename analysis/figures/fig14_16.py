"""Figs. 14-16: measured decode latency (claim C7)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.columns import column, curve_labels, metric, models_by_size, of_task, param_columns, short
from analysis.draw import color, draw_bars, draw_curves, empty_figure, grid, no_data, run_hint, titled

# y of the latency panels: the link-modelled decode step of CPU runs (compute measured, host->device bytes at
# task.link_gbps; on a CPU host and device coincide) or else the measured one (CUDA)
LATENCY_METRICS = ("modelled_decode_ms_per_token", "decode_ms_median")
LATENCY_YLABEL = "decode ms/token (median)"
MODELLED_NOTE = "CPU runs: measured compute + host->device bytes over task.link_gbps (modelled_decode_ms_per_token)"


def latency_rows(df: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """Latency rows with a `decode_ms` column (the first of LATENCY_METRICS a row has; `decode_source` says
    which); y = "decode_ms", or None without any."""
    rows = of_task(df, "latency")
    rows = rows[column(rows, "metrics.timing") != "modelled"]  # the performance model's rows: analysis/speed.py
    if rows.empty:
        return rows, None
    rows = rows.copy()
    for name in ("batch_size", "prompt_len", "gen_len", "h2d_bytes_per_token"):
        rows[name] = metric(rows, name)
    rows["decode_ms"] = np.nan
    rows["decode_source"] = pd.Series(None, index=rows.index, dtype=object)
    for name in LATENCY_METRICS:
        value = metric(rows, name)
        fill = rows["decode_ms"].isna() & value.notna()
        rows.loc[fill, "decode_ms"] = value[fill]
        rows.loc[fill, "decode_source"] = name
    rows = rows.dropna(subset=["decode_ms"])
    return rows, ("decode_ms" if not rows.empty else None)


def modelled(rows: pd.DataFrame) -> bool:
    return bool((rows["decode_source"] == LATENCY_METRICS[0]).any())


def swept_curves(data: pd.DataFrame, along: str) -> pd.DataFrame:
    """The method settings of `data` measured at >= 2 values of `along` (one-off runs, e.g. an alpha
    ablation at one batch size, would be stray points), named by what differs between them."""
    if data.empty:
        return data.assign(curve=pd.Series(dtype=object))
    setting = data[["method", *param_columns(data)]].map(short).agg(" | ".join, axis=1)
    data = data[data.groupby(setting)[along].transform(lambda s: s.astype(str).nunique()) >= 2].copy()
    data["curve"] = curve_labels(data) if not data.empty else pd.Series(dtype=object)
    return data


def sweep_group(rows: pd.DataFrame, along: str, fixed: list[str]) -> pd.DataFrame:
    """The rows of the largest group (equal `fixed`) in which `along` takes at least two values."""
    if rows.empty:
        return rows
    keys = rows[fixed].astype(str).agg(" | ".join, axis=1)
    spread = rows.groupby(keys)[along].transform(lambda s: s.astype(str).nunique())
    keys = keys[spread >= 2]
    if keys.empty:
        return rows.iloc[0:0]
    return rows.loc[keys.index[keys == keys.value_counts().index[0]]]


def fig14_16_latency(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Decode latency (a) vs batch size [Figs. 14-15], (b) vs prompt length [Fig. 16a], (c) vs model size
    [Fig. 16b], and (d) host-to-device KV bytes per generated token, one line/bar per method setting."""
    title = "Figs. 14-16: latency"
    rows, y = latency_rows(df)
    cols = ["panel", "curve", "model", "batch_size", "prompt_len", "gen_len", "value", "metric", "config_hash"]
    if y is None:
        hint = run_hint("fig14_15_latency_batch_smoke", "fig16a_latency_prompt_smoke", "fig16b_latency_model_smoke",
                        "fig14_15_latency_batch", "fig16a_latency_prompt", "fig16b_latency_model")
        return (empty_figure(title, f"latency rows with {' or '.join(LATENCY_METRICS)}", hint),
                pd.DataFrame(columns=cols))
    fig, axes = grid(4, cols=2, size=(5.2, 3.4))
    plotted = []
    sweeps = [("batch_size", ["model", "prompt_len", "gen_len"], "batch_size", "fig14_15_latency_batch"),
              ("prompt_len", ["model", "batch_size", "gen_len"], "prompt length (+ gen_len generated)",
               "fig16a_latency_prompt")]
    for ax, (along, fixed, xlabel, preset) in zip(axes, sweeps):
        data = swept_curves(sweep_group(rows, along, fixed), along)
        if data.empty:
            no_data(ax, f"latency rows over >= 2 values of {along}", run_hint(f"{preset}_smoke", preset))
            continue
        draw_curves(ax, data, along, y)
        head = data.iloc[0]
        ax.set_title(", ".join(f"{k}={short(head[k])}" for k in fixed), fontsize=9)
        ax.set(xlabel=xlabel, ylabel=LATENCY_YLABEL)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        plotted.append(data.assign(panel=f"vs {along}"))
    ax = axes[2]
    data = swept_curves(sweep_group(rows, "model", ["batch_size", "prompt_len", "gen_len"]), "model")
    if data.empty:
        no_data(ax, "latency rows over >= 2 models", run_hint("fig16b_latency_model_smoke", "fig16b_latency_model"))
    else:
        draw_bars(ax, data, "model", "curve", y, models_by_size(data["model"]), list(dict.fromkeys(data["curve"])))
        head = data.iloc[0]
        ax.set_title(f"batch_size={short(head['batch_size'])}, prompt_len={short(head['prompt_len'])}", fontsize=9)
        ax.set(xlabel="model (smallest first)", ylabel=LATENCY_YLABEL)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
        plotted.append(data.assign(panel="vs model"))
    ax = axes[3]
    traffic = rows.dropna(subset=["h2d_bytes_per_token"])
    if traffic.empty:
        no_data(ax, "latency rows with h2d_bytes_per_token", run_hint("fig14_15_latency_batch_smoke"))
    else:
        # the largest setting measured: batch, then prompt length
        top = traffic.sort_values(["batch_size", "prompt_len"]).iloc[-1]
        shape = ["model", "batch_size", "prompt_len"]
        data = traffic[(traffic[shape] == top[shape]).all(axis=1)]
        data = data.assign(curve=curve_labels(data))
        # horizontal bars, largest on top: a label per row never meets its neighbours, however many settings
        mib = (data.groupby("curve")["h2d_bytes_per_token"].mean() / 2**20).sort_values()
        ax.barh(range(len(mib)), mib.to_numpy(), color=[color(c.split(" ", 1)[0]) for c in mib.index])
        ax.set_yticks(range(len(mib)), list(mib.index), fontsize=6 if len(mib) > 6 else 7)
        ax.set_title(f"{top['model']}, batch {short(top['batch_size'])}, prompt {short(top['prompt_len'])}", fontsize=9)
        ax.set(xlabel="host->device KV (MiB / generated token)", ylabel="method setting")
        ax.grid(alpha=0.3, axis="x")
        plotted.append(data.assign(panel="h2d bytes per token"))
    titled(fig, title, rows)
    if modelled(rows):
        fig.supxlabel(MODELLED_NOTE, fontsize=7)
    if not plotted:
        return fig, pd.DataFrame(columns=cols)
    out = pd.concat(plotted)
    traffic = out["panel"] == "h2d bytes per token"
    out["value"] = np.where(traffic, out["h2d_bytes_per_token"], out[y])
    out["metric"] = np.where(traffic, "h2d_bytes_per_token", out["decode_source"])
    return fig, out[cols].reset_index(drop=True)
