"""Beyond the paper: needle retrieval through the decode-mode cache."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis import tables as T
from analysis.figures.needle import needle_cells
from analysis.report.section import Section, figure_of, needs, num, on_every_model


def needle_numbers(rows: pd.DataFrame) -> pd.DataFrame:
    """Needle accuracy per (model, setting, length, depth), a cell's keys pooled over the runs of its setting as the
    figure pools them (figures/needle.py), except runs whose task parameters differ (seeds, filler, ...): those stay
    apart, the setting naming the parameters in brackets."""
    data = C.of_task(rows, "needle")
    if data.empty:
        return pd.DataFrame(columns=["model", "setting", "length", "depth", "accuracy", "n"])
    key = data["model"] + " | " + C.curve_labels(data)
    split = T.varying(data, key, among=[c for c in data.columns if c.startswith("task_params.")])
    names = (data[split].apply(T.as_text).apply(
        lambda r: " [" + ", ".join(f"{c.split('.', 1)[1]}={v}" for c, v in r.items() if v) + "]", axis=1)
        if split else pd.Series("", index=data.index))
    parts = []
    for name, part in data.groupby(names, sort=True):
        cells = needle_cells(part)
        parts.append(cells.assign(setting=cells["setting"] + name))
    cells = pd.concat(parts, ignore_index=True)
    cells["correct"] = cells["accuracy"] * cells["n"]
    pooled = cells.groupby(["model", "setting", "length", "depth"], as_index=False)[["correct", "n"]].sum()
    pooled["accuracy"] = pooled["correct"] / pooled["n"]
    return pooled.drop(columns="correct").sort_values(["model", "setting", "length", "depth"]).reset_index(drop=True)


def needle_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per setting and prompt length: the share of keys retrieved exactly at each needle depth."""
    numbers = needle_numbers(rows)
    if numbers.empty:
        return numbers
    wide = numbers.pivot_table(index=["setting", "length"], columns="depth", values="accuracy").reset_index()
    wide.columns = [c if isinstance(c, str) else f"accuracy @ depth {c:g}" for c in wide.columns]
    return wide.rename(columns={"length": "prompt (tokens)"})


def long_verdict(rows: pd.DataFrame) -> list[str]:
    out = []
    cells = needle_numbers(rows)
    if cells.empty:
        out += needs("needle rows")
    else:
        acc = cells.groupby("setting").apply(lambda c: (c["accuracy"] * c["n"]).sum() / c["n"].sum(),
                                             include_groups=False)
        n = int(cells.groupby("setting")["n"].sum().max())
        out.append(f"needle retrieval, share of {n} keys retrieved exactly: "
                   + ", ".join(f"{s} {num(100 * a)}%" for s, a in acc.sort_index().items()))
    return out + paired_lines(rows)


def paired_lines(rows: pd.DataFrame) -> list[str]:
    """Each setting's share of keys retrieved with its 95% interval over prompts, and its difference from full
    attention's paired per prompt (the same lengths, depths and seeds), against the 2-point margin."""
    data = C.of_task(rows, "needle")
    data = data[C.column(data, "metrics.units").map(lambda u: isinstance(u, dict) and bool(u.get("id")))] \
        if not data.empty else data
    if data.empty:
        return []
    data = data.assign(setting=C.curve_labels(data))
    full = data[data["method"] == "full"]
    out = []
    for setting, part in data.groupby("setting", sort=True):
        units = part["metrics.units"].iloc[0]
        share = P.mean(units["exact"])
        line = (f"{setting}: {num(100 * share.value)}% of {share.n} keys (95% interval {num(100 * share.low)}-"
                f"{num(100 * share.high)}%)")
        if not full.empty and part["method"].iloc[0] != "full":
            try:
                effect = P.accuracy_difference(units, full["metrics.units"].iloc[0], "exact")
                verdict = effect.closeness()
                settle = (f"; {P.settle_text(effect, P.margin('accuracy'), 'prompts')}" if verdict == P.OPEN else "")
                line += (f"; minus full's {effect.text().replace('docs', 'prompts')}; within 2 points of full's: "
                         f"{verdict}{settle}")
            except P.Unpaired as err:
                line += f"; against full: {err}"
        out.append(line)
    return out


SECTION = Section(
    "long_context", "Beyond the paper: long context and needle retrieval",
    "Pass-key retrieval through the method's decode-mode cache: query-aware selection keeps a needle that "
    "eviction (StreamingLLM's window) has dropped. Perplexity at long context: docs/long_context.md.",
    on_every_model("python run.py -m +experiment=needle_smollm2_smoke"),
    needle_table,
    long_verdict, figure_of("needle_heatmap"),
    order=130, per_model=True)
