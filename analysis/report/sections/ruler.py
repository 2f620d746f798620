"""Beyond the paper: RULER through the decode-mode cache."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import tables as T
from analysis.figures.ruler import RULER_INFORMATIVE, ruler_cells
from analysis.report.section import Section, figure_of, needs, num


def ruler_verdict(rows: pd.DataFrame) -> list[str]:
    """Per model: full attention's score per RULER task @ length, which cells are informative (full >=
    figures.RULER_INFORMATIVE), then each method's mean score over the informative cells it ran, as a share of
    full's over the same cells, and what the rows' evaluations took."""
    cells = ruler_cells(rows)
    if cells.empty:
        return needs("RULER rows")
    out = []
    for model, part in cells.groupby("model"):
        full = part[part["setting"] == "full"]
        if full.empty:
            out += needs(f"RULER rows of full attention on {model}")
            continue
        out.append(f"{model} with full attention, score per task @ length: "
                   + ", ".join(f"{r.task} @ {r.length:.0f} {num(r.score, 2)}" for r in full.itertuples()))
        useful, useless = full[full["informative"]], full[~full["informative"]]
        out.append(f"informative (full >= {num(RULER_INFORMATIVE)}): {len(useful)} of {len(full)} cells"
                   + (f" ({', '.join(sorted(set(useful['task'])))})" if len(useful) else "")
                   + ("; uninformative, excluded from the comparison: "
                      + ", ".join(f"{r.task} @ {r.length:.0f}" for r in useless.itertuples()) if len(useless) else ""))
        compared = part[part["informative"] & (part["setting"] != "full")]
        if useful.empty or compared.empty:
            out += needs(f"RULER rows of KV methods on the informative cells of {model}")
            continue
        by = compared.groupby("setting").agg(score=("score", "mean"), full=("full_score", "mean"),
                                             kv=("kv_fraction", "mean"), n=("score", "size"))
        by = by.assign(share=by["score"] / by["full"]).sort_values(["share", "kv"], ascending=[False, True])
        out.append(f"on the informative cells (full's mean {num(useful['score'].mean(), 2)} over {len(useful)}), mean "
                   "score and its share of full's on the same cells: "
                   + ", ".join(f"{s} {num(r.score, 2)} ({num(100 * r.share, 3)}%, kv {num(r.kv, 2)}"
                               + (f", {r.n} of {len(useful)} cells" if r.n < len(useful) else "") + ")"
                               for s, r in by.iterrows()))
    data = C.of_task(rows, "lm_eval")
    data = data[C.column(data, "metrics.benchmark") == "ruler"]
    minutes = (C.metric(data, "seconds").groupby(data["_file"]).sum() / 60).groupby(
        data.groupby("_file")["method"].first()).sum().sort_values()
    out.append("wall time in the rows (lm-eval's sample generation, prefill and decode, summed over a run's rows; on "
               "a shared machine it includes time the run was paused, "
               f"{', '.join(sorted(set(C.column(data, 'meta.device').astype(str) + ' x ' + C.column(data, 'meta.threads').astype(str) + ' threads')))}): "
               + ", ".join(f"{m} {num(v, 2)} min" for m, v in minutes.items()))
    return out


SECTION = Section(
    "ruler", "Beyond the paper: RULER",
    "lm-eval's RULER tasks (needles, variable tracking, common / frequent word extraction), generated "
    "offline with the model's tokenizer and scored through each method's decode-mode cache: which tasks "
    "SmolLM2-135M can do at all with full attention, and how the KV methods at ~20% of the KV compare on "
    f"those (a cell where full attention scores below {RULER_INFORMATIVE:g} says nothing about a method: "
    "hatched in the figure, left out of the table and the comparison). Options and refusals: "
    "docs/long_context.md.",
    ("python run.py -m +experiment=ruler_smollm2_smoke",),
    T.ruler_table, ruler_verdict, figure_of("ruler_heatmap"),
    note="The CPU preset generates one sample per (task, length) (task.limit=1; two took 66 min on 2 cores): "
         "a single-needle cell is 0 or 1, cwe and the multi-needle tasks give partial credit within the "
         "sample, and a difference of one cell is one sample. `task.limit=N` on the same preset for more.",
    order=140)
