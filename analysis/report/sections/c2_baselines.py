"""C2: better than H2O and quantisation at small KV budgets (paper Fig. 11)."""

from __future__ import annotations


import pandas as pd

from analysis import columns as C
from analysis import like as L
from analysis import paired as P
from analysis.report import accuracy as A
from analysis.report import recommended as R
from analysis.report.ppl import (AUTHORS, COMPARED, PAIRED, at_size, full_ppl, matched_gaps, ppl_rows, ppl_table,
                                 ppl_vs_kv)
from analysis.report.section import Contrast, Section, Status, needs, num, on_every_model
from analysis.report.sections.c1_accuracy import (FIG11, FIG11_FULL, GEMMA3_FIG11, LM_AUTHORS, LM_H2O, LM_INFINIGEN,
                                                  MIN_WINDOWS, PAIRED_LM, RECOMMENDED_PPL, SMOKE, fig11_missing,
                                                  points_text)

BASELINES = ("h2o", "quant")


AUTHORS_BASELINES = ("h2o_reference",)  # H2O at the authors' semantics (the InfiniGen artifact's H2O baseline)
AUTHORS_H2O = "`method=infinigen_reference` vs `method=h2o_reference`"


def baseline_name(row: pd.Series) -> str:
    if row["method"] == "quant":
        return f"INT{num(row['method_params.bits'])}"
    return f"H2O ({num(row['method_params.heavy'])} + {num(row['method_params.recent'])})"


def paired_ppl(rows: pd.DataFrame, method: str = "infinigen", pick=R.is_recommended,
               baselines: tuple[str, ...] = BASELINES, density: bool = False
               ) -> list[tuple[str, str, P.Effect | None, str]]:
    """InfiniGen (recommended; `method` and `pick` None: every row of that method, as for infinigen_reference)
    against each baseline row on the same 16 windows at the same relative KV size: per baseline row, (baseline,
    size (`density`: with the artifact's density beside it where the row records it), InfiniGen's perplexity over the
    baseline's with its paired interval, how InfiniGen's side was had: measured / interpolated, or why it was
    refused)."""
    data = ppl_rows(rows)
    if data.empty:
        return []
    data = data[C.metric(data, "windows") >= MIN_WINDOWS]
    gen = data[data["method"] == method]
    gen = gen[pick(gen)] if pick is not None and not gen.empty else gen
    out = []
    for _, base in data[data["method"].isin(baselines)].sort_values(["method", "rel_kv"]).iterrows():
        size = f"{num(100 * base['rel_kv'])}%" + ("" if not density or pd.isna(base["density"]) else
                                                  f" (density {num(100 * base['density'])}%)")
        same = gen[[not L.differences(row, base, L.ACCURACY) for _, row in gen.iterrows()]] if not gen.empty else gen
        got = at_size(same, base["rel_kv"]) if not same.empty else None
        if got is None:
            out.append((baseline_name(base), size, None, "InfiniGen has no rows on these windows around this size"))
            continue
        try:
            out.append((baseline_name(base), size, P.perplexity_ratio(got[0], base["metrics.units"]), got[1]))
        except P.Unpaired as err:
            out.append((baseline_name(base), size, None, str(err)))
    return out


def better(effect: P.Effect) -> str:
    """InfiniGen's standing against a baseline from their ratio (< 1: InfiniGen lower perplexity)."""
    return P.HOLDS if effect.high < 1 else P.FAILS if effect.low > 1 else P.OPEN


def pairs_text(pairs: list[tuple[str, str, P.Effect | None, str]]) -> str:
    return "; ".join(f"vs {name} at {size}: " + (f"x{e.value:.3f} ({e.low:.3f}-{e.high:.3f}, InfiniGen {how}): "
                                                  f"{'better' if better(e) == P.HOLDS else 'worse' if better(e) == P.FAILS else 'not told apart'}"
                                                  if e is not None else f"refused ({how})")
                     for name, size, e, how in pairs)


def authors_pairs(rows: pd.DataFrame) -> list[tuple[str, str, P.Effect | None, str]]:
    """InfiniGen against H2O, both at the authors' semantics (infinigen_reference, h2o_reference), paired."""
    return paired_ppl(rows, "infinigen_reference", None, AUTHORS_BASELINES, density=True)


