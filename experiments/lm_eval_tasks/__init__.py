"""Offline lm-eval 0.4.13 twins of copa, openbookqa, winogrande, piqa, rte, arc_easy, arc_challenge, sciq, boolq
(multiple choice) and wikitext
(rolling log-likelihood: word/byte perplexity, bits per byte).

The YAMLs in this folder name their data files relative to a data dir (e.g. /work/shared/data, see its
SOURCES.md). :func:`task_manager` turns them into tasks with absolute paths; :func:`resolve_task_names`
maps the plain task names onto the local ones::

    from experiments.lm_eval_tasks import resolve_task_names, task_manager

    tasks = resolve_task_names(["piqa", "copa", "hellaswag"], data_dir)  # -> piqa_local, copa_local, hellaswag
    lm_eval.simple_evaluate(model=..., tasks=tasks, task_manager=task_manager(data_dir))

With ``data_dir=None`` both are pass-throughs (built-in tasks, which need the HF hub).

A user's own tasks come as lm-eval's own ``include_path``: one or more directories of task YAMLs (lm-eval reads
``**/*.yaml``; ``!function`` refers to a .py file next to the YAML; a ``data_files`` path that is not absolute is
resolved by ``datasets`` from the current directory). :func:`check_include_path` checks them without importing
lm-eval, :func:`task_manager` passes them on, :func:`tasks_identity` hashes what a run reads.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from infinigen.corpora import file_sha256

TASKS_DIR = Path(__file__).resolve().parent

#: plain lm-eval task name -> local task name (and YAML stem in this folder)
LOCAL_TASKS: dict[str, str] = {
    "copa": "copa_local",
    "openbookqa": "openbookqa_local",
    "winogrande": "winogrande_local",
    "piqa": "piqa_local",
    "rte": "rte_local",
    "arc_easy": "arc_easy_local",
    "arc_challenge": "arc_challenge_local",
    "sciq": "sciq_local",
    "boolq": "boolq_local",
    "wikitext": "wikitext_local",
}

# dataset_kwargs keys whose values are paths relative to the data dir
_PATH_KEYS = ("data_files", "labels_file")


class _TemplateLoader(yaml.SafeLoader):
    """Reads our YAMLs without importing anything: `!function x.y` stays the string 'x.y'."""


_TemplateLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _template_path(local_name: str) -> Path:
    return TASKS_DIR / f"{local_name}.yaml"


def _local_name(name: str) -> str:
    if name in LOCAL_TASKS:
        return LOCAL_TASKS[name]
    if name in LOCAL_TASKS.values():
        return name
    raise ValueError(f"unknown local task {name!r}; known: {sorted(LOCAL_TASKS)}")


def _resolve_paths(value: Any, data_dir: Path) -> Any:
    """data_files may be a str, a list of str or a {split: str | list} mapping."""
    if isinstance(value, str):
        return str(data_dir / value)
    if isinstance(value, list):
        return [_resolve_paths(v, data_dir) for v in value]
    if isinstance(value, dict):
        return {k: _resolve_paths(v, data_dir) for k, v in value.items()}
    raise ValueError(f"unsupported data file spec {value!r}")


def _flat_paths(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [p for v in value for p in _flat_paths(v)]
    return [p for v in value.values() for p in _flat_paths(v)]


def resolved_dataset_kwargs(task: str, data_dir: str | os.PathLike) -> dict[str, Any]:
    """The task's dataset_kwargs with every data path made absolute under data_dir.

    Raises ValueError naming the task and the file if a file is missing.
    """
    local = _local_name(task)
    data_dir = Path(data_dir).expanduser().resolve()
    with _template_path(local).open() as fh:
        cfg = yaml.load(fh, Loader=_TemplateLoader)  # noqa: S506 - SafeLoader subclass
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    for key in _PATH_KEYS:
        if key in kwargs:
            kwargs[key] = _resolve_paths(kwargs[key], data_dir)
            for path in _flat_paths(kwargs[key]):
                if not Path(path).is_file():
                    raise ValueError(
                        f"lm-eval task {local!r} needs the data file {path} "
                        f"({key} in {_template_path(local).name}), which does not exist under "
                        f"data_dir {data_dir}"
                    )
    return kwargs


def task_manager(
    data_dir: str | os.PathLike | None,
    *,
    tasks: Iterable[str] | None = None,
    **tm_kwargs: Any,
):
    """A lm_eval TaskManager that also knows the ``*_local`` tasks, with data files under data_dir.

    data_dir=None: a plain TaskManager (built-in tasks only). Otherwise every local task (or only those
    named in ``tasks``, plain or ``_local`` names; other names are ignored) is registered through a small
    YAML in a temporary directory that includes this folder's YAML and sets absolute data paths. The
    directory lives as long as the returned manager. Raises ValueError if data_dir or a needed file is
    missing. Extra keyword arguments go to ``TaskManager`` (``include_path`` is merged with ours).
    """
    from lm_eval.tasks import TaskManager

    if data_dir is None:
        return TaskManager(**tm_kwargs)
    data_dir = Path(data_dir).expanduser().resolve()
    if not data_dir.is_dir():
        raise ValueError(f"data_dir {data_dir} does not exist or is not a directory")

    if tasks is None:
        wanted = list(LOCAL_TASKS.values())
    else:
        all_names = set(LOCAL_TASKS) | set(LOCAL_TASKS.values())
        wanted = list(dict.fromkeys(_local_name(t) for t in tasks if t in all_names))

    # resolve (and check) everything before touching the file system
    overrides = {local: resolved_dataset_kwargs(local, data_dir) for local in wanted}

    tmp = tempfile.TemporaryDirectory(prefix="lm_eval_local_tasks_")
    for local, dataset_kwargs in overrides.items():
        wrapper = {
            "include": str(_template_path(local)),  # keeps `!function utils.*` resolving to this folder
            "task": local,
            "dataset_kwargs": dataset_kwargs,
        }
        (Path(tmp.name) / f"{local}.yaml").write_text(yaml.safe_dump(wrapper, sort_keys=False))

    extra = tm_kwargs.pop("include_path", None) or []
    extra = list(extra) if isinstance(extra, (list, tuple)) else [extra]
    tm = TaskManager(include_path=[tmp.name, *extra], **tm_kwargs)
    tm._local_tasks_tmpdir = tmp  # tie the temp dir's lifetime to the manager
    return tm


def resolve_task_names(names: list[str], data_dir: str | os.PathLike | None,
                       own: Iterable[str] = ()) -> list[str]:
    """Map the plain names in LOCAL_TASKS (copa, ..., wikitext) to their ``_local`` twins when data_dir is set.

    Other names (and everything when data_dir is None), and the names in ``own`` (the user's include_path tasks,
    which win over ours), pass through unchanged. Raises ValueError if data_dir is set and a file that a mapped
    task needs is missing.
    """
    if data_dir is None:
        return list(names)
    own = set(own)
    out = []
    for name in names:
        if name not in own and (name in LOCAL_TASKS or name in LOCAL_TASKS.values()):
            local = _local_name(name)
            resolved_dataset_kwargs(local, data_dir)  # raises on a missing file
            out.append(local)
        else:
            out.append(name)
    return out


# ----------------------------------------------------------------------------------------------- include_path


def include_dirs(include_path: Any) -> list[Path]:
    """task.include_path (null, a directory, or a list of directories) -> resolved directories, each checked to
    exist and to hold at least one *.yaml (what lm-eval scans)."""
    if include_path is None:
        return []
    paths = [include_path] if isinstance(include_path, (str, os.PathLike)) else list(include_path)
    if not paths or not all(isinstance(p, (str, os.PathLike)) and str(p).strip() for p in paths):
        raise ValueError(f"task.include_path must be null, a directory or a list of directories, got {include_path!r}")
    dirs = []
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"task.include_path: {path} is not a directory" + (" (it is a file: give its folder)"
                                                                                  if path.is_file() else ""))
        if not any(path.glob("**/*.yaml")):
            found = sorted(p.name for p in path.glob("**/*.yml"))
            raise ValueError(f"task.include_path: {path} holds no *.yaml task config"
                             + (f" (lm-eval reads .yaml only; found {found[:5]})" if found else ""))
        dirs.append(path)
    return dirs


def _load_task_yaml(path: Path, depth: int = 0) -> dict:
    """A task YAML with its `include:` chain merged (the includer's keys win), as lm-eval reads it."""
    with path.open() as fh:
        cfg = yaml.load(fh, Loader=_TemplateLoader)  # noqa: S506 - SafeLoader subclass
    if not isinstance(cfg, dict):
        raise ValueError("not a mapping")
    include = cfg.pop("include", None)
    if include and depth < 8:
        cfg = {**_load_task_yaml((path.parent / include).resolve(), depth + 1), **cfg}
    return cfg


def _yaml_names(cfg: dict) -> list[str]:
    """Names a YAML registers: its group (a group config) or task, and its tags."""
    name = cfg.get("group") if "group" in cfg else cfg.get("task")
    tags = cfg.get("tag") or []
    names = [name] if isinstance(name, str) else []
    return names + ([tags] if isinstance(tags, str) else [t for t in tags if isinstance(t, str)])


def _plain_data_files(cfg: dict) -> list[str]:
    """The plain local paths in a YAML's dataset_kwargs.data_files, as written (URLs and glob patterns are left to
    datasets)."""
    spec = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if not spec or not isinstance(spec, (str, list, dict)):
        return []
    return [p for p in _flat_paths(spec) if isinstance(p, str) and "://" not in p and not any(c in p for c in "*?[")]


def _local_data_files(cfg: dict) -> list[Path]:
    """Those paths resolved as datasets resolves them: from the current directory."""
    return [Path(p).expanduser().resolve() for p in _plain_data_files(cfg)]


def scan_include_path(include_path: Any) -> dict[str, Any]:
    """{"dirs", "tasks": {name: yaml}, "unreadable": {yaml: error}, "files": [yamls, .py, data files]} of the
    include_path directories, read with plain yaml (no lm-eval import)."""
    dirs = include_dirs(include_path)
    tasks: dict[str, Path] = {}
    unreadable: dict[Path, str] = {}
    files: list[Path] = []
    for root in dirs:
        for path in sorted(root.glob("**/*.yaml")):
            files.append(path)
            try:
                cfg = _load_task_yaml(path)
            except (OSError, ValueError, yaml.YAMLError) as err:
                unreadable[path] = str(err).splitlines()[0] if str(err) else type(err).__name__
                continue
            for name in _yaml_names(cfg):
                tasks.setdefault(name, path)
            files.extend(p for p in _local_data_files(cfg) if p.is_file())
        files.extend(sorted(root.glob("**/*.py")))  # !function prompt code
    return {"dirs": dirs, "tasks": tasks, "unreadable": unreadable, "files": list(dict.fromkeys(files))}


def check_include_path(include_path: Any, names: list[str]) -> dict[str, Any]:
    """The include_path checks that need no lm-eval: directories with YAMLs, and every data file that a requested
    task's YAML names exists. Returns the scan (names not found here may still be lm-eval's or ours)."""
    scan = scan_include_path(include_path)
    for name in names:
        path = scan["tasks"].get(name)
        if path is None:
            continue
        for raw in _plain_data_files(_load_task_yaml(path)):
            data = Path(raw).expanduser().resolve()
            if not data.is_file():
                hint = "" if Path(raw).expanduser().is_absolute() else (
                    f"; datasets resolves a relative data_files path from the current directory ({Path.cwd()}), "
                    "not from the YAML's folder: write an absolute path")
                raise ValueError(f"lm-eval task {name!r} ({path}) reads the data file {data}, which does not exist"
                                 + hint)
    return scan


def tasks_identity(names: list[str], data_dir: str | os.PathLike | None, include_path: Any = None) -> dict:
    """What identifies an lm_eval run's data: every local file it may read (our *_local tasks' data under data_dir,
    the include_path YAMLs, their .py and data files) with its sha256, and one sha256 over all of them (by file
    name, so the same files in another folder give the same digest). Hub tasks add nothing (lm-eval's version is
    in the row's meta)."""
    scan = scan_include_path(include_path) if include_path is not None else {"tasks": {}, "files": []}
    files: list[Path] = []
    for name in resolve_task_names(names, data_dir, own=scan["tasks"]):
        if name in LOCAL_TASKS.values() and name not in scan["tasks"]:
            kwargs = resolved_dataset_kwargs(name, data_dir)
            files += [Path(p) for key in _PATH_KEYS if key in kwargs for p in _flat_paths(kwargs[key])]
    files += scan["files"]
    entries = [{"path": str(p), "sha256": file_sha256(p)} for p in dict.fromkeys(files)]
    combined = "\n".join(f"{Path(e['path']).name} {e['sha256']}" for e in entries)
    return {"files": entries, "sha256": hashlib.sha256(combined.encode()).hexdigest() if entries else None}


__all__ = ["LOCAL_TASKS", "TASKS_DIR", "check_include_path", "include_dirs", "resolve_task_names",
           "resolved_dataset_kwargs", "scan_include_path", "task_manager", "tasks_identity"]
