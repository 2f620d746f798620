"""lm-eval accuracy against full attention (claims C1, C2): per task and method setting the accuracy over n docs with
its 95% interval, and the difference from full attention's on the same docs.

Method and full score the same docs, so the difference is paired (analysis/paired.py): per doc, with a bootstrap
interval over docs and McNemar's exact p. Rows stored before rows kept per-doc results get the unpaired interval
1.96 x sqrt(se^2 + se_full^2) instead, and every line built on them says "unpaired". A mean over tasks is taken
over every doc of the tasks on which full attention is above chance (its 95% interval above one over the choices),
each doc weighted alike: a task at chance cannot tell a method's losses from guessing and only pulls the mean
towards 0.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis import tables as T
from analysis.report import recommended as R
from analysis.report.section import num

Z95 = 1.96
# a task's accuracy by guessing: one over its answer choices
CHANCE = {"copa": 1 / 2, "openbookqa": 1 / 4, "piqa": 1 / 2, "rte": 1 / 2, "winogrande": 1 / 2, "arc_easy": 1 / 4,
          "arc_challenge": 1 / 4, "sciq": 1 / 4, "boolq": 1 / 2}
SAME = ["model", "task", "shots", "protocol", "limit"]  # what full's row must share to be the reference
COLUMNS = ("model", "method", "params", "task", "shots", "protocol", "limit", "n", "acc", "ci", "kv_fraction",
           "rel_kv", "full_acc", "diff", "diff_lo", "diff_hi", "paired", "p", "outside", "recommended", "setting",
           "budget", "units", "full_units", "se")


def task_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per lm-eval (non-RULER) result: accuracy, n, its 95% half-width, the measured (relative) KV size,
    full's accuracy at the same SAME and the difference with its 95% interval [diff_lo, diff_hi] (`paired`: from
    per-doc results; else unpaired), `outside` whether 0 is outside that interval, `recommended` whether the row is
    InfiniGen at the recommended setting, `setting` an InfiniGen row's setting in words, `units` its per-doc
    results."""
    data = C.of_task(rows, "lm_eval")
    data = data[C.column(data, "metrics.benchmark").isna() & C.metric(data, "acc").notna()]
    cols = list(COLUMNS)
    if data.empty:
        return pd.DataFrame(columns=cols)
    kv = C.with_kv(data)["kv_pct"] / 100
    out = pd.DataFrame({
        "model": data["model"], "method": data["method"], "params": T.key_params(data),
        "task": C.column(data, "metrics.task").astype(str), "shots": C.metric(data, "num_fewshot"),
        "protocol": C.column(data, "metrics.protocol").astype(str),
        "limit": C.metric(data, "limit").map(lambda v: "all" if pd.isna(v) else f"{v:.0f}"),
        "n": C.metric(data, "n"), "acc": C.metric(data, "acc"), "se": C.metric(data, "acc_stderr"),
        "kv_fraction": kv / C.bytes_ratio(data), "rel_kv": kv, "recommended": R.is_recommended(data),
        "setting": [R.name(row) if row["method"] == "infinigen" else "" for _, row in data.iterrows()],
        "budget": C.column(data, "method_params.budget"), "units": C.column(data, "metrics.units"),
    }, index=data.index)
    full = per_doc_first(out[out["method"] == "full"]).drop_duplicates(SAME).set_index(SAME)
    out["ci"] = Z95 * out["se"]
    diffs = [difference(row, full.loc[key] if key in full.index else None)
             for key, (_, row) in zip(out[SAME].apply(tuple, axis=1), out.iterrows())]
    for i, name in enumerate(("full_acc", "diff", "diff_lo", "diff_hi", "paired", "p")):
        out[name] = [d[i] for d in diffs]
    out["full_units"] = [full.loc[key, "units"] if key in full.index else None
                         for key in out[SAME].apply(tuple, axis=1)]
    out["outside"] = [None if pd.isna(d) else not lo <= 0 <= hi
                      for d, lo, hi in zip(out["diff"], out["diff_lo"], out["diff_hi"])]
    extra = T.apart(out, data, ["model", "method", "params", "task", "shots", "limit"])
    out = T.ordered(out, ["task", "shots", "limit", "method", "rel_kv", "params"])
    return out[cols + extra].reset_index(drop=True)


