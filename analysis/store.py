"""The results store: one JSON-lines file per finished run under `<results_dir>/rows/`, written atomically.

A run's rows (one per task result) land together or not at all (write to a temp file, then rename), so an
interrupted sweep never leaves half a row, and a re-launch finds exactly the runs that finished. A run first
claims its config hash (`claim`: an O_EXCL marker file under `<results_dir>/claims/`), so concurrent launches of
one config compute it once. `load` skips (and names) unreadable lines instead of failing every table.

Re-import rows a run could not write into the store (it prints where it kept them):

    python -m analysis.store import /path/to/kept.jsonl --results results

Copy the newest run of each config into another store (docs/store, the committed store `make report` reads),
without the per-prompt detail no table or figure reads (`DETAIL`), optionally only the rows that match:

    python -m analysis.store export --results results --to docs/store --where task=ppl method=full,infinigen
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import warnings
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path


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


# ----------------------------------------------------------------------------------------------- claims


def _claim_path(results_dir: str | Path, config_hash: str) -> Path:
    return claims_dir(results_dir) / f"{config_hash}.claim"


def _stale(path: Path, owner: dict) -> bool:
    """A claim is stale when its process is gone: same host and no such pid. A claim from another host is never
    judged stale here (its pid means nothing on this host); an empty claim (its writer killed between create and
    write) is stale after a minute."""
    if not owner:
        return _age_s(path) > 60
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError):
        return False
    return False


def _age_s(path: Path) -> float:
    try:
        return datetime.now().timestamp() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read_claim(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # created but not yet written (or its writer was killed in between)


def _take_over(path: Path, owner: dict) -> None:
    """Moves a stale claim aside. Of two takers only one rename of the file succeeds; a taker that finds it moved
    a fresh claim (made after its check) puts it back."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # someone else moved it first; the next O_EXCL create decides
    if _read_claim(aside) != owner:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    else:
        print(f"[claim] took over the stale claim of pid {owner.get('pid', '?')} on {owner.get('host', '?')} ({path})")
    aside.unlink(missing_ok=True)


def _acquire(path: Path, me: dict) -> dict | None:
    """Creates the claim file (O_EXCL); returns None when it is ours, else the live holder's claim."""
    for _ in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            owner = _read_claim(path)
            if owner is None:
                continue  # released between our create and our read
            if not _stale(path, owner):
                return owner
            _take_over(path, owner)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me))
        return None
    raise StoreError(f"could not claim {path}: it keeps reappearing (other processes are taking it over)")


@contextmanager
def claim(results_dir: str | Path, config_hash: str):
    """Holds the claim on a config hash while the block runs; yields the claim file, or None (claiming nothing)
    when a live process holds it. A claim left by a killed process on this host is taken over."""
    path = _claim_path(results_dir, config_hash)
    path.parent.mkdir(parents=True, exist_ok=True)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": datetime.now(timezone.utc).isoformat()}
    holder = _acquire(path, me)
    if holder is not None:
        print(f"[skip] config {config_hash} is being run by pid {holder.get('pid', '?')} on host "
              f"{holder.get('host', '?')} since {holder.get('started', '?')} (claim {path}; delete it if that "
              "run is dead on another host)")
        yield None
        return
    try:
        yield path
    finally:
        if _read_claim(path) == me:
            path.unlink(missing_ok=True)


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
        if latest_only and "config_hash" in df:
            hashed = df["config_hash"].notna()
            newest = df[hashed].groupby("config_hash")["_file"].transform("max")
            df = df[~hashed | (df["_file"] == newest.reindex(df.index))]
        df = df.reset_index(drop=True)
    df.attrs["skipped"] = skipped
    return df


# ----------------------------------------------------------------------------------------------- export

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="results store tools")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="add the rows of a JSON-lines file (e.g. one a failed write kept) to the store")
    imp.add_argument("path")
    imp.add_argument("--results", default="results", help="results_dir of the store")
    exp = sub.add_parser("export", help="copy the newest run of each config (without per-prompt detail) into "
                                        "another store, e.g. the committed docs/store")
    exp.add_argument("--results", default="results", help="results_dir to copy from")
    exp.add_argument("--to", required=True, help="the store to copy into (e.g. docs/store)")
    exp.add_argument("--where", nargs="*", default=[], metavar="COLUMN=VALUE",
                     help="only runs whose rows all match, e.g. task=ppl method=full,h2o task_params.seq_len=2048")
    args = p.parse_args(argv)
    if args.command == "export":
        written = export(args.results, args.to, args.where)
        print(f"[export] {len(written)} run(s) written to {rows_dir(args.to)}")
        return 0
    for path in import_rows(args.path, args.results):
        print(f"[import] {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
