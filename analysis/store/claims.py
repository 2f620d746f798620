"""Claims: a run first claims its config hash (an O_EXCL marker file under `<results_dir>/claims/`), so concurrent
launches of one config compute it once; a claim left by a killed process on this host is taken over."""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from analysis.store.files import StoreError, claims_dir


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