def authors_line(rows: pd.DataFrame) -> str:
    """C2 at the authors' semantics: InfiniGen's perplexity over H2O's at each H2O row's size, 16 windows."""
    pairs = authors_pairs(rows)
    if not pairs:
        return R.authors_missing(rows, *on_every_model(*AUTHORS), what=AUTHORS_H2O)
    return (f"{R.authors(rows, AUTHORS_H2O)}: WikiText-2, {MIN_WINDOWS} windows, InfiniGen's perplexity over H2O's at "
            f"the same kv_fraction (95% paired interval): {pairs_text(pairs)}")


def paired_ppl_lines(rows: pd.DataFrame) -> list[str]:
    pairs = paired_ppl(rows)
    if not pairs:
        return [R.missing(rows[rows["method"] == "infinigen"] if (rows["method"] == "infinigen").any() else rows,
                          *PAIRED[1:])]
    return [f"{R.lead(rows[rows['method'] == 'infinigen'])}: WikiText-2, {MIN_WINDOWS} windows, InfiniGen's perplexity "
            f"over the baseline's at the same relative KV size (95% paired interval): {pairs_text(pairs)}"]


def pairs_status(pairs: list[tuple[str, str, P.Effect | None, str]], claim: str) -> Status:
    """A perplexity claim's standing from its measured pairs: holds when InfiniGen is better in every one."""
    pairs = [(n, sz, e, how) for n, sz, e, how in pairs if e is not None]
    if not pairs:
        return Status(claim, "not measured", "")
    verdicts = [better(e) for _, _, e, _ in pairs]
    verdict = P.FAILS if P.FAILS in verdicts else P.HOLDS if all(v == P.HOLDS for v in verdicts) else P.OPEN
    settle = next((f"; at {sz}: {P.settle_text(e, 1.0, 'windows')}" for _, sz, e, _ in pairs if better(e) == P.OPEN),
                  "") if verdict == P.OPEN else ""
    return Status(claim, verdict, "; ".join(f"{n} at {sz}: x{e.value:.2f} ({e.low:.2f}-{e.high:.2f})"
                                            for n, sz, e, _ in pairs) + settle)


def authors_lm(rows: pd.DataFrame) -> tuple[P.Effect | None, pd.DataFrame, set[str]]:
    """C2 on lm-eval at the authors' semantics: InfiniGen's accuracy minus H2O's over every doc of the zero-shot
    tasks where full attention is above chance (C1's runs, LM_AUTHORS)."""
    return A.versus("infinigen_reference", "h2o_reference", rows)


def authors_lm_line(rows: pd.DataFrame) -> str:
    effect, gen, tasks = authors_lm(rows)
    if effect is None:
        return R.authors_missing(rows, *on_every_model(LM_INFINIGEN, LM_H2O), what=AUTHORS_H2O) + " (lm-eval)"
    h2o = A.zero_shot_every_doc(A.task_rows(rows))
    h2o = h2o[h2o["method"] == "h2o_reference"]
    verdict = P.side(effect, 0.0, below=False)
    settle = f"; {P.settle_text(effect, 0.0, 'docs')}" if verdict == P.OPEN else ""
    knobs = rows.loc[rows["method"] == "h2o_reference"].iloc[0]
    return (f"{R.authors(rows, AUTHORS_H2O)}: lm-eval, every doc, zero-shot, the artifact's pairing (InfiniGen budget "
            f"{num(gen['budget'].iloc[0])} at kv_fraction {num(100 * gen['kv_fraction'].mean())}%, H2O heavy "
            f"{num(knobs['method_params.heavy'])} + recent {num(knobs['method_params.recent'])} at "
            f"{num(100 * h2o['kv_fraction'].mean())}%): InfiniGen's accuracy minus H2O's over the {effect.n:,} docs of "
            f"{', '.join(sorted(tasks))} (full above chance; the tasks both ran): {effect.text()}; above H2O's: "
            f"{verdict}{settle}")


