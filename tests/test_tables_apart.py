"""Tables never merge rows that differ (issue 54, item 5): a table shows every config column that varies among rows
which would otherwise read the same, or groups by it. Each table of analysis/tables.py, and the report sections'
own tables, is built from a store whose two runs differ in one config column only (a task parameter it does not
show, an InfiniGen hyperparameter), with identical metrics: the runs stay on separate lines and no two lines read
alike. The committed store gets the same check for every section of the report."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from analysis import store
from analysis import tables as T
from analysis.report.sections import c5_eviction, gemma3_speed, long_context, ruler, successors

INFINIGEN = {"alpha": 8.0, "budget": 0.2, "partial_ratio": 0.5, "skip_layers": 2, "speculate_from": "block_input",
             "capacity": 1.0, "eviction": "counter", "size_params": ["alpha", "budget", "max_num_kv"]}
PPL_TASK = {"name": "ppl", "dataset": "wikitext2", "seq_len": 1024, "max_windows": 1, "dense_rows": 0,
            "skip_windows": 0, "stride": None}
LM_EVAL_TASK = {"name": "lm_eval", "tasks": ["copa"], "num_fewshot": 5, "limit": 8, "protocol": "paper",
                "fewshot_seed": 1234}
LATENCY_TASK = {"name": "latency", "batch_size": 1, "prompt_len": 384, "gen_len": 16, "timing": "measured",
                "schedule": "overlapped"}
RULER_TASK = {"name": "lm_eval", "tasks": ["niah_single_1"], "max_seq_lengths": [1024], "limit": 2}
NEEDLE_TASK = {"name": "needle", "lengths": [512], "depths": [0.5], "seeds": 2, "filler": "repeat"}


def lines(table: pd.DataFrame) -> list[str]:
    """The table's body as the report renders it (render.section_text: all-empty columns dropped)."""
    table = table.dropna(axis=1, how="all")
    return T.markdown(table).splitlines()[2:]


def duplicated(rendered: list[str]) -> list[str]:
    return [line for line, n in Counter(rendered).items() if n > 1]


def rows_of(digest: str, method: str, params: dict, task: dict, metrics: list[dict],
            model: str = "smollm2-135m") -> list[dict]:
    return [{"config_hash": digest, "model": model, "method": method, "task": task["name"],
             "method_params": {"name": method, **params}, "task_params": task, "metrics": m, "config": {},
             "meta": {"device": "cpu", "threads": 2}} for m in metrics]


def ppl_metrics(task: dict) -> list[dict]:
    chunks = {str(p): 3.0 for p in range(0, task["seq_len"], 256)}
    return [{"ppl": 20.0, "nll": math.log(20.0), "kv_fraction": 0.2, "recall": 0.9, "windows": 1,
             "seq_len": task["seq_len"], "dense_rows": 0, "nll_by_chunk": chunks}]


def lm_eval_metrics(task: dict) -> list[dict]:
    return [{"task": name, "acc": 0.6, "acc_stderr": 0.1, "n": task["limit"], "limit": task["limit"],
             "num_fewshot": task["num_fewshot"], "protocol": task["protocol"], "kv_fraction": 0.2}
            for name in task["tasks"]]


def latency_metrics(task: dict) -> list[dict]:
    return [{"decode_ms_median": 50.0, "h2d_bytes_per_token": 2**20, "batch_size": task["batch_size"],
             "prompt_len": task["prompt_len"], "gen_len": task["gen_len"], "kv_fraction": 0.2}]


def ruler_metrics(task: dict, score: float = 1.0) -> list[dict]:
    return [{"benchmark": "ruler", "task": name, "length": n, "n": task["limit"], "score": score,
             "kv_fraction": 0.2} for name in task["tasks"] for n in task["max_seq_lengths"]]


def needle_metrics(task: dict) -> list[dict]:
    cells = [{"length": n, "depth": d, "accuracy": 1.0, "loglik": -1.0, "n": task["seeds"]}
             for n in task["lengths"] for d in task["depths"]]
    return [{"accuracy": 1.0, "kv_fraction": 0.2, "cells": cells}]


