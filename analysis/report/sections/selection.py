"""Choosing InfiniGen's setting per model family on held-out windows (the setting every claim below reports)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis.report import recommended as R
from analysis.report import selection as S
from analysis.report.section import Section, needs, num, on_model

SWEEP = "python run.py -m +experiment=select_infinigen"
FULL = ("python run.py model=smollm2-135m task=ppl task.seq_len=1024 task.max_windows=4 task.skip_windows=64 "
        "method=full")


def table(rows: pd.DataFrame) -> pd.DataFrame:
    pts = S.points(rows)
    if pts.empty:
        return pd.DataFrame()
    parts = []
    for model, part in pts.groupby("model", sort=True):
        scored = S.scores(part)
        choice = S.pick(scored)
        scored["selected"] = ["yes" if choice and all(str(r[k]) == str(choice[k]) if k == "speculate_from"
                                                      else float(r[k]) == float(choice[k]) for k in R.KEYS) else ""
                              for _, r in scored.iterrows()]
        parts.append(scored.assign(model=model).sort_values("score", na_position="last"))
    out = pd.concat(parts, ignore_index=True)
    return pd.DataFrame({
        "model": out["model"], **{k: out[k] for k in R.KEYS},
        "kv_fraction measured": [f"{100 * a:.1f}-{100 * b:.1f}%" for a, b in zip(out["kv_min"], out["kv_max"])],
        **{f"NLL gap at kv {100 * t:.0f}% (nats/token)": out[f"gap@{t:g}"] for t in S.TARGETS},
        "score (nats/token)": out["score"], "recall (mean)": out["recall"], "selected": out["selected"],
    })


def tie(rows: pd.DataFrame, model: str, ranked: pd.DataFrame) -> str:
    """Whether the selected setting and the next one can be told apart: the next one's score minus the selected
    one's, paired over the sweep's windows with its 95% interval; where the interval reaches 0 they tie and the
    rule's tie-break (the lower mean score on these windows) decided."""
    best, next_ = (S.window_score(rows, model, ranked.iloc[i]) for i in (0, 1))
    if best is None or next_ is None:
        return "the two cannot be paired window by window"
    effect = P.mean(next_ - best, kind="nll")
    if effect.n < 2 or effect.low <= 0:
        return (f"they tie: the next one's score minus the selected one's {effect.text()} reaches 0; the rule broke "
                "the tie by the lower mean over these windows")
    return f"the selected one is better: the next one's score minus its {effect.text()}"


def verdict(rows: pd.DataFrame) -> list[str]:
    pts = S.points(rows)
    if pts.empty or pts["gap"].isna().all():
        return needs("selection-sweep rows with per-window results, and full attention on the same windows")
    out = []
    for model, part in pts.groupby("model", sort=True):
        scored = S.scores(part)
        choice = S.pick(scored)
        family = R.family(rows[rows["model"] == model]).iloc[0]
        if choice is None:
            out.append(f"{model}: no setting reaches kv_fraction {', '.join(f'{100 * t:.0f}%' for t in S.TARGETS)}")
            continue
        ranked = scored[scored["eligible"]].sort_values("score")
        runner_up = ranked.iloc[1] if len(ranked) > 1 else None
        conf = R.RECOMMENDED.get(family, R.PAPER)
        agrees = all(str(conf[k]) == str(choice[k]) if k == "speculate_from" else float(conf[k]) == float(choice[k])
                     for k in R.KEYS)
        line = (f"{model}: selected {R.describe(choice)} (mean NLL gap to full at kv_fraction "
                f"{'/'.join(f'{100 * t:.0f}%' for t in S.TARGETS)}: {num(ranked.iloc[0]['score'])} nats/token"
                + (f"; next {R.describe(runner_up)}: {num(runner_up['score'])}; {tie(rows, model, ranked)}"
                   if runner_up is not None else "")
                + f"; {int((~scored['eligible']).sum())} of {len(scored)} settings cannot reach these sizes); "
                f"infinigen/selected.py for {family}: " + ("agrees" if agrees else
                                                          f"DISAGREES ({R.describe(conf)}): edit it"))
        out.append(line)
    return out


def audit(own: pd.DataFrame, every: pd.DataFrame) -> list[str]:
    """Whether any other ppl row of the report reads the sweep's held-out windows (same model and data)."""
    sweep = C.of_task(own, "ppl")
    others = C.of_task(every, "ppl")
    others = others[~others["_file"].isin(set(sweep["_file"]))]
    out = []
    for model, part in sweep.groupby("model", sort=True):
        spans = [S.token_span(row) for _, row in part.iterrows()]
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        data = set(C.column(part, "data.sha256").dropna())
        mine = others[(others["model"] == model) & C.column(others, "data.sha256").isin(data)]
        reach = [S.token_span(row) for _, row in mine.iterrows()]
        hits = [r for r in reach if r[0] < hi and r[1] > lo]
        furthest = max((r[1] for r in reach), default=0)
        out.append(f"{model}: the sweep reads WikiText-2 tokens {lo:,}-{hi - 1:,}; " + (
            f"no verdict row reads them ({len(reach)} other ppl rows on that text, the furthest up to token "
            f"{furthest - 1:,})" if not hits else f"{len(hits)} verdict row(s) read them too: the selection is not "
            "held out"))
    return out


SECTION = Section(
    "selection", "InfiniGen's setting, selected on held-out windows",
    "Every claim below reports InfiniGen first at the setting selected for its model family, which is what "
    "`method=infinigen` gives on that family (infinigen/selected.py). The setting is chosen by the rule in "
    "analysis/report/selection.py on WikiText-2 windows 64-67 (tokens 65,536 on), which no verdict scores: the "
    "least perplexity gap to full attention at kv_fraction 15% and 20%, each setting interpolated between its "
    "measured budgets.",
    (SWEEP, FULL, on_model(SWEEP, "gemma3-270m"), on_model(FULL, "gemma3-270m")),
    table, verdict, order=5, per_model=False, audit=audit,
    note="The sweep crosses skip_layers 1/2, alpha 4/8, partial_ratio 0.2/0.5 and speculate_from previous/"
         "block_input at budgets 0.05, 0.1 and 0.2 (48 runs per model, 4 windows of 1,024 tokens). A setting whose "
         "measured kv_fraction never reaches a target is not eligible: with alpha 4 InfiniGen fetches few tokens "
         "whatever the budget. The gap is paired: each run and full attention score the same windows.")
