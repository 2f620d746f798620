"""analysis/store/ under faults (issue 16): unreadable lines are named and skipped, rows without a hash are
reported, a config hash is claimed by one process at a time (stale claims of killed processes are taken over),
rows files respect the umask, and rows that could not be stored are kept and re-imported."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from analysis import store, tables

H1, H2 = "1" * 16, "2" * 16


def ppl_row(digest: str, ppl: float) -> dict:
    return {"config_hash": digest, "model": "tiny", "method": "full", "task": "ppl",
            "method_params": {"name": "full"}, "task_params": {"name": "ppl", "dataset": "wikitext2", "seq_len": 64},
            "metrics": {"ppl": ppl, "nll": 1.0, "tokens": 63, "kv_fraction": 1.0}, "meta": {}, "config": {}}


def damaged_store(results: Path) -> None:
    """Two good runs, then the faults of issue 16: a truncated line appended to a rows file, a binary rows file
    and a valid row without a config hash."""
    good = store.append_rows(results, H1, [ppl_row(H1, 10.0)])
    store.append_rows(results, H2, [ppl_row(H2, 20.0)])
    with open(good, "a") as f:
        f.write(json.dumps(ppl_row(H1, 99.0))[:60])  # a write cut short: no closing brace, no newline
    (store.rows_dir(results) / "binary.jsonl").write_bytes(bytes(range(128, 256)) * 4)
    (store.rows_dir(results) / "by-hand.jsonl").write_text(json.dumps(ppl_row(H1, 30.0) | {"config_hash": None}) + "\n")


def test_unreadable_lines_are_named_and_skipped_and_tables_still_print(tmp_path):
    damaged_store(tmp_path)
    with pytest.warns(store.StoreWarning) as caught:
        df = store.load(tmp_path)
    messages = "\n".join(str(w.message) for w in caught)
    good_file = next(p.name for p in store.rows_dir(tmp_path).glob(f"{H1}__*.jsonl"))
    assert f"{good_file}:2: unreadable row skipped (JSONDecodeError" in messages  # file and line named
    assert "binary.jsonl:1: unreadable row skipped (UnicodeDecodeError" in messages
    assert "1 row(s) without config_hash kept" in messages and "by-hand.jsonl" in messages
    assert sorted(df["metrics.ppl"]) == [10.0, 20.0, 30.0]  # the hashless row is kept, not dropped silently
    assert len(df.attrs["skipped"]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", store.StoreWarning)
        text = tables.main(["--results", str(tmp_path), "--table", "ppl"])
    assert "10" in text and "20" in text


def test_strict_load_raises_naming_file_and_line(tmp_path):
    damaged_store(tmp_path)
    with pytest.raises(store.StoreError, match=r"binary\.jsonl:1: unreadable|__.*\.jsonl:2: unreadable"):
        store.load(tmp_path, strict=True)


def test_rows_files_respect_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        group_writable = store.append_rows(tmp_path / "a", H1, [ppl_row(H1, 1.0)])
        os.umask(0o022)
        shared = store.append_rows(tmp_path / "b", H1, [ppl_row(H1, 1.0)])
    finally:
        os.umask(old)
    assert group_writable.stat().st_mode & 0o777 == 0o664  # mkstemp alone gives 0600
    assert shared.stat().st_mode & 0o777 == 0o644


def _claimer(results: str, barrier, hold_s: float, out) -> None:
    barrier.wait()
    with store.claim(results, H1) as claimed:
        if claimed is not None:
            time.sleep(hold_s)
        out.put(claimed is not None)


def test_four_concurrent_claims_of_one_hash_give_one_owner(tmp_path):
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(str(tmp_path), barrier, 1.0, out)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert sorted(got) == [False, False, False, True]
    assert not list(store.claims_dir(tmp_path).iterdir())  # the owner released its claim


def test_a_stale_claim_of_a_killed_process_is_taken_over(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now gone (and not reused within this test in practice)
    path = store.claims_dir(tmp_path) / f"{H1}.claim"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "earlier"}))
    with store.claim(tmp_path, H1) as claimed:
        assert claimed == path
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert "took over the stale claim" in capsys.readouterr().out
    assert not path.exists()


@pytest.mark.parametrize("owner", [{"pid": os.getpid(), "host": socket.gethostname()},  # alive here
                                   {"pid": 1, "host": "another-node"}])  # another host: cannot be judged dead
def test_a_live_or_foreign_claim_is_respected(tmp_path, owner, capsys):
    path = store.claims_dir(tmp_path) / f"{H1}.claim"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(owner | {"started": "earlier"}))
    with store.claim(tmp_path, H1) as claimed:
        assert claimed is None
    assert f"is being run by pid {owner['pid']} on host {owner['host']}" in capsys.readouterr().out
    assert path.exists()  # not ours to remove


def test_an_unwritable_results_dir_is_refused(tmp_path):
    (tmp_path / "rows").write_text("a file where the rows folder should be")  # refuses even for root
    with pytest.raises(store.StoreError, match="is not writable"):
        store.check_writable(tmp_path)


def test_unsaved_rows_are_kept_and_re_imported(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    kept = store.keep_unsaved([ppl_row(H1, 5.0), ppl_row(H2, 6.0)], H1, [blocked / "sub", tmp_path / "kept"])
    assert kept.parent == tmp_path / "kept"
    assert store.main(["import", str(kept), "--results", str(tmp_path / "results")]) == 0
    df = store.load(tmp_path / "results")
    assert sorted(zip(df["config_hash"], df["metrics.ppl"])) == [(H1, 5.0), (H2, 6.0)]
