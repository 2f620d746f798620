"""C1: accuracy close to full attention above 10% of the KV cache (paper Fig. 11)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis.report import accuracy as A
from analysis.report import recommended as R
from analysis.report.ppl import AUTHORS, COMPARED, PAIRED, ppl_rows, ppl_table, versus
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
# C1 and C2 on lm-eval at the harness's variant, paired with the authors' full rows below (every doc, zero-shot):
# PIQA and COPA, 1,938 docs (ARC-Easy and SciQ would add half a run's time again; Gemma 3's H2O run scored ARC-Easy
# too, and each pair pools the tasks both rows have). Zero-shot docs are 30-100 tokens, where each method's floor
# keeps a third of the KV or more, so the three points meet at a relative KV size of about half: InfiniGen at the
# budget that gives it on each model (0.28 on SmolLM2, 0.35 on Gemma 3; measured on the first 15 docs of each task),
# H2O 0.125 + 0.125 and INT8 (INT4's 25% is below every InfiniGen budget at this length). About 13 / 30 minutes a
# point on one core for SmolLM2 / Gemma 3
LM_HARNESS_BASE = "python run.py -m task=lm_eval 'task.tasks=[piqa,copa]' task.num_fewshot=0"
PAIRED_LM = (f"{LM_HARNESS_BASE} method=infinigen method.budget=0.28 model=smollm2-135m",
             f"{LM_HARNESS_BASE} +point=h2o_0.125,quant_8 model=smollm2-135m",
             f"{LM_HARNESS_BASE} method=infinigen method.budget=0.35 model=gemma3-270m",
             f"{LM_HARNESS_BASE.replace('piqa,copa', 'piqa,arc_easy,copa')} +point=h2o_0.125 model=gemma3-270m",
             f"{LM_HARNESS_BASE} +point=quant_8 model=gemma3-270m")

# C1 and C2 on lm-eval at the authors' semantics, at a size that settles them: five tasks whole, zero-shot (PIQA
# 1,838, ARC-Easy 570, ARC-Challenge 299, SciQ 1,000, COPA 100: 3,807 docs; about 6 / 12 minutes per run on one core
# for SmolLM2-135M full / the reference methods, about 3x that on Gemma-3-270M's 262,144-token vocabulary).
# InfiniGen at the artifact's budget 0.2 and H2O at its heavy 0.1 + recent 0.1: the artifact's own pairing
LM_AUTHORS_BASE = ("python run.py -m model=smollm2-135m task=lm_eval 'task.tasks=[piqa,arc_easy,arc_challenge,sciq,"
                   "copa]' task.num_fewshot=0")
LM_FULL, LM_INFINIGEN, LM_H2O = (f"{LM_AUTHORS_BASE} method={m}" for m in ("full", "infinigen_reference",
                                                                           "h2o_reference"))
# SmolLM2's H2O rows came from two runs, the four short tasks and then SciQ (its 4,000 requests over support passages
# are half a run's time): C2 pools, per task, the rows both methods have
LM_H2O_SPLIT = (LM_H2O.replace("arc_challenge,sciq,copa", "arc_challenge,copa"),
                LM_H2O.replace("piqa,arc_easy,arc_challenge,sciq,copa", "sciq"))
LM_AUTHORS = (*on_every_model(LM_FULL, LM_INFINIGEN, LM_H2O), *LM_H2O_SPLIT)


def authors_lm_effect(rows: pd.DataFrame) -> tuple[P.Effect | None, str]:
    """C1 on lm-eval at the authors' semantics: InfiniGen's accuracy minus full's over every doc of the zero-shot
    tasks where full attention is above chance, and the line that says so (or which runs it lacks)."""
    effect, gen, tasks = A.versus("infinigen_reference", "full", rows)
    if effect is None:
        return None, (R.authors_missing(rows, *on_every_model(LM_FULL, LM_INFINIGEN)) + " (lm-eval)"
                      if gen.empty or not tasks else f"{R.authors(rows)}: lm-eval: unpaired rows (see the table)")
    verdict = effect.closeness()
    settle = f"; {P.settle_text(effect, P.margin('accuracy'), 'docs')}" if verdict == P.OPEN else ""
    return effect, (f"{R.authors(rows)}: lm-eval, every doc, zero-shot, budget {num(gen['budget'].iloc[0])} "
                    f"(kv_fraction {num(100 * gen['kv_fraction'].mean())}%): InfiniGen's accuracy minus full's over "
                    f"the {effect.n:,} docs of {', '.join(sorted(tasks))} (full above chance; each doc alike): "
                    f"{effect.text()}; {P.margin_text('accuracy')}: {verdict}{settle}")


def fig11_missing(rows: pd.DataFrame) -> str:
    """The lm-eval line of a model whose store lacks Fig. 11 rows at its recommended setting, naming its commands."""
    lm = C.of_task(rows, "lm_eval")
    return f"lm-eval {R.missing(lm, *PAIRED_LM)}"


SMOKE = ("python run.py -m +experiment=fig11_accuracy_smoke +point=full,h2o_0.0625,quant_2,infinigen_a5_b0.2,"
         "infinigen_a7_b0.6")
ABOVE = 0.10  # the claim's threshold: InfiniGen fetching more than about 10% of the KV cache


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
    """The perplexity claim's standing from paired points (16 windows): the first point at kv_fraction >= ABOVE;
    where it cannot be shown, the windows that would settle the first open point."""
    if points.empty:
        return Status(claim, "not measured", "")
    verdict, where = standing(points)
    low = points[points["kv"] >= ABOVE].iloc[0] if (points["kv"] >= ABOVE).any() else points.iloc[-1]
    number = f"{ratio_text(low)} at {kept_text(low, density)}; {where}"
    if verdict == P.OPEN:
        point = points[(points["kv"] >= ABOVE) & (points["closeness"] == P.OPEN)].iloc[0]
        effect = P.Effect(point["ratio"], point["lo"], point["hi"], int(point["windows"]), "perplexity")
        number += f"; at kv {num(100 * point['kv'])}%: {P.settle_text(effect, P.margin('perplexity'), 'windows')}"
    return Status(claim, verdict, number)


def c1_status(rows: pd.DataFrame) -> list[Status]:
    """Perplexity (16 windows, paired) at the authors' semantics, then the harness's variant's perplexity and
    lm-eval (most docs per task, paired), at kv_fraction >= ABOVE."""
    claim = f"C1: perplexity within {100 * P.MARGIN_PPL:.0f}% of full's above 10% KV"
    authors = ppl_status(authors_points(rows), f"{claim} ({R.AUTHORS_CLAIM})", density=True)
    ppl = ppl_status(paired_points(rows), f"{claim} ({R.BEYOND_CLAIM})")
    lm_claim = f"C1: lm-eval within {100 * P.MARGIN_POINTS:.0f} points of full's above 10% KV"
    effect = authors_lm_effect(rows)[0]
    authors_lm = (Status(f"{lm_claim} ({R.AUTHORS_CLAIM})", "not measured", "") if effect is None else
                  Status(f"{lm_claim} ({R.AUTHORS_CLAIM})", effect.closeness(), points_text(effect)))
    claim = f"{lm_claim} ({R.BEYOND_CLAIM})"
    effects = lm_eval_lines(rows)[1]
    paired = [(limit, e) for limit, e in effects if e is not None]
    if not paired:
        return [authors, authors_lm, ppl, Status(claim, "not measured", "no paired lm-eval rows at the recommended setting")]
    top = [e for limit, e in paired if limit == paired[0][0]]
    verdicts = [e.closeness() for e in top]
    verdict = P.FAILS if P.FAILS in verdicts else P.HOLDS if all(v == P.HOLDS for v in verdicts) else P.OPEN
    worst = min(top, key=lambda e: e.low)
    return [authors, authors_lm, ppl, Status(claim, verdict, f"{len(top)} budget(s); lowest: {points_text(worst)}")]


def points_text(effect: P.Effect, threshold: float = P.margin("accuracy")) -> str:
    """An accuracy difference for the summary: points with the interval and n; the docs that would settle it where
    it cannot be shown."""
    text = (f"{100 * effect.value:+.1f} points ({100 * effect.low:+.1f} to {100 * effect.high:+.1f}), n = "
            f"{effect.n:,} docs")
    open_ = P.side(effect, threshold, below=False) == P.OPEN
    return text + (f"; {P.settle_text(effect, threshold, 'docs')}" if open_ else "")


def c1_verdict(rows: pd.DataFrame) -> list[str]:
    """The authors' semantics first; then, beyond the paper, the harness's variant (its first line says so)."""
    return [authors_ppl_line(rows), authors_lm_effect(rows)[1], f"{R.BEYOND} {paired_ppl_line(rows)}",
            *lm_eval_lines(rows)[0]]


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
    (*on_every_model(PAIRED[0], AUTHORS[0], PAIRED[1]), *LM_AUTHORS, *PAIRED_LM, FIG11_FULL, FIG11, *GEMMA3_FIG11,
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
         "docs/methods.md), some 5-15 minutes per point on its 262,144-token vocabulary. The harness's variant's "
         "lm-eval verdict scores every doc of PIQA and COPA zero-shot, paired with the authors' full rows, at a "
         "relative KV size of about half (C2's note says why). Lines over more docs per "
         "task come first.",
    order=10, per_model=True, contrast=c1_contrast, status=c1_status)
