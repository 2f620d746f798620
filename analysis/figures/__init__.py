"""The paper's figures from the results store: `python -m analysis.figures --results results --out figures`.

Each figure is one pure function `DataFrame (analysis.store.load) -> (matplotlib Figure, DataFrame of the
numbers it plots)`; `main` reads the store only and writes `<out>/<name>.png`, `.pdf` and `.csv` per figure.
Rows are picked by what they are (task, method, hyperparameters), never by which preset produced them, so a
figure also shows matching runs made by hand. A panel without rows shows the command that produces them (the
presets in conf/experiment/). Accuracy is plotted against the *measured* relative KV size of each run: its
`metrics.kv_fraction` (the share of cached entries the decoded rows attended) times the size of an entry
relative to 16 bits (quantisation), not against the nominal budget. Reading rows: analysis/columns.py; drawing:
analysis/draw.py.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis import store
from analysis.figures.fig11 import fig11_accuracy
from analysis.figures.fig12 import fig12_ppl_position
from analysis.figures.fig13_skew import fig13_skew
from analysis.figures.fig13_speculation import fig13_speculation
from analysis.figures.fig14_16 import fig14_16_latency
from analysis.figures.fig17 import fig17_ablation
from analysis.figures.needle import needle_heatmap
from analysis.figures.ruler import ruler_heatmap
from analysis.figures.table2 import table2_eviction

# one module per paper figure (and per figure beyond the paper); the name is the files' stem
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

