"""C6: alpha and the partial weight ratio plateau (paper Fig. 17)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis.figures.fig17 import ablation_rows, measured_sweeps, modelled_sweeps
from analysis.report import recommended as R
from analysis import paired as P
from analysis.report.ppl import AUTHORS, PPL16, ppl_table
from analysis.report.section import ONE_WINDOW, Contrast, Section, Status, figure_of, num, on_every_model


ALPHA = "python run.py -m +experiment=fig17_alpha_smoke method.alpha=1.0,3.0,5.0,7.0,9.0"
PARTIAL = "python run.py -m +experiment=fig17_partial_smoke method.partial_ratio=0.1,0.2,0.5,1.0"
# the same sweeps around the recommended setting: every other InfiniGen hyperparameter at its recommended value
RECOMMENDED_ALPHA = R.on_every_model_selected(ALPHA, skip=("alpha",))
RECOMMENDED_PARTIAL = R.on_every_model_selected(PARTIAL, skip=("partial_ratio",))


# Fig. 17 (b), decode latency vs alpha: measured through this CPU's offloading runtime (384 + 16 tokens, batch 1),
# and MODELLED at the paper's shape (batch 8, 1,920 + 128 tokens) on its GPU profile and runtime (the FlexGen-based
# artifact's, task.schedule=paper), from each alpha's measured per-layer fetch fractions in the store
LATENCY = "python run.py -m +experiment=fig17_alpha_latency_smoke"
MODELLED = (f"{LATENCY} task.timing=modelled hardware=a6000_pcie3 task.schedule=paper task.batch_size=8 "
            "task.prompt_len=1920 task.gen_len=128")
LATENCY_COMMANDS = (LATENCY, f"{LATENCY} model=gemma3-270m", MODELLED,
                    f"{MODELLED} model=gemma3-270m task.fractions_model=gemma3-270m")


# the sweeps at the authors' semantics, paired over 16 windows: the artifact's InfiniGen at budget 0.2 (alpha 5 and
# partial_ratio 0.2 are C1's run, AUTHORS[0]) with alpha, then the partial weight ratio, swept
AUTHORS_ALPHA = on_every_model(f"{PPL16} method=infinigen_reference method.alpha=1.0,3.0,7.0,9.0")
AUTHORS_PARTIAL = on_every_model(f"{PPL16} method=infinigen_reference method.partial_ratio=0.1,0.5,1.0")


def around_recommended(part: pd.DataFrame, along: str) -> bool:
    """Whether a sweep of `along` holds every other InfiniGen hyperparameter at the recommended setting."""
    wanted = pd.DataFrame([R.RECOMMENDED.get(f, R.LLAMA) for f in R.family(part)], index=part.index)
    wanted[along] = R.setting(part)[along]
    return bool(R.matches(part, wanted).all())


def sweeps(rows: pd.DataFrame, along: str) -> list[tuple[str, pd.DataFrame]]:
    """Each sweep of `along`, sorted along it: the authors' semantics first, then those around the recommended
    setting, then the rest."""
    data = ablation_rows(rows, "ppl", along)
    if data.empty:
        return []
    data = data[data.groupby("group")[along].transform("nunique") >= 3]
    key = lambda g: (g[1]["method"].iloc[0] != "infinigen_reference", not around_recommended(g[1], along), g[0])  # noqa: E731
    return [(curve, part.assign(ppl=C.metric(part, "ppl"), kv=C.metric(part, "kv_fraction")).sort_values(along))
            for curve, part in sorted(data.groupby("curve"), key=key)]


def against_best(part: pd.DataFrame) -> list[P.Effect | None]:
    """Each point's perplexity over the sweep's best, paired over windows (None at the best itself)."""
    best = part.loc[part["ppl"].idxmin()]
    out = []
    for i, row in part.iterrows():
        try:
            out.append(None if i == best.name else P.perplexity_ratio(row["metrics.units"], best["metrics.units"]))
        except P.Unpaired:
            out.append(None)
    return out


def plateau(part: pd.DataFrame, along: str) -> tuple[str, str]:
    """(verdict, words) of "perplexity saturates beyond a moderate value": the plateau is the run of points up to
    the largest value swept that the sweep's best cannot be told apart from (each one's 95% paired interval of its
    perplexity over the best's reaches 1). Holds when it starts before the largest value; does not hold when only
    the largest value is on it (perplexity still falls) or none is (it rises again past the best)."""
    effects = against_best(part)
    if any(e is not None and e.n < 2 for e in effects):
        return P.OPEN, (f"{ONE_WINDOW}; perplexity at each value swept: "
                        + ", ".join(f"{num(r[along])}: {num(r['ppl'], 4)}" for _, r in part.iterrows()))
    tied = [e is None or e.low <= 1 for e in effects]
    start = len(tied)
    while start > 0 and tied[start - 1]:
        start -= 1
    values = list(part[along])
    each = ", ".join(f"{num(v)}: " + ("best" if e is None else f"x{e.value:.3f} ({e.low:.3f}-{e.high:.3f})")
                     for v, e in zip(values, effects))
    n = next((e.n for e in effects if e is not None), 0)
    kv = list(part["kv"])
    text = (f"perplexity over the sweep's best ({num(part['ppl'].min(), 4)}), {n} windows, 95% paired interval: "
            f"{each}; kv_fraction {num(100 * kv[0])}% at {along} {num(values[0])} to {num(100 * kv[-1])}% at "
            f"{num(values[-1])}")
    if start == len(tied):
        return P.FAILS, f"no plateau: perplexity rises again past the best; {text}"
    if start == len(tied) - 1:
        return P.FAILS, f"no plateau: perplexity still falls at the largest {along} swept; {text}"
    return P.HOLDS, f"plateau from {along} = {num(values[start])} on (not told apart from the best); {text}"


def lines(rows: pd.DataFrame, along: str) -> list[tuple[str, str, str]]:
    """(who, verdict, words) per sweep of `along`."""
    out = []
    for curve, part in sweeps(rows, along):
        who = (R.AUTHORS_CLAIM if part["method"].iloc[0] == "infinigen_reference" else
               "the recommended setting otherwise" if around_recommended(part, along) else
               f"{curve}; {R.describe(R.setting(part).iloc[0], skip=(along,))}")
        out.append((who, *plateau(part, along)))
    return out


def c6_status(rows: pd.DataFrame) -> list[Status]:
    """Each swept hyperparameter's first sweep (the authors' semantics where stored)."""
    out = []
    for along in ("alpha", "partial_ratio"):
        found = lines(rows, along)
        claim = f"C6: perplexity plateaus in {along}"
        out.append(Status(f"{claim} ({found[0][0]})", found[0][1], found[0][2]) if found else
                   Status(f"{claim} ({R.AUTHORS_CLAIM})", "not measured", ""))
    return out


def c6_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """Where the plateau of each sweep starts (the first sweep of each hyperparameter)."""
    out = []
    for along in ("alpha", "partial_ratio"):
        found = sweeps(rows, along)
        verdict = plateau(found[0][1], along) if found else None
        out.append(Contrast(f"whether perplexity plateaus in {along} (first sweep)", None if verdict is None else
                            float(verdict[0] == P.HOLDS), None if verdict is None else verdict[0] == P.HOLDS))
    return out


def latency_line(rows: pd.DataFrame) -> list[str]:
    """Fig. 17 (b) in words: InfiniGen's decode ms/token at the smallest and largest alpha swept, measured on this
    CPU and modelled, each curve apart."""
    out = []
    for what, data, y in (("measured on this CPU", measured_sweeps(rows), "measured_ms"),
                          ("MODELLED", modelled_sweeps(rows), "modelled_ms")):
        for curve, part in ([] if data.empty else data.groupby("curve", sort=True)):
            part = part.sort_values("alpha")
            ends = part.iloc[[0, -1]]
            out.append(f"Fig. 17 (b), decode latency vs alpha, {what} ({curve.split(': ', 1)[1]}): "
                       + " to ".join(f"{num(v)} ms/token at alpha {num(a)}" for a, v in zip(ends["alpha"], ends[y]))
                       + f" ({part['alpha'].nunique()} values)")
    return out


def c6_verdict(rows: pd.DataFrame) -> list[str]:
    """The sweeps at the authors' semantics first, then the harness's variant: the sweeps around the recommended
    setting (or the commands that add them), then the others."""
    found = {along: lines(rows, along) for along in ("alpha", "partial_ratio")}
    gen = rows[rows["method"] == "infinigen"] if (rows["method"] == "infinigen").any() else rows
    out = [f"{R.authors(rows)}: {along}: {verdict}: {words}" for along, each in found.items()
           for who, verdict, words in each if who == R.AUTHORS_CLAIM]
    out = out or [R.authors_missing(rows, *AUTHORS_ALPHA, *AUTHORS_PARTIAL)]
    recommended = [f"{along}: {verdict}: {words}" for along, each in found.items()
                   for who, verdict, words in each if who == "the recommended setting otherwise"]
    out += ([f"{R.BEYOND} {R.lead(gen)}: {line}" for line in recommended]
            or [f"{R.BEYOND} {R.missing(gen, *RECOMMENDED_ALPHA, *RECOMMENDED_PARTIAL)}"])
    return out + [f"{along} ({who}): {verdict}: {words}" for along, each in found.items()
                  for who, verdict, words in each if who not in (R.AUTHORS_CLAIM, "the recommended setting otherwise")
                  ] + latency_line(rows)


SECTION = Section(
    "c6_ablation", "C6. Alpha and the partial weight ratio plateau",
    "Accuracy saturates beyond a moderate alpha (while the fetched share keeps growing) and beyond a small "
    "partial weight ratio (paper Fig. 17).",
    (*on_every_model(AUTHORS[0]), *AUTHORS_ALPHA, *AUTHORS_PARTIAL, *on_every_model(ALPHA, PARTIAL),
     *RECOMMENDED_ALPHA, *RECOMMENDED_PARTIAL, *LATENCY_COMMANDS),
    ppl_table, c6_verdict, figure_of("fig17_ablation"),
    note="A sweep's points are each paired with its best over the same windows (analysis/paired.py). The plateau is "
         "the run of points up to the largest value swept that the best cannot be told apart from (the 95% interval "
         "of the point's perplexity over the best's reaches 1): an interval, not a fixed percentage. One-window "
         "sweeps are in the table and the figure only.",
    order=60, per_model=True, contrast=c6_contrast, status=c6_status)
