"""Beyond the paper: RULER through the decode-mode cache."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis import tables as T
from analysis.figures.ruler import RULER_INFORMATIVE, ruler_cells
from analysis.report.section import Section, figure_of, needs, num


def full_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Full attention's RULER score per model and task, one column per length (what the verdict's first line
    summarises)."""
    cells = ruler_cells(rows)
    full = cells[cells["method"] == "full"]
    if full.empty:
        return pd.DataFrame(columns=["model", "method", "task"])
    wide = full.pivot_table(index=["model", "setting", "task"], columns="length", values="score").reset_index()
    wide.columns = [f"score (0-1) @ {c:.0f} tokens" if isinstance(c, float) else c for c in wide.columns]
    return wide.rename(columns={"setting": "method"})


def settings_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The RULER table (analysis/tables.py: mean score and score per informative task @ length per setting) with
    each setting's mean as a share of full attention's over the same cells."""
    out = T.table(rows, "ruler")
    shares = shares_of(rows)
    if out.empty or shares.empty:
        return out
    share = shares.set_index(["model", "setting"])["share"]
    full = set(ruler_cells(rows).query("method == 'full'")["setting"])
    out.insert(out.columns.get_loc("mean score (0-1)") + 1, "share of full's (%)",
               [100.0 if s in full else 100 * share.get((m, s), float("nan"))
                for m, s in zip(out["model"], out["method"])])
    return out


def shares_of(cells_or_rows: pd.DataFrame) -> pd.DataFrame:
    """Per (model, setting) but full's: the mean score over the informative cells it ran, full's mean over the same
    cells, their ratio, its mean kv_fraction and how many cells."""
    cells = ruler_cells(cells_or_rows) if "informative" not in cells_or_rows else cells_or_rows
    compared = cells[cells["informative"] & (cells["method"] != "full")]
    if compared.empty:
        return pd.DataFrame(columns=["model", "setting", "method", "score", "full", "share", "kv", "n"])
    by = compared.groupby(["model", "setting"], as_index=False).agg(
        method=("method", "first"), score=("score", "mean"), full=("full_score", "mean"), kv=("kv_fraction", "mean"),
        n=("score", "size"))
    return by.assign(share=by["score"] / by["full"])


# the paired comparison: 20 samples per (task, length) at 1,024 tokens on the tasks where full attention scored
# >= 0.5 on the preset's one sample, for full attention, InfiniGen and H2O at the authors' semantics
PAIRED_BASE = ("python run.py -m model=smollm2-135m task=lm_eval 'task.tasks=[niah_single_1,niah_single_2,"
               "niah_single_3,niah_multikey_1,niah_multivalue]' 'task.max_seq_lengths=[1024]' task.limit=20 "
               "task.protocol=serving")
PAIRED = tuple(f"{PAIRED_BASE} method={m}" for m in ("full", "infinigen_reference", "h2o_reference"))
PAIRED_FULL = 0.5  # a cell enters the paired comparison where full attention scores at least this


def sample_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """RULER rows that keep their per-sample scores: model, method, setting, task, length, units."""
    data = C.of_task(rows, "lm_eval")
    data = data[C.column(data, "metrics.benchmark") == "ruler"] if not data.empty else data
    if data.empty:
        return data
    data = data[C.column(data, "metrics.units").map(lambda u: isinstance(u, dict) and bool(u.get("id")))]
    if data.empty:
        return data
    return data.assign(setting=C.curve_labels(data), length=C.metric(data, "length"),
                       cell=C.column(data, "metrics.task").astype(str) + " @ "
                       + C.metric(data, "length").map(lambda v: f"{v:.0f}"))


def cell_interval(units: dict, length: float) -> tuple[float, float, float, int]:
    """A cell's mean score with its 95% bootstrap interval over samples, and n."""
    effect = P.mean(units[f"{length:.0f}"])
    return effect.value, effect.low, effect.high, effect.n


def paired_lines(rows: pd.DataFrame) -> list[str]:
    """Per model: each cell's score with its interval over samples; then each method against full attention over
    the samples of the cells where full scores >= PAIRED_FULL, paired per sample, against the 2-point margin."""
    data = sample_rows(rows)
    out = []
    for model, part in data.groupby("model", sort=True):
        if not (part["method"] == "full").any():
            continue
        cells = []
        for _, r in part.sort_values(["method", "cell"]).iterrows():
            value, low, high, n = cell_interval(r["metrics.units"], r["length"])
            cells.append(f"{r['setting']} {r['cell']} {num(value, 2)} ({num(low, 2)}-{num(high, 2)}, n = {n})")
        out.append(f"{model}: RULER score per cell, 95% interval over samples: " + "; ".join(cells))
        # full's cells by (cell, samples): a method is paired with full's run over the same samples
        refs = {(r["cell"], len(r["metrics.units"]["id"])): r["metrics.units"] for _, r in
                part[part["method"] == "full"].iterrows()}
        useful = {key for key, units in refs.items() if P.mean(units[key[0].split(" @ ")[1]]).value >= PAIRED_FULL}
        others = part[part["method"] != "full"]
        for (setting, length), mine in others.groupby(["setting", "length"], sort=True):
            mine = mine.assign(key=[(r["cell"], len(r["metrics.units"]["id"])) for _, r in mine.iterrows()])
            mine = mine[mine["key"].isin(useful)].drop_duplicates("key")
            if mine.empty:
                continue
            try:
                effect = P.accuracy_difference(*P.pooled([(r["metrics.units"], refs[r["key"]])
                                                          for _, r in mine.sort_values("cell").iterrows()]),
                                               f"{length:.0f}")
            except P.Unpaired as err:
                out.append(f"{model}: {setting} vs full: unpaired ({err})")
                continue
            verdict = effect.closeness()
            settle = (f"; {P.settle_text(effect, P.margin('accuracy'), 'samples')}" if verdict == P.OPEN else "")
            out.append(f"{model}: {setting} (kv_fraction {num(100 * C.metric(mine, 'kv_fraction').mean())}%) minus full "
                       f"over the {effect.n} samples of {len(mine)} cells where full scores >= {PAIRED_FULL:g} "
                       f"({', '.join(sorted(mine['cell']))}): {effect.text().replace('docs', 'samples')}; "
                       f"{P.margin_text('accuracy').replace('accuracy', 'score')}: {verdict}{settle}")
    return out