def difference(row: pd.Series, full: pd.Series | None) -> tuple:
    """(full's acc, row - full, 95% low, high, paired?, McNemar p) of one task row against full's on it."""
    if full is None or row["method"] == "full":
        return (math.nan if full is None else full["acc"]), math.nan, math.nan, math.nan, False, math.nan
    try:
        effect = P.accuracy_difference(row["units"], full["units"])
        return full["acc"], effect.value, effect.low, effect.high, True, effect.p
    except P.Unpaired:
        half = Z95 * math.sqrt(row["se"] ** 2 + full["se"] ** 2)
        diff = row["acc"] - full["acc"]
        return full["acc"], diff, diff - half, diff + half, False, math.nan


def table(rows: pd.DataFrame) -> pd.DataFrame:
    """The Fig. 11 table: per method setting and task, n, accuracy with its 95% interval and the difference from
    full's with its 95% interval (paired where both rows kept per-doc results)."""
    data = task_rows(rows)
    if data.empty:
        return data
    others = data["method"] != "full"
    extra = [c for c in data.columns if c not in COLUMNS]  # what tables.apart added: configs that differ
    return pd.DataFrame({**{c: data[c] for c in extra},
        "method": data["method"], "params": data["params"], "task": data["task"],
        "shots": data["shots"].astype("Int64"), "docs": data["limit"], "n": data["n"].astype("Int64"),
        "acc (%)": 100 * data["acc"], "± 95% (points)": 100 * data["ci"], "rel. KV size (%)": 100 * data["rel_kv"],
        "Δ full (points)": (100 * data["diff"]).where(others),
        "Δ 95% interval (points)": [f"{100 * lo:+.1f} to {100 * hi:+.1f}" if o and pd.notna(lo) else ""
                                    for o, lo, hi in zip(others, data["diff_lo"], data["diff_hi"])],
        "interval": [("paired" if p else "unpaired") if o and pd.notna(d) else ""
                     for o, p, d in zip(others, data["paired"], data["diff"])],
    })


def docs(limit: str) -> str:
    return "every doc of each task" if limit == "all" else f"up to the first {limit} docs of each task"


def points(x: float) -> str:
    """An accuracy difference in points (percentage points)."""
    return f"{100 * x:+.1f}"


def above_chance(data: pd.DataFrame) -> dict[tuple[str, str], set[str]]:
    """(model, docs per task) -> the tasks on which full attention's accuracy is above chance (95% interval)."""
    full = data[(data["method"] == "full") & data["task"].isin(CHANCE)]
    return {key: set(part.loc[part["acc"] - part["ci"] > part["task"].map(CHANCE), "task"])
            for key, part in full.groupby(["model", "limit"])}


def chance_lines(data: pd.DataFrame) -> list[str]:
    """Per docs-per-task size, the tasks on which full attention's accuracy is above chance (its 95% interval
    above one over the choices) and those on which it is not (at chance, or below it, as SmolLM2 on OpenBookQA):
    there a method's difference from full's says little about what it keeps of the context."""
    full = most_docs_first(data[(data["method"] == "full") & data["task"].isin(CHANCE)])
    out = []
    for limit, part in full.groupby("limit", sort=False):
        part = per_doc_first(part).drop_duplicates(["model", "task"]).sort_values("task", kind="stable")
        clear = part["acc"] - part["ci"] > part["task"].map(CHANCE)
        named = [f"{r.task} {100 * r.acc:.1f}% (chance {100 * CHANCE[r.task]:.0f}%)" for r in part.itertuples()]
        out.append(f"lm-eval, full attention ({docs(limit)}): above chance (95% interval) on "
                   f"{', '.join(n for n, c in zip(named, clear) if c) or 'no task'}"
                   + (f"; not on {', '.join(n for n, c in zip(named, clear) if not c)}; the pooled differences "
                      "above leave those out" if not clear.all() else ""))
    return out


