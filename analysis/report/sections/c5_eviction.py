"""C5: eviction policies for a capped KV pool (paper Table 2)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis import tables as T
from analysis.figures.table2 import eviction_rows
from analysis.report import recommended as R
from analysis.report.section import Section, Status, figure_of, needs, num, signed


def eviction_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The eviction table (one line per InfiniGen setting, analysis/tables.py), each pool's column saying that it
    holds perplexities."""
    out = T.table(rows, "eviction")
    out = out.rename(columns={c: f"ppl, {c}" for c in out.columns if str(c).startswith("pool ")})
    return out.drop(columns=[c for c in ("model",) if c in out.columns])


WINDOWS = 16  # this report's sample for a perplexity claim: 16 windows of the preset's 1,024 tokens
PRESET = f"python run.py -m +experiment=table2_eviction_smoke task.max_windows={WINDOWS}"
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


def policy_effects(group: pd.DataFrame) -> list[tuple[str, P.Effect]]:
    """The counter policy's perplexity over each other capped policy's, paired over the windows both scored."""
    capped = {p.split(", ")[-1]: row for p, row in group.drop_duplicates("pool").set_index("pool").iterrows()
              if p != "pool 100%"}
    if "counter" not in capped:
        return []
    out = []
    for name, row in sorted(capped.items()):
        if name == "counter":
            continue
        try:
            out.append((name, P.perplexity_ratio(capped["counter"]["metrics.units"], row["metrics.units"])))
        except P.Unpaired:
            continue
    return out


def standing(effects: list[tuple[str, P.Effect]]) -> tuple[str, str]:
    """(verdict, its number) of "the counter policy loses least": holds when its perplexity is below every other
    policy's (each interval below 1), does not hold when one is wholly above 1."""
    sides = [P.side(e, 1.0) for _, e in effects]
    verdict = P.FAILS if P.FAILS in sides else P.HOLDS if all(s == P.HOLDS for s in sides) else P.OPEN
    number = "; ".join(f"counter / {name} x{e.value:.3f} ({e.low:.3f}-{e.high:.3f}), {e.n} windows"
                       for name, e in effects)
    settle = next((f"; vs {name}: {P.settle_text(e, 1.0, 'windows')}" for (name, e), s in zip(effects, sides)
                   if s == P.OPEN), "") if verdict == P.OPEN else ""
    return verdict, number + settle


def unmeasured_spread(group: pd.DataFrame) -> str:
    """Why a group of one window per policy settles nothing, and what the windows that would settle it cost, from
    its own rows' seconds per window."""
    seconds = pd.to_numeric(C.column(group, "metrics.seconds_per_window"), errors="coerce")
    capped = seconds[(group["pool"] != "pool 100%").to_numpy()].median()
    cost = ("" if pd.isna(capped) else f": {WINDOWS} windows would take about {num(WINDOWS * capped / 60)} min per "
            f"capped policy at these rows' {num(capped)} s a window")
    return "one window per policy, so the windows' spread is not measured" + cost


def c5_status(rows: pd.DataFrame) -> list[Status]:
    _, groups = pool_groups(rows)
    claim = "C5: the counter policy loses least with a capped KV pool"
    found = [(g, policy_effects(g)) for g in groups]
    paired = [(g, e) for g, e in found if e and min(x.n for _, x in e) >= 2]
    if paired:
        return [Status(claim, *standing(paired[0][1]))]
    if found:
        _, deltas = pool_deltas(found[0][0])
        return [Status(claim, P.OPEN, unmeasured_spread(found[0][0]) + "; measured on one window: "
                       + ", ".join(f"{name} {signed(d)}" for d, name in deltas))]
    return [Status(claim, "not measured", "")]


def c5_verdict(rows: pd.DataFrame) -> list[str]:
    """Each capped pool against the full pool per InfiniGen setting, with the counter policy against each other one
    paired per window where the rows hold two windows or more."""
    data, groups = pool_groups(rows)
    if not groups:
        return needs("InfiniGen ppl rows with a 100% and an 80% pool")
    def line(who: str, g: pd.DataFrame) -> str:
        effects = policy_effects(g)
        many = effects and min(e.n for _, e in effects) >= 2
        tail = (": counter loses least: {}: {}".format(*standing(effects)) if many else
                f"; counter loses least: {P.OPEN}: {unmeasured_spread(g)}")
        return f"{who}: {pool_line(g)}{tail}"

    recommended = [g for g in groups if R.is_recommended(g).all()]
    out = [line(R.lead(data), g) for g in recommended] or [R.missing(data, *RECOMMENDED)]
    return out + [line(f"{g['method'].iloc[0]} at {R.name(g.iloc[0])}", g) for g in groups
                  if not R.is_recommended(g).all()]


SECTION = Section(
    "c5_eviction", "C5. Eviction policies for a capped KV pool",
    "With the KV pool capped at 80% of the sequence, the counter-based policy loses least (paper Table 2).",
    RECOMMENDED,
    eviction_table, c5_verdict, figure_of("table2_eviction"),
    order=50, per_model=True, status=c5_status)
