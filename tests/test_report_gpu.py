"""The GPU as measured (issue 54, item 7): the H200 rows of docs/gpu reach the report as store rows
(experiments/validate_gpu.py --store), measured beside modelled with the commit each ran at; the CPU validation
names its commit and what a CPU cannot test; every hardware profile number says where it comes from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from analysis import store
from analysis.report import matching, script_rows
from analysis.report.matching import Matched
from analysis.report.render import section_text
from analysis.report.sections import c7_validation, gpu_measured

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def gpu_row(run: str, order: int, index: int, name: str, method: str, measured: float, modelled: float,
            gather: str | None = None, changed: list[str] | None = None, **params) -> dict:
    """A store row as validate_gpu --store writes it (the fields the section reads)."""
    task = {"name": "gpu_latency", "batch_size": 20, "prompt_len": 1920, "gen_len": 128}
    if gather:
        task["gather"] = gather
    config = {"benchmark": "gpu", "source": f"docs/gpu/{run}.jsonl", "row": name, "task": task,
              "method": {"name": method, **params}}
    return {
        "config_hash": f"{order}{index:015d}", "model": "opt-13b", "method": method, "task": "gpu_latency", "data": {},
        "method_params": {"name": method, **params}, "task_params": task, "config": config,
        "metrics": {"benchmark": "gpu", "run": run, "run_order": order, "row_index": index, "gpu_row": name,
                    "source": f"docs/gpu/{run}.jsonl", "batch_size": 20, "prompt_len": 1920, "gen_len": 128,
                    "dtype": "float16", "decode_ms_median": measured, "attention_ms": measured / 2,
                    "transfer_ms": measured / 3, "modelled_perf_ms_per_token": modelled,
                    "modelled_perf_to_measured": modelled / measured,
                    "modelled_perf": {"compute_ms": modelled * 0.6, "speculation_ms": modelled * 0.3, "host_ms": 0.0},
                    "modelled_profile": "conf/hardware/h200_pcie5_calibrated.yaml",
                    "modelled_census": "live: this checkout's runtime"},
        "meta": {"git_commit": "2f67c00284b1627c085ba623baaff043eb1535d3-dirty", "code": "2f67c00 + a change (x)",
                 "code_since": "aed9c9d", "code_also": None, "device": "cuda", "threads": 16,
                 "versions": {"torch": "2.11.0+cu130"}, "modelled_commit": "a" * 40,
                 "runtime_changed_since": changed if changed is not None else [],
                 "model_changed_since": {"aed9c9d": {}, "f7a4402": {"infinigen/offload/perf.py": [269, 46]}},
                 "cpu_validation_commits": ["f7a4402"]},
    }


def small_store(path: Path, changed: list[str] | None = None) -> pd.DataFrame:
    rows = [gpu_row("run_b", 2, 0, "ideal", "full", 28.7, 44.7, changed=changed),
            gpu_row("run_b", 2, 1, "h2o", "h2o", 126.7, 123.8, changed=changed),
            gpu_row("run_b", 2, 2, "quant-int4", "quant", 226.8, 243.5, changed=changed, bits=4),
            gpu_row("run_b", 2, 3, "infinigen-b0.05", "infinigen", 351.8, 118.4, changed=changed, budget=0.05),
            gpu_row("run_b", 2, 4, "infinigen-b0.05-zero-copy", "infinigen", 119.3, 118.4, gather="zero_copy",
                    changed=changed, budget=0.05)]
    for row in rows:
        store.append_rows(path, row["config_hash"], [row])
    return matching.load(path)


def test_the_gpu_section_shows_measured_beside_modelled_with_the_commit(tmp_path):
    df = small_store(tmp_path / "store", changed=["baselines/h2o.py", "infinigen/offload/runtime.py"])
    assert script_rows(df).all(), "GPU rows are script rows: the stale check never sees them"
    rows = gpu_measured.SECTION.script(df)
    table = gpu_measured.table(rows)
    assert list(table["row"]) == ["ideal", "h2o", "quant-int4", "infinigen-b0.05", "infinigen-b0.05-zero-copy"]
    assert list(table["measured decode ms/token"]) == [28.7, 126.7, 226.8, 351.8, 119.3]
    assert list(table["modelled ms/token"]) == [44.7, 123.8, 243.5, 118.4, 118.4]
    assert table["modelled / measured"].tolist() == [1.56, 0.98, 1.07, 0.34, 0.99]
    assert set(table["ran at"]) == {"2f67c00 + a change"}
    lines = gpu_measured.verdict(rows)
    assert all(len(line) <= 210 for line in lines), [line for line in lines if len(line) > 210]
    text = "\n".join(lines)
    assert "measured ideal 28.7, h2o 126.7, quant-int4 226.8, infinigen-b0.05 351.8" in text
    assert "InfiniGen (budget 0.05, host gather) over H2O: measured 0.36x, modelled 1.05x; INT4: measured 0.64x" in text
    assert "the paper's InfiniGen at OPT-13B, batch 20, 1920 + 128 on its RTX A6000" in text
    assert "InfiniGen (budget 0.05, zero-copy gather) over H2O: measured 1.06x" in text
    assert "3 of 5 within ±25%" in text
    assert ("run_b: 2 runtime files changed after aed9c9d (runtime.py, h2o.py; as of aaaaaaa): this code has not "
            "run on a GPU") in text
    assert "since the CPU validation at f7a4402 (lines): perf.py +269/-46" in text
    # rendered: the table (measured beside modelled, the commit) under the section's title
    md = section_text(gpu_measured.SECTION, Matched(rows, {}, len(rows), len(rows)), lines, tmp_path, "report",
                      figures=True)
    assert "## C7. Speed measured on a GPU (H200)" in md
    assert "| measured decode ms/token | modelled ms/token | modelled / measured |" in md
    assert "rows by commit: 2f67c00-dirty (5 runs)" in md
    assert (tmp_path / "report" / "gpu_measured.png").exists()


def test_a_run_whose_runtime_is_the_code_now_says_so(tmp_path):
    rows = gpu_measured.SECTION.script(small_store(tmp_path / "store", changed=[]))
    text = "\n".join(gpu_measured.verdict(rows))
    assert "no runtime file changed after aed9c9d (as of aaaaaaa): the code now is the code that ran" in text
    assert "has not run on a GPU" not in text


def test_an_empty_store_names_the_command():
    assert "make validate-gpu" in gpu_measured.verdict(pd.DataFrame())[0]


def test_the_cpu_validation_names_its_commit_and_what_a_cpu_cannot_test():
    point = {"task": "latency", "metrics.validation_point": "h2o", "metrics.batch_size": 8, "metrics.prompt_len": 2048,
             "meta.git_commit": "f7a440246320c249eb3c7f6ec5546ee86a3d7d11"}
    df = pd.DataFrame([
        {**point, "metrics.timing": None, "metrics.decode_ms_median": 300.0,
         "metrics.decode_ms_rounds": [280.0, 300.0, 360.0]},
        {**point, "metrics.timing": "modelled", "metrics.decode_ms_median": 267.0, "metrics.measured_decode_ms": 300.0,
         "metrics.ratio": 0.89, "metrics.exposed_transfer_ms": 0.0, "metrics.host_ms": 13.5},
    ])
    lines = c7_validation.verdict(c7_validation.SECTION.script(df))
    assert lines[0].startswith("1 of 1 points within ±25% of what this CPU measured (measured and modelled at "
                               "f7a4402); largest deviation of modelled from measured: 11%")
    assert "|" not in lines[0], "the summary table replaces '|': no formula with bars in a first line"
    assert any("no link is exposed (the modelled exposed link time is 0 ms at every point)" in line
               and "at most 13.5 ms per step" in line for line in lines)


def test_every_hardware_profile_number_says_where_it_comes_from():
    """Each number of conf/hardware/*.yaml: measured (where), derived, from the H200 runs, datasheet or assumed, in
    its own line's comment or the comment lines just above it."""
    unlabelled = []
    for path in sorted((ROOT / "conf" / "hardware").glob("*.yaml")):
        lines = path.read_text().splitlines()
        values = yaml.safe_load(path.read_text())
        for i, line in enumerate(lines):
            key = re.match(r"^(\w+):", line)
            value = values.get(key.group(1)) if key else None
            if value is None or isinstance(value, (bool, str)):
                continue
            said, j = line.split("#", 1)[1] if "#" in line else "", i - 1
            while j >= 0 and lines[j].startswith("#"):
                said, j = said + " " + lines[j], j - 1
            if not re.search(r"measured|derived|datasheet|assumed|from the H200", said):
                unlabelled.append(f"{path.name}: {key.group(1)}")
    assert not unlabelled


def test_the_committed_store_holds_both_h200_runs_as_measured():
    """docs/store's GPU rows are docs/gpu's rows, each with the model beside it and the commit it ran at."""
    rows = gpu_measured.gpu_rows(matching.load(DOCS / "store"))
    if rows.empty:
        pytest.skip("no GPU rows in docs/store yet: make validate-gpu")
    for source in ("docs/gpu/h200_opt13b_b20_p1920_g32.jsonl", "docs/gpu/run_20261204/latency.jsonl"):
        measured = {r["row"]: r["decode_ms_median"] for r in map(json.loads, (ROOT / source).read_text().splitlines())}
        stored = rows[rows["metrics.source"] == source]
        assert dict(zip(stored["metrics.gpu_row"], stored["metrics.decode_ms_median"])) == measured, source
        assert stored["metrics.modelled_perf_ms_per_token"].gt(0).all()
        assert stored["meta.git_commit"].str.startswith("2f67c00").all()
