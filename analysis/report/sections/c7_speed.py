"""C7: measured decode speed (paper Figs. 14-16)."""

from __future__ import annotations

import math

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis import like as L
from analysis import tables as T
from analysis.figures.fig14_16 import latency_rows
from analysis.report import recommended as R
from analysis.report.section import Section, Status, figure_of, needs, num

LATENCY = ("python run.py -m +experiment=fig14_15_latency_batch_smoke",
           "python run.py -m +experiment=fig16a_latency_prompt_smoke",
           "python run.py -m +experiment=fig16b_latency_model_smoke",
           "python run.py -m +experiment=fig17_alpha_latency_smoke")


def latency_table(rows: pd.DataFrame) -> pd.DataFrame:
    return T.table(rows, "latency")


RECOMMENDED = R.at_selected(
    "python run.py -m +experiment=fig14_15_latency_batch_smoke +point=infinigen_selected method.budget=0.2", "smollm2-135m")


# what a CPU row measures (decode_ms_median: the step's wall time, no link) and what it adds a modelled PCIe link to
# (modelled_decode_ms_per_token: measured compute + the bytes it moves over task.link_gbps, overlapped as the runtime
# would): both are shown, labelled, never one for the other
MEASURES = (("decode_ms_median", "measured decode ms/token (no link on a CPU)"),
            ("modelled_decode_ms_per_token", "measured compute + modelled link, ms/token"))


def group_line(part: pd.DataFrame, gen: pd.DataFrame) -> tuple[str, dict[str, float]]:
    """InfiniGen's (`gen`) decode step against each other method's at one model, batch and prompt, on each measure,
    when every row shares commit, device, threads, dtype and shape (like.check); else a refusal naming the
    difference and the command that re-measures them together."""
    head = part.iloc[0]
    where = f"{head['model']}, batch {num(head['batch_size'])}, prompt {num(head['prompt_len'], 5)}"
    ours = gen.iloc[0]
    unlike = []
    for _, row in part.drop(gen.index).iterrows():
        try:
            L.check(ours, row, "speed")
        except L.Unlike as err:
            unlike.append(f"{row['method']}: {err}")
    for _, row in gen.iloc[1:].iterrows():
        try:
            L.check(ours, row, "speed")
        except L.Unlike as err:
            unlike.append(f"infinigen: {err}")
    if unlike:
        return (f"{where}: refused: the rows are not one build, device and thread count ({'; '.join(unlike[:3])}"
                f"{' ...' if len(unlike) > 3 else ''}); `{RERUN}` re-measures them together", {})
    parts, ratios = [], {}
    for column, label in MEASURES:
        values = pd.to_numeric(C.column(part, f"metrics.{column}"), errors="coerce")
        if values.isna().all():
            continue
        mine = values[gen.index].median()
        others = values.drop(gen.index).groupby(part.drop(gen.index)["method"]).median()
        ratios |= {f"{m} ({column})": v / mine for m, v in others.items()}
        parts.append(f"{label}: InfiniGen {num(mine)}; others over InfiniGen: "
                     + ", ".join(f"{m} {num(v / mine)}x" for m, v in others.items()))
    commit = L.short_commit(ours.get("meta.git_commit"))
    return (f"{where} (commit {commit}, {ours.get('meta.device')} x {num(ours.get('meta.threads'))} threads): "
            + "; ".join(parts), ratios)


RERUN = "python run.py -m +experiment=fig14_15_latency_batch_smoke force=true"


