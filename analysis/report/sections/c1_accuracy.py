"""C1: accuracy close to full attention above 10% of the KV cache (paper Fig. 11)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis.report import accuracy as A
from analysis.report import recommended as R
from analysis.report.ppl import AUTHORS, COMPARED, PAIRED, full_ppl, ppl_rows, ppl_table, versus
from analysis.report.section import Contrast, Section, Status, figure_of, needs, num, on_every_model, on_model

# InfiniGen at the recommended setting on the one-window perplexity preset (budgets 0.1 and 0.2), on each model
RECOMMENDED_PPL = R.on_every_model_selected(
    "python run.py -m +experiment=fig13_speculation_smoke +point=infinigen_selected")
# the five tasks at real sizes: the preset scores up to 500 docs per task (COPA, OpenBookQA and RTE whole; 33-45
# minutes per point on one CPU core, minutes on a GPU); at 100 docs per task, the size both models have rows at.
# Its InfiniGen points run at the model family's selected setting (conf/point/infinigen_b*.yaml)
FIG11_FULL = "python run.py -m +experiment=fig11_accuracy_smollm2"
FIG11 = f"{FIG11_FULL} task.limit=100"
GEMMA3_FIG11 = (on_model(FIG11, "gemma3-270m"),)
# the paired comparison: the two tasks on which full attention is above chance on both models (COPA whole, the first
# 500 docs of PIQA), full and InfiniGen at two budgets beside H2O and INT4 at the same relative KV size, each row
# with its per-doc results (~16 minutes a point on one core of this CPU)
PAIRED_FIG11 = on_every_model("python run.py -m +experiment=fig11_accuracy_smollm2 'task.tasks=[copa,piqa]' "
                              "+point=full,infinigen_b0.07,infinigen_b0.14,infinigen_b0.28,h2o_0.0625,quant_4")


def fig11_missing(rows: pd.DataFrame) -> str:
    """The lm-eval line of a model whose store lacks Fig. 11 rows at its recommended setting, naming its commands."""
    lm = C.of_task(rows, "lm_eval")
    gemma = not lm.empty and R.model_of(lm)[0] == "gemma3-270m"
    return f"lm-eval {R.missing(lm, *PAIRED_FIG11)}"


SMOKE = ("python run.py -m +experiment=fig11_accuracy_smoke +point=full,h2o_0.0625,quant_2,infinigen_a5_b0.2,"
         "infinigen_a7_b0.6")
ABOVE = 0.10  # the claim's threshold: InfiniGen fetching more than about 10% of the KV cache


def worst(part: pd.DataFrame) -> pd.Series | None:
    """A setting's row with the highest perplexity at kv_fraction >= ABOVE (None: no such row)."""
    above = part[part["kv"] >= ABOVE]
    return above.loc[above["ppl"].idxmax()] if not above.empty else None


def worst_above(part: pd.DataFrame, full: float) -> str:
    """A setting's largest perplexity increase over full's at kv_fraction >= ABOVE."""
    row = worst(part)
    if row is None:
        return f"no kv_fraction >= {num(100 * ABOVE)}% (largest {num(100 * part['kv'].max())}%)"
    return (f"WikiText-2 perplexity at measured kv_fraction >= {num(100 * ABOVE)}% "
            f"({int((part['kv'] >= ABOVE).sum())} budgets): at most {num(100 * (row['ppl'] / full - 1))}% above "
            f"full's {num(full, 4)} (worst: {num(row['ppl'], 4)} at kv_fraction {num(100 * row['kv'])}%)")


MIN_WINDOWS = 16  # the paired perplexity claim's windows (16 x 1,024 tokens)


def paired_points(rows: pd.DataFrame, method: str = "infinigen", pick=R.is_recommended) -> pd.DataFrame:
    """The rows of `method` (InfiniGen at the recommended setting; `pick` None: every row of it, as for
    infinigen_reference) over MIN_WINDOWS+ windows against full's on the same windows: kv, density, budget and the
    paired perplexity ratio (versus), by kv_fraction."""
    data = ppl_rows(rows)
    if data.empty:
        return data
    data = data[C.metric(data, "windows") >= MIN_WINDOWS]
    full, gen = data[data["method"] == "full"], data[data["method"] == method]
    gen = gen[pick(gen)] if pick is not None and not gen.empty else gen
    if full.empty or gen.empty:
        return data.iloc[:0]
    got = versus(gen, full)
    return got.join(gen[["kv", "density", "ppl", "method_params.budget"]]).dropna(subset=["ratio"]).sort_values("kv")


