"""Reading the results store's rows: a column or metric of a flat frame (analysis.store.load), what names a
method setting (its hyperparameters, those that set its KV size apart), the measured relative KV size, and the
order of models. Shared by the figures, the tables and the report."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd

# hyperparameters that set a method's KV size (they place a point on a curve instead of naming a curve): rows carry
# them (method_params.size_params, from the method's `size_params`); these are for rows written before they did
LEGACY_SIZE_PARAMS = {"h2o": {"heavy", "recent"}, "quant": {"bits"}, "infinigen": {"alpha", "budget", "max_num_kv"},
               "oracle": {"budget", "alpha", "max_num_kv"}, "streaming": {"sinks", "recent"},
               "kivi": {"bits", "residual"}, "quest": {"budget", "page_size"}, "snapkv": {"budget", "window"}}
# method_params that do not change results (paths, bookkeeping) and never name a curve
IGNORED_PARAMS = {"name", "size_params", "calib_data_dir", "cache_dir", "track_recall"}
# models in order of parameter count (unknown models come after these, in store order)
MODEL_ORDER = ["tiny-llama", "tiny-opt", "tiny-llama-gqa", "tiny-gemma3", "smollm2-135m", "gemma3-270m", "opt-6.7b",
               "llama-2-7b", "mistral-7b", "qwen2.5-7b", "llama-3-8b", "opt-13b", "llama-2-13b", "opt-30b"]


def column(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df else pd.Series(np.nan, index=df.index, dtype=object)


def metric(df: pd.DataFrame, name: str) -> pd.Series:
    """metrics.<name> as float, falling back to metrics.stats[name] and then task_params.<name>."""
    out = pd.to_numeric(column(df, f"metrics.{name}"), errors="coerce")
    stats = column(df, "metrics.stats").map(lambda s: s.get(name) if isinstance(s, dict) else None)
    out = out.fillna(pd.to_numeric(stats, errors="coerce"))
    return out.fillna(pd.to_numeric(column(df, f"task_params.{name}"), errors="coerce")).astype(float)


def param_columns(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if c.startswith("method_params.") and c.split(".", 1)[1] not in IGNORED_PARAMS]


def short(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def size_params(method: str, rows: pd.DataFrame) -> set[str]:
    """The KV-size hyperparameters `rows` (of `method`) declare."""
    declared = [set(v) for v in column(rows, "method_params.size_params") if isinstance(v, (list, tuple))]
    return set().union(*declared) if declared else LEGACY_SIZE_PARAMS.get(method, set())



def curve_labels(df: pd.DataFrame, point_params: Callable[[str, pd.DataFrame], set[str]] = lambda m, r: set(),
                 shown: Callable[[str, pd.DataFrame], set[str]] = size_params) -> pd.Series:
    """A name per row for the curve it belongs to: the method, plus its `shown(method)` hyperparameters and
    those that differ between that method's rows here, except those that place a point on the curve
    (`point_params(method)`)."""
    labels = pd.Series("", index=df.index, dtype=object)
    for method, rows in df.groupby("method", sort=False):
        skip, show = point_params(method, rows), shown(method, rows)
        varying = [c for c in param_columns(rows)
                   if c.split(".", 1)[1] not in skip and rows[c].notna().any()
                   and (c.split(".", 1)[1] in show or rows[c].map(short).nunique(dropna=False) > 1)]
        for i, row in rows.iterrows():
            extra = ", ".join(f"{c.split('.', 1)[1]}={short(row[c])}" for c in varying)
            labels[i] = f"{method} ({extra})" if extra else method
    return labels


def per_panel(df: pd.DataFrame, point_params: Callable[[str, pd.DataFrame], set[str]] = lambda m, r: set()) -> pd.Series:
    """curve_labels within each panel, so a curve is named by what differs on its own panel."""
    labels = [curve_labels(rows, point_params) for _, rows in df.groupby("panel", sort=False)]
    return pd.concat(labels).reindex(df.index) if labels else pd.Series(dtype=object)


def bytes_ratio(df: pd.DataFrame) -> pd.Series:
    """Size of a cached entry relative to a 16-bit one: metrics/stats `kv_bytes_ratio` when the method reports
    it, else bits/16 for quant and kivi (codes only, as the paper's axis; fp16 scales add 4 bytes per group and
    kivi's fp residual more; cache_bytes has the measured total), else 1."""
    ratio = metric(df, "kv_bytes_ratio")
    bits = pd.to_numeric(column(df, "method_params.bits"), errors="coerce")
    quant = df["method"].isin(["quant", "kivi"]) & bits.notna()
    return ratio.fillna(pd.Series(np.where(quant, bits / 16, 1.0), index=df.index))


def with_kv(df: pd.DataFrame) -> pd.DataFrame:
    """Adds kv_pct: relative KV cache size in % = measured kv_fraction (share of cached entries attended; full =
    1) x bytes_ratio; and recall."""
    out = df.copy()
    kv = metric(out, "kv_fraction")
    kv = kv.where(~(kv.isna() & (out["method"] == "full")), 1.0)
    out["kv_pct"] = 100 * kv * bytes_ratio(out)
    out["recall"] = metric(out, "recall")
    return out


def of_task(df: pd.DataFrame, task: str) -> pd.DataFrame:
    if df.empty or "task" not in df:
        return pd.DataFrame(columns=["model", "method", "task"])
    return df[df["task"] == task].copy()


def models_by_size(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (MODEL_ORDER.index(n) if n in MODEL_ORDER else len(MODEL_ORDER), names.index(n)))


def ordered(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Rows by model size (MODEL_ORDER), then by `by`."""
    rank = {m: i for i, m in enumerate(models_by_size(df["model"]))}
    return df.assign(_rank=df["model"].map(rank)).sort_values(["_rank", *by], kind="stable").drop(columns="_rank")
