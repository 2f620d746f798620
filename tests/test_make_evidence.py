"""`make evidence` (analysis/evidence.py): what it plans from the store, what it runs, and its estimates."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from analysis import evidence, store
from analysis.report import compose

COMMAND = "python run.py -m +experiment=table2_eviction_smoke task.max_windows=4"


def stored_run(path, config: dict, digest: str, seconds_per_window: float, wall_s: float = 100.0) -> None:
    config = config | {"data_dir": "/data", "results_dir": "results"}
    store.append_rows(path, digest, [{
        "config_hash": digest, "model": config["model"]["name"], "method": "infinigen", "task": "ppl",
        "method_params": {"name": "infinigen"}, "task_params": config["task"], "config": config, "data": {},
        "metrics": {"ppl": 20.0, "windows": config["task"]["max_windows"], "seconds_per_window": seconds_per_window},
        "meta": {"git_commit": "0" * 40, "wall_s": wall_s, "load_s": 1.0, "threads": 1}}])


@pytest.fixture
def one_section(monkeypatch):
    monkeypatch.setattr(evidence, "discover", lambda: [SimpleNamespace(slug="c5_eviction", commands=(COMMAND,))])
    return compose.compose_jobs(COMMAND)


def test_a_stored_config_is_skipped_and_the_rest_estimated_from_the_stores_seconds_per_window(tmp_path, one_section):
    for i, job in enumerate(one_section[:2]):  # the 100% pool and one capped policy stored, at 3 s a window
        stored_run(tmp_path / "store", job, f"{i:016x}", seconds_per_window=3.0)
    every, by_section, _ = evidence.plan(tmp_path / "store", tmp_path / "results")
    jobs = [every[k] for k in by_section["c5_eviction"]]
    assert [j.stored for j in jobs] == [True, True, False, False]
    assert [j.seconds for j in jobs if not j.stored] == [12.0, 12.0]  # 4 windows x 3 s
    lines = evidence.plan_lines(every, by_section, workers=2)
    assert lines[0] == "[evidence] plan c5_eviction: 4 runs, 2 in the store, 2 to run, est. 24 s"
    assert lines[-1].endswith("2 to run: est. 24 s of compute, about 12 s at 2 at a time")


def test_a_full_store_runs_nothing_and_only_rewrites_the_report(tmp_path, one_section, monkeypatch, capsys):
    for i, job in enumerate(one_section):
        stored_run(tmp_path / "store", job, f"{i:016x}", seconds_per_window=3.0, wall_s=13.0)
    calls = []
    monkeypatch.setattr(evidence, "run_job", lambda *a: pytest.fail("a stored config was run"))
    monkeypatch.setattr(evidence.subprocess, "run", lambda cmd, **kw: calls.append(cmd[2:]))
    monkeypatch.setattr(evidence, "ROOT", tmp_path)
    assert evidence.main(["--store", "store", "--results", "results"]) == 0
    # nothing ran, so nothing is exported; the report is rewritten from the store
    assert calls == [["analysis.report", "--store", "store", "--out", "docs", "--readme", "README.md"]]
    out = capsys.readouterr().out
    assert "4 runs, 4 in the store, 0 to run, est. 0 s" in out
    assert "[evidence] compute c5_eviction: 4 stored runs took 52 s; this invocation ran nothing" in out


def test_a_config_in_results_but_not_yet_exported_is_not_run_again(tmp_path, one_section):
    stored_run(tmp_path / "results", one_section[3], "f" * 16, seconds_per_window=3.0)
    every, by_section, _ = evidence.plan(tmp_path / "store", tmp_path / "results")
    assert [every[k].stored for k in by_section["c5_eviction"]] == [False, False, False, True]
    assert all(every[k].seconds is None for k in by_section["c5_eviction"][:3])  # no alike row in the store


def test_lm_eval_estimates_pool_each_tasks_docs_over_the_runs_that_scored_it(tmp_path):
    config = {"model": {"name": "m"}, "method": {"_target_": "baselines.full.Full"},
              "task": {"name": "lm_eval", "tasks": ["piqa", "copa"], "limit": None, "num_fewshot": 5}}
    rows = []
    for task, n in (("piqa", 100), ("copa", 100)):
        rows.append({"config_hash": "a" * 16, "model": "m", "method": "full", "task": "lm_eval", "config": config,
                     "metrics": {"task": task, "n": n}, "meta": {"wall_s": 401.0, "load_s": 1.0}})
    store.append_rows(tmp_path, "a" * 16, rows)
    from analysis.report.matching import load
    df = load(tmp_path)
    # 400 s over 200 docs: 2 s a doc; every doc of both tasks again (100 each), then 10 of each
    assert evidence.estimate(df, config) == pytest.approx(400.0)
    limited = json.loads(json.dumps(config))
    limited["task"]["limit"] = 10
    assert evidence.estimate(df, limited) == pytest.approx(40.0)
    other = json.loads(json.dumps(config))
    other["task"]["num_fewshot"] = 0  # zero-shot docs cost another amount: no alike row
    assert evidence.estimate(df, other) is None


def test_a_benchmark_scripts_row_in_the_store_is_no_job_and_no_estimate(tmp_path, monkeypatch):
    """bench_lm_eval's rows carry a config of their own (its `task` a string): the plan of an lm-eval job passes
    them by."""
    from experiments import bench_lm_eval

    command = "python run.py task=lm_eval task.tasks=[piqa] task.limit=10"
    monkeypatch.setattr(evidence, "discover", lambda: [SimpleNamespace(slug="speed", commands=(command,))])
    bench_lm_eval.write_rows(str(tmp_path / "store"), "smollm2-135m", [
        {"kind": "piqa", "task": "piqa", "docs": 200, "shots": 0, "harness_s": 1.0, "hf_s": 1.0, "hf_batch": 16,
         "x_hf": 1.0, "same_docs": 200, "compared_docs": 200, "x_full": {}}])
    every, by_section, _ = evidence.plan(tmp_path / "store", tmp_path / "results")
    (job,) = [every[k] for k in by_section["speed"]]
    assert not job.stored and job.seconds is None  # nothing alike: no lm-eval run of this model is stored