# (where the two runs differ: "method" or "task", the parameter, its two values)
METHOD_APART = [("method", "speculate_from", ("block_input", "previous")), ("method", "skip_layers", (1, 2))]
APART = {
    "ppl": [("task", "dense_rows", (0, 512)), ("task", "stride", (None, 512)), ("task", "skip_windows", (0, 8)),
            ("task", "max_windows", (1, 8)), *METHOD_APART],
    "lm_eval": [("task", "fewshot_seed", (1234, 42)), *METHOD_APART],
    "accuracy": [("task", "fewshot_seed", (1234, 42)), ("task", "tasks", (["copa"], ["copa", "piqa"])),
                 *METHOD_APART],
    "latency": [("task", "schedule", ("overlapped", "paper")), ("task", "timing", ("measured", "modelled")),
                *METHOD_APART],
    "eviction": [("task", "dense_rows", (0, 512)), ("task", "max_windows", (1, 8)), *METHOD_APART],
    "successors": [("task", "seq_len", (1024, 2048)), ("task", "skip_windows", (0, 8)), *METHOD_APART],
    "ruler": [("task", "limit", (2, 4)), *METHOD_APART],
    "paired": [("task", "dense_rows", (0, 512)), *METHOD_APART],
    "needle": [("task", "filler", ("repeat", "essay")), *METHOD_APART],
    "gemma3_speed": [("task", "timing", ("measured", "modelled")), *METHOD_APART],
}


def pair(name: str, where: str, param: str, values: tuple) -> list[list[dict]]:
    """Runs for table `name`: InfiniGen twice, the two differing in `param` only (everything a table needs beside
    them: full attention for RULER, a capped pool for the eviction table, a latency run for the successors)."""
    runs = []
    for i, value in enumerate(values):
        params, task = dict(INFINIGEN), {}
        kind = {"lm_eval": "lm_eval", "accuracy": "lm_eval", "latency": "latency", "gemma3_speed": "latency",
                "ruler": "ruler", "needle": "needle"}.get(name, "ppl")
        task = dict({"ppl": PPL_TASK, "lm_eval": LM_EVAL_TASK, "latency": LATENCY_TASK, "ruler": RULER_TASK,
                     "needle": NEEDLE_TASK}[kind])
        (params if where == "method" else task)[param] = value
        metrics = {"ppl": ppl_metrics, "lm_eval": lm_eval_metrics, "latency": latency_metrics,
                   "ruler": ruler_metrics, "needle": needle_metrics}[kind](task)
        if kind == "ruler":
            task = task | {"name": "lm_eval"}
        runs.append(rows_of(f"{i:015x}a", "infinigen", params, task, metrics))
        if name == "eviction":
            runs.append(rows_of(f"{i:015x}b", "infinigen", params | {"capacity": 0.8}, task, metrics))
        if name == "successors" and (where == "method" or i == 0):  # a latency run of each method setting
            runs.append(rows_of(f"{i:015x}c", "infinigen", params, dict(LATENCY_TASK), latency_metrics(LATENCY_TASK)))
    if name == "ruler":
        runs.append(rows_of("f" * 16, "full", {}, dict(RULER_TASK), ruler_metrics(RULER_TASK)))
    if name == "gemma3_speed":
        runs.append(rows_of("e" * 16, "offload", {}, dict(LATENCY_TASK), latency_metrics(LATENCY_TASK)))
    return runs


def frame(tmp_path: Path, runs: list[list[dict]]) -> pd.DataFrame:
    for rows in runs:
        store.append_rows(tmp_path, rows[0]["config_hash"], rows)
    return store.load(tmp_path)


SECTION_TABLES = {
    "eviction": lambda df: [c5_eviction.eviction_table(df)],
    "successors": lambda df: [successors.successors_table(df)],
    "ruler": lambda df: [ruler.settings_table(df)],  # ruler.full_table: full attention's lines only
    "needle": lambda df: [long_context.needle_table(df)],
    "gemma3_speed": lambda df: [gemma3_speed.table(df)],
}
CASES = [pytest.param(name, *case, id=f"{name}-{case[1]}") for name in APART for case in APART[name]]


@pytest.mark.parametrize("name, where, param, values", CASES)
def test_a_table_keeps_apart_two_runs_that_differ_in_one_column(tmp_path, name, where, param, values):
    df = frame(tmp_path, pair(name, where, param, values))
    tables = ([T.table(df, name)] if name in T.TABLES else []) + SECTION_TABLES.get(name, lambda df: [])(df)
    assert tables
    for table in tables:
        rendered = lines(table)
        infinigen = [line for line in rendered if "infinigen" in line]
        assert len(infinigen) >= 2, f"{name}: the runs with {where}.{param} = {values} merged:\n" + "\n".join(rendered)
        assert not duplicated(rendered), f"{name}: lines read alike:\n" + "\n".join(rendered)


def test_the_eviction_table_shows_each_setting_and_never_averages_two(tmp_path):
    """C5 on Gemma: a block_input and a previous setting with the same size hyperparameters are two lines, each
    with its own perplexities (the table once showed their mean, (27.74 + 20.51) / 2)."""
    runs = []
    for i, (option, full, capped) in enumerate((("block_input", 27.74, 27.79), ("previous", 20.51, 20.51))):
        params = INFINIGEN | {"speculate_from": option}
        for j, (capacity, ppl) in enumerate(((1.0, full), (0.8, capped))):
            runs.append(rows_of(f"{i}{j}".rjust(16, "0"), "infinigen", params | {"capacity": capacity}, dict(PPL_TASK),
                                [{"ppl": ppl, "kv_fraction": 0.2, "seq_len": 1024}], model="gemma3-270m"))
    table = c5_eviction.eviction_table(frame(tmp_path, runs)).set_index("params")
    assert table["ppl, pool 100%"].to_dict() == {
        "alpha=8, budget=0.2, partial_ratio=0.5, speculate_from=block_input": 27.74,
        "alpha=8, budget=0.2, partial_ratio=0.5, speculate_from=previous": 20.51}


