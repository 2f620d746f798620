"""Markdown tables from the results store, for the README:

    python -m analysis.tables --results results --table ppl|lm_eval|accuracy|latency|eviction|successors|ruler

One line per stored row (ppl, lm_eval: one per lm-eval task, latency), per method setting for `accuracy` (lm-eval
acc, one column per task), or per (model, dataset) for `eviction` (InfiniGen Table 2: perplexity by KV pool
setting), per method setting for `successors` (its ppl and latency rows side by side), per method setting for
`ruler` (RULER score, one column per task @ length; only the cells where full attention scores >= 0.1). `params` lists a
method's KV-size hyperparameters and any other hyperparameter that differs between that method's rows in the table. No
table merges rows whose configs differ: a task parameter that varies among rows which would otherwise read the same
(task.dense_rows, task.stride, ...) gets a column of its own, and the tables that aggregate (eviction, accuracy,
successors, ruler) group by every parameter that varies. kv_fraction is measured (share of
cached entries attended); rel. KV size = kv_fraction x entry size vs 16 bits (quant: bits/16); recall
(InfiniGen / oracle) is the share of the true attention mass carried by the tokens a method fetched; byte counts appear when the task
reported them.
"""

from __future__ import annotations

import argparse
import difflib
import math

import pandas as pd

from analysis import paired, store
from analysis.columns import bytes_ratio, column, metric, ordered, param_columns, short, size_params  # noqa: F401
from analysis.apart import (IGNORED_TASK_PARAMS, PPL_SHOWN, _missing, apart, as_text, config_columns, fmt,  # noqa: F401
                            key_params, label, shown, varying)
from analysis.figures.ruler import ruler_cells
from analysis.figures.table2 import eviction_rows

TABLES = ("ppl", "lm_eval", "accuracy", "latency", "eviction", "successors", "ruler", "paired")


def markdown(df: pd.DataFrame, right: set[str] = frozenset()) -> str:
    """A GitHub markdown table; numeric columns are right-aligned."""
    head = "| " + " | ".join(df.columns) + " |"
    rule = "|" + "|".join("---:" if c in right else "---" for c in df.columns) + "|"
    body = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body])


def bytes_columns(df: pd.DataFrame) -> dict[str, pd.Series]:
    """metrics.*bytes* columns, in MiB."""
    return {f"{c.split('.', 1)[1]} (MiB)": pd.to_numeric(df[c], errors="coerce") / 2**20
            for c in df.columns if c.startswith("metrics.") and "bytes" in c}


def kv_columns(rows: pd.DataFrame) -> dict[str, pd.Series]:
    return {
        "kv_fraction": metric(rows, "kv_fraction"),
        "rel. KV size": metric(rows, "kv_fraction") * bytes_ratio(rows),
        "recall": metric(rows, "recall"),
        **bytes_columns(rows),
    }


def base(rows: pd.DataFrame) -> dict[str, pd.Series]:
    return {"model": rows["model"], "method": rows["method"], "params": key_params(rows)}


def data_id(rows: pd.DataFrame) -> pd.Series:
    """The first 8 hex digits of the sha256 of the data a row read (rows stored before it was recorded: empty), so
    one dataset name over two different texts shows as two datas."""
    return column(rows, "data.sha256").map(lambda h: h[:8] if isinstance(h, str) else None)


def ppl_table(df: pd.DataFrame) -> pd.DataFrame:
    rows = df[df["task"] == "ppl"]
    out = pd.DataFrame(base(rows) | {
        "dataset": column(rows, "task_params.dataset"),
        "data": data_id(rows),
        "seq_len": metric(rows, "seq_len").astype("Int64"),
        "windows": metric(rows, "windows").astype("Int64"),
        "ppl": metric(rows, "ppl"),
        **kv_columns(rows),
    })
    extra = apart(out, rows, ["model", "method", "params", "dataset", "data", "seq_len", "windows"], PPL_SHOWN)
    return ordered(out, ["dataset", "data", "seq_len", *extra, "method", "params"])


def lm_eval_table(df: pd.DataFrame) -> pd.DataFrame:
    return lm_eval_lines(df)[0]


