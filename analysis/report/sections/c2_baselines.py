"""C2: better than H2O and quantisation at small KV budgets (paper Fig. 11)."""

from __future__ import annotations

import math

import pandas as pd

from analysis.report import accuracy as A
from analysis.report import recommended as R
from analysis.report.ppl import COMPARED, full_ppl, matched_gaps, ppl_rows, ppl_table, ppl_vs_kv
from analysis.report.section import Contrast, Section, needs, num, on_every_model, signed
from analysis.report.sections.c1_accuracy import FIG11, FIG11_FULL, GEMMA3_FIG11, RECOMMENDED_PPL, SMOKE, fig11_missing


def ppl_setting_lines(data: pd.DataFrame, gen: pd.DataFrame) -> list[str]:
    """InfiniGen's rows `gen` (one setting) against H2O at the same measured relative KV size, and against each
    quant row (at the same size where InfiniGen's range holds it, else its nearest InfiniGen point)."""
    data = data[(data["method"] != "infinigen") | data.index.isin(gen.index)]
    full, out = full_ppl(data), []
    for x, gap, ref_gap, row, _ in matched_gaps(data, "infinigen", "h2o"):
        out.append(f"at relative KV size {num(100 * x)}% (budget {num(row['method_params.budget'])}, measured): "
                   f"perplexity gap to full InfiniGen {signed(gap)}, H2O {signed(ref_gap)} (interpolated): H2O's gap / "
                   f"InfiniGen's = {num(ref_gap / gap)}x")
    quant = matched_gaps(data, "quant", "infinigen")
    for x, gap, ref_gap, row, _ in quant:
        out.append(f"at relative KV size {num(100 * x)}% ({num(row['method_params.bits'])}-bit quant): gap to full "
                   f"quant {signed(gap)}, InfiniGen {signed(ref_gap)} (interpolated): quant's gap / InfiniGen's = "
                   f"{num(gap / ref_gap)}x")
    for _, row in data[data["method"] == "quant"].iterrows():  # outside InfiniGen's range: its nearest point
        if not any(m[3].name == row.name for m in quant):
            near = gen.loc[(gen["rel_kv"] - row["rel_kv"]).abs().idxmin()]
            out.append(f"{num(row['method_params.bits'])}-bit quant at relative KV size {num(100 * row['rel_kv'])}%: "
                       f"gap to full {signed(row['ppl'] - full)}; nearest InfiniGen point (budget "
                       f"{num(near['method_params.budget'])}, {num(100 * near['rel_kv'])}%): "
                       f"{signed(near['ppl'] - full)}")
    return out or [f"no point inside H2O's or quant's measured KV-size range (InfiniGen at "
                   f"{num(100 * gen['rel_kv'].min())}-{num(100 * gen['rel_kv'].max())}%; widen the budgets)"]


def ppl_lines(rows: pd.DataFrame) -> list[str]:
    """The recommended setting first, each other setting next, the paper's OPT defaults last, as a finding."""
    data = ppl_rows(rows)
    if data.empty or full_ppl(data) is None or not (data["method"] == "infinigen").any():
        return needs("WikiText-2 ppl rows of full, InfiniGen, H2O and quant")
    gen = data[data["method"] == "infinigen"]
    recommended, paper = gen[R.is_recommended(gen)], gen[R.is_paper(gen)]
    if recommended.empty:
        out = [R.missing(gen, RECOMMENDED_PPL)]
    else:
        first, *rest = ppl_setting_lines(data, recommended)
        out = [f"{R.lead(gen)}: {first}", *(f"at the recommended setting, {line}" for line in rest)]
    for _, part in gen.drop(recommended.index.union(paper.index)).groupby("curve"):
        out += [f"at {R.name(part.iloc[0])}: {line}" for line in ppl_setting_lines(data, part)]
    if not paper.empty:
        out += [paper_finding(data, gen, paper, recommended)]
        out += [f"at the paper's OPT defaults, {line}" for line in ppl_setting_lines(data, paper)]
    return out


def paper_finding(data: pd.DataFrame, gen: pd.DataFrame, paper: pd.DataFrame, recommended: pd.DataFrame) -> str:
    """Where the paper's OPT defaults land on this model, beside H2O's smallest setting and the recommended one."""
    full = full_ppl(data)
    gaps = paper["ppl"] - full
    line = (f"finding: {R.paper_name(gen)}: perplexity gap to full {signed(gaps.min())} to {signed(gaps.max())} at "
            f"relative KV size {num(100 * paper['rel_kv'].min())}-{num(100 * paper['rel_kv'].max())}%")
    near = [("H2O's smallest setting", data[data["method"] == "h2o"]), ("the recommended setting", recommended)]
    beside = [f"{what}: {signed(row['ppl'] - full)} at {num(100 * row['rel_kv'])}%"
              for what, part in near if not part.empty for row in [part.loc[part["rel_kv"].idxmin()]]]
    line += f" ({'; '.join(beside)})" if beside else ""
    if paper["recall"].notna().any() and not recommended.empty and recommended["recall"].notna().any():
        less = paper["recall"].mean() < recommended["recall"].mean()
        line += f"; their speculation recalls {'less' if less else 'more'} of the attention than the recommended (C1)"
    return line