def standing(points: pd.DataFrame) -> tuple[str, str]:
    """(closeness over every kv_fraction >= ABOVE, the kv_fraction from which every larger point holds) of the
    paired points, sorted by kv_fraction."""
    above = points[points["kv"] >= ABOVE]
    if above.empty:
        return "not measured", f"no point at kv_fraction >= {num(100 * ABOVE)}%"
    verdicts = list(above["closeness"])
    if all(v == P.HOLDS for v in verdicts):
        return P.HOLDS, f"holds at every point from {num(100 * above['kv'].min())}%"
    last_miss = max(i for i, v in enumerate(verdicts) if v != P.HOLDS)
    where = (f"holds from kv_fraction {num(100 * above['kv'].iloc[last_miss + 1])}% on"
             if last_miss + 1 < len(verdicts) else "not at the largest kv_fraction measured either")
    return (P.FAILS if P.FAILS in verdicts else P.OPEN), where


def ratio_text(r) -> str:
    return f"x{r.ratio:.3f} ({r.lo:.3f}-{r.hi:.3f})"


def kept_text(r, density: bool = True) -> str:
    """A point's kept fraction: kv_fraction, with the artifact's density beside it (`density`) where the row
    records it."""
    value = getattr(r, "density", float("nan")) if density else float("nan")
    return f"kv {num(100 * r.kv)}%" + ("" if pd.isna(value) else f" (density {num(100 * value)}%)")


def authors_points(rows: pd.DataFrame) -> pd.DataFrame:
    """InfiniGen at the authors' semantics (method=infinigen_reference) against full, paired (paired_points)."""
    return paired_points(rows, "infinigen_reference", None)


def points_line(lead: str, points: pd.DataFrame, density: bool) -> str:
    """A paired perplexity line: each point's kept fraction and ratio to full's, then the margin's standing."""
    verdict, where = standing(points)
    windows = int(points["windows"].iloc[0])
    each = ", ".join(f"{kept_text(r, density)} {ratio_text(r)}" for r in points.itertuples())
    return (f"{lead}: WikiText-2, {windows} windows of 1,024 tokens, perplexity over full's with its 95% paired "
            f"interval: {each}; {P.margin_text('perplexity')} at kv_fraction >= {num(100 * ABOVE)}%: {verdict} "
            f"({where})")


def authors_ppl_line(rows: pd.DataFrame) -> str:
    """C1 at the authors' semantics: every infinigen_reference budget's perplexity over full's on the same 16
    windows, its kept fraction on both measures, against the margin at kv_fraction >= ABOVE."""
    points = authors_points(rows)
    if points.empty:
        return R.authors_missing(rows, *on_every_model(AUTHORS[0]))
    return points_line(R.authors(rows), points, density=True)


def paired_ppl_line(rows: pd.DataFrame) -> str:
    points = paired_points(rows)
    if points.empty:
        return R.missing(rows[rows["method"] == "infinigen"] if (rows["method"] == "infinigen").any() else rows,
                         PAIRED[0], PAIRED[1])
    return points_line(R.lead(rows[rows["method"] == "infinigen"]), points, density=False)


def recall_range(part: pd.DataFrame) -> str:
    return f"{num(part['recall'].min(), 2)}-{num(part['recall'].max(), 2)}"


def paper_finding(gen: pd.DataFrame, paper: pd.DataFrame, recommended: pd.DataFrame, full: float) -> str:
    """The paper's OPT defaults on this model against the recommended setting, with the speculation's recall."""
    row = worst(paper)
    row = row if row is not None else paper.loc[paper["ppl"].idxmax()]
    best = worst(recommended) if not recommended.empty else None
    more = best is None or row["ppl"] > best["ppl"]
    line = (f"finding (one window): {R.paper_name(gen)} lose {'more' if more else 'less'}: perplexity up to "
            f"{num(100 * (row['ppl'] / full - 1))}% above full's ({num(row['ppl'], 4)} at kv_fraction "
            f"{num(100 * row['kv'])}%)")
    if best is not None:
        line += f", against at most {num(100 * (best['ppl'] / full - 1))}% at the recommended setting"
    line += f"; the tokens they fetch carry {recall_range(paper)} of the attention mass (recall)"
    if not recommended.empty and recommended["recall"].notna().any():
        line += f", against {recall_range(recommended)} at the recommended setting"
    return line


