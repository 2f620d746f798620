"""Drawing helpers of the figures: the figure grid, a method's colour and marker, curves, grouped bars, the
panel that says which command fills it, and a title naming what the rows were measured on."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.columns import column, models_by_size

COLORS = {"full": "black", "offload": "tab:gray", "h2o": "tab:orange", "quant": "tab:green",
          "infinigen": "tab:blue", "oracle": "tab:purple", "streaming": "tab:brown"}
OTHER_COLORS = ("tab:red", "tab:pink", "tab:olive", "tab:cyan", "gold", "navy", "teal", "maroon")  # other methods
MARKERS = "osD^v<>Px*"


def run_hint(*presets: str) -> str:
    """The commands that produce a figure's rows: smoke preset(s) first (CPU), then the full ones (GPU)."""
    smoke = [p for p in presets if p.endswith("_smoke")]
    full = [p for p in presets if not p.endswith("_smoke")]
    lines = [f"python run.py -m +experiment={p}" for p in smoke]
    lines += [f"python run.py -m +experiment={p} hydra/launcher=slurm  # GPU" for p in full]
    return "\n".join(lines)


def color(method: str) -> str:
    """A method's colour: fixed for the paper's methods, a stable pick from OTHER_COLORS for any other."""
    return COLORS.get(method) or OTHER_COLORS[zlib.crc32(method.encode()) % len(OTHER_COLORS)]


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


def draw_error_bars(ax: Axes, data: pd.DataFrame, x: str, y: str, err: str) -> None:
    """Each `curve`'s error bars (half-width `err`), in the colour draw_curves gave its line."""
    colours = {line.get_label(): line.get_color() for line in ax.get_lines()}
    for label, rows in data.dropna(subset=[err]).groupby("curve", sort=False):
        ax.errorbar(rows[x], rows[y], yerr=rows[err], fmt="none", ecolor=colours.get(label), elinewidth=0.8,
                    capsize=2)


def draw_bars(ax: Axes, data: pd.DataFrame, group: str, bar: str, y: str, groups: list, bars: list) -> None:
    width = 0.8 / max(len(bars), 1)
    for j, name in enumerate(bars):
        heights = [data.loc[(data[group] == g) & (data[bar] == name), y].mean() for g in groups]
        xs = np.arange(len(groups)) + (j - (len(bars) - 1) / 2) * width
        ax.bar(xs, heights, width, label=str(name), color=color(str(name).split(" ", 1)[0]),
               alpha=0.9 if j == 0 else 0.75, edgecolor="white", hatch=["", "//", "..", "xx", "\\\\"][j % 5])
    ax.set_xticks(np.arange(len(groups)), [str(g) for g in groups], rotation=20 if len(groups) > 4 else 0)