def c2_status(rows: pd.DataFrame) -> list[Status]:
    """At the authors' semantics (vs H2O) first, then the harness's variant (vs H2O, quantisation, lm-eval)."""
    out = [pairs_status(authors_pairs(rows), f"C2: perplexity below H2O's at the same KV size ({R.AUTHORS_CLAIM})")]
    effect = authors_lm(rows)[0]
    claim = f"C2: lm-eval accuracy above H2O's at the same KV budget ({R.AUTHORS_CLAIM})"
    out.append(Status(claim, "not measured", "") if effect is None else
               Status(claim, P.side(effect, 0.0, below=False), points_text(effect, 0.0)))
    pairs = paired_ppl(rows)
    for method, label in (("H2O", "H2O"), ("INT", "KV quantisation")):
        out.append(pairs_status([p for p in pairs if p[0].startswith(method)],
                                f"C2: perplexity below {label}'s at the same KV size ({R.BEYOND_CLAIM})"))
    effects = lm_eval_effects(rows)
    claim = f"C2: lm-eval accuracy above H2O's and quantisation's at the same KV size ({R.BEYOND_CLAIM})"
    paired = [(name, e) for name, e, _ in effects if e is not None]
    if not paired:
        out.append(Status(claim, "not measured", "no paired lm-eval rows at matched KV size"))
    else:
        verdicts = [P.side(e, 0.0, below=False) for _, e in paired]
        verdict = P.FAILS if P.FAILS in verdicts else P.HOLDS if all(v == P.HOLDS for v in verdicts) else P.OPEN
        deciding = sorted(paired, key=lambda pair: P.side(pair[1], 0.0, below=False) != verdict)  # the verdict's first
        out.append(Status(claim, verdict, "; ".join(f"vs {n}: {points_text(e, 0.0)}" for n, e in deciding)))
    return out


def lm_eval_effects(rows: pd.DataFrame) -> list[tuple[str, P.Effect | None, str]]:
    """Each H2O and quant setting (most docs per task first) against InfiniGen at the recommended setting at the
    same relative KV size (like.KV_TOLERANCE), over the docs of the tasks where full attention is above chance:
    (the baseline named, InfiniGen's accuracy minus the baseline's paired, the line)."""
    data = A.task_rows(rows)
    gen = data[data["method"] == "infinigen"]
    if gen.empty or not data["method"].isin(BASELINES).any():
        return []
    recommended = gen[gen["recommended"].astype(bool)]
    pool = recommended if not recommended.empty else gen
    informative = A.above_chance(data)
    out = []
    for (method, params, limit), base in A.most_docs_first(data[data["method"].isin(BASELINES)]).groupby(
            ["method", "params", "limit"], sort=False):
        near = pool[pool["limit"] == limit]
        if near.empty:
            continue
        base = A.per_doc_first(base).drop_duplicates(["task"])  # one row per task, a paired one where stored
        kv = base["rel_kv"].mean()
        budget = near.loc[(near["rel_kv"] - kv).abs().idxmin(), "budget"]
        pick = A.per_doc_first(near[near["budget"] == budget]).drop_duplicates(["task"])
        name = f"{method} ({params}) at relative KV size {num(100 * kv)}%"
        head = (f"lm-eval ({A.docs(limit)}): {name} vs InfiniGen at {pick['setting'].iloc[0]}, budget "
                f"{num(budget)} ({num(100 * pick['rel_kv'].mean())}%)")
        if not L.same_size(pick["rel_kv"].mean(), kv):
            out.append((name, None, f"{head}: refused: relative KV size {num(100 * pick['rel_kv'].mean())}% vs "
                                    f"{num(100 * kv)}% (more than {100 * L.KV_TOLERANCE:.0f}% apart); an "
                                    f"InfiniGen budget at that size in `{FIG11_FULL}` adds the row that matches"))
            continue
        both = pick.merge(base[["task", "units"]], on="task", suffixes=("", "_base"))
        tasks = informative.get((base["model"].iloc[0], limit), set())
        effect = A.pooled(both.assign(full_units=both["units_base"]), tasks)
        if effect is None:
            out.append((name, None, f"{head}: unpaired (rows without per-doc results, or full attention is above "
                                    f"chance on none of the tasks): see the table"))
            continue
        out.append((name, effect, f"{head}: InfiniGen minus {method} over the {effect.n} docs of "
                                  f"{', '.join(sorted(tasks & set(both['task'])))} (full above chance; the tasks "
                                  f"both ran): {effect.text()}"))
    return out


def lm_eval_lines(rows: pd.DataFrame) -> list[str]:
    effects = lm_eval_effects(rows)
    data = A.task_rows(rows)
    if not effects:
        return needs("lm-eval rows of InfiniGen, H2O and quant")
    recommended = data[(data["method"] == "infinigen") & data["recommended"].astype(bool)]
    return ([] if not recommended.empty else [fig11_missing(rows)]) + [line for _, _, line in effects]


