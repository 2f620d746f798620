"""C3: perplexity along the sequence (paper Fig. 12)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import like as L
from analysis.figures.fig12 import fig12_ppl_position
from analysis.report import recommended as R
from analysis.report.section import Contrast, Section, Status, figure_of, needs, num, on_every_model


def nll_table(rows: pd.DataFrame) -> pd.DataFrame:
    _, numbers = fig12_ppl_position(rows)
    if numbers.empty:
        return numbers
    wide = numbers.pivot_table(index="position", columns="curve", values="nll").reset_index()
    wide.columns.name = None
    wide = wide.rename(columns={c: f"{c}: NLL (nats/token)" for c in wide.columns if c != "position"})
    return wide.rename(columns={"position": "chunk start (token)"})


RECOMMENDED = R.on_every_model_selected(
    "python run.py -m +experiment=fig12_ppl_position_smoke +point=infinigen_selected method.budget=0.2")
# H2O at the recommended InfiniGen's KV size on the same window (heavy = recent = 0.1 and 0.125: kv ~21-28%)
MATCHED_H2O = "python run.py -m +experiment=fig12_ppl_position_smoke +point=h2o_0.1,h2o_0.125"


def chunk_nll(row: pd.Series) -> pd.Series:
    chunks = row.get("metrics.nll_by_chunk")
    return pd.Series({int(k): float(v) for k, v in chunks.items()}).sort_index() if isinstance(chunks, dict) else None


def curves(rows: pd.DataFrame) -> tuple[pd.Series | None, pd.DataFrame]:
    """Full attention's NLL per chunk, and the other rows (seq_len >= 2048, no capped pool) with their kv."""
    data = C.of_task(rows, "ppl")
    if data.empty:
        return None, data
    capacity = pd.to_numeric(C.column(data, "method_params.capacity"), errors="coerce").fillna(1.0)
    data = data[(C.metric(data, "seq_len") >= 2048) & ~((capacity != 1.0) & (data["method"] == "infinigen"))]
    full = data[data["method"] == "full"]
    if full.empty:
        return None, data
    data = data.assign(kv=C.metric(data, "kv_fraction"))
    return chunk_nll(full.iloc[0]), data[data["method"] != "full"]


def h2o_at(h2o: pd.DataFrame, row: pd.Series, full: pd.Series) -> tuple[pd.Series | None, str]:
    """H2O's NLL gap to full per chunk at `row`'s kv_fraction on the same window: its row within like.KV_TOLERANCE
    ("measured"), else interpolated chunk by chunk between the two H2O rows around it ("interpolated"); None and
    why otherwise."""
    same = h2o[[not L.differences(r, row, L.ACCURACY) for _, r in h2o.iterrows()]] if not h2o.empty else h2o
    if same.empty:
        return None, "no H2O row on the same window"
    near = same[L.same_size(same["kv"], row["kv"])]
    if not near.empty:
        pick = near.loc[(near["kv"] - row["kv"]).abs().idxmin()]
        return chunk_nll(pick) - full, f"measured at kv_fraction {num(100 * pick['kv'])}%"
    below, above = same[same["kv"] < row["kv"]], same[same["kv"] > row["kv"]]
    if below.empty or above.empty:
        return None, (f"H2O's rows span kv_fraction {num(100 * same['kv'].min())}-{num(100 * same['kv'].max())}%, "
                      f"not InfiniGen's {num(100 * row['kv'])}%")
    lo, hi = below.loc[below["kv"].idxmax()], above.loc[above["kv"].idxmin()]
    w = (row["kv"] - lo["kv"]) / (hi["kv"] - lo["kv"])
    return (chunk_nll(lo) + w * (chunk_nll(hi) - chunk_nll(lo))) - full, \
        f"interpolated between kv_fraction {num(100 * lo['kv'])}% and {num(100 * hi['kv'])}%"


def versus_h2o(rows: pd.DataFrame) -> list[tuple[pd.Series, float, float | None, str]]:
    """Per InfiniGen row: (row, its mean NLL gap to full over the window, H2O's at the same kv_fraction or None,
    how H2O's was had or why not)."""
    full, data = curves(rows)
    if full is None:
        return []
    h2o = data[data["method"] == "h2o"]
    out = []
    for _, row in data[data["method"] == "infinigen"].iterrows():
        gap = float((chunk_nll(row) - full).mean())
        ref, how = h2o_at(h2o, row, full)
        out.append((row, gap, None if ref is None else float(ref.mean()), how))
    return out