def versus(infinigen: pd.DataFrame, baseline: pd.DataFrame) -> tuple[float, float, int]:
    """InfiniGen's accuracy minus the baseline's averaged over the tasks both scored (same docs), with its 95%
    half-width (each task's two stderrs as independent) and the number of tasks."""
    both = infinigen.merge(baseline, on=["task", "shots", "protocol", "limit"], suffixes=("", "_b"))
    if both.empty:
        return math.nan, math.nan, 0
    k = len(both)
    diff = (both["acc"] - both["acc_b"]).mean()
    return diff, A.Z95 * math.sqrt((both["se"] ** 2 + both["se_b"] ** 2).sum()) / k, k


def lm_eval_lines(rows: pd.DataFrame) -> list[str]:
    """Each H2O and quant setting against the InfiniGen setting nearest in relative KV size (the recommended
    setting where it has rows), mean accuracy over the tasks, with the difference's 95% interval."""
    data = A.task_rows(rows)
    gen = data[data["method"] == "infinigen"]
    if gen.empty or not data["method"].isin(["h2o", "quant"]).any():
        return needs("lm-eval rows of InfiniGen, H2O and quant")
    recommended = gen[gen["recommended"].astype(bool)]
    out = [] if not recommended.empty else [fig11_missing(rows)]
    pool = recommended if not recommended.empty else gen
    for (method, params, limit), base in A.most_docs_first(data[data["method"].isin(["h2o", "quant"])]).groupby(
            ["method", "params", "limit"], sort=False):
        near = pool[pool["limit"] == limit]
        if near.empty:
            continue
        kv = base["rel_kv"].mean()
        budget = near.loc[(near["rel_kv"] - kv).abs().idxmin(), "budget"]
        pick = near[near["budget"] == budget]
        diff, ci, k = versus(pick, base)
        out.append(f"lm-eval ({A.docs(limit)}, n = {A.docs_range(base['n'])} per task): {method} "
                   f"({params}) at relative KV size {num(100 * kv)}% vs InfiniGen at {pick['setting'].iloc[0]}, budget "
                   f"{num(budget)} ({num(100 * pick['rel_kv'].mean())}%): accuracy InfiniGen minus {method} "
                   f"{A.points(diff)} ± {100 * ci:.1f} points over {k} task(s), {A.significance(diff, ci)}")
    return out


def c2_verdict(rows: pd.DataFrame) -> list[str]:
    return ppl_lines(rows) + lm_eval_lines(rows)


def c2_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """At the recommended setting: H2O's perplexity gap to full over InfiniGen's at InfiniGen's smallest KV size
    inside H2O's range, and quant's over InfiniGen's at the smallest quant size inside InfiniGen's (holds: > 1)."""
    data = ppl_rows(rows)
    gen = data[data["method"] == "infinigen"] if not data.empty else data
    full = full_ppl(data) if not data.empty else None
    data = data[(data["method"] != "infinigen") | data.index.isin(gen[R.is_recommended(gen)].index)] \
        if full is not None and not gen.empty else data.iloc[:0]
    h2o = matched_gaps(data, "infinigen", "h2o") if not data.empty else []
    quant = matched_gaps(data, "quant", "infinigen") if not data.empty else []
    return [Contrast("H2O's perplexity gap to full / InfiniGen's (recommended) at the smallest matched KV size",
                     h2o[0][2] / h2o[0][1] if h2o and h2o[0][1] else None, h2o[0][2] > h2o[0][1] if h2o else None),
            Contrast("quant's perplexity gap to full / InfiniGen's (recommended) at the smallest matched KV size",
                     quant[0][1] / quant[0][2] if quant and quant[0][2] else None,
                     quant[0][1] > quant[0][2] if quant else None)]


SECTION = Section(
    "c2_baselines", "C2. Better than H2O and quantisation at small KV budgets",
    "At the same (small) relative KV cache size InfiniGen loses less than H2O's eviction and low-bit KV "
    "quantisation (paper Fig. 11). Compared here on WikiText-2 perplexity at the measured relative KV size and on "
    "lm-eval accuracy with its 95% interval, on each model, InfiniGen at the setting docs/methods.md recommends for "
    "it (SmolLM2: skip_layers 2, alpha 8, partial_ratio 0.5, speculate_from block_input; Gemma-3: the same with "
    "previous) first, then at the same with the other speculation input, then at the paper's OPT defaults "
    "(conf/method/infinigen.yaml: skip_layers 1, alpha 4, partial_ratio 0.2).",
    (FIG11_FULL, FIG11, *GEMMA3_FIG11, *on_every_model(*COMPARED, RECOMMENDED_PPL, SMOKE)),
    lambda rows: [ppl_table(rows), A.table(rows)],
    c2_verdict,
    lambda rows: ppl_vs_kv(rows, "C2: perplexity vs relative KV size"),
    note="An lm-eval difference is called outside its 95% interval when it exceeds 1.96 x sqrt(sum of both "
         "stderrs squared) / tasks: the two methods' accuracies treated as independent, though they score the same "
         "docs (the paired interval is narrower). Gemma-3-270M runs the perplexity comparison, the lm-eval "
         "smoke and Fig. 11's points at 100 docs per task (C1's note).",
    order=20, per_model=True, contrast=c2_contrast)
