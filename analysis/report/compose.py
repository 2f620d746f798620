"""Today's configs of a section's commands, as run.py composes them."""

from __future__ import annotations

import json
import multiprocessing
import os
import shlex
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from infinigen.semantic import semantic_config

ROOT = Path(__file__).resolve().parents[2]  # the repository (conf/ is read from it)
# the golden values of the InfiniGen authors' code (docs/reference.md): the report's one input besides the store
REFERENCE = ROOT / "tests" / "data" / "reference"


def semantic(config: dict) -> str:
    """What a run computes, as text: the config without locations and bookkeeping (the runner's config hash
    without the data identity, which needs the data folder)."""
    return json.dumps(semantic_config(config), sort_keys=True, default=str)


def overrides_of(command: str) -> tuple[list[str], bool]:
    """The Hydra overrides of a `python run.py [-m] ...` command line, and whether it sweeps (-m)."""
    words = shlex.split(command)
    if words[:2] != ["python", "run.py"]:
        raise ValueError(f"a section command starts with `python run.py`, got {command!r}")
    words = words[2:]
    multirun = any(w in ("-m", "--multirun") for w in words)
    return [w for w in words if w not in ("-m", "--multirun")], multirun


def job_overrides(command: str) -> list[list[str]]:
    """The overrides of every job the command runs today, one `python run.py` line each (sweeps expanded as Hydra's
    basic sweeper does: the preset's hydra.sweeper.params, then the command line)."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    overrides, multirun = overrides_of(command)
    if not multirun:
        return [overrides]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        hydra_cfg = GlobalHydra.instance().hydra.compose_config(
            "config", overrides, run_mode=RunMode.MULTIRUN, from_shell=True).hydra
        params = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.get("params") or {}).items()]
        parsed = OverridesParser.create().parse_overrides(params + overrides)
        return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]


def compose_jobs(command: str) -> list[dict]:
    """The config of every job the command runs today, as run.py composes it (`job_overrides`)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    batches = job_overrides(command)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return [OmegaConf.to_container(compose("config", overrides=list(job)), resolve=True) for job in batches]


_COMPOSED: dict[str, tuple[str, ...]] = {}


def _semantic_jobs(command: str) -> tuple[str, ...]:
    return tuple(semantic(job) for job in compose_jobs(command))


def composed(command: str) -> tuple[str, ...]:
    """`compose_jobs` in semantic form, once per process (Hydra takes ~0.2 s per job)."""
    if command not in _COMPOSED:
        _COMPOSED[command] = _semantic_jobs(command)
    return _COMPOSED[command]


def compose_all(commands: list[str]) -> None:
    """Composes every command's jobs in worker processes, one command at a time each: the report composes some
    250 jobs, which on one core took most of its minute."""
    todo = [c for c in dict.fromkeys(commands) if c not in _COMPOSED]
    workers = min(len(todo), os.cpu_count() or 1)
    if workers < 2:
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        _COMPOSED.update(zip(todo, pool.map(_semantic_jobs, todo)))


def jobs(command: str) -> list[dict]:
    return [json.loads(text) for text in composed(command)]


def flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def difference(row_config: dict, job: dict) -> list[str]:
    """The leaves where a row's recorded config and today's composed config differ."""
    row, now = flat(json.loads(semantic(row_config))), flat(json.loads(semantic(job)))
    return [f"{k}: row {row.get(k, '(absent)')!r}, now {now.get(k, '(absent)')!r}"
            for k in sorted(set(row) | set(now)) if row.get(k, "(absent)") != now.get(k, "(absent)")]
