"""What two stored rows must share before a verdict puts them in one ratio or difference, and the refusal when they
do not.

* speed: the same code (one clean commit), device, thread count, dtype, model and shape (batch, prompt, generated
  tokens), and the same kind of number (measured or modelled, on the same runtime and schedule);
* accuracy: the same model, data (sha256 of what was read), windows or docs (dataset, length, stride, windows
  skipped and scored, dense rows; lm-eval task, shots, docs, protocol) and, where a KV budget is compared, the same
  measured kv_fraction within KV_TOLERANCE of each other (or a value interpolated inside a measured range, which the
  caller says).

`check(a, b, kind)` raises `Unlike` naming every difference; `refusal` words it for a verdict, with the command
that adds matching rows. A verdict never words around a mismatch: it refuses.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

KV_TOLERANCE = 0.10  # relative: two rows "at the same KV size" keep within 10% of the larger one's share (20% vs 18.5%)


def same_size(a, b):
    """Whether two (relative) KV sizes are the same within KV_TOLERANCE (numbers, or a Series and a number)."""
    return np.abs(a - b) <= KV_TOLERANCE * np.maximum(a, b)


SPEED = {
    "commit": "meta.git_commit", "device": "meta.device", "threads": "meta.threads", "model": "model",
    "dtype": "metrics.dtype", "batch": "metrics.batch_size", "prompt": "metrics.prompt_len", "gen": "metrics.gen_len",
    "timing": "metrics.timing", "schedule": "metrics.schedule",
    "hardware": "metrics.hardware",
}
ACCURACY = {
    "model": "model", "data": "data.sha256", "dataset": "task_params.dataset", "seq_len": "task_params.seq_len",
    "stride": "task_params.stride", "windows": "metrics.windows", "skip_windows": "task_params.skip_windows",
    "dense_rows": "task_params.dense_rows", "task": "metrics.task", "shots": "metrics.num_fewshot",
    "docs": "metrics.limit", "protocol": "metrics.protocol", "n": "metrics.n",
}
# a later option absent from an older row means its default
DEFAULTS = {"task_params.skip_windows": 0}


class Unlike(ValueError):
    """Two rows a verdict would compare differ in what the comparison needs them to share."""

    def __init__(self, what: list[str]):
        self.what = what
        super().__init__("; ".join(what))


def value(row: pd.Series, column: str):
    got = row.get(column) if column in row.index else None
    if got is None or (isinstance(got, float) and math.isnan(got)):
        return DEFAULTS.get(column)
    return got


def _same(x, y) -> bool:
    if x is None or y is None:
        return x is None and y is None
    try:
        return float(x) == float(y)
    except (TypeError, ValueError):
        return str(x) == str(y)


def short_commit(commit) -> str:
    return "not recorded" if not isinstance(commit, str) else commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")


def differences(a: pd.Series, b: pd.Series, keys: dict[str, str]) -> list[str]:
    """`what: a vs b` for each key the two rows do not share (absent on both counts as shared)."""
    out = []
    for name, column in keys.items():
        x, y = value(a, column), value(b, column)
        if not _same(x, y):
            show = short_commit if name == "commit" else str
            out.append(f"{name} {show(x)} vs {show(y)}")
    return out


def check(a: pd.Series, b: pd.Series, kind: str, kv: bool = False) -> None:
    """Raises Unlike unless rows `a` and `b` may share a ratio or difference of `kind` ("speed" | "accuracy");
    `kv`: also at the same measured kv_fraction (KV_TOLERANCE)."""
    what = differences(a, b, SPEED if kind == "speed" else ACCURACY)
    if kind == "speed":
        for row in (a, b):
            commit = value(row, "meta.git_commit")
            if not isinstance(commit, str) or commit.endswith("-dirty") or commit == "unknown":
                what.append(f"commit {short_commit(commit)} is not a clean commit")
    if kind == "accuracy":
        ids = [units_ids(row) for row in (a, b)]
        if ids[0] is not None and ids[1] is not None and ids[0] != ids[1]:
            what.append("scored units (windows or docs) differ")
    if kv:
        x, y = kv_of(a), kv_of(b)
        if x is None or y is None or not same_size(x, y):
            what.append(f"kv_fraction {_pct(x)} vs {_pct(y)} (more than {100 * KV_TOLERANCE:.0f}% apart)")
    if what:
        raise Unlike(list(dict.fromkeys(what)))


def units_ids(row: pd.Series) -> list | None:
    units = value(row, "metrics.units")
    return sorted(map(str, units["id"])) if isinstance(units, dict) and units.get("id") else None


def kv_of(row: pd.Series) -> float | None:
    got = value(row, "metrics.kv_fraction")
    if got is None and isinstance(value(row, "metrics.stats"), dict):
        got = value(row, "metrics.stats").get("kv_fraction")
    if got is None and row.get("method") == "full":
        return 1.0
    return None if got is None else float(got)


def _pct(x: float | None) -> str:
    return "not recorded" if x is None else f"{100 * x:.3g}%"


def refusal(err: Unlike, what: str, command: str | None = None) -> str:
    """A verdict line that refuses `what` (e.g. "InfiniGen's / H2O's NLL gap") and names the command that adds rows
    that match."""
    line = f"refused: {what} compares unlike rows ({err})"
    return line + (f"; `{command}` adds rows that match" if command else "")
