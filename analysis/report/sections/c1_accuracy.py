"""C1: accuracy close to full attention above 10% of the KV cache (paper Fig. 11)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis.report import accuracy as A
from analysis.report import recommended as R
from analysis.report.ppl import COMPARED, full_ppl, ppl_rows, ppl_table
from analysis.report.section import Contrast, Section, figure_of, needs, num, on_every_model, on_model

# InfiniGen at the recommended setting on the perplexity window (the speculation preset's block_input rows)
RECOMMENDED_PPL = "python run.py -m +experiment=fig13_speculation_smoke +point=speculate_block_input"
# the five tasks at real sizes: the preset scores up to 500 docs per task (COPA, OpenBookQA and RTE whole; 33-45
# minutes per point on one CPU core, minutes on a GPU); at 100 docs per task, the size both models have rows at
FIG11_FULL = "python run.py -m +experiment=fig11_accuracy_smollm2"
FIG11 = f"{FIG11_FULL} task.limit=100"
# Gemma-3-270M at the same 100 docs per task, Fig. 11's points with InfiniGen at its recommended setting (a command
# per point: a swept +point would take method.budget before the point selects its method)
GEMMA3_FIG11 = tuple(on_model(f"{FIG11} +point={point}", "gemma3-270m") for point in (
    "full", *(f"speculate_previous method.budget={b}" for b in (0.035, 0.07, 0.14, 0.28)),
    *(f"h2o_{b}" for b in (0.25, 0.125, 0.0625, 0.03125)), "quant_4", "quant_2"))


def fig11_missing(rows: pd.DataFrame) -> str:
    """The lm-eval line of a model whose store lacks Fig. 11 rows at its recommended setting, naming its commands."""
    lm = C.of_task(rows, "lm_eval")
    gemma = not lm.empty and R.model_of(lm)[0] == "gemma3-270m"
    return f"lm-eval {R.missing(lm, *(GEMMA3_FIG11[1:5] if gemma else (FIG11_FULL, FIG11)))}"


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


def recall_range(part: pd.DataFrame) -> str:
    return f"{num(part['recall'].min(), 2)}-{num(part['recall'].max(), 2)}"


def paper_finding(gen: pd.DataFrame, paper: pd.DataFrame, recommended: pd.DataFrame, full: float) -> str:
    """The paper's OPT defaults on this model against the recommended setting, with the speculation's recall."""
    row = worst(paper)
    row = row if row is not None else paper.loc[paper["ppl"].idxmax()]
    best = worst(recommended) if not recommended.empty else None
    more = best is None or row["ppl"] > best["ppl"]
    line = (f"finding: {R.paper_name(gen)} lose {'more' if more else 'less'}: perplexity up to "
            f"{num(100 * (row['ppl'] / full - 1))}% above full's ({num(row['ppl'], 4)} at kv_fraction "
            f"{num(100 * row['kv'])}%)")
    if best is not None:
        line += f", against at most {num(100 * (best['ppl'] / full - 1))}% at the recommended setting"
    line += f"; the tokens they fetch carry {recall_range(paper)} of the attention mass (recall)"
    if not recommended.empty and recommended["recall"].notna().any():
        line += f", against {recall_range(recommended)} at the recommended setting"
    return line


def ppl_lines(rows: pd.DataFrame) -> list[str]:
    """The recommended setting first, then every other setting, then the paper's OPT defaults as a finding."""
    data = ppl_rows(rows)
    full = full_ppl(data) if not data.empty else None
    gen = data[data["method"] == "infinigen"] if not data.empty else data
    if full is None or gen.empty:
        return needs("WikiText-2 ppl rows of full and InfiniGen")
    recommended, paper = gen[R.is_recommended(gen)], gen[R.is_paper(gen)]
    out = [f"{R.lead(gen)}: {worst_above(recommended, full)}" if not recommended.empty
           else R.missing(gen, RECOMMENDED_PPL)]
    for _, part in gen.drop(recommended.index.union(paper.index)).groupby("curve"):
        out.append(f"at {R.name(part.iloc[0])}: {worst_above(part, full)}")
    return out + ([paper_finding(gen, paper, recommended, full)] if not paper.empty else [])


