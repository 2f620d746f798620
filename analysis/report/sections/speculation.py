"""Beyond the paper: InfiniGen's speculation input."""

from __future__ import annotations

import pandas as pd

from analysis.report.ppl import COMPARED, full_ppl, matched_gaps, ppl_rows, ppl_table
from analysis.report.section import Section, figure_of, needs, num, signed


def speculation_verdict(rows: pd.DataFrame) -> list[str]:
    data = ppl_rows(rows)
    if data.empty or full_ppl(data) is None or not (data["method"] == "infinigen").any():
        return needs("ppl rows of full and InfiniGen's speculate_from options")
    out = []
    gen = data[data["method"] == "infinigen"]
    full = full_ppl(data)
    by = gen.assign(budget=pd.to_numeric(gen["method_params.budget"]), source=gen["method_params.speculate_from"])
    for budget, part in by.groupby("budget"):
        ppl = part.set_index("source")["ppl"]
        if {"previous", "block_input"} <= set(ppl.index):
            out.append(f"at budget {num(budget)}: gap to full `block_input` {signed(ppl['block_input'] - full)}, the "
                       f"paper's `previous` {signed(ppl['previous'] - full)}: block_input's gap / previous's = "
                       f"{num((ppl['block_input'] - full) / (ppl['previous'] - full))}x")
    for x, gap, ref_gap, row, _ in matched_gaps(data, "infinigen", "oracle", x="kv"):
        out.append(f"`{row['method_params.speculate_from']}` at budget {num(row['method_params.budget'])} "
                   f"(kv_fraction {num(100 * x)}%): gap to full {signed(gap)}, the oracle's at that kv_fraction "
                   f"{signed(ref_gap)}: InfiniGen's gap / the oracle's = {num(gap / ref_gap)}x")
    outside = len(gen) - len(matched_gaps(data, "infinigen", "oracle", x="kv"))
    if not (data["method"] == "oracle").any():
        out.append("no oracle rows: the matched comparison needs them (the second command below)")
    elif outside:
        out.append(f"{outside} InfiniGen setting(s) lie outside the oracle's measured kv_fraction range (no matched "
                   "comparison)")
    return out or needs("InfiniGen rows of two speculate_from options at one budget")


SECTION = Section(
    "speculation", "Beyond the paper: the speculation input",
    "Speculating layer i from layer i's own input norm applied to the residual stream the paper reads "
    "(`block_input`) fetches better tokens than the paper's `previous`, at the same prefetch window.",
    (COMPARED[0], "python run.py -m +experiment=fig13_speculation_smoke "
                  "+point=speculate_previous,speculate_block_input,oracle_skip2"),
    ppl_table, speculation_verdict, figure_of("fig13_speculation"),
    order=100)
