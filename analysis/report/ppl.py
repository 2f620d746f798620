"""The perplexity comparisons' shared pieces: their commands, ppl rows with the measured relative KV size, a
method's gap to full attention matched at the same KV size, and the ppl-vs-KV figure."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis import columns as C
from analysis import draw as D
from analysis import like as L
from analysis import paired as P
from analysis import tables as T

# the perplexity setting of the comparisons: one 1024-token WikiText-2 window (what a shared 2-core CPU affords)
PPL = "python run.py -m model=smollm2-135m task=ppl task.seq_len=1024 task.max_windows=1"


# C1 and C2's perplexity comparison: 16 windows of 1,024 WikiText-2 tokens (16,368 scored), each method paired with
# full attention window by window (enough windows for an interval); InfiniGen at the model family's selected setting
PPL16 = "python run.py -m model=smollm2-135m task=ppl task.seq_len=1024 task.max_windows=16"
PAIRED = (f"{PPL16} method=full", f"{PPL16} method=infinigen method.budget=0.02,0.035,0.07,0.1,0.14,0.2,0.28",
          f"{PPL16} +point=h2o_0.03125,h2o_0.0625,h2o_0.1,h2o_0.125", f"{PPL16} method=quant method.bits=2,4")
# C1 and C2 at the authors' semantics, on the same 16 windows beside full's row of PAIRED: InfiniGen and H2O as the
# InfiniGen artifact computes them (conf/method/infinigen_reference.yaml, h2o_reference.yaml; docs/reference.md),
# H2O's heavy + recent the same fractions of the sequence as InfiniGen's budgets
AUTHORS_RATIOS = (0.05, 0.1, 0.15)
AUTHORS = (f"{PPL16} method=infinigen_reference method.budget=0.1,0.2,0.3,0.4,0.6",
           *(f"{PPL16} method=h2o_reference method.heavy={r} method.recent={r}" for r in AUTHORS_RATIOS))


def versus(data: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Each row of `data` against the row of `reference` on the same model, data and windows: its perplexity over
    the reference's, paired over windows (ratio, lo, hi, n windows, closeness to the margin); NaN where no
    reference row matches or either has no per-window results (`why` says which)."""
    out = []
    for i, row in data.iterrows():
        got = {"ratio": float("nan"), "lo": float("nan"), "hi": float("nan"), "windows": 0, "closeness": None,
               "why": "no reference row on the same windows"}
        for _, ref in reference.iterrows():
            try:
                L.check(row, ref, "accuracy")
            except L.Unlike:
                continue
            try:
                effect = P.perplexity_ratio(row.get("metrics.units"), ref.get("metrics.units"))
            except P.Unpaired as err:
                got["why"] = str(err)
                break
            got = {"ratio": effect.value, "lo": effect.low, "hi": effect.high, "windows": effect.n,
                   "closeness": effect.closeness(), "why": ""}
            break
        out.append(got)
    return pd.DataFrame(out, index=data.index)


def at_size(rows: pd.DataFrame, x: float, column: str = "rel_kv") -> tuple[dict, str] | None:
    """Per-window results of `rows` (one method setting at several sizes, same windows) at size `x`: a row within
    like.KV_TOLERANCE of it as it is ("measured"), else each window's NLL interpolated linearly between the two rows
    around `x` ("interpolated", each window's per-chunk NLL too where both rows hold it); None outside the measured
    range or without per-window results."""
    rows = rows.dropna(subset=[column]).sort_values(column)
    near = rows[L.same_size(rows[column], x)]
    if not near.empty:
        row = near.loc[(near[column] - x).abs().idxmin()]
        return (row["metrics.units"], "measured") if isinstance(row.get("metrics.units"), dict) else None
    below, above = rows[rows[column] < x], rows[rows[column] > x]
    if below.empty or above.empty:
        return None
    lo, hi = below.iloc[-1], above.iloc[0]
    a, b = lo.get("metrics.units"), hi.get("metrics.units")
    if not isinstance(a, dict) or not isinstance(b, dict) or a.get("id") != b.get("id") or a.get("tokens") != b.get("tokens"):
        return None
    w = (x - lo[column]) / (hi[column] - lo[column])
    units = {"id": a["id"], "tokens": a["tokens"], "nll": [u + w * (v - u) for u, v in zip(a["nll"], b["nll"])]}
    if a.get("chunk_nll") and b.get("chunk_nll") and a.get("chunk_tokens") == b.get("chunk_tokens"):
        units |= {"chunk_tokens": a["chunk_tokens"], "chunk_nll": [
            [u + w * (v - u) for u, v in zip(ua, vb)] for ua, vb in zip(a["chunk_nll"], b["chunk_nll"])]}
    return units, "interpolated"


