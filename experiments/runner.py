"""One experiment = (model, method, task) config -> metrics -> rows in the results store."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from analysis import store
from infinigen import adapter

# config keys that do not change what is computed (excluded from the config hash)
NON_SEMANTIC = ("force", "logger", "results_dir", "data_dir", "hydra", "progress")
TASKS = {}


def task_module(name: str):
    import importlib

    modules = {"ppl": "experiments.ppl", "lm_eval": "experiments.lm_eval", "latency": "experiments.latency",
               "needle": "experiments.needle"}
    if name not in modules:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(modules)}")
    return importlib.import_module(modules[name])


def config_hash(cfg: DictConfig) -> str:
    semantic = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in NON_SEMANTIC}
    return hashlib.sha256(json.dumps(semantic, sort_keys=True, default=str).encode()).hexdigest()[:16]


def git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "lm_eval", "hydra-core", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def method_params(cfg: DictConfig) -> dict:
    params = OmegaConf.to_container(cfg.method, resolve=True)
    return {"name": params.pop("_target_").rsplit(".", 1)[-1].lower(), **params}


def validate(cfg: DictConfig):
    """Everything that can be checked before a model is loaded; returns (task module, method object)."""
    if cfg.data_dir and not Path(cfg.data_dir).is_dir():
        raise FileNotFoundError(f"data_dir={cfg.data_dir!r} is not a directory")
    adapter.validate_model(cfg.model)
    module = task_module(cfg.task.name)
    module.validate(cfg.task, cfg.data_dir)
    method = instantiate(cfg.method)  # dataclass __post_init__ checks hyperparameters
    return module, method


def run(cfg: DictConfig) -> dict | None:
    module, method = validate(cfg)
    digest = config_hash(cfg)
    if store.has_run(cfg.results_dir, digest) and not cfg.force:
        print(f"[skip] config {digest} already in {cfg.results_dir} (force=true to run it again)")
        return None
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = adapter.load(cfg.model, device=device)
    load_s = time.perf_counter() - t0
    results = module.run(model, tokenizer, method, cfg.task, cfg.data_dir, device=device)
    results = results if isinstance(results, list) else [results]
    meta = {
        "git_commit": git_commit(),
        "versions": versions(),
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - t0,
        "load_s": load_s,
        "started": started.isoformat(),
        "finished": datetime.now(timezone.utc).isoformat(),
        "host": platform.node(),
        "random_init": bool(cfg.model.get("random_init")),
    }
    config = OmegaConf.to_container(cfg, resolve=True)
    rows = [
        {
            "config_hash": digest,
            "model": cfg.model.name,
            "method": method_params(cfg)["name"],
            "task": cfg.task.name,
            "method_params": method_params(cfg),
            "task_params": config["task"],
            "metrics": metrics,
            "meta": meta,
            "config": config,
        }
        for metrics in results
    ]
    run_dir = Path(cfg.results_dir) / "runs" / f"{digest}__{started.strftime('%Y%m%dT%H%M%S%fZ')}"
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run_dir / "metrics.json").write_text(json.dumps(results, indent=1, default=str))
    (run_dir / "meta.json").write_text(json.dumps(meta | {"config_hash": digest}, indent=1))
    path = store.append_rows(cfg.results_dir, digest, rows)
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
