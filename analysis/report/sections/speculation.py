"""Beyond the paper: InfiniGen's speculation input."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis.report.ppl import COMPARED, full_ppl, matched_gaps, ppl_rows, ppl_table
from analysis.report.section import ONE_WINDOW, Section, figure_of, needs, num, on_every_model, on_model, signed

SOURCES = ("python run.py -m +experiment=fig13_speculation_smoke "
           "+point=speculate_previous,speculate_block_input,oracle_skip2")
# QK-norm's alternative (issue 42): the speculated query scaled by the norm's weight alone, no RMS (one command per
# point: Hydra's sweeper would apply method.qk_norm before a swept +point selects the InfiniGen method)
QK_WEIGHT = tuple(on_model(f"python run.py -m +experiment=fig13_speculation_smoke +point={point} method.qk_norm=weight",
                           "gemma3-270m") for point in ("speculate_previous", "speculate_block_input"))


def qk_norm_lines(data: pd.DataFrame) -> list[str]:
    """Per speculation input and budget, InfiniGen's speculated query through QK-norm with the true RMS (`rms`, the
    default) and with the norm's weight alone (`weight`): perplexity gap to full and recall, and the oracle nearest
    to the default's kv_fraction."""
    gen = data[data["method"] == "infinigen"]
    gen = gen.assign(qk=C.column(gen, "method_params.qk_norm").fillna("rms"), recall=C.metric(gen, "recall"),
                     budget=pd.to_numeric(gen["method_params.budget"]), source=gen["method_params.speculate_from"])
    full, oracle = full_ppl(data), data[data["method"] == "oracle"].assign(recall=lambda d: C.metric(d, "recall"))
    if full is None:
        return []
    out = []
    for (source, budget), part in gen.groupby(["source", "budget"]):
        if part["qk"].nunique() < 2:
            continue
        line = f"QK-norm, `{source}` at budget {num(budget)}: " + ", ".join(
            f"`qk_norm={r.qk}` gap to full {signed(r.ppl - full)}, recall {num(r.recall)} (kv_fraction "
            f"{num(100 * r.kv)}%)" for r in part.sort_values("qk").itertuples())
        default = part.loc[part["qk"] == "rms", "kv"]  # the oracle beside the default's kv_fraction
        near = oracle.loc[(oracle["kv"] - default.iloc[0]).abs().idxmin()] if not (oracle.empty or default.empty) \
            else None
        if near is not None:
            line += (f"; the oracle at kv_fraction {num(100 * near['kv'])}%: gap {signed(near['ppl'] - full)}, recall "
                     f"{num(near['recall'])}")
        out.append(line)
    return out


def speculation_verdict(rows: pd.DataFrame) -> list[str]:
    data = ppl_rows(rows)
    qk = data[C.column(data, "method_params.qk_norm").fillna("rms") == "weight"] if not data.empty else data
    data, qk_lines = data.drop(qk.index), qk_norm_lines(data) if not qk.empty else []
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
    if out and C.metric(gen, "windows").max() < 2:
        out = [f"{line} ({ONE_WINDOW})" if "x" in line.split(":")[-1] else line for line in out]
    return (out + qk_lines) or needs("InfiniGen rows of two speculate_from options at one budget")


SECTION = Section(
    "speculation", "Beyond the paper: the speculation input",
    "Speculating layer i from layer i's own input norm applied to the residual stream the paper reads "
    "(`block_input`) fetches better tokens than the paper's `previous`, at the same prefetch window.",
    (*on_every_model(COMPARED[0], SOURCES), *QK_WEIGHT),
    ppl_table, speculation_verdict, figure_of("fig13_speculation"),
    note="On Gemma-3 (QK-norm) the speculated query goes through the layer's per-head RMS norm with the true RMS "
         "of the whole speculated head vector (`qk_norm=rms`, the default); the alternative that skips the RMS "
         "and applies the norm's weight alone (`qk_norm=weight`) is shown beside it (infinigen/method/infinigen.py).",
    order=100, per_model=True)