def per_doc_first(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` with those that keep per-doc results first (stable otherwise): where two full-attention runs score
    the same docs, the one a paired comparison can use is the reference."""
    kept = rows["units"].map(lambda u: isinstance(u, dict) and bool(u))
    return rows.loc[kept.sort_values(ascending=False, kind="stable").index]


def most_docs_first(data: pd.DataFrame) -> pd.DataFrame:
    """`data` with its rows over every doc first, then by docs per task, most first (stable within a size)."""
    docs_per_task = data["limit"].map(lambda v: math.inf if v == "all" else float(v))
    return data.loc[docs_per_task.sort_values(ascending=False, kind="stable").index]


def docs_range(n: pd.Series) -> str:
    """How many docs each task scored: one number, or the range."""
    sizes = sorted(set(n.dropna().astype(int)))
    return f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"


def pooled(part: pd.DataFrame, tasks: set[str]) -> P.Effect | None:
    """`part`'s accuracy minus its reference's (`units` against `full_units`, or another method's the caller put
    there) over every doc of `tasks`, paired; None when a row carries no per-doc results."""
    pairs = [(r.units, r.full_units) for r in part[part["task"].isin(tasks)].sort_values("task").itertuples()]
    if not pairs:
        return None
    try:
        return P.accuracy_difference(*P.pooled(pairs))
    except P.Unpaired:
        return None


def setting_line(part: pd.DataFrame, name: str, informative: set[str]) -> tuple[str, P.Effect | None]:
    """One InfiniGen setting at one KV size against full: over the docs of the `informative` tasks (paired, against
    the margin), then each task's difference with its interval. Returns (line, the pooled effect or None)."""
    part = part.dropna(subset=["diff"])
    if part.empty:
        return f"{name}: no full-attention row on the same tasks, shots and docs to compare with", None
    head = f"{name} (kv_fraction {num(100 * part['kv_fraction'].mean())}%)"
    tasks = ", ".join(f"{r.task} {points(r.diff)} [{points(r.diff_lo)}, {points(r.diff_hi)}]"
                      for r in part.itertuples())
    effect = pooled(part, informative) if part["paired"].all() else None
    if effect is None:
        kind = "paired" if part["paired"].all() else "unpaired: rows without per-doc results"
        why = "" if informative & set(part["task"]) else "; full attention is above chance on none of them"
        return f"{head}: accuracy minus full's in points, 95% interval ({kind}): {tasks}{why}", None
    return (f"{head}: over the {effect.n} docs of {', '.join(sorted(informative & set(part['task'])))} (full above "
            f"chance; each doc alike): {effect.text()}; {P.margin_text('accuracy')}: {effect.closeness()}; per task: "
            f"{tasks}", effect)


def zero_shot_every_doc(data: pd.DataFrame) -> pd.DataFrame:
    """task_rows over every doc of each task, zero-shot: the size the lm-eval claims are settled at."""
    return data[(data["shots"] == 0) & (data["limit"] == "all")] if not data.empty else data


def versus(method: str, reference: str, rows: pd.DataFrame) -> tuple[P.Effect | None, pd.DataFrame, set[str]]:
    """`method`'s accuracy minus `reference`'s (another method, or full), paired over every doc of the zero-shot
    tasks on which full attention is above chance, each doc alike: (the effect or None, `method`'s task rows, those
    tasks)."""
    data = zero_shot_every_doc(task_rows(rows))
    mine, ref = data[data["method"] == method], data[data["method"] == reference]
    if mine.empty or ref.empty:
        return None, mine, set()
    tasks = above_chance(data).get((mine["model"].iloc[0], "all"), set())
    both = mine.merge(per_doc_first(ref).drop_duplicates("task")[["task", "units"]], on="task", suffixes=("", "_ref"))
    return pooled(both.assign(full_units=both["units_ref"]), tasks), mine, tasks & set(both["task"])