def versus_text(gap: float, ref: float | None, how: str) -> str:
    line = f"mean NLL gap to full over the window {num(gap)} nats/token"
    if ref is None:
        return line + f"; against H2O: refused ({how}); `{MATCHED_H2O}` adds H2O at that size"
    return line + f", H2O's at the same kv_fraction {num(ref)} ({how}): InfiniGen's / H2O's = {num(gap / ref)}x"


def c3_verdict(rows: pd.DataFrame) -> list[str]:
    """InfiniGen's mean NLL gap to full against H2O's at the same kv_fraction (one 2048-token window: no interval),
    the recommended setting first, then each other setting; then each curve's gap over the window's two halves."""
    found = versus_h2o(rows)
    full, data = curves(rows)
    if full is None or not found:
        return needs("ppl rows with per-chunk NLL (seq_len >= 2048) of full and the compared methods")
    recommended = [f for f in found if bool(R.is_recommended(f[0].to_frame().T).iloc[0])]
    source = rows[rows["method"] == "infinigen"]
    out = [f"{R.lead(source)} (kv_fraction {num(100 * r['kv'])}%; one 2,048-token window, no interval): "
           f"{versus_text(g, h, how)}" for r, g, h, how in recommended] or [R.missing(source, *RECOMMENDED)]
    out += [f"at {R.name(r)} (kv_fraction {num(100 * r['kv'])}%): {versus_text(g, h, how)}"
            for r, g, h, how in found if not bool(R.is_recommended(r.to_frame().T).iloc[0])]
    for _, row in data.iterrows():
        gap = chunk_nll(row) - full
        first, second = gap.iloc[:len(gap) // 2].mean(), gap.iloc[len(gap) // 2:].mean()
        out.append(f"{row['method']} ({T_params(row)}; kv_fraction {num(100 * row['kv'])}%): NLL gap to full "
                   f"{num(first)} nats/token over the first half of the window, {num(second)} over the second "
                   f"({'grows' if second > first else 'does not grow'} along it)")
    return out


def T_params(row: pd.Series) -> str:
    frame = row.to_frame().T
    return R.name(row) if row["method"] == "infinigen" else ", ".join(
        f"{k}={C.short(row[f'method_params.{k}'])}" for k in sorted(C.size_params(row["method"], frame))
        if f"method_params.{k}" in row and pd.notna(row[f"method_params.{k}"]))


def c3_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """The recommended setting's mean NLL gap to full over H2O's at the same kv_fraction (holds: < 1)."""
    found = [f for f in versus_h2o(rows) if bool(R.is_recommended(f[0].to_frame().T).iloc[0]) and f[2]]
    ratio = found[0][1] / found[0][2] if found else None
    return [Contrast("InfiniGen's (recommended) mean NLL gap to full along the window / H2O's at the same kv_fraction",
                     ratio, None if ratio is None else ratio < 1)]


def c3_status(rows: pd.DataFrame) -> list[Status]:
    claim = "C3: NLL gap to full below H2O's at the same KV size, along the sequence"
    found = [f for f in versus_h2o(rows) if bool(R.is_recommended(f[0].to_frame().T).iloc[0])]
    if not found or found[0][2] is None:
        return [Status(claim, "not measured", found[0][3] if found else "")]
    row, gap, ref, how = found[0]
    return [Status(claim, "holds" if gap < ref else "does not hold",
                   f"{num(gap)} vs {num(ref)} nats/token at kv {num(100 * row['kv'])}% (one window, no interval)")]


SECTION = Section(
    "c3_position", "C3. Perplexity along the sequence",
    "InfiniGen's loss stays close to full attention's along the whole sequence, while H2O's drifts (paper "
    "Fig. 12). Compared at the same kv_fraction (H2O's own row within 10% of InfiniGen's, else its chunks "
    "interpolated between its two rows around it, said so), over one 2,048-token window.",
    (*on_every_model("python run.py -m +experiment=fig12_ppl_position_smoke", MATCHED_H2O), *RECOMMENDED),
    nll_table, c3_verdict, figure_of("fig12_ppl_position"),
    order=30, per_model=True, contrast=c3_contrast, status=c3_status)
