"""C3: perplexity along the sequence (paper Fig. 12)."""

from __future__ import annotations

import pandas as pd

from analysis.figures.fig12 import fig12_ppl_position
from analysis.report import recommended as R
from analysis.report.section import Contrast, Section, figure_of, needs, num, on_every_model


def nll_table(rows: pd.DataFrame) -> pd.DataFrame:
    _, numbers = fig12_ppl_position(rows)
    if numbers.empty:
        return numbers
    wide = numbers.pivot_table(index="position", columns="curve", values="nll").reset_index()
    wide.columns.name = None
    return wide.rename(columns={"position": "chunk start"})


RECOMMENDED = "python run.py -m +experiment=fig12_ppl_position_smoke +point=speculate_block_input method.budget=0.2"
GEMMA3 = R.on_gemma3(RECOMMENDED)


def curve_gaps(rows: pd.DataFrame) -> tuple[dict, dict, list[float]] | None:
    """Per non-full curve its NLL gap to full by chunk, the InfiniGen curves' settings in words, and H2O's mean
    gaps (None: no full curve)."""
    _, numbers = fig12_ppl_position(rows)
    if numbers.empty or not (numbers["method"] == "full").any():
        return None
    full = numbers[numbers["method"] == "full"].set_index("position")["nll"]
    gaps = {c: part.set_index("position")["nll"] - full
            for c, part in numbers[numbers["method"] != "full"].groupby("curve")}
    by_hash = rows.drop_duplicates("config_hash").set_index("config_hash")
    curves = numbers.drop_duplicates("curve").set_index("curve")
    named = {c: R.name(by_hash.loc[curves.loc[c, "config_hash"]]) for c in gaps
             if curves.loc[c, "method"] == "infinigen"}
    return gaps, named, [gaps[c].mean() for c in gaps if curves.loc[c, "method"] == "h2o"]


def c3_verdict(rows: pd.DataFrame) -> list[str]:
    """InfiniGen's mean NLL gap to full against H2O's, at the recommended setting first (each other setting next,
    named), then each curve's gap over the two halves of the window."""
    found = curve_gaps(rows)
    if found is None:
        return needs("ppl rows with per-chunk NLL (seq_len >= 2048) of full and the compared methods")
    gaps, named, h2o = found
    source = rows[rows["method"] == "infinigen"] if named else rows

    def versus(curve: str) -> str:
        gap = gaps[curve].mean()
        line = f"mean NLL gap to full over the window {num(gap)} nats/token"
        return line + (f", H2O's {num(h2o[0])}: InfiniGen's / H2O's = {num(gap / h2o[0])}x" if h2o else "")

    out = [f"{R.lead(source)}: {versus(c)}" for c in named if named[c] == "the recommended setting"]
    out = out or [R.missing(source, RECOMMENDED)]
    out += [f"at {named[c]} ({c}): {versus(c)}" for c in named if named[c] != "the recommended setting"]
    for curve, gap in gaps.items():
        first, second = gap.iloc[:len(gap) // 2].mean(), gap.iloc[len(gap) // 2:].mean()
        out.append(f"{curve}: NLL gap to full {num(first)} nats/token over the first half of the window, "
                   f"{num(second)} over the second ({'grows' if second > first else 'does not grow'} along it)")
    return out


def c3_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """The recommended setting's mean NLL gap to full over H2O's (holds: < 1)."""
    gaps, named, h2o = curve_gaps(rows) or ({}, {}, [])
    gap = [gaps[c].mean() for c in named if named[c] == "the recommended setting"]
    ratio = gap[0] / h2o[0] if gap and h2o and h2o[0] else None
    return [Contrast("InfiniGen's (recommended) mean NLL gap to full along the window / H2O's", ratio,
                     None if ratio is None else gap[0] < h2o[0])]


SECTION = Section(
    "c3_position", "C3. Perplexity along the sequence",
    "InfiniGen's loss stays close to full attention's along the whole sequence, while H2O's drifts (paper "
    "Fig. 12).", (*on_every_model("python run.py -m +experiment=fig12_ppl_position_smoke", RECOMMENDED), GEMMA3),
    nll_table, c3_verdict, figure_of("fig12_ppl_position"),
    order=30, per_model=True, contrast=c3_contrast)
