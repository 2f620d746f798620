"""Beyond the paper: what each method generates, beside full attention on the same prompts (task=generate)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis import tables as T
from analysis.report.section import Section, needs, num, on_every_model

SIDE_BY_SIDE = "python run.py -m +experiment=generate_side_by_side_smoke"
SHOWN = 60  # characters of each continuation in the table


def rows_of(rows: pd.DataFrame) -> pd.DataFrame:
    data = C.of_task(rows, "generate")
    if data.empty:
        return data
    return data.assign(params=T.key_params(data), agreement=C.metric(data, "agreement"),
                       units=C.column(data, "metrics.units"),
                       exact=C.metric(data, "exact"), divergence=C.metric(data, "first_divergence"),
                       kv=C.metric(data, "kv_fraction"))


def clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= SHOWN else text[:SHOWN].rsplit(" ", 1)[0] + " ..."


def table(rows: pd.DataFrame) -> list[pd.DataFrame]:
    data = rows_of(rows)
    if data.empty:
        return [pd.DataFrame()]
    summary = T.ordered(pd.DataFrame({
        "model": data["model"], "method": data["method"], "params": data["params"],
        "kv_fraction (%)": 100 * data["kv"], "token agreement with full (%)": 100 * data["agreement"],
        "prompts identical to full's (%)": 100 * data["exact"],
        "first divergence (mean token)": data["divergence"]}), ["token agreement with full (%)"])
    texts = []
    for _, row in data.iterrows():
        shown = row.get("metrics.texts")
        if isinstance(shown, dict) and shown.get("method"):
            texts.append({"model": row["model"], "method": row["method"], "params": row["params"],
                          "first prompt's continuation": clip(shown["method"][0]),
                          "full attention's": clip(shown["full"][0])})
    return [summary, T.ordered(pd.DataFrame(texts), ["method"]) if texts else pd.DataFrame()]


def verdict(rows: pd.DataFrame) -> list[str]:
    data = rows_of(rows)
    if data.empty:
        return needs("task=generate rows")
    data = data[data["method"] != "full"].sort_values("agreement", ascending=False)
    head = data.iloc[0]
    return [f"greedy continuations of {num(C.metric(head.to_frame().T, 'prompts').iloc[0])} WikiText-2 prompts "
            f"({num(C.metric(head.to_frame().T, 'new_tokens').iloc[0])} new tokens each), token agreement with full "
            "attention's, 95% interval over prompts: " + ", ".join(
                f"{r.method} {num(100 * r.agreement)}% ({interval(r.units)}; kv {num(100 * r.kv)}%)"
                for r in data.itertuples() if pd.notna(r.agreement))]


def interval(units) -> str:
    """The per-prompt agreement's 95% bootstrap interval, with n; a row without per-prompt results says so."""
    if not isinstance(units, dict) or not units.get("agreement"):
        return "no per-prompt results stored"
    share = P.mean(units["agreement"])
    return f"{num(100 * share.low)}-{num(100 * share.high)}%, n = {share.n} prompts"


SECTION = Section(
    "generate", "Beyond the paper: what each method generates",
    "Every method inside transformers' own `model.generate` (infinigen.apply, README 'Use it from Python'), greedy, "
    "on the same prompts as full attention: how many of its tokens agree with full attention's continuation, where "
    "the two first differ, and the text itself.",
    on_every_model(SIDE_BY_SIDE), table, verdict, order=145, per_model=True,
    note="Token agreement: positions where both continuations hold the same token, over the longer one; a "
         "continuation that ends early counts as diverging there. The texts are the first prompt's (the store keeps "
         "each prompt's, `metrics.texts`).")
