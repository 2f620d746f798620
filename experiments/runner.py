"""One experiment = (model, method, task) config -> metrics -> rows in the results store.

Import cost is part of the interface: `validate` refuses a bad config within seconds, so this module and the
task modules' `validate` import nothing heavy (no transformers model classes, lm_eval, pandas); torch and
transformers' cache classes come in with the model and method checks, the rest only once a run starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from analysis import store
from experiments.lm_eval_tasks import tasks_identity
from experiments.lm_eval_tasks.ruler import haystack_identity, ruler_names
from infinigen import corpora
from infinigen.semantic import semantic_config  # what a run computes: the config hash's input


class UserError(ValueError):
    """Bad input (a config value, a file, a folder, a name): run.py prints `error: <line>` and exits 2, without a
    traceback unless debug=true or HYDRA_FULL_ERROR=1. Anything else is a bug: traceback, exit 1."""

    def __init__(self, option: str, message: str):
        self.option, self.message = option, " ".join(message.split())
        super().__init__(self.message)

    @property
    def line(self) -> str:
        """`<option>: <message>`, a message that starts with "<option> must ..." cut to "must ..."."""
        word = self.option.rsplit(".", 1)[-1]
        for head in (self.option, word):
            rest = self.message[len(head):] if self.message.startswith(head) else ""
            if rest.startswith((" must ", " may ")):
                return f"{self.option}: {rest.lstrip()}"
        return f"{self.option}: {self.message}"


# what a check of the user's input raises (a ValueError names a bad value, an OSError a path that is not there or
# not usable); a TypeError counts only from instantiating a config group (an unknown or mistyped argument)
INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, store.StoreError)


def option_of(message: str, group: str | None, cfg) -> tuple[str, str]:
    """(option, message) for a check's message: the option is the message's first word when it names a key of
    the config (bare, or inside `group`), else `group`."""
    word = re.match(r"[A-Za-z_][\w.]*", message)
    word = word.group(0).rstrip(".") if word else ""
    option = group or "config"
    if word and group and word.startswith(f"{group}."):
        option = word
    elif word and OmegaConf.select(cfg, f"{group}.{word}" if group else word, default="<absent>") != "<absent>":
        option = f"{group}.{word}" if group else word
    return option, message


@contextmanager
def user_input(group: str | None, cfg):
    """Turns what checking `group` of the config (None = its top level) raises on bad input into a UserError."""
    from hydra.errors import InstantiationException

    try:
        yield
    except UserError:
        raise
    except InstantiationException as err:
        cause = err.__cause__
        if not isinstance(cause, (*INPUT_ERRORS, TypeError)):
            raise
        raise UserError(*option_of(str(cause), group, cfg)) from err
    except INPUT_ERRORS as err:
        raise UserError(*option_of(str(err), group, cfg)) from err


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


class NonFiniteError(FloatingPointError):
    pass


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


def hydra_error(err: BaseException) -> UserError | None:
    """The user error behind an exception Hydra raises before a job starts (an override it cannot parse, a
    config group option or key that does not exist, an output folder it cannot create); None for anything else."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    text = str(err)
    if isinstance(err, OverrideParseException):
        detail = " ".join(err.message.split("See https://")[0].split())
        return UserError(err.override.split("=", 1)[0].lstrip("+~") or "override",
                         f"cannot parse {err.override!r} ({detail}); write KEY=VALUE, lists as [a,b], sweeps as a,b "
                         "(https://hydra.cc/docs/advanced/override_grammar/basic)")
    if isinstance(err, ConfigCompositionException):
        missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
        options = re.search(r"Available options in '[^']+':\n((?:\t.*\n?)*)", text)
        if missing:
            group, name = missing.groups()
            allowed = ", ".join(options.group(1).split()) if options else "none"
            return UserError(group, f"no {group} named {name!r}; choose one of: {allowed}")
        key = re.search(r"Could not (?:override|append to|delete from config\.?) '?([\w./]+)'?", text)
        if key:
            return UserError(key.group(1), f"{' '.join(text.split('full_key')[0].split())}; `python run.py --cfg job` "
                             "lists the options")
        return UserError("config", " ".join(text.split("Config search path")[0].split()))
    frames = traceback.extract_tb(err.__traceback__)
    if not frames or any(f.name == "run_point" for f in frames):
        return None  # raised inside a job: the runner has classified it
    if isinstance(err, OSError) and any(f"{os.sep}hydra{os.sep}" in f.filename for f in frames):
        return UserError("results_dir", f"cannot create Hydra's output folder {err.filename} ({err.strerror}); choose "
                         "a results_dir=... (or hydra.run.dir / hydra.sweep.dir) you can write")
    if isinstance(err, ValueError) and any(part in frames[-1].filename for part in (f"{os.sep}hydra{os.sep}",
                                                                                  f"{os.sep}omegaconf{os.sep}")):
        return UserError("override", f"{' '.join(text.split())} (composing the config from the command line)")
    return None


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
