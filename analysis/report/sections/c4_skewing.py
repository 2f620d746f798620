"""C4: skewing makes the partial weights speculate better (paper Fig. 13)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis.figures.fig13_skew import fig13_skew
from analysis.report import recommended as R
from analysis.report.ppl import PPL, full_ppl, ppl_and_accuracy, ppl_rows
from analysis.report.section import Contrast, Section, figure_of, needs, num, on_every_model

SKEW_PPL = f"{PPL} +point=infinigen_a99_b0.2_p0.1,infinigen_a99_b0.2_p0.1_noskew"


RECOMMENDED = R.on_every_model_selected(f"{PPL} +point=infinigen_selected method.budget=0.2 method.skew=true,false")


def twin_line(pair: pd.DataFrame, full: float | None) -> str:
    on, off = (pair[pair["method_params.skew"].map(bool) == s].iloc[0] for s in (True, False))
    gap = f" (full {num(full, 4)})" if full is not None else ""
    return (f"WikiText-2 perplexity with skewing {num(on['ppl'], 4)}, without {num(off['ppl'], 4)}{gap}; "
            f"speculation recall {num(on['recall'])} vs {num(off['recall'])} at kv_fraction "
            f"{num(100 * on['kv'])}% vs {num(100 * off['kv'])}%")


def skew_pairs(gen: pd.DataFrame) -> list[pd.DataFrame]:
    """InfiniGen ppl rows of one setting and budget with skew on and off."""
    key = R.setting(gen).astype(str).agg(" ".join, axis=1) + " " + gen["method_params.budget"].astype(str)
    return [part for _, part in gen.groupby(key, sort=True) if part["method_params.skew"].map(bool).nunique() == 2]


def c4_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """Perplexity without skewing minus with it at the recommended setting (holds: > 0)."""
    data = ppl_rows(rows)
    gen = data[data["method"] == "infinigen"] if not data.empty else data
    pair = [p for p in (skew_pairs(gen) if not gen.empty else []) if R.is_recommended(p).all()]
    if not pair:
        return [Contrast("perplexity without skewing minus with it (recommended setting)", None)]
    on, off = (pair[0][pair[0]["method_params.skew"].map(bool) == s]["ppl"].iloc[0] for s in (True, False))
    return [Contrast(f"perplexity without skewing minus with it (recommended setting, budget "
                     f"{num(pair[0]['method_params.budget'].iloc[0])})", off - on, off > on)]


def c4_verdict(rows: pd.DataFrame) -> list[str]:
    """Skew on against off per InfiniGen setting and budget, the recommended setting first."""
    out = []
    data = ppl_rows(rows)
    gen = data[data["method"] == "infinigen"] if not data.empty else data
    if gen.empty or gen["method_params.skew"].map(bool).nunique() < 2:
        out += needs("InfiniGen ppl rows with skew on and off")
    else:
        full = full_ppl(data)
        pairs = skew_pairs(gen)
        recommended = [p for p in pairs if R.is_recommended(p).all()]
        out += ([f"{R.lead(gen)}, budget {num(p['method_params.budget'].iloc[0])}: {twin_line(p, full)}"
                 for p in recommended] or [R.missing(gen, *RECOMMENDED)])
        out += [f"at {R.name(p.iloc[0])}, budget {num(p['method_params.budget'].iloc[0])}: {twin_line(p, full)}"
                for p in pairs if not R.is_recommended(p).all()]
    _, bars = fig13_skew(rows)
    bars = bars[bars["metric"] == "acc_pct"].rename(columns={"value": "acc_pct"}) if not bars.empty else bars
    if bars.empty:
        return out + needs("InfiniGen lm-eval rows with skew on and off")
    mean = bars.groupby("bar")["acc_pct"].mean()
    out.append("lm-eval accuracy, mean over " + f"{bars['task'].nunique()} tasks: "
               + ", ".join(f"{b} {num(mean[b])}%" for b in ("full", "infinigen (skew)", "infinigen (no skew)")
                           if b in mean)
               + f" (n = {int(C.metric(C.of_task(rows, 'lm_eval'), 'n').max())} docs per task: smoke size)")
    return out


SECTION = Section(
    "c4_skewing", "C4. Skewing makes the partial weights speculate better",
    "Skewing the query/key weights concentrates the attention scores in few columns, so the partial "
    "weights speculate better (paper Fig. 13).",
    (*on_every_model(SKEW_PPL, "python run.py -m +experiment=fig13_skew_smoke"), *RECOMMENDED),
    ppl_and_accuracy, c4_verdict, figure_of("fig13_skew"),
    order=40, per_model=True, contrast=c4_contrast)
