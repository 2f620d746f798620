"""The paper's figures from the results store: `python -m analysis.figures --results results --out figures`.

Each figure is one pure function `DataFrame (analysis.store.load) -> (matplotlib Figure, DataFrame of the
numbers it plots)`; `main` reads the store only and writes `<out>/<name>.png`, `.pdf` and `.csv` per figure.
Rows are picked by what they are (task, method, hyperparameters), never by which preset produced them, so a
figure also shows matching runs made by hand. A panel without rows shows the command that produces them (the
presets in conf/experiment/). Accuracy is plotted against the *measured* relative KV size of each run: its
`metrics.kv_fraction` (the share of cached entries the decoded rows attended) times the size of an entry
relative to 16 bits (quantisation), not against the nominal budget.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from analysis import store

COLORS = {"full": "black", "offload": "tab:gray", "h2o": "tab:orange", "quant": "tab:green",
          "infinigen": "tab:blue", "oracle": "tab:purple", "streaming": "tab:brown"}
OTHER_COLORS = ("tab:red", "tab:pink", "tab:olive", "tab:cyan", "gold", "navy", "teal", "maroon")  # other methods
MARKERS = "osD^v<>Px*"
# hyperparameters that set a method's KV size (they place a point on a curve instead of naming a curve): rows carry
# them (method_params.size_params, from the method's `size_params`); these are for rows written before they did
LEGACY_SIZE_PARAMS = {"h2o": {"heavy", "recent"}, "quant": {"bits"}, "infinigen": {"alpha", "budget", "max_num_kv"},
               "oracle": {"budget", "alpha", "max_num_kv"}, "streaming": {"sinks", "recent"},
               "kivi": {"bits", "residual"}, "quest": {"budget", "page_size"}, "snapkv": {"budget", "window"}}
# method_params that do not change results (paths, bookkeeping) and never name a curve
IGNORED_PARAMS = {"name", "size_params", "calib_data_dir", "cache_dir", "track_recall"}
# models in order of parameter count (unknown models come after these, in store order)
MODEL_ORDER = ["tiny-llama", "tiny-opt", "tiny-llama-gqa", "smollm2-135m", "opt-6.7b", "llama-2-7b",
               "mistral-7b", "qwen2.5-7b", "llama-3-8b", "opt-13b", "llama-2-13b", "opt-30b"]
# y of the latency panels: the link-modelled decode step of CPU runs (compute measured, host->device bytes at
# task.link_gbps; on a CPU host and device coincide) or else the measured one (CUDA)
LATENCY_METRICS = ("modelled_decode_ms_per_token", "decode_ms_median")
LATENCY_YLABEL = "decode ms/token (median)"
MODELLED_NOTE = "CPU runs: measured compute + host->device bytes over task.link_gbps (modelled_decode_ms_per_token)"


def run_hint(*presets: str) -> str:
    """The commands that produce a figure's rows: smoke preset(s) first (CPU), then the full ones (GPU)."""
    smoke = [p for p in presets if p.endswith("_smoke")]
    full = [p for p in presets if not p.endswith("_smoke")]
    lines = [f"python run.py -m +experiment={p}" for p in smoke]
    lines += [f"python run.py -m +experiment={p} hydra/launcher=slurm  # GPU" for p in full]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- row access


