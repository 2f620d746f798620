"""One experiment = (model, method, task) config -> metrics -> rows in the results store: running it (`run`:
validate, claim the config hash, load, run the task, refuse non-finite metrics, write the rows) and run.py's entry
points (`run_point`, `cli`, the summary of a sweep's refused points). What a run is (its config hash, the data it
reads, its rows) is experiments/identity.py; the checks before a model loads, experiments/validation.py; the errors a
user sees, experiments/cli_errors.py.

Import cost is part of the interface: `validate` refuses a bad config within seconds, so this module, those three
and the task modules' `validate` import nothing heavy (no transformers model classes, lm_eval, pandas); torch and
transformers' cache classes come in with the model and method checks, the rest only once a run starts.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from analysis import store
from experiments.cli_errors import UserError, hydra_error, user_input
from experiments.identity import config_hash, git_commit, make_rows, needs_model, versions
from experiments.validation import check_weights, validate, weights_available


class NonFiniteError(FloatingPointError):
    pass


def nonfinite(value, path: str = "") -> list[str]:
    """Dotted paths of the NaN/inf numbers in a metrics dict (stderr columns may legitimately be NaN: n = 1)."""
    if isinstance(value, float):
        return [] if math.isfinite(value) or "stderr" in path else [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nonfinite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in nonfinite(v, f"{path}[{i}]")]
    return []


def check_finite(results: list[dict], task: str) -> None:
    bad = [p for i, metrics in enumerate(results) for p in nonfinite(metrics, f"row{i}" if len(results) > 1 else "")]
    if bad:
        raise NonFiniteError(f"task {task}: non-finite metrics {bad[:8]}{' ...' if len(bad) > 8 else ''}; no row "
                             "written (a NaN/inf in the model or the method: check model.arch, dtype, the method)")


def run(cfg: DictConfig) -> dict | None:
    module, method = validate(cfg)
    digest = config_hash(cfg)
    if store.has_run(cfg.results_dir, digest) and not cfg.force:
        print(f"[skip] config {digest} already in {cfg.results_dir} (force=true to run it again)")
        return None
    check_weights(cfg)  # before anything is claimed or loaded; may ask the hub once
    with user_input("results_dir", cfg):
        store.check_writable(cfg.results_dir)
    with store.claim(cfg.results_dir, digest) as claimed:
        if claimed is None:
            return None
        if store.has_run(cfg.results_dir, digest) and not cfg.force:  # finished while we were validating
            print(f"[skip] config {digest} already in {cfg.results_dir} (force=true to run it again)")
            return None
        return _run_claimed(cfg, module, method, digest)


# ----------------------------------------------------------------------------------------------- run.py


# the points of this process's sweep: (job number, overrides, outcome), outcome "ran" | "skipped" | "refused: ..."
SWEEP: list[tuple[int, str, str]] = []
DEBUG = False  # set by `cli`: debug=true or HYDRA_FULL_ERROR=1 on the command line


def run_point(cfg: DictConfig) -> dict | None:
    """run.py's job: `run`, with bad input reported on one line: a single run then exits 2; in a sweep the point
    is recorded as refused and the sweep's other points still run (debug=true: it raises, as a bug would)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if cfg.get("debug") is True or DEBUG:
        return run(cfg)
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    sweep = hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN
    point = (hydra_cfg.job.get("num", len(SWEEP)), " ".join(hydra_cfg.overrides.task)) if sweep else None
    try:
        row = run(cfg)
    except UserError as err:
        if not sweep:  # before Hydra logs "Error executing job" and re-raises it
            print(f"error: {err.line}", file=sys.stderr)
            raise SystemExit(2) from err
        print(f"error: {err.line}  [point #{point[0]}: {point[1]}]", file=sys.stderr)
        SWEEP.append((*point, f"refused: {err.line}"))
        return None
    if sweep:
        SWEEP.append((*point, "ran" if row else "skipped"))
    return row


