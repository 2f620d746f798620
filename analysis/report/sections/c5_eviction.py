"""C5: eviction policies for a capped KV pool (paper Table 2)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import tables as T
from analysis.figures.table2 import eviction_rows
from analysis.report import recommended as R
from analysis.report.section import Contrast, Section, figure_of, needs, num, on_every_model, signed


def eviction_table(rows: pd.DataFrame) -> pd.DataFrame:
    out = T.table(rows, "eviction")
    return out.drop(columns=[c for c in ("model",) if c in out.columns])


PRESET = "python run.py -m +experiment=table2_eviction_smoke task.seq_len=512"
RECOMMENDED = (f"{PRESET} method.skip_layers=2 method.alpha=8.0 method.partial_ratio=0.5 "
               "method.speculate_from=block_input")
GEMMA3 = R.on_gemma3(RECOMMENDED)


def pool_deltas(part: pd.DataFrame) -> tuple[float, list[tuple[float, str]]]:
    """One setting's full-pool perplexity and (increase, policy) of each capped pool, least first."""
    ppl = part.groupby("pool")["ppl"].mean()
    full = ppl["pool 100%"]
    return full, sorted((v - full, p.split(", ")[-1]) for p, v in ppl.drop("pool 100%").items())


def pool_line(part: pd.DataFrame) -> str:
    """One setting's perplexity with each capped pool against the full pool's."""
    full, deltas = pool_deltas(part)
    head = part.iloc[0]
    return (f"{head['dataset']} seq {num(C.metric(part, 'seq_len').iloc[0], 5)}: perplexity with the capped pool, vs "
            f"the full pool's {num(full, 4)}: " + ", ".join(f"{name} {signed(d)}" for d, name in deltas)
            + f" (best: {deltas[0][1]})")


def pool_groups(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[pd.DataFrame]]:
    data = eviction_rows(rows)
    return data, [part for _, part in data.groupby("group", sort=True)
                  if "pool 100%" in set(part["pool"]) and part["pool"].nunique() > 1] if not data.empty else []


def c5_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """The counter policy's perplexity increase over the full pool at the recommended setting (holds: it loses
    least)."""
    _, groups = pool_groups(rows)
    group = [g for g in groups if R.is_recommended(g).all()]
    deltas = dict((name, d) for d, name in pool_deltas(group[0])[1]) if group else {}
    least = min(deltas, key=deltas.get) if deltas else None
    return [Contrast("the counter policy's perplexity increase with the capped pool (recommended setting)",
                     deltas.get("counter"), None if "counter" not in deltas else least == "counter")]


def c5_verdict(rows: pd.DataFrame) -> list[str]:
    """Each capped pool against the full pool per InfiniGen setting, the recommended setting first."""
    data, groups = pool_groups(rows)
    if not groups:
        return needs("InfiniGen ppl rows with a 100% and an 80% pool")
    recommended = [g for g in groups if R.is_recommended(g).all()]
    out = [f"{R.lead(data)}: {pool_line(g)}" for g in recommended] or [R.missing(data, RECOMMENDED)]
    return out + [f"at {R.name(g.iloc[0])}: {pool_line(g)}" for g in groups if not R.is_recommended(g).all()]


SECTION = Section(
    "c5_eviction", "C5. Eviction policies for a capped KV pool",
    "With the KV pool capped at 80% of the sequence, the counter-based policy loses least (paper Table 2).",
    (*on_every_model(PRESET, RECOMMENDED), GEMMA3),
    eviction_table, c5_verdict, figure_of("table2_eviction"),
    order=50, per_model=True, contrast=c5_contrast)
