"""C6: alpha and the partial weight ratio plateau (paper Fig. 17)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis.figures.fig17 import ablation_rows
from analysis.report import recommended as R
from analysis.report.ppl import ppl_table
from analysis.report.section import Contrast, Section, figure_of, needs, num, on_every_model


ALPHA = "python run.py -m +experiment=fig17_alpha_smoke method.alpha=1.0,3.0,5.0,7.0,9.0"
PARTIAL = "python run.py -m +experiment=fig17_partial_smoke method.partial_ratio=0.1,0.2,0.5,1.0"
# the same sweeps around the recommended setting: every other InfiniGen hyperparameter at its recommended value
RECOMMENDED_ALPHA = R.on_every_model_selected(ALPHA, skip=("alpha",))
RECOMMENDED_PARTIAL = R.on_every_model_selected(PARTIAL, skip=("partial_ratio",))


def around_recommended(part: pd.DataFrame, along: str) -> bool:
    """Whether a sweep of `along` holds every other InfiniGen hyperparameter at the recommended setting."""
    wanted = pd.DataFrame([R.RECOMMENDED.get(f, R.LLAMA) for f in R.family(part)], index=part.index)
    wanted[along] = R.setting(part)[along]
    return bool(R.matches(part, wanted).all())


def plateau_mask(part: pd.DataFrame, tolerance: float) -> pd.Series:
    """Which points of a sweep (sorted along it) start a run to its end within `tolerance` of its best ppl."""
    return (part["ppl"] <= part["ppl"].min() * (1 + tolerance)).astype(int)[::-1].cummin()[::-1] == 1


def sweeps(rows: pd.DataFrame, along: str) -> list[tuple[str, pd.DataFrame]]:
    """Each swept setting's curve and its rows sorted along the sweep, those around the recommended setting first."""
    data = ablation_rows(rows, "ppl", along)
    return [(curve, part.assign(ppl=C.metric(part, "ppl"), kv=C.metric(part, "kv_fraction")).sort_values(along))
            for curve, part in sorted(data.groupby("curve"), key=lambda g: (not around_recommended(g[1], along), g[0]))]


def c6_contrast(rows: pd.DataFrame, tolerance: float = 0.02) -> list[Contrast]:
    """Where the perplexity plateau of each sweep around the recommended setting starts (holds: one starts before
    the largest value swept)."""
    out = []
    for along in ("alpha", "partial_ratio"):
        part = next((p for _, p in sweeps(rows, along) if around_recommended(p, along)), None)
        within = plateau_mask(part, tolerance) if part is not None else None
        start = part[within].iloc[0][along] if within is not None and within.any() else None
        out.append(Contrast(f"the {along} from which perplexity stays within {num(100 * tolerance)}% of the sweep's "
                            "best (recommended setting otherwise)", start,
                            None if part is None or len(part) < 3 else start is not None and start < part[along].max()))
    return out


def plateau(rows: pd.DataFrame, along: str, tolerance: float = 0.02) -> list[str]:
    """Per swept setting (those around the recommended setting first): the smallest value of `along` from which
    every perplexity is within `tolerance` of the sweep's best, and the kv_fraction there and at the largest value."""
    out = []
    for curve, part in sweeps(rows, along):
        curve = (f"{curve}, the recommended setting otherwise" if around_recommended(part, along)
                 else f"{curve}; {R.describe(R.setting(part).iloc[0], skip=(along,))}")
        best = part["ppl"].min()
        within = plateau_mask(part, tolerance)
        last = part.iloc[-1]
        if not within.any():
            out.append(f"{along} ({curve}): no plateau: at {along} = {num(last[along])} perplexity is "
                       f"{num(100 * (last['ppl'] / best - 1))}% above the sweep's best ({num(best, 4)})")
            continue
        first = part[within].iloc[0]
        if len(part) > 1 and first[along] == last[along]:  # only the last point: still falling, no plateau
            before = part.iloc[-2]
            out.append(f"{along} ({curve}): no plateau within {num(100 * tolerance)}% yet: perplexity still falls "
                       f"from {num(before['ppl'], 4)} at {along} = {num(before[along])} to {num(last['ppl'], 4)} at "
                       f"{along} = {num(last[along])}, the largest swept ({num(part[along].min())}-"
                       f"{num(last[along])}); kv_fraction {num(100 * before['kv'])}% -> {num(100 * last['kv'])}%")
            continue
        out.append(f"{along} ({curve}): perplexity within {num(100 * tolerance)}% of the sweep's best "
                   f"({num(best, 4)}) from {along} = {num(first[along])} on (swept {num(part[along].min())}-"
                   f"{num(part[along].max())}); kv_fraction {num(100 * first['kv'])}% there, "
                   f"{num(100 * last['kv'])}% at {along} = {num(last[along])}")
    return out


def c6_verdict(rows: pd.DataFrame) -> list[str]:
    out = plateau(rows, "alpha") + plateau(rows, "partial_ratio")
    if not out:
        return needs("InfiniGen ppl rows over >= 3 values of alpha or partial_ratio")
    gen = rows[rows["method"] == "infinigen"]
    first = [f"{R.lead(gen)}: {line}" for line in out if "the recommended setting otherwise" in line]
    rest = [line for line in out if "the recommended setting otherwise" not in line]
    return (first or [R.missing(gen, *RECOMMENDED_ALPHA, *RECOMMENDED_PARTIAL)]) + rest


SECTION = Section(
    "c6_ablation", "C6. Alpha and the partial weight ratio plateau",
    "Accuracy saturates beyond a moderate alpha (while the fetched share keeps growing) and beyond a small "
    "partial weight ratio (paper Fig. 17).",
    (*on_every_model(ALPHA, PARTIAL), *RECOMMENDED_ALPHA, *RECOMMENDED_PARTIAL),
    ppl_table, c6_verdict, figure_of("fig17_ablation"),
    order=60, per_model=True, contrast=c6_contrast)