def ppl_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """ppl rows with ppl, kv (measured kv_fraction), rel_kv (x bytes per entry vs 16 bits), density (kept entries
    over the causal area of the layers the method selects on, the InfiniGen artifact's measure; NaN on rows stored
    before it was recorded) and a curve label."""
    out = C.with_kv(C.of_task(rows, "ppl"))
    if out.empty:
        return out.assign(ppl=[], kv=[], rel_kv=[], density=[], curve=[])
    out["ppl"] = C.metric(out, "ppl")
    out["rel_kv"] = out["kv_pct"] / 100
    out["kv"] = out["rel_kv"] / C.bytes_ratio(out)
    out["density"] = C.metric(out, "density")
    out["curve"] = C.curve_labels(out, C.size_params)
    return out


def interpolate(points: pd.DataFrame, x: str, y: str, at: float) -> float | None:
    """y at x = at, linear between the two neighbouring points; None outside the measured range."""
    points = points.dropna(subset=[x, y]).sort_values(x)
    xs, ys = points[x].to_list(), points[y].to_list()
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= at <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    return ys[xs.index(at)] if at in xs else None


def full_ppl(rows: pd.DataFrame) -> float | None:
    full = rows[rows["method"] == "full"]
    return float(full["ppl"].iloc[0]) if not full.empty else None


def matched_gaps(data: pd.DataFrame, method: str, reference: str, x: str = "rel_kv") -> list[tuple]:
    """(x, method's ppl gap to full, reference's gap interpolated at that x, the method's row, the reference's
    curve) for each row of `method` inside the measured range of a curve of `reference`."""
    full = full_ppl(data)
    out = []
    for ref_curve, ref in data[data["method"] == reference].groupby("curve"):
        for _, row in data[data["method"] == method].sort_values([x, "curve"]).iterrows():
            at = interpolate(ref, x, "ppl", row[x])
            if at is not None:
                out.append((row[x], row["ppl"] - full, at - full, row, ref_curve))
    return out


def ppl_vs_kv(rows: pd.DataFrame, title: str) -> Figure:
    """Perplexity vs measured relative KV size, one line per method setting, full attention dashed."""
    data = ppl_rows(rows)
    panels = sorted(data.assign(panel=data["model"] + " / " + C.column(data, "task_params.dataset").astype(str)
                                + " / " + C.metric(data, "windows").map(lambda v: f"{v:.0f}") + " x "
                                + C.metric(data, "seq_len").map(lambda v: f"{v:.0f}") + " tokens, dense_rows "
                                + C.metric(data, "dense_rows").fillna(0).map(lambda v: f"{v:.0f}"))
                    .groupby("panel"), key=lambda p: p[0])
    fig, axes = D.grid(len(panels), cols=2, size=(6.0, 3.8))
    for ax, (panel, part) in zip(axes, panels):
        for value in part.loc[part["method"] == "full", "ppl"].unique():
            ax.axhline(value, color="black", linestyle="--", linewidth=1, label="full")
        D.draw_curves(ax, part[part["method"] != "full"], "kv_pct", "ppl")
        ax.set_yscale("log")
        ax.set(xlabel="relative KV cache size (%, measured)", ylabel="perplexity (log scale)")
        ax.set_title(panel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    D.titled(fig, title, data)
    return fig


def ppl_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The ppl rows' table without byte columns, and without the model and data columns where one value holds."""
    out = T.table(rows, "ppl")
    return out.drop(columns=[c for c in out.columns if c.endswith("(MiB)")
                             or (c in ("data", "model") and out[c].nunique(dropna=False) <= 1)])


def accuracy_table(rows: pd.DataFrame) -> pd.DataFrame:
    out = T.table(rows, "accuracy")
    return out.drop(columns=[c for c in ("model", "protocol") if c in out.columns])


def ppl_and_accuracy(rows: pd.DataFrame) -> pd.DataFrame:
    return pd.concat([ppl_table(rows), accuracy_table(rows)], ignore_index=True)


COMPARED = (f"{PPL} method=full",
            f"{PPL} +point=infinigen_paper method.budget=0.1,0.2",
            "python run.py -m +experiment=fig13_speculation_smoke +point=speculate_previous",
            f"{PPL} +point=h2o_0.0625,h2o_0.1",
            f"{PPL} method=quant method.bits=2,4")


OTHERS = (f"{PPL} method=oracle method.budget=0.1,0.2",
          f"{PPL} method=quest method.budget=0.03,0.05,0.1,0.2",
          f"{PPL} method=kivi method.bits=2",
          f"{PPL} task.dense_rows=512 method=snapkv method.budget=0.2",
          f"{PPL} task.dense_rows=512 method=full",
          f"{PPL} task.dense_rows=512 method=oracle method.budget=0.1,0.2")
