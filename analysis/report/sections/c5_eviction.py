"""C5: eviction policies for a capped KV pool (paper Table 2)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import tables as T
from analysis.figures.table2 import eviction_rows
from analysis.report import recommended as R
from analysis.report.section import Section, figure_of, needs, num, signed


def eviction_table(rows: pd.DataFrame) -> pd.DataFrame:
    out = T.table(rows, "eviction")
    return out.drop(columns=[c for c in ("model",) if c in out.columns])


PRESET = "python run.py -m +experiment=table2_eviction_smoke task.seq_len=512"
RECOMMENDED = (f"{PRESET} method.skip_layers=2 method.alpha=8.0 method.partial_ratio=0.5 "
               "method.speculate_from=block_input")


def pool_line(part: pd.DataFrame) -> str:
    """One setting's perplexity with each capped pool against the full pool's."""
    ppl = part.groupby("pool")["ppl"].mean()
    deltas = sorted((v - ppl["pool 100%"], p.split(", ")[-1]) for p, v in ppl.drop("pool 100%").items())
    head = part.iloc[0]
    return (f"{head['dataset']} seq {num(C.metric(part, 'seq_len').iloc[0], 5)}: perplexity with the capped pool, vs "
            f"the full pool's {num(ppl['pool 100%'], 4)}: " + ", ".join(f"{name} {signed(d)}" for d, name in deltas)
            + f" (best: {deltas[0][1]})")


def c5_verdict(rows: pd.DataFrame) -> list[str]:
    """Each capped pool against the full pool per InfiniGen setting, the recommended setting first."""
    data = eviction_rows(rows)
    groups = [part for _, part in data.groupby("group", sort=True)
              if "pool 100%" in set(part["pool"]) and part["pool"].nunique() > 1] if not data.empty else []
    if not groups:
        return needs("InfiniGen ppl rows with a 100% and an 80% pool")
    recommended = [g for g in groups if R.is_recommended(g).all()]
    out = [f"{R.lead(data)}: {pool_line(g)}" for g in recommended] or [R.missing(data, RECOMMENDED)]
    return out + [f"at {R.name(g.iloc[0])}: {pool_line(g)}" for g in groups if not R.is_recommended(g).all()]


SECTION = Section(
    "c5_eviction", "C5. Eviction policies for a capped KV pool",
    "With the KV pool capped at 80% of the sequence, the counter-based policy loses least (paper Table 2).",
    (PRESET, RECOMMENDED),
    eviction_table, c5_verdict, figure_of("table2_eviction"),
    order=50)