def c2_verdict(rows: pd.DataFrame) -> list[str]:
    first, *rest = paired_ppl_lines(rows)
    return [authors_line(rows), authors_lm_line(rows), f"{R.BEYOND} {first}", *rest, *lm_eval_lines(rows)]


def c2_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """At the recommended setting: H2O's perplexity gap to full over InfiniGen's at InfiniGen's smallest KV size
    inside H2O's range, and quant's over InfiniGen's at the smallest quant size inside InfiniGen's (holds: > 1)."""
    data = ppl_rows(rows)
    many = data[C.metric(data, "windows") >= MIN_WINDOWS] if not data.empty else data
    if {"full", "infinigen"} <= set(many["method"]):
        data = many  # the paired comparison's windows where the store has them, not a single window
    gen = data[data["method"] == "infinigen"] if not data.empty else data
    full = full_ppl(data) if not data.empty else None
    data = data[(data["method"] != "infinigen") | data.index.isin(gen[R.is_recommended(gen)].index)] \
        if full is not None and not gen.empty else data.iloc[:0]
    h2o = matched_gaps(data, "infinigen", "h2o") if not data.empty else []
    quant = matched_gaps(data, "quant", "infinigen") if not data.empty else []
    authors = [e for _, _, e, _ in authors_pairs(rows) if e is not None]
    return [Contrast(f"InfiniGen's perplexity over H2O's at the authors' semantics at the smallest matched KV size "
                     f"({MIN_WINDOWS} windows)", authors[0].value if authors else None,
                     better(authors[0]) == P.HOLDS if authors else None),
            Contrast(f"H2O's perplexity gap to full / InfiniGen's (recommended) at the smallest matched KV size "
                     f"({MIN_WINDOWS} windows where stored, else one)",
                     h2o[0][2] / h2o[0][1] if h2o and h2o[0][1] else None, h2o[0][2] > h2o[0][1] if h2o else None),
            Contrast(f"quant's perplexity gap to full / InfiniGen's (recommended) at the smallest matched KV size "
                     f"({MIN_WINDOWS} windows where stored, else one)",
                     quant[0][1] / quant[0][2] if quant and quant[0][2] else None,
                     quant[0][1] > quant[0][2] if quant else None)]


SECTION = Section(
    "c2_baselines", "C2. Better than H2O and quantisation at small KV budgets",
    "At the same (small) relative KV cache size InfiniGen loses less than H2O's eviction and low-bit KV "
    "quantisation (paper Fig. 11). Compared on each model first at the authors' semantics: InfiniGen and H2O as the "
    "InfiniGen artifact computes them (`method=infinigen_reference`, `method=h2o_reference`: [The authors' "
    "code](#the-authors-code)), WikiText-2 perplexity paired over 16 windows at the same measured kv_fraction, the "
    "artifact's density beside it; then, beyond the paper, at the harness's variant: on perplexity at the measured "
    "relative KV size and on lm-eval accuracy with its 95% interval, InfiniGen at the setting selected for its "
    "family on held-out windows (what `method=infinigen` gives; the selection section) first, then at the other "
    "settings the store holds, each named.",
    (*on_every_model(*PAIRED, *AUTHORS), *LM_AUTHORS, *PAIRED_LM, FIG11_FULL, FIG11, *GEMMA3_FIG11, *on_every_model(*COMPARED, SMOKE), *RECOMMENDED_PPL),
    lambda rows: [ppl_table(rows), A.table(rows)],
    c2_verdict,
    lambda rows: ppl_vs_kv(rows, "C2: perplexity vs relative KV size"),
    note="Both sides score the same windows or docs, so each comparison is paired (analysis/paired.py). InfiniGen "
         "is compared with a baseline at the same relative KV size (entries kept x bytes per entry): its own row "
         "within 10% of it, else each window's NLL interpolated between its two budgets around it (said "
         "so); an lm-eval pair more than 10% apart is refused and names the command that adds a match. On lm-eval "
         "the harness's variant scores PIQA and COPA whole, zero-shot: their docs are 30-100 tokens, where each "
         "method's floor keeps a third of the KV or more, so InfiniGen, H2O 0.125 + 0.125 and quantisation meet at "
         "about half the KV, where quantisation is INT8 (INT4's 25% is below every InfiniGen budget at this length). "
         "Gemma-3-270M runs the perplexity comparison, the lm-eval smoke and Fig. 11's points at 100 docs per task "
         "(C1's note).",
    order=20, per_model=True, contrast=c2_contrast, status=c2_status)
