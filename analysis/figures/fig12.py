"""Fig. 12: NLL along the sequence (claim C3)."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis.columns import column, metric, of_task, per_panel
from analysis.draw import draw_curves, empty_figure, grid, run_hint, titled


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
