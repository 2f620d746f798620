"""Beyond the paper: Quest, SnapKV and KIVI on the perplexity windows."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import like as L
from analysis.report.ppl import COMPARED, OTHERS, full_ppl, interpolate, ppl_rows, ppl_table, ppl_vs_kv
from analysis.report.section import ONE_WINDOW, Section, needs, num, signed


def against_oracle(data: pd.DataFrame, method: str, what: str, command: str) -> list[str]:
    """Each `method` row's perplexity gap to full beside the oracle's at the same kv_fraction on the same windows:
    an oracle row within like.KV_TOLERANCE (measured), else the oracle curve interpolated inside its measured range
    (said so), else refused with the command that adds rows there."""
    full = full_ppl(data)
    oracle = data[data["method"] == "oracle"]
    out = []
    for _, row in data[data["method"] == method].sort_values("kv").iterrows():
        name = f"{what} at budget {num(row['method_params.budget'])} (kv_fraction {num(100 * row['kv'])}%)"
        same = oracle[[not L.differences(r, row, L.ACCURACY) for _, r in oracle.iterrows()]] if not oracle.empty \
            else oracle
        best = None
        for curve, part in same.groupby("curve"):
            near = part[L.same_size(part["kv"], row["kv"])]
            if not near.empty:
                pick = near.loc[(near["kv"] - row["kv"]).abs().idxmin()]
                best = best or (pick["ppl"], f"{curve} measured at {num(100 * pick['kv'])}%")
            else:
                at = interpolate(part, "kv", "ppl", row["kv"])
                if at is not None:
                    best = best or (at, f"{curve} interpolated")
        if best is None:
            span = (f"{num(100 * same['kv'].min())}-{num(100 * same['kv'].max())}%" if not same.empty else "none")
            out.append(f"{name}: gap to full {signed(row['ppl'] - full)}; against the oracle: refused (its rows on "
                       f"these windows span kv_fraction {span}); `{command}` adds oracle rows there")
            continue
        out.append(f"{name}: gap to full {signed(row['ppl'] - full)}, the oracle's at the same kv_fraction "
                   f"{signed(best[0] - full)} ({best[1]}): {num((row['ppl'] - full) / (best[0] - full))}x the "
                   f"oracle's ({ONE_WINDOW})")
    return out


def others_verdict(rows: pd.DataFrame) -> list[str]:
    data = ppl_rows(rows)
    if data.empty or full_ppl(data) is None:
        return needs("ppl rows of full and the compared methods")
    out = []
    plain = data[C.metric(data, "dense_rows").fillna(0) == 0]
    if full_ppl(plain) is not None:
        out += against_oracle(plain, "quest", "Quest", OTHERS[0])
    for bits in (2, 4):
        kivi = plain[(plain["method"] == "kivi") & (pd.to_numeric(C.column(plain, "method_params.bits")) == bits)]
        quant = plain[(plain["method"] == "quant") & (pd.to_numeric(C.column(plain, "method_params.bits")) == bits)]
        full = full_ppl(plain)
        if not kivi.empty and not quant.empty and full is not None:
            out.append(f"{bits}-bit, every entry kept: perplexity gap to full KIVI {signed(kivi['ppl'].iloc[0] - full)}, "
                       f"per-token quant {signed(quant['ppl'].iloc[0] - full)} ({ONE_WINDOW})")
    prompt = data[C.metric(data, "dense_rows").fillna(0) > 0]
    if not prompt.empty and full_ppl(prompt) is not None:
        out += against_oracle(prompt, "snapkv", "SnapKV with a 512-token prompt", OTHERS[5])
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
