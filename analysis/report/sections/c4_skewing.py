"""C4: skewing makes the partial weights speculate better (paper Fig. 13)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis.report import recommended as R
from analysis.report.ppl import AUTHORS, PPL, PPL16, ppl_and_accuracy, ppl_rows
from analysis.report.section import Contrast, Section, Status, figure_of, num, on_every_model

SKEW_PPL = f"{PPL} +point=infinigen_a99_b0.2_p0.1,infinigen_a99_b0.2_p0.1_noskew"
# the claim at the authors' semantics, paired over 16 windows: the artifact's InfiniGen with and without its skewing
# (the run with skewing is C1's budget 0.2, AUTHORS[0])
AUTHORS_SKEW = on_every_model(f"{PPL16} method=infinigen_reference method.skew=false")

RECOMMENDED = R.on_every_model_selected(f"{PPL} +point=infinigen_selected method.budget=0.2 method.skew=true,false")
METHODS = ("infinigen_reference", "infinigen")  # the authors' semantics first, the harness's variant beside


def skew_pairs(gen: pd.DataFrame) -> list[pd.DataFrame]:
    """Rows of one method, setting, budget and windows with skew on and off."""
    key = (gen["method"] + " " + R.setting(gen).astype(str).agg(" ".join, axis=1) + " "
           + gen["method_params.budget"].astype(str) + " " + C.metric(gen, "windows").astype(str))
    return [part for _, part in gen.groupby(key, sort=True) if part["method_params.skew"].map(bool).nunique() == 2]


def skew_effect(pair: pd.DataFrame) -> P.Effect | None:
    """Perplexity without skewing over with it, paired over the windows both scored (None: unpaired)."""
    on, off = (pair[pair["method_params.skew"].map(bool) == s].iloc[0] for s in (True, False))
    try:
        return P.perplexity_ratio(off["metrics.units"], on["metrics.units"])
    except P.Unpaired:
        return None


def pairs(rows: pd.DataFrame, method: str) -> list[tuple[pd.DataFrame, P.Effect]]:
    """`method`'s skew pairs with their paired effect, the most windows first (one window: no spread, said so)."""
    data = ppl_rows(rows)
    gen = data[data["method"] == method] if not data.empty else data
    found = [(p, skew_effect(p)) for p in (skew_pairs(gen) if not gen.empty else [])]
    return sorted([(p, e) for p, e in found if e is not None], key=lambda pe: -pe[1].n)


def pair_line(pair: pd.DataFrame, effect: P.Effect) -> str:
    on, off = (pair[pair["method_params.skew"].map(bool) == s].iloc[0] for s in (True, False))
    verdict = P.side(effect, 1.0, below=False)
    settle = f"; {P.settle_text(effect, 1.0, 'windows')}" if verdict == P.OPEN else ""
    return (f"budget {num(on['method_params.budget'])}, {int(effect.n)} window{'s' * (effect.n != 1)}: perplexity "
            "without skewing over with it "
            f"{effect.text()} ({num(off['ppl'], 4)} vs {num(on['ppl'], 4)}; speculation recall {num(on['recall'])} "
            f"vs {num(off['recall'])}, kv_fraction {num(100 * on['kv'])}% vs {num(100 * off['kv'])}%): skewing "
            f"{'helps' if verdict == P.HOLDS else 'hurts' if verdict == P.FAILS else 'is not told apart'}{settle}")


def c4_verdict(rows: pd.DataFrame) -> list[str]:
    """Skew on against off, paired per window: at the authors' semantics first, then each harness setting."""
    found = pairs(rows, "infinigen_reference")
    out = ([f"{R.authors(rows)}: {pair_line(p, e)}" for p, e in found]
           or [R.authors_missing(rows, *AUTHORS_SKEW)])
    gen = pairs(rows, "infinigen")
    recommended = [(p, e) for p, e in gen if R.is_recommended(p).all()]
    source = rows[rows["method"] == "infinigen"] if (rows["method"] == "infinigen").any() else rows
    out += ([f"{R.BEYOND} {R.lead(source)}, {pair_line(p, e)}" for p, e in recommended]
            or [f"{R.BEYOND} {R.missing(source, *RECOMMENDED)}"])
    out += [f"at {R.name(p.iloc[0])}, {pair_line(p, e)}" for p, e in gen if not R.is_recommended(p).all()]
    return out


def c4_status(rows: pd.DataFrame) -> list[Status]:
    """The claim at the authors' semantics, and the harness's variant beside where the store has its pairs."""
    out = []
    for method, who in zip(METHODS, (R.AUTHORS_CLAIM, R.BEYOND_CLAIM)):
        found = pairs(rows, method)
        claim = f"C4: skewing makes the partial weights speculate better ({who})"
        if not found:
            if method == METHODS[0]:
                out.append(Status(claim, "not measured", ""))
            continue
        pair, effect = found[0]
        verdict = P.side(effect, 1.0, below=False)
        settle = f"; {P.settle_text(effect, 1.0, 'windows')}" if verdict == P.OPEN else ""
        out.append(Status(claim, verdict, f"perplexity without skewing over with it at budget "
                                          f"{num(pair['method_params.budget'].iloc[0])}: x{effect.value:.3f} "
                                          f"({effect.low:.3f}-{effect.high:.3f}), {effect.n} windows{settle}"))
    return out


def c4_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """Perplexity without skewing over with it at the authors' semantics (holds: its interval above 1)."""
    found = pairs(rows, "infinigen_reference")
    effect = found[0][1] if found else None
    return [Contrast("perplexity without skewing over with it (the authors' semantics)",
                     None if effect is None else effect.value,
                     None if effect is None or P.side(effect, 1.0, below=False) == P.OPEN
                     else P.side(effect, 1.0, below=False) == P.HOLDS)]


SECTION = Section(
    "c4_skewing", "C4. Skewing makes the partial weights speculate better",
    "Skewing the query/key weights concentrates the attention scores in few columns, so the partial "
    "weights speculate better (paper Fig. 13).",
    (*on_every_model(AUTHORS[0]), *AUTHORS_SKEW, *on_every_model(SKEW_PPL, "python run.py -m "
     "+experiment=fig13_skew_smoke"), *RECOMMENDED),
    ppl_and_accuracy, c4_verdict, figure_of("fig13_skew"),
    note="Each pair is paired over the windows both rows scored (analysis/paired.py): the ratio of token-weighted "
         "perplexities without and with skewing, a bootstrap over windows. The claim holds where the whole 95% "
         "interval lies above 1, does not hold where it lies below, and cannot be shown otherwise (with the windows "
         "that would settle it). One-window rows are in the tables only.",
    order=40, per_model=True, contrast=c4_contrast, status=c4_status)