def ruler_verdict(rows: pd.DataFrame) -> list[str]:
    """Per model: full attention's mean score over every task and length (per task: the section's first table),
    which cells are informative (full >= figures.RULER_INFORMATIVE), each setting's mean score over the informative
    cells it ran as a share of full's over the same cells, and what the rows' evaluations took."""
    cells = ruler_cells(rows)
    if cells.empty:
        return needs("RULER rows")
    out = []
    for model, part in cells.groupby("model"):
        full = part[part["method"] == "full"]
        if full.empty:
            out += needs(f"RULER rows of full attention on {model}")
            continue
        out.append(f"{model} full attention: mean score {num(full['score'].mean(), 2)} (0-1) over "
                   f"{full['task'].nunique()} tasks x {full['length'].nunique()} lengths; per task in the first table")
        cell = full.drop_duplicates(["task", "length"])
        useful, useless = cell[cell["informative"]], cell[~cell["informative"]]
        out.append(f"informative (full >= {num(RULER_INFORMATIVE)}): {len(useful)} of {len(cell)} cells"
                   + ("; uninformative, left out of the comparison: "
                      + ", ".join(f"{r.task} @ {r.length:.0f}" for r in useless.itertuples()) if len(useless) else ""))
        by = shares_of(part)
        if useful.empty or by.empty:
            out += needs(f"RULER rows of KV methods on the informative cells of {model}")
            continue
        by = by.sort_values(["share", "kv", "setting"], ascending=[False, True, True])
        alone = by["method"].map(by["method"].value_counts()) == 1  # a method's only setting: its name says it
        out.append(f"on the informative cells, mean score as a share of full's ({num(useful['score'].mean(), 2)} over "
                   f"{len(useful)}): "
                   + ", ".join(f"{r.method if one else r.setting} {num(100 * r.share, 3)}% (kv {num(r.kv, 2)}"
                               + (f", {r.n} of {len(useful)} cells" if r.n < len(useful) else "") + ")"
                               for one, r in zip(alone, by.itertuples())))
    data = C.of_task(rows, "lm_eval")
    data = data[C.column(data, "metrics.benchmark") == "ruler"]
    minutes = (C.metric(data, "seconds").groupby(data["_file"]).sum() / 60).groupby(
        data.groupby("_file")["method"].first()).sum().sort_values()
    threads = sorted(set(C.column(data, "meta.device").astype(str) + " x "
                         + C.column(data, "meta.threads").astype(str) + " threads"))
    out.append(f"wall time per method ({', '.join(threads)}; pauses of the shared machine included): "
               + ", ".join(f"{m} {num(v, 2)} min" for m, v in minutes.items()))
    return out + paired_lines(rows)


SECTION = Section(
    "ruler", "Beyond the paper: RULER",
    "lm-eval's RULER tasks (needles, variable tracking, common / frequent word extraction), generated "
    "offline with the model's tokenizer and scored through each method's decode-mode cache: which tasks "
    "SmolLM2-135M can do at all with full attention, and how the KV methods at ~20% of the KV compare on "
    f"those (a cell where full attention scores below {RULER_INFORMATIVE:g} says nothing about a method: "
    "hatched in the figure, left out of the table and the comparison). Options and refusals: "
    "docs/long_context.md.",
    (*PAIRED, "python run.py -m +experiment=ruler_smollm2_smoke"),
    lambda rows: [full_table(rows), settings_table(rows)], ruler_verdict, figure_of("ruler_heatmap"),
    note="The paired comparison (first lines) scores 20 samples per cell at 1,024 tokens on the tasks where full "
         "attention scored >= 0.5 on the preset's sample, for full attention, InfiniGen and H2O at the authors' "
         "semantics: each cell's score with a bootstrap interval over its samples, each method minus full paired "
         "per sample (analysis/paired.py). The CPU preset generates one sample per (task, length) (task.limit=1; "
         "two took 66 min on 2 cores): a single-needle cell is 0 or 1. "
         "Scores are lm-eval's RULER string match, 0 to 1. The first table: full attention's score per task and "
         "length; the second: each setting's score on the informative cells (`task @ length`), their mean and "
         "its share of full's mean over the same cells. Wall time: lm-eval's sample generation, prefill and "
         "decode, summed over a run's rows.",
    order=140)