def ppl_lines(rows: pd.DataFrame) -> list[str]:
    """The recommended setting over 16 windows (paired) first, then the one-window rows of every other setting,
    then the paper's OPT defaults as a finding."""
    return [paired_ppl_line(rows), *one_window_lines(rows)]


def one_window_lines(rows: pd.DataFrame) -> list[str]:
    """The smoke-size rows (one window; no interval): each setting's worst point at kv >= ABOVE, named so."""
    data = ppl_rows(rows)
    data = data[C.metric(data, "windows") < MIN_WINDOWS] if not data.empty else data
    full = full_ppl(data) if not data.empty else None
    gen = data[data["method"] == "infinigen"] if not data.empty else data
    if full is None or gen.empty:
        return needs("WikiText-2 ppl rows of full and InfiniGen")
    recommended, paper = gen[R.is_recommended(gen)], gen[R.is_paper(gen)]
    out = [f"one window (no interval), at the recommended setting: {worst_above(recommended, full)}"
           ] if not recommended.empty else []
    for _, part in gen.drop(recommended.index.union(paper.index)).groupby("curve"):
        out.append(f"one window (no interval), at {R.name(part.iloc[0])}: {worst_above(part, full)}")
    return out + ([paper_finding(gen, paper, recommended, full)] if not paper.empty else [])


def lm_eval_lines(rows: pd.DataFrame) -> tuple[list[str], list[tuple[str, P.Effect | None]]]:
    """Each InfiniGen setting and budget (most docs per task first) against full: paired over the docs of the tasks
    where full attention is above chance, then per task; and each recommended line's (docs, pooled effect or None)."""
    data = A.task_rows(rows)
    if data.empty or not (data["method"] == "full").any():
        return needs("lm-eval rows of full attention and InfiniGen"), []
    informative = A.above_chance(data)
    gen = data[(data["method"] == "infinigen") & (data["kv_fraction"] >= ABOVE)]
    recommended = gen[gen["recommended"].astype(bool)]
    out, verdicts = ([] if not recommended.empty else [fig11_missing(rows)]), []
    for (budget, limit), part in A.most_docs_first(recommended).groupby(["budget", "limit"], sort=False):
        line, effect = A.setting_line(part, f"lm-eval at the recommended setting, budget {num(budget)} "
                                            f"({A.docs(limit)})", informative.get((part["model"].iloc[0], limit), set()))
        out.append(line)
        verdicts.append((limit, effect))
    for (setting, budget, limit), part in A.most_docs_first(gen.drop(recommended.index)).groupby(
            ["setting", "budget", "limit"], sort=False):
        out.append(A.setting_line(part, f"lm-eval, InfiniGen at {setting}, budget {num(budget)} ({A.docs(limit)})",
                                  informative.get((part["model"].iloc[0], limit), set()))[0])
    lines = (out or needs(f"lm-eval rows of InfiniGen at kv_fraction >= {num(100 * ABOVE)}%")) + A.chance_lines(data)
    return lines, verdicts


def ppl_status(points: pd.DataFrame, claim: str, density: bool = False) -> Status:
    """The perplexity claim's standing from paired points (16 windows): the first point at kv_fraction >= ABOVE."""
    if points.empty:
        return Status(claim, "not measured", "")
    verdict, where = standing(points)
    low = points[points["kv"] >= ABOVE].iloc[0] if (points["kv"] >= ABOVE).any() else points.iloc[-1]
    return Status(claim, verdict, f"{ratio_text(low)} at {kept_text(low, density)}; {where}")


def c1_status(rows: pd.DataFrame) -> list[Status]:
    """Perplexity (16 windows, paired) at the authors' semantics, then the harness's variant's perplexity and
    lm-eval (most docs per task, paired), at kv_fraction >= ABOVE."""
    claim = f"C1: perplexity within {100 * P.MARGIN_PPL:.0f}% of full's above 10% KV"
    authors = ppl_status(authors_points(rows), f"{claim} ({R.AUTHORS_CLAIM})", density=True)
    ppl = ppl_status(paired_points(rows), f"{claim} ({R.BEYOND_CLAIM})")
    claim = f"C1: lm-eval within {100 * P.MARGIN_POINTS:.0f} points of full's above 10% KV ({R.BEYOND_CLAIM})"
    effects = lm_eval_lines(rows)[1]
    paired = [(limit, e) for limit, e in effects if e is not None]
    if not paired:
        return [authors, ppl, Status(claim, "not measured", "no paired lm-eval rows at the recommended setting")]
    top = [e for limit, e in paired if limit == paired[0][0]]
    verdicts = [e.closeness() for e in top]
    verdict = P.FAILS if P.FAILS in verdicts else P.HOLDS if all(v == P.HOLDS for v in verdicts) else P.OPEN
    worst = min(top, key=lambda e: e.low)
    return [authors, ppl, Status(claim, verdict, f"{len(top)} budget(s), n = {worst.n} docs; lowest: {100 * worst.value:+.1f} "
                                        f"points ({100 * worst.low:+.1f} to {100 * worst.high:+.1f})")]