def lm_eval_lines(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The lm_eval table and the config columns it added to keep rows apart."""
    rows = df[df["task"] == "lm_eval"]
    out = pd.DataFrame(base(rows) | {
        "task": column(rows, "metrics.task"),
        "data": data_id(rows),
        "shots": metric(rows, "num_fewshot").astype("Int64"),
        "protocol": column(rows, "metrics.protocol"),
        "limit": metric(rows, "limit").astype("Int64"),
        "n": metric(rows, "n").astype("Int64"),
        "acc": metric(rows, "acc"),
        "± stderr": metric(rows, "acc_stderr"),
        "acc_norm": metric(rows, "acc_norm"),
        "word ppl": metric(rows, "word_perplexity"),
        **kv_columns(rows),
    })
    extra = apart(out, rows, ["model", "method", "params", "task", "data", "shots", "protocol", "limit"])
    return ordered(out, ["task", "shots", *extra, "method", "params"]), extra


def latency_table(df: pd.DataFrame) -> pd.DataFrame:
    rows = df[df["task"] == "latency"]
    out = pd.DataFrame(base(rows) | {
        "batch": metric(rows, "batch_size").astype("Int64"),
        "prompt": metric(rows, "prompt_len").astype("Int64"),
        "gen": metric(rows, "gen_len").astype("Int64"),
        "decode ms/token": metric(rows, "decode_ms_median"),
        "modelled ms/token": metric(rows, "modelled_decode_ms_per_token"),
        "prefill s": metric(rows, "prefill_s"),
        "tokens/s": metric(rows, "tokens_per_s"),
        "kv_fraction": metric(rows, "kv_fraction"),
        **bytes_columns(rows),
        "device": column(rows, "meta.device"),
    })
    extra = apart(out, rows, ["model", "method", "params", "batch", "prompt", "gen", "device"], after="gen")
    return ordered(out, ["batch", "prompt", *extra, "method", "params"])


def eviction_table(df: pd.DataFrame) -> pd.DataFrame:
    rows = eviction_rows(df)
    if rows.empty:
        return pd.DataFrame(columns=["model", "method", "params", "dataset", "seq_len"])
    # one line per group (eviction_rows: every parameter but the pool's alike), its InfiniGen hyperparameters in
    # `params` (those that vary among the groups included) and a column for each other task parameter that varies
    tasks = [c for c in varying(rows) if c.startswith("task_params.")
             and c not in ("task_params.dataset", "task_params.seq_len")]
    extra = [label(c) if label(c) not in ("model", "method", "params", "dataset", "seq_len") else c for c in tasks]
    rows = rows.assign(seq_len=metric(rows, "seq_len").astype("Int64"),
                       **{name: shown(rows[c]).map(fmt) for name, c in zip(extra, tasks)})
    index = ["model", "method", "params", "dataset", "seq_len", *extra]
    wide = rows.pivot_table(index=[*index, "group"], columns="pool", values="ppl", aggfunc="mean").reset_index()
    pools = ["pool 100%"] + sorted(c for c in wide.columns if str(c).startswith("pool ") and c != "pool 100%")
    wide = wide[[*index, *[p for p in pools if p in wide.columns]]]
    wide.columns.name = None
    return ordered(wide, ["dataset", *extra, "params"])


def accuracy_table(df: pd.DataFrame) -> pd.DataFrame:
    """lm_eval accuracy, one line per method setting (and shots, protocol, limit), one column per task (acc; the
    mean over the tasks last), with the setting's kv_fraction averaged over its tasks."""
    long, extra = lm_eval_lines(df)
    long = long[long["acc"].notna()]
    if long.empty:
        return pd.DataFrame(columns=["model", "method", "params"])
    long = long.assign(limit=long["limit"].astype(str))  # a missing limit (every doc) stays a group: "<NA>"
    # a config column that keeps rows apart (lm_eval_lines) splits the settings too; as text, so a gap is a group
    long = long.assign(**{c: long[c].map(fmt) for c in extra})
    index = ["model", "method", "params", "shots", "protocol", "limit", *extra]
    wide = long.pivot_table(index=index, columns="task", values="acc", aggfunc="mean").reset_index()
    tasks = sorted(long["task"].unique())
    wide["mean acc"] = wide[tasks].mean(axis=1)
    kv = long.groupby(index, dropna=False)["kv_fraction"].mean().rename("kv_fraction").reset_index()
    wide = wide.merge(kv, on=index, how="left")
    wide.columns.name = None
    return ordered(wide[[*index, *tasks, "mean acc", "kv_fraction"]], ["shots", "protocol", "kv_fraction"])


def decoded_nll(rows: pd.DataFrame) -> pd.Series:
    """Mean NLL of the rows past the dense prompt (task.dense_rows): the buckets of metrics.nll_by_chunk that start
    there, weighted by their size (a bucket straddling the prompt's end: NaN, never a mix)."""
    def one(row):
        chunks, dense = row.get("metrics.nll_by_chunk"), row.get("task_params.dense_rows")
        if not isinstance(chunks, dict) or not dense:
            return math.nan
        starts = sorted(int(c) for c in chunks)
        if dense not in starts:
            return math.nan
        seq_len = int(row.get("task_params.seq_len"))
        spans = [(s, (starts[i + 1] if i + 1 < len(starts) else seq_len) - s) for i, s in enumerate(starts) if s >= dense]
        return sum(chunks[str(s)] * n for s, n in spans) / sum(n for _, n in spans)
    return rows.apply(one, axis=1).astype(float)


def successors_table(df: pd.DataFrame) -> pd.DataFrame:
    """One line per method setting: its perplexity run (ppl over every row and over the decoded rows only,
    kv_fraction, recall) beside its latency run's link traffic and device-resident bytes."""
    rows = df[df["task"].isin(["ppl", "latency"])]
    rows = rows.assign(params=key_params(rows))
    ppl, lat = rows[rows["task"] == "ppl"], rows[rows["task"] == "latency"]
    left = pd.DataFrame({
        "model": ppl["model"], "method": ppl["method"], "params": ppl["params"],
        "prompt": metric(ppl, "dense_rows").astype("Int64"), "windows": metric(ppl, "windows").astype("Int64"),
        "ppl": metric(ppl, "ppl"), "decoded ppl": decoded_nll(ppl).map(math.exp),
        "kv_fraction": metric(ppl, "kv_fraction"), "recall": metric(ppl, "recall"),
    })
    right = pd.DataFrame({
        "model": lat["model"], "method": lat["method"], "params": lat["params"],
        "h2d KiB/token": metric(lat, "h2d_bytes_per_token") / 2**10,
        "device KV MiB": metric(lat, "device_kv_bytes") / 2**20,
        "host pool MiB": metric(lat, "host_pool_bytes") / 2**20,
    })
    extra = apart(left, ppl, ["model", "method", "params", "prompt", "windows"])
    lat_extra = apart(right, lat, ["model", "method", "params"])
    right = right.rename(columns={c: f"latency {c}" for c in lat_extra})
    out = left.merge(right, on=["model", "method", "params"], how="outer")
    return ordered(out, ["method", *extra, *(f"latency {c}" for c in lat_extra), "kv_fraction"])


def ruler_table(df: pd.DataFrame) -> pd.DataFrame:
    """RULER score per method setting (mean measured kv_fraction), one column per informative task @ length (full
    attention >= figures/ruler.py RULER_INFORMATIVE there), and their mean."""
    cells = ruler_cells(df)
    cells = cells[cells["informative"]]
    if cells.empty:
        return pd.DataFrame(columns=["model", "method"])
    cells["cell"] = cells["task"] + " @ " + cells["length"].map(lambda n: f"{n:.0f}")
    wide = cells.pivot_table(index=["model", "setting"], columns="cell", values="score").reset_index()
    info = cells.groupby(["model", "setting"], as_index=False).agg(kv_fraction=("kv_fraction", "mean"),
                                                                   mean_score=("score", "mean"))
    out = info.merge(wide, on=["model", "setting"]).rename(columns={"setting": "method",
                                                                    "mean_score": "mean score (0-1)"})
    return out.sort_values(["model", "kv_fraction", "method"], ascending=[True, False, True])


BUILDERS = {"ppl": ppl_table, "lm_eval": lm_eval_table, "accuracy": accuracy_table, "latency": latency_table,
            "eviction": eviction_table, "successors": successors_table, "ruler": ruler_table, "paired": paired.table}
TEXT = {"model", "method", "params", "dataset", "data", "task", "protocol", "device"}


def table(df: pd.DataFrame, name: str) -> pd.DataFrame:
    if df.empty or "task" not in df:
        return pd.DataFrame(columns=["model", "method", "params"])
    out = BUILDERS[name](df)
    return out.dropna(axis=1, how="all").reset_index(drop=True) if not out.empty else out


def matches(col: pd.Series, values: list[str]) -> pd.Series:
    """col equals one of values: as text, or as numbers (a column with gaps reads 8 as 8.0)."""
    mask = col.astype(str).isin(values)
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        return mask
    return mask | pd.to_numeric(col, errors="coerce").isin(numbers)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results", help="results store folder (run.py results_dir)")
    parser.add_argument("--table", choices=TABLES, required=True)
    parser.add_argument("--model", nargs="*", help="only these models")
    parser.add_argument("--where", nargs="*", default=[], metavar="COLUMN=VALUE",
                        help="only rows whose store column equals the value (or one of a,b,c), e.g. method=full,h2o")
    args = parser.parse_args(argv)
    df = store.load(args.results)
    if args.model and not df.empty:
        df = df[df["model"].isin(args.model)]
    for clause in args.where:
        column, _, value = clause.partition("=")
        if df.empty:
            break
        if column not in df:
            near = difflib.get_close_matches(column, list(df.columns), n=3, cutoff=0.5)
            raise SystemExit(f"--where {clause!r}: the store has no column {column!r}" + (f"; close: {near}" if near else ""))
        df = df[matches(df[column], value.split(","))]
    out = table(df, args.table)
    text = markdown(out, right={c for c in out.columns if c not in TEXT})
    print(text)
    return text


if __name__ == "__main__":
    main()
