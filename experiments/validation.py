"""Everything checked before a model loads (`validate`: the top-level options, the model, the task, the method's
hyperparameters, the device) and the weights a run will load (`check_weights`, `weights_available`): bad input is
refused as a UserError naming the option, within seconds (torch comes in only with the method's checks).
"""

from __future__ import annotations

import importlib.util
import re
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from experiments.cli_errors import UserError, user_input
from experiments.identity import needs_model, task_module


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def torch_cuda_build() -> bool | None:
    """Whether the installed torch was built with CUDA, read from torch/version.py without importing torch (which
    takes seconds); None when that file does not say (adapter.resolve_device then asks torch itself)."""
    spec = importlib.util.find_spec("torch")
    try:
        text = Path(next(iter(spec.submodule_search_locations)), "version.py").read_text()
    except (AttributeError, TypeError, StopIteration, OSError):
        return None
    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*(None|['\"][^'\"]*['\"])", text, re.MULTILINE)
    return None if found is None else found.group(1) != "None"


def check_top_level(cfg: DictConfig) -> None:
    """The options of conf/config.yaml itself (the model/method/task groups are checked by their owners)."""
    if not _is_int(cfg.get("seed")):
        raise ValueError(f"seed must be an integer, got {cfg.get('seed')!r}")
    if not isinstance(cfg.get("debug", False), bool):
        raise ValueError(f"debug must be true or false, got {cfg.get('debug')!r}")
    if not isinstance(cfg.get("force"), bool):
        raise ValueError(f"force must be true or false, got {cfg.get('force')!r}")
    device = cfg.get("device")
    if device is not None and not (isinstance(device, str) and re.fullmatch(r"cpu|mps|cuda(:\d+)?", device)):
        raise ValueError(f"device must be null (auto), cpu, cuda, cuda:N or mps, got {device!r}")
    if isinstance(device, str) and device.startswith("cuda") and torch_cuda_build() is False:
        raise ValueError(f"device={device!r} is not available: torch here is a CPU-only build; use device=cpu")
    if not isinstance(cfg.get("results_dir"), str) or not cfg.results_dir.strip():
        raise ValueError(f"results_dir must be a folder path, got {cfg.get('results_dir')!r}")
    if cfg.data_dir is not None and not isinstance(cfg.data_dir, str):
        raise ValueError(f"data_dir must be null (the HF hub) or a folder path, got {cfg.data_dir!r}")
    if cfg.data_dir and not Path(cfg.data_dir).is_dir():
        raise FileNotFoundError(f"data_dir={cfg.data_dir!r} is not a directory")
    backends = cfg.logger.get("backends") or []
    unknown = [b for b in backends if b not in ("wandb",)]
    if unknown:
        raise ValueError(f"logger.backends may hold only 'wandb', got {unknown}")


def check_positions(cfg: DictConfig, module) -> None:
    """A task's longest sequence against the model's max_position_embeddings (past it, OPT's learned positions
    index out of range after the load, and RoPE models silently extrapolate)."""
    from infinigen.models import max_positions

    needed = getattr(module, "positions_needed", None)
    limit = max_positions(cfg.model)
    if needed is None or limit is None:
        return
    try:
        option, n = needed(cfg.task)
        too_long = n > limit
    except TypeError:  # a length that is not a number (the task's own validate names it), or nothing to check
        return
    if too_long:
        raise ValueError(f"{option} = {n} is beyond the max_position_embeddings of model {cfg.model.name} "
                         f"({limit}); use at most {limit} positions")


def validate(cfg: DictConfig):
    """Everything that can be checked before a model is loaded; returns (task module, method object). Bad input
    raises UserError naming the option.

    Cheapest first: top-level options, the model cfg and the task without torch, then the method's
    hyperparameters (torch and transformers' cache classes come in with the method classes) and the device."""
    from hydra.utils import instantiate

    from infinigen.models import kv_shape, validate_model

    with user_input(None, cfg):
        check_top_level(cfg)
    with user_input("model", cfg):
        validate_model(cfg.model)
    with user_input("task", cfg):
        module = task_module(cfg.task.name)
        check_positions(cfg, module)  # before the task's validate: latency's imports the runtime (torch)
        module.validate(cfg.task, cfg.data_dir)
    # first heavy import: the method classes bring torch and transformers' cache classes
    with user_input("method", cfg):
        method = instantiate(cfg.method)  # dataclass __post_init__ checks hyperparameters (types first, then ranges)
        if needs_model(cfg):
            method.check_data()
        shape = kv_shape(cfg.model)
        if shape is not None:
            method.check_shape(*shape)  # hyperparameters bounded by the model's attention shape (ShadowKV's rank)
    no_prompt = cfg.task.name == "ppl" or (cfg.task.name == "lm_eval" and cfg.task.get("protocol") == "paper")
    if method.needs_prompt and no_prompt and not cfg.task.get("dense_rows"):
        raise UserError("task.dense_rows", f"{type(method).__name__} compresses a prompt: task.dense_rows=0 leaves "
                        "none; set task.dense_rows to the prompt length, or task.protocol=serving for lm_eval")
    if hasattr(module, "validate_config"):  # what the task needs of the rest of the config (e.g. hardware)
        with user_input("hardware" if cfg.task.get("timing") == "modelled" else "task", cfg):
            module.validate_config(cfg, method)
    from infinigen import adapter

    with user_input("device", cfg):
        adapter.resolve_device(cfg.get("device"))
    return module, method


@contextmanager
def weights_available():
    """Weights that cannot be had (not on disk, no hub to ask) are bad input like any other: the line names
    model.local_path and model.random_init (ModelUnavailable's message), instead of transformers' tracebacks."""
    from infinigen.models import ModelUnavailable

    try:
        yield
    except ModelUnavailable as err:
        raise UserError("model.local_path", str(err)) from err


def check_weights(cfg: DictConfig) -> None:
    """The weights a run will load are on disk or can be asked of the hub (a modelled run loads none). Not part of
    `validate`: a config is valid wherever it runs, the weights are this machine's (a GPU preset validates here)."""
    from infinigen.models import check_available

    if needs_model(cfg):
        with weights_available():
            check_available(cfg.model)
