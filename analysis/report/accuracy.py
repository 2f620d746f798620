"""lm-eval accuracy with its sampling error (claims C1, C2): per task and method setting the accuracy over n docs,
its 95% interval (1.96 x lm-eval's acc_stderr), and the difference from full attention's on the same task, shots,
protocol and docs, with the 95% interval of that difference.

The difference's interval treats the two accuracies as independent, 1.96 x sqrt(se^2 + se_full^2); both score the
same docs, whose agreement makes the true interval narrower, so a difference called outside it is outside the
paired one too, and one called inside may not be. A mean over tasks weighs each task alike, its stderr
sqrt(sum se^2) / tasks.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis import columns as C
from analysis import tables as T
from analysis.report import recommended as R
from analysis.report.section import num

Z95 = 1.96
# a task's accuracy by guessing: one over its answer choices
CHANCE = {"copa": 1 / 2, "openbookqa": 1 / 4, "piqa": 1 / 2, "rte": 1 / 2, "winogrande": 1 / 2}
SAME = ["model", "task", "shots", "protocol", "limit"]  # what full's row must share to be the reference


def task_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per lm-eval (non-RULER) result: accuracy, n, its 95% half-width, the measured (relative) KV size,
    full's accuracy at the same SAME and the difference with its 95% half-width; `outside` says whether the
    difference is outside it, `recommended` whether the row is InfiniGen at the recommended setting, `setting` an
    InfiniGen row's setting in words."""
    data = C.of_task(rows, "lm_eval")
    data = data[C.column(data, "metrics.benchmark").isna() & C.metric(data, "acc").notna()]
    cols = ["model", "method", "params", "task", "shots", "protocol", "limit", "n", "acc", "ci", "kv_fraction",
            "rel_kv", "full_acc", "diff", "diff_ci", "outside", "recommended", "setting", "budget"]
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
        "budget": C.column(data, "method_params.budget"),
    }, index=data.index)
    full = out[out["method"] == "full"].drop_duplicates(SAME).set_index(SAME)[["acc", "se"]]
    ref = out[SAME].apply(tuple, axis=1).map(lambda k: full.loc[k] if k in full.index else None)
    out["full_acc"] = [r["acc"] if r is not None else math.nan for r in ref]
    full_se = pd.Series([r["se"] if r is not None else math.nan for r in ref], index=out.index)
    out["ci"] = Z95 * out["se"]
    out["diff"] = out["acc"] - out["full_acc"]
    out["diff_ci"] = Z95 * (out["se"] ** 2 + full_se ** 2) ** 0.5
    out["outside"] = (out["diff"].abs() > out["diff_ci"]).where(out["diff"].notna())
    out = T.ordered(out, ["task", "shots", "limit", "method", "rel_kv", "params"])
    return out[cols + ["se"]].reset_index(drop=True)


def table(rows: pd.DataFrame) -> pd.DataFrame:
    """The Fig. 11 table: per method setting and task, n, accuracy with its 95% interval and the difference from
    full's with its interval, and whether the difference is outside it."""
    data = task_rows(rows)
    if data.empty:
        return data
    others = data["method"] != "full"
    return pd.DataFrame({
        "method": data["method"], "params": data["params"], "task": data["task"],
        "shots": data["shots"].astype("Int64"), "docs": data["limit"], "n": data["n"].astype("Int64"),
        "acc": data["acc"], "± 95%": data["ci"], "rel. KV size": data["rel_kv"],
        "Δ full": data["diff"].where(others), "Δ ± 95%": data["diff_ci"].where(others),
        "outside": data["outside"].where(others).map(
            lambda v: "" if pd.isna(v) else ("yes" if v else "no")),
    })


def mean_over_tasks(part: pd.DataFrame) -> dict:
    """A setting's accuracy and difference from full averaged over its tasks, with their 95% half-widths."""
    k = len(part)
    diff_ci = Z95 * math.sqrt(((part["diff_ci"] / Z95) ** 2).sum()) / k
    return {"acc": part["acc"].mean(), "ci": Z95 * math.sqrt((part["se"] ** 2).sum()) / k,
            "diff": part["diff"].mean(), "diff_ci": diff_ci, "tasks": k, "n": part["n"].min()}


def docs_range(n: pd.Series) -> str:
    """How many docs each task scored: one number, or the range."""
    sizes = sorted(set(n.dropna().astype(int)))
    return f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"


def most_docs_first(data: pd.DataFrame) -> pd.DataFrame:
    """`data` with its rows over every doc first, then by docs per task, most first (stable within a size)."""
    docs_per_task = data["limit"].map(lambda v: math.inf if v == "all" else float(v))
    return data.loc[docs_per_task.sort_values(ascending=False, kind="stable").index]


def docs(limit: str) -> str:
    return "every doc of each task" if limit == "all" else f"up to the first {limit} docs of each task"


def points(x: float) -> str:
    """An accuracy difference in points (percentage points)."""
    return f"{100 * x:+.1f}"


def significance(diff: float, ci: float) -> str:
    if pd.isna(diff):
        return "nothing to compare with"
    if pd.isna(ci):
        return "no stderr recorded: no interval"
    return "outside the 95% interval" if abs(diff) > ci else "inside the 95% interval (not significant)"


def chance_lines(data: pd.DataFrame) -> list[str]:
    """Per docs-per-task size, the tasks on which full attention's accuracy is above chance (its 95% interval
    above one over the choices) and those on which it is not (at chance, or below it, as SmolLM2 on OpenBookQA):
    there a method's difference from full's says little about what it keeps of the context."""
    full = most_docs_first(data[(data["method"] == "full") & data["task"].isin(CHANCE)])
    out = []
    for limit, part in full.groupby("limit", sort=False):
        clear = part["acc"] - part["ci"] > part["task"].map(CHANCE)
        named = [f"{r.task} {100 * r.acc:.1f}% (chance {100 * CHANCE[r.task]:.0f}%)" for r in part.itertuples()]
        out.append(f"lm-eval, full attention ({docs(limit)}): above chance (95% interval) on "
                   f"{', '.join(n for n, c in zip(named, clear) if c) or 'no task'}; not on "
                   f"{', '.join(n for n, c in zip(named, clear) if not c) or 'any task'}"
                   + ("; there the tasks cannot tell a method's losses from guessing" if not clear.all() else ""))
    return out


def setting_line(part: pd.DataFrame, name: str) -> str:
    """One InfiniGen setting at one KV size: the difference from full per task (and over the tasks), each against
    its interval, and which differences are outside it."""
    part = part.dropna(subset=["diff"])
    if part.empty:
        return f"{name}: no full-attention row on the same tasks, shots and docs to compare with"
    mean = mean_over_tasks(part)
    n = docs_range(part["n"])
    tasks = ", ".join(f"{r.task} {points(r.diff)} ± {100 * r.diff_ci:.1f}" for r in part.itertuples())
    out = [r.task for r in part.itertuples() if r.outside]
    line = (f"{name} (kv_fraction {num(100 * part['kv_fraction'].mean())}%): accuracy minus full's, in points, "
            f"± the 95% interval, over n = {n} docs per task: {tasks}; outside the interval: "
            f"{', '.join(out) if out else 'none'}")
    if mean["tasks"] > 1:
        line += (f"; mean over the {mean['tasks']} tasks {points(mean['diff'])} ± {100 * mean['diff_ci']:.1f}, "
                 f"{significance(mean['diff'], mean['diff_ci'])}")
    return line
