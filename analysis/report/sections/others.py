"""Beyond the paper: Quest, SnapKV and KIVI on the perplexity windows."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis.report.ppl import COMPARED, OTHERS, full_ppl, matched_gaps, ppl_rows, ppl_table, ppl_vs_kv
from analysis.report.section import Section, needs, num, signed


def others_verdict(rows: pd.DataFrame) -> list[str]:
    data = ppl_rows(rows)
    if data.empty or full_ppl(data) is None:
        return needs("ppl rows of full and the compared methods")
    out = []
    plain = data[C.metric(data, "dense_rows").fillna(0) == 0]
    quest = matched_gaps(plain, "quest", "oracle", x="kv") if full_ppl(plain) is not None else []
    for x, gap, ref_gap, row, _ in quest:
        out.append(f"Quest at budget {num(row['method_params.budget'])} (kv_fraction {num(100 * x)}%): gap to "
                   f"full {signed(gap)}, the oracle's there {signed(ref_gap)}: {num(gap / ref_gap)}x the oracle's")
    for bits in (2, 4):
        kivi = plain[(plain["method"] == "kivi") & (pd.to_numeric(C.column(plain, "method_params.bits")) == bits)]
        quant = plain[(plain["method"] == "quant") & (pd.to_numeric(C.column(plain, "method_params.bits")) == bits)]
        full = full_ppl(plain)
        if not kivi.empty and not quant.empty and full is not None:
            out.append(f"{bits}-bit: KIVI gap to full {signed(kivi['ppl'].iloc[0] - full)}, per-token quant "
                       f"{signed(quant['ppl'].iloc[0] - full)}")
    prompt = data[C.metric(data, "dense_rows").fillna(0) > 0]
    if not prompt.empty and full_ppl(prompt) is not None:
        for x, gap, ref_gap, row, _ in matched_gaps(prompt, "snapkv", "oracle", x="kv"):
            out.append(f"SnapKV at budget {num(row['method_params.budget'])} with a "
                       f"{num(C.metric(row.to_frame().T, 'dense_rows').iloc[0], 5)}-token prompt (kv_fraction "
                       f"{num(100 * x)}%): gap to full {signed(gap)}, the oracle's there {signed(ref_gap)}: "
                       f"{num(gap / ref_gap)}x the oracle's")
    return out or needs("ppl rows of Quest, KIVI or SnapKV")


SECTION = Section(
    "others", "Beyond the paper: Quest, SnapKV, KIVI",
    "Later methods on the same windows: Quest's page bounds and SnapKV's prompt compression against the "
    "oracle's exact top-k at a matched kv_fraction, KIVI's per-channel keys against per-token quantisation "
    "at the same bits. SnapKV compresses a prompt: its rows (and their full / oracle / Quest references) "
    "treat the first 512 tokens as the prompt (task.dense_rows=512).",
    (COMPARED[0], *OTHERS, COMPARED[4]), ppl_table, others_verdict,
    lambda rows: ppl_vs_kv(rows, "Quest, SnapKV, KIVI: perplexity vs relative KV size"),
    order=110)
