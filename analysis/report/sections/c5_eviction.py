"""C5: eviction policies for a capped KV pool (paper Table 2)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import tables as T
from analysis.figures.table2 import eviction_rows
from analysis.report import recommended as R
from analysis.report.section import Contrast, Section, figure_of, needs, num, on_every_model, signed


def eviction_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The eviction table (one line per InfiniGen setting, analysis/tables.py), each pool's column saying that it
    holds perplexities."""
    out = T.table(rows, "eviction")
    out = out.rename(columns={c: f"ppl, {c}" for c in out.columns if str(c).startswith("pool ")})
    return out.drop(columns=[c for c in ("model",) if c in out.columns])


PRESET = "python run.py -m +experiment=table2_eviction_smoke task.seq_len=512"
RECOMMENDED = R.on_every_model_selected(PRESET)


def pool_deltas(part: pd.DataFrame) -> tuple[float, list[tuple[float, str]]]:
    """One setting's full-pool perplexity and (increase, policy) of each capped pool, least first (a policy is
    named with its pool's size where the capped pools differ in size)."""
    ppl = part.groupby("pool")["ppl"].mean()
    full = ppl["pool 100%"]
    capped = ppl.drop("pool 100%")
    sizes = {p.split(", ")[0] for p in capped.index}
    return full, sorted((v - full, p.split(", ")[-1] if len(sizes) == 1 else p.removeprefix("pool "))
                        for p, v in capped.items())


def pool_line(part: pd.DataFrame) -> str:
    """One setting's perplexity with each capped pool against the full pool's."""
    full, deltas = pool_deltas(part)
    head = part.iloc[0]
    sizes = sorted({p.split(", ")[0].removeprefix("pool ") for p in part["pool"] if p != "pool 100%"})
    pool = f"the pool capped at {sizes[0]}" if len(sizes) == 1 else "a capped pool"
    return (f"{head['dataset']}, {num(C.metric(part, 'seq_len').iloc[0], 5)} tokens: perplexity {num(full, 4)} with "
            f"the full pool; with {pool}: " + ", ".join(f"{name} {signed(d)}" for d, name in deltas)
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
    out = [f"{R.lead(data)}: {pool_line(g)}" for g in recommended] or [R.missing(data, *RECOMMENDED)]
    return out + [f"at {R.name(g.iloc[0])}: {pool_line(g)}" for g in groups if not R.is_recommended(g).all()]


SECTION = Section(
    "c5_eviction", "C5. Eviction policies for a capped KV pool",
    "With the KV pool capped at 80% of the sequence, the counter-based policy loses least (paper Table 2).",
    (*on_every_model(PRESET), *RECOMMENDED),
    eviction_table, c5_verdict, figure_of("table2_eviction"),
    order=50, per_model=True, contrast=c5_contrast)