def test_the_ppl_table_shows_a_task_parameter_that_varies_and_only_then(tmp_path):
    runs = [rows_of("1" * 16, "full", {}, PPL_TASK | {"dense_rows": 512}, ppl_metrics(PPL_TASK)),
            rows_of("2" * 16, "full", {}, dict(PPL_TASK), ppl_metrics(PPL_TASK))]
    table = T.table(frame(tmp_path / "a", runs), "ppl")
    assert list(table["dense_rows"]) == [0, 512]
    assert "dense_rows" not in T.table(frame(tmp_path / "b", runs[1:]), "ppl")


def test_rulers_first_verdict_line_is_short_and_its_table_has_one_row_per_task(tmp_path):
    task = RULER_TASK | {"tasks": ["niah_single_1", "ruler_cwe"], "max_seq_lengths": [1024, 2048]}
    df = frame(tmp_path, [rows_of("f" * 16, "full", {}, task, ruler_metrics(task, 0.5)),
                          rows_of("e" * 16, "infinigen", INFINIGEN, task, ruler_metrics(task, 0.25))])
    first = ruler.ruler_verdict(df)[0]
    assert first == ("smollm2-135m full attention: mean score 0.5 (0-1) over 2 tasks x 2 lengths; per task in the "
                     "first table")
    table = ruler.full_table(df)
    assert list(table["task"]) == ["niah_single_1", "ruler_cwe"]
    assert [c for c in table.columns if "@" in c] == ["score (0-1) @ 1024 tokens", "score (0-1) @ 2048 tokens"]
    shares = ruler.settings_table(df).set_index("method")["share of full's (%)"]
    assert shares["full"] == 100 and shares.drop("full").tolist() == [50]


# ------------------------------------------------------------------------------------------- the committed store


@pytest.fixture(scope="module")
def committed():
    """Each section's rows from docs/store, matched as `make report` matches them."""
    from analysis.report import discover, script_rows
    from analysis.report.compose import compose_all
    from analysis.report.matching import load, match, stale_rows
    from conftest import ROOT

    every = discover()
    df = load(ROOT / "docs" / "store")
    scripted = script_rows(df)
    scripts, df = df[scripted], df[~scripted]
    commands = list(dict.fromkeys(c for s in every for c in s.commands))
    compose_all(commands)
    stale = stale_rows(df, commands)
    fresh = df[~df["_file"].isin({line.split("`")[1] for line in stale})] if stale else df
    return [(s, s.script(scripts) if s.script is not None else match(fresh, s.commands).rows) for s in every]


def test_no_section_of_the_report_shows_two_lines_alike(committed):
    from analysis.report.render import tables_of

    found = []
    for section, rows in committed:
        if rows.empty:
            continue
        for i, table in enumerate(tables_of(section, rows)):
            if not isinstance(table, str) and not table.empty:  # a str: a paragraph between two tables
                found += [f"{section.slug} table {i}: {line}" for line in duplicated(lines(table))]
    assert not found, "\n".join(found)


def test_a_full_attention_run_with_per_doc_results_is_the_reference_over_one_without(tmp_path):
    """Two full-attention runs score the same docs, an older one without per-doc results and a newer with them:
    InfiniGen's difference is paired against the newer, and full's task is named once in the chance line."""
    from analysis.report import accuracy as A

    task = LM_EVAL_TASK | {"limit": 8}
    per_doc = lambda hits: {"id": list(range(8)), "acc": hits}  # noqa: E731
    old = rows_of("1" * 16, "full", {}, task, lm_eval_metrics(task))
    new = rows_of("2" * 16, "full", {}, task, [m | {"units": per_doc([1] * 6 + [0] * 2)}
                                                        for m in lm_eval_metrics(task)])
    gen = rows_of("3" * 16, "infinigen", INFINIGEN, task, [m | {"units": per_doc([1] * 5 + [0] * 3)}
                                                            for m in lm_eval_metrics(task)])
    data = A.task_rows(frame(tmp_path, [old, new, gen]))
    row = data[data["method"] == "infinigen"].iloc[0]
    assert bool(row["paired"]) and row["full_units"]["acc"] == [1] * 6 + [0] * 2
    assert A.chance_lines(data)[0].count("copa") == 1
