"""The store's files: where a store keeps its rows and claims, writing one run's rows atomically, and reading
them back (analysis/store/__init__.py says what the store is)."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path

from infinigen.semantic import LATER_METHOD_OPTIONS


class StoreError(RuntimeError):
    pass


class StoreWarning(UserWarning):
    pass


def rows_dir(results_dir: str | Path) -> Path:
    return Path(results_dir) / "rows"


def claims_dir(results_dir: str | Path) -> Path:
    return Path(results_dir) / "claims"


def has_run(results_dir: str | Path, config_hash: str) -> bool:
    return any(rows_dir(results_dir).glob(f"{config_hash}__*.jsonl"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(results_dir: str | Path) -> None:
    """Creates rows/, runs/ and claims/ and writes a probe file in each, so an unwritable store is refused before
    a model loads (and not after the compute)."""
    for sub in ("rows", "runs", "claims"):
        folder = Path(results_dir) / sub
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as err:
            raise StoreError(
                f"results_dir={str(results_dir)!r} is not writable ({folder}: {err.strerror or err}); "
                "choose another results_dir=... or fix its permissions"
            ) from err


def _write_rows(path: Path, rows: list[dict]) -> None:
    """Writes rows to a temp file next to `path`, then renames it into place (readable as umask allows)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; rows are shared like every other output
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_rows(results_dir: str | Path, config_hash: str, rows: list[dict]) -> Path:
    """Atomically add one run's rows; never overwrites an earlier run (forced re-runs get a new file)."""
    out = rows_dir(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    final = out / f"{config_hash}__{stamp}.jsonl"
    _write_rows(final, rows)
    return final


def keep_unsaved(rows: list[dict], config_hash: str, places: list[Path]) -> Path:
    """Rows that could not be written to the store go to the first writable of `places` (then the temp dir)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    for folder in [*places, Path(tempfile.gettempdir())]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"unsaved-{config_hash}__{stamp}-{os.getpid()}.jsonl"
            _write_rows(path, rows)
            return path
        except OSError:
            continue
    raise StoreError(f"rows of {config_hash} could not be written anywhere (tried {places} and the temp dir)")


def import_rows(path: str | Path, results_dir: str | Path) -> list[Path]:
    """Adds the rows of a JSON-lines file (e.g. one `keep_unsaved` wrote) to the store, one file per config hash."""
    by_hash: dict[str, list[dict]] = {}
    for _, row in _rows_of(Path(path), strict=True):
        if "config_hash" not in row:
            raise StoreError(f"{path}: a row without config_hash cannot be imported")
        by_hash.setdefault(row["config_hash"], []).append(row)
    return [append_rows(results_dir, digest, rows) for digest, rows in by_hash.items()]



# ----------------------------------------------------------------------------------------------- reading


def _rows_of(path: Path, strict: bool):
    """(line number, row dict) of a rows file; unreadable lines raise (strict) or warn naming file and line."""
    data = path.read_bytes()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            if not isinstance(row, dict):
                raise ValueError(f"a row is a JSON object, got {type(row).__name__}")
        except (UnicodeDecodeError, ValueError) as err:
            message = f"{path}:{number}: unreadable row skipped ({type(err).__name__}: {str(err)[:120]})"
            if strict:
                raise StoreError(message) from err
            warnings.warn(message, StoreWarning, stacklevel=3)
            continue
        yield number, row


def load(results_dir: str | Path = "results", latest_only: bool = True, strict: bool = False):
    """Every row of the store as a flat pandas DataFrame (nested dicts become dotted columns).

    latest_only: when a config was forced to re-run, keep only its newest rows. An unreadable line (truncated,
    not UTF-8, not a JSON object) is skipped with a warning naming its file and line, or raises StoreError with
    strict=True. Rows without a config_hash (not written by the runner) are kept, never deduplicated, and
    reported. `df.attrs["skipped"]` lists the skipped "file:line" places.
    """
    import pandas as pd

    # a write killed before its rename leaves a hidden .tmp-* file behind: never rows
    files = sorted(p for p in rows_dir(results_dir).glob("*.jsonl") if not p.name.startswith("."))
    records, skipped = [], []
    for path in files:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StoreWarning)
            records.extend(row | {"_file": path.name} for _, row in _rows_of(path, strict))
        for w in caught:
            skipped.append(str(w.message).split(": unreadable", 1)[0])
            warnings.warn(w.message, StoreWarning, stacklevel=2)
    unhashed = [r["_file"] for r in records if not r.get("config_hash")]
    if unhashed:
        message = (f"{len(unhashed)} row(s) without config_hash kept as they are (never deduplicated): "
                   f"{sorted(set(unhashed))[:5]}")
        if strict:
            raise StoreError(message)
        warnings.warn(message, StoreWarning, stacklevel=2)
    if not records:
        df = pd.DataFrame()
    else:
        df = pd.json_normalize(records, max_level=1)
        for name, neutral in LATER_METHOD_OPTIONS.items():  # at its neutral value a later option is as if absent
            column = f"method_params.{name}"
            if column in df and neutral is not None:
                df[column] = df[column].where(df[column] != neutral)
        if latest_only and "config_hash" in df:
            hashed = df["config_hash"].notna()
            newest = df[hashed].groupby("config_hash")["_file"].transform("max")
            df = df[~hashed | (df["_file"] == newest.reindex(df.index))]
        df = df.reset_index(drop=True)
    df.attrs["skipped"] = skipped
    return df

