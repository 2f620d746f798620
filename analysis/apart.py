"""Which config columns set stored rows apart: what a table must show, or group by, so that it never merges rows
whose configs differ (a task parameter such as dense_rows, a method hyperparameter such as speculate_from), and a
method setting's name in a table (`key_params`). Shared by the tables, the figures and the report."""

from __future__ import annotations

import math

import pandas as pd

from analysis.columns import param_columns, short, size_params


def key_params(df: pd.DataFrame) -> pd.Series:
    """Per row: the method's KV-size hyperparameters plus those that vary among its rows here."""
    out = pd.Series("", index=df.index, dtype=object)
    for method, rows in df.groupby("method", sort=False):
        cols = [c for c in param_columns(rows) if rows[c].notna().any()]
        keep = [c for c in cols if c.split(".", 1)[1] in size_params(method, rows)
                or rows[c].map(short).nunique(dropna=False) > 1]
        for i, row in rows.iterrows():
            out[i] = ", ".join(f"{c.split('.', 1)[1]}={short(row[c])}" for c in keep if not _missing(row[c]))
    return out


def _missing(value) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


# task parameters that never set two rows' results apart (the task's name is the row's `task`)
IGNORED_TASK_PARAMS = {"name"}
# ppl task parameters the ppl table shows whenever they vary among its rows (dataset, seq_len and the windows scored
# have columns of their own)
PPL_SHOWN = ("dense_rows", "skip_windows", "stride")


def config_columns(rows: pd.DataFrame) -> list[str]:
    """The columns in which two rows' configs can differ: the model, the method's hyperparameters (but
    columns.IGNORED_PARAMS: paths, bookkeeping) and the task's parameters."""
    return [c for c in rows.columns if c == "model" or c in param_columns(rows)
            or (c.startswith("task_params.") and c.split(".", 1)[1] not in IGNORED_TASK_PARAMS)]


def as_text(values: pd.Series) -> pd.Series:
    """A config column as text, a missing value as ''."""
    return values.map(lambda v: "" if _missing(v) else short(v))


def varying(rows: pd.DataFrame, key: pd.Series | None = None, among: list[str] | None = None) -> list[str]:
    """The config columns (or `among`) whose values differ between rows with the same `key` (a Series on rows'
    index: what a table shows of them; None: all rows alike): what a table must show, or group by, so that it never
    merges rows whose configs differ."""
    cols = config_columns(rows) if among is None else [c for c in among if c in rows]
    if rows.empty or not cols:
        return []
    text = rows[cols].apply(as_text)
    key = pd.Series("", index=rows.index) if key is None else key.reindex(rows.index).astype(str)
    counts = text.groupby(key.to_numpy()).nunique()
    return [c for c in cols if (counts[c] > 1).any()]


def label(column: str) -> str:
    """A config column's name in a table: task_params.dense_rows -> dense_rows."""
    return column.split(".", 1)[1] if "." in column else column


def shown(values: pd.Series) -> pd.Series:
    """A config column as a table shows it: whole numbers as integers, anything else as its text."""
    if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
        numbers = pd.to_numeric(values, errors="coerce")
        finite = numbers.dropna()
        if finite.map(math.isfinite).all() and (finite % 1 == 0).all():
            return numbers.astype("Int64")
    return as_text(values)


def apart(out: pd.DataFrame, rows: pd.DataFrame, keys: list[str], always: tuple[str, ...] = (),
          after: str | None = None) -> list[str]:
    """Adds to `out` (a table with one line per row of `rows`, on the same index) a column for each task parameter
    of `always` that varies among its rows, then for each config column that varies among rows whose `keys` (and
    those columns) read the same, after `after` (default: the last of `keys`): no two lines of different configs
    read alike. Returns the added columns' names."""
    if out.empty:
        return []
    rows = rows.loc[out.index]
    cols = varying(rows, among=[f"task_params.{p}" for p in always])
    text = out[[k for k in keys if k in out]].map(fmt).agg(" | ".join, axis=1)
    key = text + rows[cols].apply(as_text).agg(" | ".join, axis=1) if cols else text
    cols += [c for c in varying(rows, key) if c not in cols]
    names = []
    at = (out.columns.get_loc(after) if after in out else max(out.columns.get_loc(k) for k in keys if k in out)) + 1
    for c in cols:
        name = label(c)
        if name in out or name in names:
            name = c.replace("method_params.", "method.").replace("task_params.", "task.")
        out.insert(at + len(names), name, shown(rows[c]))
        names.append(name)
    return names


def fmt(value) -> str:
    if _missing(value):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value).replace("|", "\\|")
