"""The rule that selects InfiniGen's setting for a model family, on windows no verdict scores.

The sweep (`python run.py -m +experiment=select_infinigen`, on each real model) runs every combination of the four
speculation knobs (skip_layers, alpha, partial_ratio, speculate_from) at three budgets on held-out WikiText-2
windows, beside full attention on the same windows. The rule:

1. each run's perplexity gap to full is its mean NLL minus full's over the same windows (nats/token, paired);
2. a setting's gap at each kv_fraction of TARGETS is interpolated linearly between its two measured budgets around
   it; a setting whose measured kv_fraction range does not hold a target is not eligible (it cannot run there);
3. the setting with the least mean gap over TARGETS is selected.

TARGETS sit in the range the accuracy claim is about (above 10% of the KV cache). The rule is fixed in code, before
the sweep's rows are read; infinigen/selected.py must hold what it picks (the report and a test check that).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis.report import recommended as R
from analysis.report.ppl import interpolate

TARGETS = (0.15, 0.20)  # kv_fraction


def points(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per InfiniGen run of the sweep: its setting (R.KEYS), budget, measured kv_fraction, recall and its
    paired NLL gap to full on the same windows (nats/token; NaN where the rows cannot be paired)."""
    ppl = C.of_task(rows, "ppl")
    full = ppl[ppl["method"] == "full"]
    gen = ppl[ppl["method"] == "infinigen"]
    cols = [*R.KEYS, "model", "budget", "kv", "recall", "gap"]
    if gen.empty or full.empty:
        return pd.DataFrame(columns=cols)
    out = R.setting(gen)
    out["model"] = gen["model"]
    out["budget"] = C.column(gen, "method_params.budget").astype(float)
    out["kv"] = C.metric(gen, "kv_fraction")
    out["recall"] = C.metric(gen, "recall")
    reference = {m: part.iloc[0] for m, part in full.groupby("model")}
    gaps = []
    for i, row in gen.iterrows():
        ref = reference.get(row["model"])
        try:
            gaps.append(P.nll_gap(row.get("metrics.units"), ref.get("metrics.units")).value if ref is not None
                        else math.nan)
        except P.Unpaired:
            gaps.append(math.nan)
    out["gap"] = gaps
    return out[cols]


def window_score(rows: pd.DataFrame, model: str, setting: pd.Series) -> np.ndarray | None:
    """A setting's score window by window: each window's NLL gap to full (nats/token) at each of TARGETS,
    interpolated between the setting's budgets around it as the score is, averaged over TARGETS; None where the
    rows cannot be paired or do not reach a target."""
    ppl = C.of_task(rows, "ppl")
    full = ppl[(ppl["method"] == "full") & (ppl["model"] == model)]
    gen = ppl[(ppl["method"] == "infinigen") & (ppl["model"] == model)]
    gen = gen[R.matches(gen, pd.DataFrame([setting[list(R.KEYS)]] * len(gen), index=gen.index))] if not gen.empty \
        else gen
    if full.empty or gen.empty:
        return None
    ref = full.iloc[0]["metrics.units"]
    per = []
    for _, row in gen.iterrows():
        try:
            got = P.aligned(row["metrics.units"], ref, ("nll", "tokens"))
        except P.Unpaired:
            return None
        per.append((C.metric(row.to_frame().T, "kv_fraction").iloc[0], (got["nll"] - got["ref_nll"]) / got["tokens"]))
    per.sort(key=lambda kv: kv[0])
    at = []
    for t in TARGETS:
        pair = next(((a, b) for a, b in zip(per, per[1:]) if a[0] <= t <= b[0]), None)
        if pair is None:
            return None
        (x0, y0), (x1, y1) = pair
        at.append(y0 + (y1 - y0) * ((t - x0) / (x1 - x0) if x1 > x0 else 0.0))
    return sum(at) / len(at)


def scores(pts: pd.DataFrame) -> pd.DataFrame:
    """Per setting: its measured kv_fraction range, its gap at each target (interpolated; NaN outside the range),
    the mean over TARGETS (the score) and whether it is eligible."""
    lines = []
    for key, part in pts.groupby([*R.KEYS], sort=True):
        at = {t: interpolate(part, "kv", "gap", t) for t in TARGETS}
        eligible = all(v is not None for v in at.values())
        lines.append({**dict(zip(R.KEYS, key)), "kv_min": part["kv"].min(), "kv_max": part["kv"].max(),
                      **{f"gap@{t:g}": (math.nan if v is None else v) for t, v in at.items()},
                      "score": sum(at.values()) / len(TARGETS) if eligible else math.nan, "eligible": eligible,
                      "recall": part["recall"].mean()})
    return pd.DataFrame(lines)


def pick(table: pd.DataFrame) -> dict | None:
    """The eligible setting with the least score (None: none eligible)."""
    eligible = table[table["eligible"]]
    if eligible.empty:
        return None
    best = eligible.loc[eligible["score"].idxmin()]
    return {k: (best[k] if k == "speculate_from" else float(best[k]) if k != "skip_layers" else int(best[k]))
            for k in R.KEYS}


def selected(rows: pd.DataFrame) -> dict[str, dict]:
    """model -> the setting the rule picks from that model's sweep rows."""
    pts = points(rows)
    out = {}
    for model, part in pts.groupby("model", sort=True):
        choice = pick(scores(part))
        if choice is not None:
            out[model] = choice
    return out


def token_span(row: pd.Series) -> tuple[int, int]:
    """[first, last) token a ppl row read, from its task parameters (windows it skipped, scored, stride)."""
    seq = int(C.metric(row.to_frame().T, "seq_len").iloc[0])
    stride = row.get("task_params.stride")
    stride = seq if stride is None or (isinstance(stride, float) and math.isnan(stride)) else int(stride)
    skip = row.get("task_params.skip_windows")
    skip = 0 if skip is None or (isinstance(skip, float) and math.isnan(skip)) else int(skip)
    windows = int(C.metric(row.to_frame().T, "windows").iloc[0])
    return skip * stride, skip * stride + (windows - 1) * stride + seq
