"""Hydra multirun sweeps end to end (run.py in a subprocess, tiny-llama, perplexity on a few bytes of WikiText-2):
the submitit_local launcher completes a sweep over methods, and a sweep killed mid-way, launched again, runs
only what is missing and ends with exactly one row per config hash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis import store
from conftest import DATA_DIR, ROOT

TINY_PPL = ["model=tiny-llama", "task=ppl", "task.seq_len=64", "task.max_windows=1"]


def run_py(args: list[str], results: Path) -> list[str]:
    return [sys.executable, str(ROOT / "run.py"), "-m", *args, f"results_dir={results}", f"data_dir={DATA_DIR}"]


def env() -> dict:
    # one torch thread per run: the sweep's jobs (and other tests) share the CPU
    return os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                         "WANDB_MODE": "disabled"}


def stored(results: Path) -> dict[str, list[Path]]:
    """config hash -> its row files."""
    out: dict[str, list[Path]] = {}
    for path in sorted(store.rows_dir(results).glob("*__*.jsonl")):
        out.setdefault(path.name.split("__")[0], []).append(path)
    return out


@pytest.fixture
def data_dir_present():
    if not Path(DATA_DIR, "wikitext-2").is_dir():
        pytest.skip(f"evaluation data not found at {DATA_DIR} (set DATA_DIR)")


@pytest.mark.slow
def test_submitit_local_sweep_completes(tmp_path, data_dir_present):
    methods = [m for m in ("full", "h2o", "streaming") if (ROOT / "conf" / "method" / f"{m}.yaml").is_file()]
    cmd = run_py([*TINY_PPL, f"method={','.join(methods)}", "hydra/launcher=submitit_local",
                  "hydra.launcher.timeout_min=10"], tmp_path)
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    df = store.load(tmp_path)
    assert sorted(df["method"]) == sorted(methods)
    assert df["config_hash"].is_unique
    assert (df["metrics.windows"] == 1).all() and (df["metrics.ppl"] > 1).all()
    # each job ran in its own submitit process, which left its log in the sweep folder
    assert len(list(tmp_path.glob("hydra/multirun_*/.submitit/*/*_log.out"))) == len(methods)


@pytest.mark.slow
def test_killed_sweep_relaunch_runs_only_the_missing_configs(tmp_path, data_dir_present):
    # four configs of a few seconds each, so the kill lands while the sweep is still going
    sweep = ["model=tiny-llama", "task=ppl", "task.seq_len=512", "method=full", "task.max_windows=12,13,14,15"]
    cmd = run_py(sweep, tmp_path)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not stored(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # no chance to clean up: the worst interruption
    finally:
        proc.wait(timeout=60)
    first = stored(tmp_path)
    assert 1 <= len(first) < 4, f"the kill should land mid-sweep, found {len(first)} finished runs"

    again = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("[skip]") == len(first), again.stdout
    final = stored(tmp_path)
    assert len(final) == 4 and all(len(files) == 1 for files in final.values())
    assert {h: f for h, f in final.items() if h in first} == first  # finished runs were not redone
    df = store.load(tmp_path)
    assert len(df) == 4 and df["config_hash"].is_unique
    assert sorted(df["task_params.max_windows"]) == [12, 13, 14, 15]


def test_relaunching_a_finished_config_is_a_skip(tmp_path, data_dir_present):
    """The in-process half of the above: runner.run twice on one config stores one row."""
    from hydra import compose, initialize_config_dir

    from experiments import runner

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_PPL, "method=full", f"results_dir={tmp_path}", f"data_dir={DATA_DIR}"])
    assert runner.run(cfg) is not None
    assert runner.run(cfg) is None
    assert [len(f) for f in stored(tmp_path).values()] == [1]


def test_a_write_killed_before_its_rename_is_invisible(tmp_path):
    store.append_rows(tmp_path, "a" * 16, [{"config_hash": "a" * 16, "model": "m", "metrics": {"ppl": 1.0}}])
    # what a SIGKILL between mkstemp and os.replace leaves behind: half a row under a temp name
    half = json.dumps({"config_hash": "b" * 16, "model": "m", "metrics": {"ppl": 2.0}})[:25]
    (store.rows_dir(tmp_path) / ".tmp-x1y2z3.jsonl").write_text(half)
    assert not store.has_run(tmp_path, "b" * 16)
    df = store.load(tmp_path)
    assert df["config_hash"].tolist() == ["a" * 16]