def c1_verdict(rows: pd.DataFrame) -> list[str]:
    """The authors' semantics first; then, beyond the paper, the harness's variant (its first line says so)."""
    first, *rest = ppl_lines(rows)
    return [authors_ppl_line(rows), f"{R.BEYOND} {first}", *rest, *lm_eval_lines(rows)[0]]


def c1_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """InfiniGen's perplexity over full's at its smallest kv_fraction >= ABOVE (16 windows, paired): at the
    authors' semantics, then at the recommended setting."""
    out = []
    for points, who in ((authors_points(rows), "at the authors' semantics"), (paired_points(rows), "recommended")):
        above = points[points["kv"] >= ABOVE] if not points.empty else points
        out.append(Contrast(f"InfiniGen's ({who}) perplexity over full's at its smallest kv_fraction >= "
                            f"{num(100 * ABOVE)}% (16 windows)", None if above.empty else float(above["ratio"].iloc[0]),
                            None if above.empty else above["closeness"].iloc[0] == P.HOLDS))
    return out


def tables(rows: pd.DataFrame) -> list[pd.DataFrame]:
    return [ppl_table(rows), A.table(rows)]


SECTION = Section(
    "c1_accuracy", "C1. Accuracy close to full attention above 10% of the KV cache",
    "InfiniGen keeps accuracy within a small margin of full attention once it fetches more than about 10% of the KV "
    "cache (paper Fig. 11). Tested against a stated margin (perplexity within 5% of full's, lm-eval accuracy within "
    "2 points, each a 95% paired interval over the same windows or docs) first at the authors' semantics "
    "(`method=infinigen_reference`, what the InfiniGen artifact computes: [The authors' code](#the-authors-code)), "
    "its kept fraction as kv_fraction and as the artifact's density; then, beyond the paper, at the harness's "
    "variant: the InfiniGen setting selected for each model family on held-out windows (the section above; what "
    "`method=infinigen` gives), with the paper's OPT defaults (skip_layers 1, alpha 4, partial_ratio 0.2, "
    "speculate_from previous) and its Llama-2 (alpha, budget) pairs beside it.",
    (*on_every_model(PAIRED[0], AUTHORS[0], PAIRED[1]), *PAIRED_FIG11, FIG11_FULL, FIG11, *GEMMA3_FIG11,
     *on_every_model(SMOKE, *COMPARED[:3]), *RECOMMENDED_PPL),
    tables, c1_verdict, figure_of("fig11_accuracy"),
    note="Differences from full attention are paired: per window (perplexity: the ratio of token-weighted "
         "perplexities, a bootstrap over windows) or per doc (accuracy: a bootstrap over docs and McNemar's exact p), "
         "analysis/paired.py; rows stored before rows kept per-doc results are marked unpaired (their interval "
         "1.96 x sqrt(se^2 + se_full^2)). A closeness claim holds when the whole 95% interval is inside the margin, "
         "does not hold when it is wholly outside, and cannot be shown at this n otherwise. The lm-eval mean is over "
         "the docs of the tasks where full attention is above chance (below). The smoke rows score the first 5 COPA "
         "docs (one doc = 20 points): a check of the path. `python run.py -m +experiment=fig11_accuracy_smollm2` scores COPA, OpenBookQA and RTE whole "
         "and the first 500 docs of PIQA and WinoGrande (95% interval about +-4-9 points), 33-45 minutes per point "
         "on one core of this CPU (two points at a time); with `task.limit=100` it scores the first 100 docs of "
         "each (+-10 points), the size Gemma-3-270M runs too (InfiniGen at its recommended setting, "
         "docs/methods.md), some 5-15 minutes per point on its 262,144-token vocabulary. Lines over more docs per "
         "task come first.",
    order=10, per_model=True, contrast=c1_contrast, status=c1_status)
