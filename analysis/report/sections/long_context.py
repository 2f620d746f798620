"""Beyond the paper: needle retrieval through the decode-mode cache."""

from __future__ import annotations

import pandas as pd

from analysis.figures.needle import needle_heatmap
from analysis.report.section import Section, figure_of, needs, num, on_every_model


def needle_table(rows: pd.DataFrame) -> pd.DataFrame:
    _, numbers = needle_heatmap(rows)
    if numbers.empty:
        return numbers
    wide = numbers.pivot_table(index=["setting", "length"], columns="depth", values="accuracy").reset_index()
    wide.columns = [c if isinstance(c, str) else f"depth {c:g}" for c in wide.columns]
    return wide


def long_verdict(rows: pd.DataFrame) -> list[str]:
    out = []
    _, cells = needle_heatmap(rows)
    if cells.empty:
        out += needs("needle rows")
    else:
        acc = cells.groupby("setting").apply(lambda c: (c["accuracy"] * c["n"]).sum() / c["n"].sum(),
                                             include_groups=False)
        n = int(cells.groupby("setting")["n"].sum().max())
        out.append(f"needle retrieval, share of {n} keys retrieved exactly: "
                   + ", ".join(f"{s} {num(100 * a)}%" for s, a in acc.sort_index().items()))
    return out


SECTION = Section(
    "long_context", "Beyond the paper: long context and needle retrieval",
    "Pass-key retrieval through the method's decode-mode cache: query-aware selection keeps a needle that "
    "eviction (StreamingLLM's window) has dropped. Perplexity at long context: docs/long_context.md.",
    on_every_model("python run.py -m +experiment=needle_smollm2_smoke"),
    needle_table,
    long_verdict, figure_of("needle_heatmap"),
    order=130, per_model=True)