def lm_eval_lines(rows: pd.DataFrame) -> list[str]:
    data = A.task_rows(rows)
    if data.empty or not (data["method"] == "full").any():
        return needs("lm-eval rows of full attention and InfiniGen")
    gen = data[(data["method"] == "infinigen") & (data["kv_fraction"] >= ABOVE)]
    recommended = gen[gen["recommended"].astype(bool)]
    out = [] if not recommended.empty else [fig11_missing(rows)]
    for (budget, limit), part in A.most_docs_first(recommended).groupby(["budget", "limit"], sort=False):
        out.append(A.setting_line(part, f"lm-eval at the recommended setting, budget {num(budget)} ({A.docs(limit)})"))
    for (setting, budget, limit), part in A.most_docs_first(gen.drop(recommended.index)).groupby(
            ["setting", "budget", "limit"], sort=False):
        out.append(A.setting_line(part, f"lm-eval, InfiniGen at {setting}, budget {num(budget)} ({A.docs(limit)})"))
    return (out or needs(f"lm-eval rows of InfiniGen at kv_fraction >= {num(100 * ABOVE)}%")) + A.chance_lines(data)


def c1_verdict(rows: pd.DataFrame) -> list[str]:
    return ppl_lines(rows) + lm_eval_lines(rows)


def c1_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """The recommended setting's largest perplexity increase over full at kv_fraction >= ABOVE, in %."""
    data = ppl_rows(rows)
    full = full_ppl(data) if not data.empty else None
    gen = data[data["method"] == "infinigen"] if full is not None else data.iloc[:0]
    row = worst(gen[R.is_recommended(gen)]) if not gen.empty else None
    return [Contrast(f"InfiniGen's largest WikiText-2 perplexity increase over full at kv_fraction >= "
                     f"{num(100 * ABOVE)}%, recommended setting (%)",
                     None if row is None else 100 * (row["ppl"] / full - 1))]


def tables(rows: pd.DataFrame) -> list[pd.DataFrame]:
    return [ppl_table(rows), A.table(rows)]


SECTION = Section(
    "c1_accuracy", "C1. Accuracy close to full attention above 10% of the KV cache",
    "InfiniGen keeps accuracy within a small margin of full attention once it fetches more than about 10% of the KV "
    "cache (paper Fig. 11). Tested at the InfiniGen setting docs/methods.md recommends for each model (SmolLM2: "
    "skip_layers 2, alpha 8, partial_ratio 0.5, speculate_from block_input; Gemma-3: the same with speculate_from "
    "previous), with the paper's OPT defaults "
    "(skip_layers 1, alpha 4, partial_ratio 0.2, speculate_from previous) and the paper's Llama-2 (alpha, budget) "
    "pairs beside it.",
    (FIG11_FULL, FIG11, *GEMMA3_FIG11, *on_every_model(SMOKE, *COMPARED[:3], RECOMMENDED_PPL)),
    tables, c1_verdict, figure_of("fig11_accuracy"),
    note="lm-eval accuracies carry their 95% interval (1.96 x lm-eval's acc_stderr over the task's n docs); a "
         "difference from full's is called outside its interval when it exceeds 1.96 x sqrt(se^2 + se_full^2), "
         "which treats the two as independent (both score the same docs, so the paired interval is narrower: "
         "outside holds for it too). The smoke rows score the first 5 COPA docs (one doc = 20 points): a check "
         "of the path. `python run.py -m +experiment=fig11_accuracy_smollm2` scores COPA, OpenBookQA and RTE whole "
         "and the first 500 docs of PIQA and WinoGrande (95% interval about +-4-9 points), 33-45 minutes per point "
         "on one core of this CPU (two points at a time); with `task.limit=100` it scores the first 100 docs of "
         "each (+-10 points), the size Gemma-3-270M runs too (InfiniGen at its recommended setting, "
         "docs/methods.md), some 5-15 minutes per point on its 262,144-token vocabulary. Lines over more docs per "
         "task come first.",
    order=10, per_model=True, contrast=c1_contrast)
