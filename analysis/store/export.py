"""Copying runs between stores: the newest run of each config, without the per-prompt detail no table or figure
reads (`DETAIL`; each row's per-unit results, `metrics.units`, are kept: paired comparisons read them), optionally
only the runs whose rows match `--where` clauses."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from analysis.store.files import StoreError, _rows_of, _umask, rows_dir


# metrics holding one entry per prompt or document: raw detail behind the aggregates, dropped by `export`
DETAIL = ("per_prompt", "seconds_per_prompt", "per_doc", "samples")


def field(row: dict, path: str):
    """A dotted path into a row (`method_params.alpha`, `task_params.seq_len`); None where it does not exist."""
    value = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _equal(value, wanted: str) -> bool:
    if str(value) == wanted:
        return True
    try:
        return float(value) == float(wanted)
    except (TypeError, ValueError):
        return False


def matches(row: dict, where: list[str]) -> bool:
    """Every clause COLUMN=VALUE (or COLUMN=a,b,c: one of them) holds for the row."""
    for clause in where:
        path, sep, values = clause.partition("=")
        if not sep:
            raise StoreError(f"--where {clause!r}: expected COLUMN=VALUE, e.g. task=ppl or method_params.bits=4")
        if not any(_equal(field(row, path), v) for v in values.split(",")):
            return False
    return True


def without_detail(row: dict) -> dict:
    metrics = {k: v for k, v in row.get("metrics", {}).items() if k not in DETAIL}
    return row | {"metrics": metrics}


def newest_files(results_dir: str | Path) -> list[Path]:
    """The newest rows file of each config hash (a forced re-run supersedes the earlier files), by name."""
    newest: dict[str, Path] = {}
    for path in sorted(p for p in rows_dir(results_dir).glob("*.jsonl") if not p.name.startswith(".")):
        newest[path.name.split("__", 1)[0]] = path  # names sort by time within a hash
    return sorted(newest.values())


def export(results_dir: str | Path, to: str | Path, where: list[str] = ()) -> list[Path]:
    """Copies the newest run of each config in `results_dir` whose rows match `where` into the store `to`, under
    the same file name, without DETAIL; returns the files written (a run already there with the same content is
    left alone; one with other content is replaced, so a re-export after a forced re-run updates it)."""
    out = rows_dir(to)
    written = []
    for path in newest_files(results_dir):
        rows = [row for _, row in _rows_of(path, strict=True)]
        if not rows or not all(matches(row, list(where)) for row in rows):
            continue
        digest = rows[0].get("config_hash")
        stale = [p for p in out.glob(f"{digest}__*.jsonl") if p.name != path.name] if digest else []
        target = out / path.name
        text = "".join(json.dumps(without_detail(row), sort_keys=True, default=str) + "\n" for row in rows)
        if target.exists() and target.read_text() == text and not stale:
            continue
        out.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-", suffix=".jsonl")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
        for old in stale:  # an older run of the same config: the export keeps one run per config
            old.unlink()
        written.append(target)
    return written
