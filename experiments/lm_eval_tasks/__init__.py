"""Offline lm-eval 0.4.13 twins of copa, openbookqa, winogrande, piqa, rte (multiple choice) and wikitext
(rolling log-likelihood: word/byte perplexity, bits per byte).

The YAMLs in this folder name their data files relative to a data dir (e.g. /work/shared/data, see its
SOURCES.md). :func:`task_manager` turns them into tasks with absolute paths; :func:`resolve_task_names`
maps the plain task names onto the local ones::

    from experiments.lm_eval_tasks import resolve_task_names, task_manager

    tasks = resolve_task_names(["piqa", "copa", "hellaswag"], data_dir)  # -> piqa_local, copa_local, hellaswag
    lm_eval.simple_evaluate(model=..., tasks=tasks, task_manager=task_manager(data_dir))

With ``data_dir=None`` both are pass-throughs (built-in tasks, which need the HF hub).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

TASKS_DIR = Path(__file__).resolve().parent

#: plain lm-eval task name -> local task name (and YAML stem in this folder)
LOCAL_TASKS: dict[str, str] = {
    "copa": "copa_local",
    "openbookqa": "openbookqa_local",
    "winogrande": "winogrande_local",
    "piqa": "piqa_local",
    "rte": "rte_local",
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


def resolve_task_names(names: list[str], data_dir: str | os.PathLike | None) -> list[str]:
    """Map the plain names in LOCAL_TASKS (copa, ..., wikitext) to their ``_local`` twins when data_dir is set.

    Other names (and everything when data_dir is None) pass through unchanged. Raises ValueError if
    data_dir is set and a file that a mapped task needs is missing.
    """
    if data_dir is None:
        return list(names)
    out = []
    for name in names:
        if name in LOCAL_TASKS or name in LOCAL_TASKS.values():
            local = _local_name(name)
            resolved_dataset_kwargs(local, data_dir)  # raises on a missing file
            out.append(local)
        else:
            out.append(name)
    return out


__all__ = ["LOCAL_TASKS", "TASKS_DIR", "resolve_task_names", "resolved_dataset_kwargs", "task_manager"]
