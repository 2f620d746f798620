"""The results store: one JSON-lines file per finished run under `<results_dir>/rows/`, written atomically.

A run's rows (one per task result) land together or not at all (write to a temp file, then rename), so an
interrupted sweep never leaves half a row, and a re-launch finds exactly the runs that finished.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd


def rows_dir(results_dir: str | Path) -> Path:
    return Path(results_dir) / "rows"


def has_run(results_dir: str | Path, config_hash: str) -> bool:
    return any(rows_dir(results_dir).glob(f"{config_hash}__*.jsonl"))


def append_rows(results_dir: str | Path, config_hash: str, rows: list[dict]) -> Path:
    """Atomically add one run's rows; never overwrites an earlier run (forced re-runs get a new file)."""
    out = rows_dir(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    final = out / f"{config_hash}__{stamp}.jsonl"
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-", suffix=".jsonl")
    with os.fdopen(fd, "w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def load(results_dir: str | Path = "results", latest_only: bool = True) -> pd.DataFrame:
    """Every row of the store as a flat DataFrame (nested dicts become dotted columns).

    latest_only: when a config was forced to re-run, keep only its newest rows.
    """
    # a write killed before its rename leaves a hidden .tmp-* file behind: never rows
    files = sorted(p for p in rows_dir(results_dir).glob("*.jsonl") if not p.name.startswith("."))
    records = []
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line) | {"_file": path.name})
    if not records:
        return pd.DataFrame()
    df = pd.json_normalize(records, max_level=1)
    if latest_only and "config_hash" in df:
        newest = df.groupby("config_hash")["_file"].transform("max")
        df = df[df["_file"] == newest]
    return df.reset_index(drop=True)
