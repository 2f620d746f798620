"""C7: measured decode speed (paper Figs. 14-16)."""

from __future__ import annotations

import pandas as pd

from analysis import tables as T
from analysis.figures.fig14_16 import latency_rows
from analysis.report import recommended as R
from analysis.report.section import Section, figure_of, needs, num

LATENCY = ("python run.py -m +experiment=fig14_15_latency_batch_smoke",
           "python run.py -m +experiment=fig16a_latency_prompt_smoke",
           "python run.py -m +experiment=fig16b_latency_model_smoke",
           "python run.py -m +experiment=fig17_alpha_latency_smoke")


def latency_table(rows: pd.DataFrame) -> pd.DataFrame:
    return T.table(rows, "latency")


RECOMMENDED = "python run.py -m +experiment=fig14_15_latency_batch_smoke +point=speculate_block_input method.budget=0.2"


def speedups(part: pd.DataFrame, gen: pd.DataFrame, y: str) -> str:
    """InfiniGen's (`gen`) median decode step against each other method's at one model, batch and prompt."""
    ms = part[part["method"] != "infinigen"].groupby("method")[y].median()
    ours = gen[y].median()
    head = part.iloc[0]
    source = "; ".join(sorted(set(part["decode_source"])))
    return (f"{head['model']}, batch {num(head['batch_size'])}, prompt {num(head['prompt_len'], 5)} ({source}; "
            f"median over a method's settings): decode ms/token InfiniGen {num(ours)}; speed-up of InfiniGen over "
            + ", ".join(f"{m} {num(v / ours)}x" for m, v in ms.items()))


def c7_verdict(rows: pd.DataFrame) -> list[str]:
    """InfiniGen's decode speed-up over each other method per model, batch and prompt: at the recommended setting
    first, then at the other settings the rows hold (named)."""
    data, y = latency_rows(rows)
    if y is None or not (data["method"] == "infinigen").any():
        return needs("latency rows of InfiniGen and the baselines")
    recommended = R.is_recommended(data)
    ours, others = [], []
    for _, part in data.groupby(["model", "batch_size", "prompt_len"]):
        gen = part[part["method"] == "infinigen"]
        if gen.empty or gen.shape[0] == part.shape[0]:
            continue
        if recommended[gen.index].any():
            ours.append(speedups(part, gen[recommended[gen.index]], y))
        rest = gen[~recommended[gen.index]]
        if not rest.empty:
            others.append(f"at {R.names(rest)}: {speedups(part, rest, y)}")
    if not ours and not others:
        return needs("latency rows of InfiniGen and a baseline at the same batch and prompt")
    gen = data[data["method"] == "infinigen"]
    if not ours:
        return [R.missing(gen, RECOMMENDED), *others]
    return [f"{R.lead(gen)}: {ours[0]}", *(f"at the recommended setting: {line}" for line in ours[1:]), *others]


SECTION = Section(
    "c7_speed", "C7. Speed",
    "InfiniGen's decode is faster than full offloading, H2O and quantisation at large batches and long "
    "prompts (paper Figs. 14-16).", (*LATENCY, RECOMMENDED), latency_table, c7_verdict, figure_of("fig14_16_latency"),
    note="Measured CPU latencies are not the paper's setting (a GPU with the KV cache in host memory); "
         "modelled speed rows are labelled apart in docs/speed.md.",
    order=70)
