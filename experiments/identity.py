"""What a run is, as its rows record it: the config hash a run is stored and skipped under (`config_hash`: what it
computes plus the content identity of the data it reads, `data_identity`), the name its rows are called by
(`method_name`, `method_params`), the code and packages that ran it (`git_commit`, `versions`) and the rows
themselves (`make_rows`); `task_module` / `needs_model`: the task module a config runs, and whether it loads a model.

Imports nothing heavy (see experiments/runner.py): the config hash is computed before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.lm_eval_tasks import tasks_identity
from experiments.lm_eval_tasks.ruler import haystack_identity, ruler_names
from infinigen import corpora
from infinigen.semantic import semantic_config  # what a run computes: the config hash's input


def task_module(name: str):
    import importlib

    modules = {"ppl": "experiments.ppl", "lm_eval": "experiments.lm_eval", "latency": "experiments.latency",
               "needle": "experiments.needle", "generate": "experiments.generate"}
    if name not in modules:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(modules)}")
    return importlib.import_module(modules[name])


def needs_model(cfg) -> bool:
    return getattr(task_module(cfg.task.name), "needs_model", lambda task: True)(cfg.task)


def data_identity(cfg) -> dict:
    """The data a run reads (a (model, method, task) config with data_dir): the task's corpus or lm-eval task files
    and the method's calibration text. Goes into every row; `without_paths` of it goes into the config hash."""
    task, data_dir = cfg.task, cfg.get("data_dir")
    out: dict = {}
    if task.name == "ppl" or (task.name == "latency" and (task.get("prompt") == "text"
                                                            or (task.get("prompt") == "auto" and data_dir))):
        out = corpora.identity(task.dataset, data_dir)
    elif task.name == "generate":  # the prompts' file or corpus (a text prompt is in the config itself)
        prompt = task.get("prompt")
        if prompt is None or str(prompt).startswith(corpora.FILE):
            out = corpora.identity(task.dataset if prompt is None else prompt, data_dir)
    elif task.name == "lm_eval":
        names = list(task.tasks) if not isinstance(task.tasks, str) else [task.tasks]
        out = tasks_identity(names, data_dir, task.get("include_path"))
        if ruler_names(names):
            out["ruler"] = haystack_identity(ruler_names(names), task.haystack, data_dir, task.get("qa_data"))
    if cfg.method.get("calibration") and needs_model(cfg):  # a modelled run binds nothing: reads no calibration
        out["calibration"] = corpora.identity(cfg.method.calibration, cfg.method.get("calib_data_dir"))
        if cfg.method.get("column_calibration"):  # InfiniGen's partial columns' own text (absent: calibration's)
            out["column_calibration"] = corpora.identity(cfg.method.column_calibration, cfg.method.get("calib_data_dir"))
    return out


def config_hash(cfg: DictConfig) -> str:
    """sha256 of what a run computes: the config without locations and bookkeeping, plus the content identity of
    its data (sha256 of each file read, or the hub dataset), so another data folder with other text is another
    run, and the same data moved elsewhere is the same one."""
    semantic = semantic_config(OmegaConf.to_container(cfg, resolve=True))
    semantic["data"] = corpora.without_paths(data_identity(cfg))
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


def method_name(cfg: DictConfig) -> str:
    """The conf/method choice the run was composed with (what rows are called); without Hydra's runtime (e.g. a
    config composed by hand), the conf/method whose `_target_` it is (else the class name, lowercased)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.method
    except (ImportError, ValueError, AttributeError):
        from infinigen.models import method_of_target

        return method_of_target(cfg.method._target_) or cfg.method._target_.rsplit(".", 1)[-1].lower()


def method_params(cfg: DictConfig, method) -> dict:
    params = {k: v for k, v in OmegaConf.to_container(cfg.method, resolve=True).items() if k != "_target_"}
    return {"name": method_name(cfg), **params, "size_params": list(method.size_params)}


def make_rows(cfg: DictConfig, method, digest: str, results: list[dict], meta: dict) -> list[dict]:
    """The store rows of one run: one per task result, each with the whole config."""
    config = OmegaConf.to_container(cfg, resolve=True)
    return [
        {
            "config_hash": digest,
            "model": cfg.model.name,
            "method": method_name(cfg),
            "task": cfg.task.name,
            "method_params": method_params(cfg, method),
            "task_params": config["task"],
            "data": data_identity(cfg),
            "metrics": metrics,
            "meta": meta,
            "config": config,
        }
        for metrics in results
    ]