def c7_verdict(rows: pd.DataFrame) -> list[str]:
    """InfiniGen's decode step against each other method per model, batch and prompt, at the recommended setting
    first, then at the other settings the rows hold (named), each only among rows of one build and machine."""
    data, y = latency_rows(rows)
    if y is None or not (data["method"] == "infinigen").any():
        return needs("latency rows of InfiniGen and the baselines")
    recommended = R.is_recommended(data)
    ours, others = [], []
    for _, part in data.groupby(["model", "batch_size", "prompt_len"]):
        gen = part[part["method"] == "infinigen"]
        if gen.empty or gen.shape[0] == part.shape[0]:
            continue
        rec = gen[recommended[gen.index]]
        if not rec.empty:
            ours.append(group_line(part.drop(gen.index.difference(rec.index)), rec)[0])
        for _, rest in gen[~recommended[gen.index]].groupby(C.curve_labels(gen[~recommended[gen.index]])):
            others.append(f"at {R.names(rest)}: {group_line(part.drop(gen.index.difference(rest.index)), rest)[0]}")
    if not ours and not others:
        return needs("latency rows of InfiniGen and a baseline at the same batch and prompt")
    gen = data[data["method"] == "infinigen"]
    if not ours:
        return [R.missing(gen, RECOMMENDED), *others]
    return [f"{R.lead(gen)}: {ours[0]}", *(f"at the recommended setting: {line}" for line in ours[1:]), *others]


def c7_status(rows: pd.DataFrame) -> list[Status]:
    """On this CPU, measured: is InfiniGen's decode step faster than full offloading's (the paper's baseline)? Per
    shape, offload's median step over InfiniGen's with its interval over the runs' decode steps (P.step_time_ratio):
    holds where the interval is wholly above 1, does not hold where wholly below."""
    data, y = latency_rows(rows)
    claim = "C7 (this CPU, measured): InfiniGen decodes faster than full offload"
    if y is None:
        return [Status(claim, "not measured", "")]
    rec = data[(data["method"] == "infinigen") & R.is_recommended(data)]
    shapes = []
    for _, part in data.groupby(["model", "batch_size", "prompt_len"]):
        gen = part[part.index.isin(rec.index)]
        if gen.empty or not (part["method"] == "offload").any():
            continue
        _, ratios = group_line(part.drop(part.index[(part["method"] == "infinigen") & ~part.index.isin(gen.index)]),
                               gen)
        if "offload (decode_ms_median)" not in ratios:
            continue
        offload = part[part["method"] == "offload"].iloc[0]
        try:
            effect = P.step_time_ratio(gen.iloc[0].get("metrics.decode_ms_steps"),
                                       offload.get("metrics.decode_ms_steps"))
        except P.Unpaired:
            ratio = ratios["offload (decode_ms_median)"]
            effect = P.Effect(ratio, math.nan, math.nan, 0, "speed")
        shapes.append((num(part["batch_size"].iloc[0]), num(part["prompt_len"].iloc[0], 5), effect))
    if not shapes:
        return [Status(claim, "not measured", "no offload and InfiniGen rows of one build at one shape")]
    sides = [P.side(e, 1.0, below=False) for _, _, e in shapes]
    verdict = (sides[0] if len(set(sides)) == 1 else P.OPEN if P.OPEN in sides else "holds at some shapes")
    return [Status(claim, verdict, "; ".join(f"batch {b} x {p}: offload / InfiniGen {e.text()}" for b, p, e in shapes)
                   + " (medians; the interval is over one run's decode steps each, not run-to-run drift)")]


SECTION = Section(
    "c7_speed", "C7. Speed",
    "InfiniGen's decode is faster than full offloading, H2O and quantisation at large batches and long "
    "prompts (paper Figs. 14-16).", (*LATENCY, RECOMMENDED), latency_table, c7_verdict, figure_of("fig14_16_latency"),
    note="Measured CPU latencies are not the paper's setting (a GPU with the KV cache in host memory): on a CPU "
         "nothing crosses a link, so the measured decode step shows what a method's own work costs; the second "
         "measure adds the bytes each method moves over a modelled PCIe link (task.link_gbps) to the measured "
         "compute. A speed ratio is computed only among rows of one clean commit, device, thread count, dtype and "
         "shape (analysis/like.py); otherwise the line refuses and names the command that re-measures them "
         "together. The GPU measurements are in the next section.",
    order=70, status=c7_status)