def sweep_summary() -> str | None:
    """The refused points of this process's sweep (None without any), for the end of run.py's output."""
    refused = [(num, overrides, outcome) for num, overrides, outcome in SWEEP if outcome.startswith("refused")]
    if not refused:
        return None
    lines = [f"sweep: {len(refused)} of {len(SWEEP)} points refused (the others ran or were already in the store):"]
    lines += [f"  #{num} {overrides}: {outcome.removeprefix('refused: ')}" for num, overrides, outcome in refused]
    return "\n".join(lines)


def cli(main) -> None:
    """run.py's `__main__`: runs the Hydra entry `main`, prints a user error as one line (exit 2) and a bug's
    traceback (exit 1); debug=true or HYDRA_FULL_ERROR=1 shows the traceback of a user error too."""
    global DEBUG
    debug = DEBUG = bool(os.environ.get("HYDRA_FULL_ERROR")) or any(
        re.fullmatch(r"\+*debug=(true|True)", a) for a in sys.argv[1:])
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own report and exiting 1
    try:
        main()
    except Exception as err:  # noqa: BLE001 -- classified here: one line for bad input, a traceback for a bug
        summary = sweep_summary()
        if summary:
            print(summary, file=sys.stderr)
        user = err if isinstance(err, UserError) else hydra_error(err)
        if user is None or debug:
            traceback.print_exc()
            if user is not None:
                print(f"error: {user.line}", file=sys.stderr)
            sys.exit(2 if user is not None else 1)
        print(f"error: {user.line}", file=sys.stderr)
        sys.exit(2)
    summary = sweep_summary()
    if summary:
        print(summary, file=sys.stderr)
        sys.exit(2)


def _run_claimed(cfg: DictConfig, module, method, digest: str) -> dict:
    import torch

    from infinigen import adapter

    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if needs_model(cfg):
        device = adapter.resolve_device(cfg.get("device"))
        with weights_available():  # e.g. a cached config.json whose weights were never downloaded
            model, tokenizer = adapter.load(cfg.model, device=device)
        load_s = time.perf_counter() - t0
        results = module.run(model, tokenizer, method, cfg.task, cfg.data_dir, device=device)
    else:  # modelled: computed from the configs alone
        device, load_s = f"modelled:{cfg.hardware.name}", 0.0
        results = module.run_modelled(cfg, method)
    results = results if isinstance(results, list) else [results]
    check_finite(results, cfg.task.name)
    meta = {
        "git_commit": git_commit(),
        "versions": versions(),
        "device": device if not device.startswith("cuda") else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - t0,
        "load_s": load_s,
        "started": started.isoformat(),
        "finished": datetime.now(timezone.utc).isoformat(),
        "host": platform.node(),
        "random_init": bool(cfg.model.get("random_init")),
    }
    rows = make_rows(cfg, method, digest, results, meta)
    # unique per run, not per second: a forced re-run started in the same microsecond has another pid
    run_dir = Path(cfg.results_dir) / "runs" / f"{digest}__{started.strftime('%Y%m%dT%H%M%S%fZ')}-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        (run_dir / "metrics.json").write_text(json.dumps(results, indent=1, default=str))
        (run_dir / "meta.json").write_text(json.dumps(meta | {"config_hash": digest}, indent=1))
        path = store.append_rows(cfg.results_dir, digest, rows)
    except OSError as err:
        kept = store.keep_unsaved(rows, digest, [run_dir, Path.home() / ".cache" / "infinigen" / "unsaved"])
        raise store.StoreError(
            f"could not write the rows of {digest} to {cfg.results_dir} ({err}); the computed rows are kept in "
            f"{kept}: add them to the store with `python -m analysis.store import {kept} --results "
            f"{cfg.results_dir}`"
        ) from err
    for logger in cfg.logger.get("backends", []):
        _log(logger, cfg, rows)
    print(f"[done] {digest} -> {path}")
    return rows[0]


def _log(backend: str, cfg: DictConfig, rows: list[dict]) -> None:
    if backend == "wandb":
        import wandb

        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            os.environ["WANDB_MODE"] = "offline"  # sync later with `wandb sync`
        run = wandb.init(project=cfg.logger.project, config=rows[0]["config"], dir=cfg.results_dir, reinit=True)
        for row in rows:
            run.log({k: v for k, v in row["metrics"].items() if isinstance(v, (int, float))})
        run.finish()