def column(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df else pd.Series(np.nan, index=df.index, dtype=object)


def metric(df: pd.DataFrame, name: str) -> pd.Series:
    """metrics.<name> as float, falling back to metrics.stats[name] and then task_params.<name>."""
    out = pd.to_numeric(column(df, f"metrics.{name}"), errors="coerce")
    stats = column(df, "metrics.stats").map(lambda s: s.get(name) if isinstance(s, dict) else None)
    out = out.fillna(pd.to_numeric(stats, errors="coerce"))
    return out.fillna(pd.to_numeric(column(df, f"task_params.{name}"), errors="coerce")).astype(float)


def param_columns(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if c.startswith("method_params.") and c.split(".", 1)[1] not in IGNORED_PARAMS]


def short(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def size_params(method: str, rows: pd.DataFrame) -> set[str]:
    """The KV-size hyperparameters `rows` (of `method`) declare."""
    declared = [set(v) for v in column(rows, "method_params.size_params") if isinstance(v, (list, tuple))]
    return set().union(*declared) if declared else LEGACY_SIZE_PARAMS.get(method, set())


def color(method: str) -> str:
    """A method's colour: fixed for the paper's methods, a stable pick from OTHER_COLORS for any other."""
    return COLORS.get(method) or OTHER_COLORS[zlib.crc32(method.encode()) % len(OTHER_COLORS)]


def curve_labels(df: pd.DataFrame, point_params: Callable[[str, pd.DataFrame], set[str]] = lambda m, r: set(),
                 shown: Callable[[str, pd.DataFrame], set[str]] = size_params) -> pd.Series:
    """A name per row for the curve it belongs to: the method, plus its `shown(method)` hyperparameters and
    those that differ between that method's rows here, except those that place a point on the curve
    (`point_params(method)`)."""
    labels = pd.Series("", index=df.index, dtype=object)
    for method, rows in df.groupby("method", sort=False):
        skip, show = point_params(method, rows), shown(method, rows)
        varying = [c for c in param_columns(rows)
                   if c.split(".", 1)[1] not in skip and rows[c].notna().any()
                   and (c.split(".", 1)[1] in show or rows[c].map(short).nunique(dropna=False) > 1)]
        for i, row in rows.iterrows():
            extra = ", ".join(f"{c.split('.', 1)[1]}={short(row[c])}" for c in varying)
            labels[i] = f"{method} ({extra})" if extra else method
    return labels


def per_panel(df: pd.DataFrame, point_params: Callable[[str, pd.DataFrame], set[str]] = lambda m, r: set()) -> pd.Series:
    """curve_labels within each panel, so a curve is named by what differs on its own panel."""
    labels = [curve_labels(rows, point_params) for _, rows in df.groupby("panel", sort=False)]
    return pd.concat(labels).reindex(df.index) if labels else pd.Series(dtype=object)


def bytes_ratio(df: pd.DataFrame) -> pd.Series:
    """Size of a cached entry relative to a 16-bit one: metrics/stats `kv_bytes_ratio` when the method reports
    it, else bits/16 for quant and kivi (codes only, as the paper's axis; fp16 scales add 4 bytes per group and
    kivi's fp residual more; cache_bytes has the measured total), else 1."""
    ratio = metric(df, "kv_bytes_ratio")
    bits = pd.to_numeric(column(df, "method_params.bits"), errors="coerce")
    quant = df["method"].isin(["quant", "kivi"]) & bits.notna()
    return ratio.fillna(pd.Series(np.where(quant, bits / 16, 1.0), index=df.index))


def with_kv(df: pd.DataFrame) -> pd.DataFrame:
    """Adds kv_pct: relative KV cache size in % = measured kv_fraction (share of cached entries attended; full =
    1) x bytes_ratio; and recall."""
    out = df.copy()
    kv = metric(out, "kv_fraction")
    kv = kv.where(~(kv.isna() & (out["method"] == "full")), 1.0)
    out["kv_pct"] = 100 * kv * bytes_ratio(out)
    out["recall"] = metric(out, "recall")
    return out


def of_task(df: pd.DataFrame, task: str) -> pd.DataFrame:
    if df.empty or "task" not in df:
        return pd.DataFrame(columns=["model", "method", "task"])
    return df[df["task"] == task].copy()


def models_by_size(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (MODEL_ORDER.index(n) if n in MODEL_ORDER else len(MODEL_ORDER), names.index(n)))


# ----------------------------------------------------------------------------------------------- drawing


def grid(n: int, cols: int = 3, size=(4.2, 3.2)) -> tuple[Figure, list[Axes]]:
    n = max(n, 1)
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(size[0] * cols, size[1] * rows), layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    return fig, axes


def no_data(ax: Axes, what: str, hint: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"no data yet: {what}\n\nrun:\n{hint}", ha="center", va="center", fontsize=7,
            family="monospace", transform=ax.transAxes)


def empty_figure(title: str, what: str, hint: str) -> Figure:
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    no_data(ax, what, hint)
    fig.suptitle(title)
    return fig


def context(rows: pd.DataFrame) -> str:
    """What a figure's rows were measured on, for its title: models, hardware (the rows' meta.device) and data
    (corpus or lm-eval tasks)."""
    if rows.empty or "model" not in rows:
        return ""
    models = ", ".join(models_by_size(rows["model"].dropna().astype(str)))
    devices = ", ".join(sorted({str(d) for d in column(rows, "meta.device").dropna()})) or "device not recorded"
    data = {str(d) for d in column(rows, "task_params.dataset").dropna()}
    tasks = {str(t) for t in column(rows, "metrics.task").dropna()}
    # a suite's task names would not fit a title line: counted instead (the panels name them)
    data |= tasks if len(tasks) <= 6 else {f"{len(tasks)} lm-eval tasks"}
    if "needle" in set(rows.get("task", [])):
        data |= {f"needle ({f} filler)" for f in column(rows, "task_params.filler").fillna("repeat")}
    return " | ".join(part for part in (models, devices, ", ".join(sorted(data))) if part)


def titled(fig: Figure, title: str, rows: pd.DataFrame) -> None:
    about = context(rows)
    fig.suptitle(f"{title}\n{about}" if about else title, fontsize=11)


def style(label: str, index: int) -> dict:
    method = label.split(" ", 1)[0]
    return {"color": color(method), "marker": MARKERS[index % len(MARKERS)]}


def draw_curves(ax: Axes, data: pd.DataFrame, x: str, y: str, order: str | None = None) -> None:
    """One line per `curve`, points sorted by x (or `order`)."""
    for i, (label, rows) in enumerate(data.groupby("curve", sort=False)):
        rows = rows.sort_values(order or x)
        ax.plot(rows[x], rows[y], label=label, linewidth=1.2, markersize=4, **style(label, i))


def draw_bars(ax: Axes, data: pd.DataFrame, group: str, bar: str, y: str, groups: list, bars: list) -> None:
    width = 0.8 / max(len(bars), 1)
    for j, name in enumerate(bars):
        heights = [data.loc[(data[group] == g) & (data[bar] == name), y].mean() for g in groups]
        xs = np.arange(len(groups)) + (j - (len(bars) - 1) / 2) * width
        ax.bar(xs, heights, width, label=str(name), color=color(str(name).split(" ", 1)[0]),
               alpha=0.9 if j == 0 else 0.75, edgecolor="white", hatch=["", "//", "..", "xx", "\\\\"][j % 5])
    ax.set_xticks(np.arange(len(groups)), [str(g) for g in groups], rotation=20 if len(groups) > 4 else 0)


# ----------------------------------------------------------------------------------------------- Fig. 11


def fig11_accuracy(df: pd.DataFrame, x: str = "kv_pct") -> tuple[Figure, pd.DataFrame]:
    """Accuracy vs relative KV cache size, one panel per (model, lm-eval task, shots, docs, protocol); full
    attention is the dashed reference. x = "kv_pct" (measured kv_fraction x bytes per entry vs 16 bits, see
    `with_kv`) or "retain_ratio" (the stats' (1 - sqrt(1 - kv_fraction)) * 100)."""
    title = "Fig. 11: accuracy vs relative KV cache size"
    hint = run_hint("fig11_accuracy_smoke", "fig11_accuracy_opt", "fig11_accuracy_llama")
    rows = with_kv(of_task(df, "lm_eval"))
    rows["acc_pct"] = 100 * metric(rows, "acc")
    rows["retain_ratio"] = metric(rows, "retain_ratio")
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
        for acc in full["acc_pct"].unique():
            ax.axhline(acc, color="black", linestyle="--", linewidth=1, label="full")
        draw_curves(ax, data[data["method"] != "full"], x, "acc_pct")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("relative KV cache size (%, measured)" if x == "kv_pct" else "retain ratio (%)")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    titled(fig, title, rows)
    cols = ["panel", "model", "curve", "method", x, "acc_pct", "recall", "config_hash"]
    return fig, rows[cols + param_columns(rows)].sort_values(["panel", "curve", x]).reset_index(drop=True)


# ----------------------------------------------------------------------------------------------- Fig. 12


def nll_by_position(rows: pd.DataFrame) -> pd.DataFrame:
    out = []
    for i, row in rows.iterrows():
        chunks = row.get("metrics.nll_by_chunk")
        if isinstance(chunks, dict):
            for pos, nll in chunks.items():
                out.append({"row": i, "position": int(pos), "nll": float(nll)})
    return pd.DataFrame(out, columns=["row", "position", "nll"])


def fig12_ppl_position(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Mean NLL per 256-token chunk vs position (WikiText-2 etc.), one panel per (model, dataset, seq_len, windows) with
    at least 8 chunks, one line per method setting. InfiniGen runs with a capped pool (Table 2) are left out."""
    title = "Fig. 12: NLL per 256-token chunk vs position"
    hint = run_hint("fig12_ppl_position_smoke", "fig12_ppl_position_opt", "fig12_ppl_position_llama")
    cols = ["panel", "curve", "method", "position", "nll", "config_hash"]
    rows = of_task(df, "ppl")
    if not rows.empty:
        capacity = pd.to_numeric(column(rows, "method_params.capacity"), errors="coerce").fillna(1.0)
        rows = rows[(metric(rows, "seq_len") >= 2048) & ~((capacity != 1.0) & (rows["method"] == "infinigen"))]
    points = nll_by_position(rows)
    if points.empty:
        return empty_figure(title, "ppl rows with seq_len >= 2048", hint), pd.DataFrame(columns=cols)
    rows = rows.copy()
    rows["panel"] = (rows["model"] + " / " + column(rows, "task_params.dataset").astype(str) + " / seq "
                     + metric(rows, "seq_len").map(lambda v: f"{v:.0f}") + " / "
                     + metric(rows, "windows").map(lambda v: f"{v:.0f} window" + "s" * (v != 1)))
    rows["curve"] = per_panel(rows)
    data = points.join(rows[["panel", "curve", "method", "config_hash"]], on="row")
    panels = sorted(data["panel"].unique())
    fig, axes = grid(len(panels), cols=2, size=(5.5, 3.4))
    for ax, panel in zip(axes, panels):
        draw_curves(ax, data[data["panel"] == panel], "position", "nll")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("token position (chunk start, tokens)")
        ax.set_ylabel("NLL (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    titled(fig, title, rows)
    return fig, data[cols].sort_values(["panel", "curve", "position"]).reset_index(drop=True)


# ----------------------------------------------------------------------------------------------- Fig. 13


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


# ----------------------------------------------------------------------------------------------- Figs. 14-16


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


# ----------------------------------------------------------------------------------------------- Fig. 17


def ablation_rows(df: pd.DataFrame, task: str, along: str, sweep: int = 3) -> pd.DataFrame:
    """InfiniGen rows of `task` in groups (same model, task setting and every other hyperparameter) where
    method_params.<along> takes at least `sweep` values (two budget pairs sharing a budget are no sweep)."""
    rows = with_kv(of_task(df, task))
    rows = rows[rows["method"] == "infinigen"]
    col = f"method_params.{along}"
    if rows.empty or col not in rows:
        return rows.iloc[0:0]
    task_cols = [c for c in rows.columns if c.startswith("task_params.")]
    fixed = ["model", *task_cols, *[c for c in param_columns(rows) if c != col]]
    if task == "lm_eval":
        fixed.append("metrics.task")
    rows = rows.copy()
    rows["group"] = rows[fixed].map(short).agg(" | ".join, axis=1)
    rows[along] = pd.to_numeric(rows[col], errors="coerce")
    rows = rows[rows.groupby("group")[along].transform("nunique") >= sweep]
    first = {g: rows.loc[rows["group"] == g].iloc[0] for g in rows["group"].unique()}
    rows["curve"] = rows["group"].map(lambda g: setting_name(first[g], task))
    return rows


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
    draw_curves(ax, data, along, y)
    twin = ax.twinx()
    for i, (label, rows) in enumerate(data.groupby("curve", sort=False)):
        rows = rows.sort_values(along)
        twin.plot(rows[along], rows["kv_pct"], linestyle=":", color="tab:red", marker=MARKERS[i], markersize=3)
    twin.set_ylabel("measured KV fraction (%), dotted", color="tab:red", fontsize=8)
    if y == "ppl" and data[y].max() > 10 * data[y].min():  # a small alpha's perplexity would flatten the rest
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
    rows, y = latency_rows(df)
    data = ablation_rows(rows, "latency", "alpha") if y else rows
    if y is None or data.empty:
        no_data(axes[1], "InfiniGen latency rows over >= 3 values of alpha",
                run_hint("fig17_alpha_latency_smoke", "fig17_alpha_latency"))
    else:
        draw_curves(axes[1], data, "alpha", y)
        axes[1].set(xlabel="alpha (speculation threshold)", ylabel=LATENCY_YLABEL)
        if modelled(data):
            fig.supxlabel(MODELLED_NOTE, fontsize=7)
        axes[1].grid(alpha=0.3)
        axes[1].legend(fontsize=7)
        plotted.append(data.assign(panel="latency vs alpha", value=data[y], metric=data["decode_source"]))
    titled(fig, title, pd.concat([p for p in plotted if not p.empty]) if any(not p.empty for p in plotted) else df)
    plotted = [p for p in plotted if not p.empty]
    if not plotted:
        return fig, pd.DataFrame(columns=cols)
    out = pd.concat(plotted)
    for name in ("alpha", "partial_ratio"):
        out[name] = pd.to_numeric(column(out, f"method_params.{name}"), errors="coerce")
    return fig, out[cols].reset_index(drop=True)


# ----------------------------------------------------------------------------------------------- Table 2


def pool_name(capacity, eviction) -> str:
    capacity = float(capacity) if capacity is not None and not pd.isna(capacity) else 1.0
    if capacity == 1.0:
        return "pool 100%"
    size = f"{capacity:.0%}" if capacity < 1 else f"{capacity:.0f} tokens"
    return f"pool {size}, {eviction}"


def eviction_rows(df: pd.DataFrame) -> pd.DataFrame:
    """InfiniGen ppl rows in groups (same model, dataset, seq_len and other hyperparameters) that hold at least
    one run with a capped pool; `pool` names the pool setting."""
    rows = of_task(df, "ppl")
    rows = rows[rows["method"] == "infinigen"].copy()
    if rows.empty or "method_params.capacity" not in rows:
        return rows.iloc[0:0]
    capacity = pd.to_numeric(rows["method_params.capacity"], errors="coerce").fillna(1.0)
    rows["pool"] = [pool_name(c, e) for c, e in zip(capacity, column(rows, "method_params.eviction"))]
    # at a full pool the eviction policy never runs: it must not split the group
    pool_cols = {"method_params.capacity", "method_params.eviction"}
    task_cols = [c for c in rows.columns if c.startswith("task_params.")]
    fixed = ["model", *task_cols, *[c for c in param_columns(rows) if c not in pool_cols]]
    rows["group"] = rows[fixed].map(short).agg(" | ".join, axis=1)
    rows = rows[rows.groupby("group")["pool"].transform(lambda s: (s != "pool 100%").any())]
    if rows.empty:
        return rows
    rows["ppl"] = metric(rows, "ppl")
    rows["dataset"] = column(rows, "task_params.dataset").astype(str)
    seq = metric(rows, "seq_len").map(lambda v: f"{v:.0f}")
    rows["setting"] = rows["model"] + " / " + rows["dataset"] + " / seq " + seq
    return rows


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
    fig, axes = grid(1, size=(max(6.0, 1.8 * len(settings)), 3.6))
    draw_bars(axes[0], rows, "setting", "pool", "ppl", settings, pools)
    for bars in axes[0].containers:  # the policies differ by a few percent: the numbers say by how much
        axes[0].bar_label(bars, fmt="%.4g", fontsize=6)
    axes[0].set_ylim(0, rows["ppl"].max() * 1.4)  # room for the legend above the bars
    axes[0].set(xlabel="model / dataset / sequence length (tokens)", ylabel="perplexity")
    axes[0].grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7, ncols=min(len(pools), 4), loc="upper center")
    titled(fig, title, rows)
    return fig, rows[cols].sort_values(["setting", "pool"]).reset_index(drop=True)


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


RULER_INFORMATIVE = 0.1  # a (model, task, length) where full attention scores below this says nothing of a method


def ruler_cells(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, method setting, RULER task, length): score (lm-eval's RULER string match, pooled over
    runs by samples), measured kv_fraction, samples, full attention's score at that cell and whether the cell is
    `informative` (full >= RULER_INFORMATIVE: where full fails, a KV method cannot be judged)."""
    cols = ["model", "setting", "task", "length", "score", "kv_fraction", "n", "full_score", "informative"]
    rows = of_task(df, "lm_eval")
    if rows.empty or "metrics.benchmark" not in rows:
        return pd.DataFrame(columns=cols)
    rows = rows[rows["metrics.benchmark"] == "ruler"].copy()
    if rows.empty:
        return pd.DataFrame(columns=cols)
    rows["setting"] = curve_labels(rows)
    rows["task_name"], rows["length"] = rows["metrics.task"], metric(rows, "length")
    rows["n"], rows["score"], rows["kv_fraction"] = metric(rows, "n"), metric(rows, "score"), metric(rows, "kv_fraction")
    rows["points"], rows["kv_n"] = rows["score"] * rows["n"], rows["kv_fraction"] * rows["n"]
    keys = ["model", "setting", "task_name", "length"]
    out = rows.groupby(keys, as_index=False)[["points", "kv_n", "n"]].sum(min_count=1)
    out["score"], out["kv_fraction"] = out["points"] / out["n"], out["kv_n"] / out["n"]
    full = out[out["setting"] == "full"].set_index(["model", "task_name", "length"])["score"]
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


# ----------------------------------------------------------------------------------------------- main


FIGURES: dict[str, Callable[[pd.DataFrame], tuple[Figure, pd.DataFrame]]] = {
    "fig11_accuracy": fig11_accuracy,
    "fig12_ppl_position": fig12_ppl_position,
    "fig13_skew": fig13_skew,
    "fig13_speculation": fig13_speculation,
    "fig14_16_latency": fig14_16_latency,
    "fig17_ablation": fig17_ablation,
    "table2_eviction": table2_eviction,
    "needle_heatmap": needle_heatmap,
    "ruler_heatmap": ruler_heatmap,
}



def write(name: str, fig: Figure, numbers: pd.DataFrame, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf", out / f"{name}.csv"]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    numbers.to_csv(paths[2], index=False)
    return paths


def panels_without_data(fig: Figure) -> list[str]:
    """What each of the figure's "no data yet" panels lacks (make smoke prints them: nothing to see in a png)."""
    return [t.get_text().split("\n")[0].removeprefix("no data yet: ") for ax in fig.axes for t in ax.texts
            if t.get_text().startswith("no data yet: ")]


def failed_figure(name: str, err: BaseException) -> Figure:
    """What a figure that raised is written as, so no earlier file of it passes for a current one."""
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"{name} failed on this store:\n{type(err).__name__}: {err}"[:600], ha="center", va="center",
            fontsize=7, family="monospace", transform=ax.transAxes, wrap=True)
    return fig


def main(argv: list[str] | None = None, registry: dict | None = None) -> list[Path]:
    """Writes every figure of `registry` (default FIGURES); one that raises is reported by name (with its
    traceback) and written as a panel saying so, the others are still written, and the exit status is 1 at the end."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results", help="results store folder (run.py results_dir)")
    parser.add_argument("--out", default="figures", help="where the png/pdf/csv files go")
    registry = FIGURES if registry is None else registry
    parser.add_argument("--only", nargs="*", choices=sorted(registry), help="a subset of the figures")
    args = parser.parse_args(argv)
    df = store.load(args.results)
    written, failed, empty = [], [], []
    for name in args.only or registry:
        try:
            fig, numbers = registry[name](df)
            paths = write(name, fig, numbers, Path(args.out))
        except Exception as err:  # noqa: BLE001 -- one figure's bug must not cost the others
            traceback.print_exc()
            print(f"{name}: FAILED ({type(err).__name__}: {err})", file=sys.stderr)
            failed.append(name)
            write(name, failed_figure(name, err), pd.DataFrame(), Path(args.out))
            continue
        written += paths
        print(f"{name}: {len(numbers)} plotted values -> {Path(args.out) / name}.{{png,pdf,csv}}")
        empty += [f"{name}: {what}" for what in panels_without_data(fig)]
    if empty:
        print(f"{len(empty)} panels without data yet:\n  " + "\n  ".join(empty))
    if failed:
        print(f"figures failed: {', '.join(failed)} (the others were written)", file=sys.stderr)
        raise SystemExit(1)
    return written


if __name__ == "__main__":
    main()
