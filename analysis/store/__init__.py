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

from analysis.store.claims import claim
from analysis.store.cli import main
from analysis.store.export import DETAIL, export, matches, newest_files, without_detail
from analysis.store.files import (StoreError, StoreWarning, append_rows, check_writable, claims_dir, has_run,
                                  import_rows, keep_unsaved, load, rows_dir)

__all__ = ["DETAIL", "StoreError", "StoreWarning", "append_rows", "check_writable", "claim", "claims_dir", "export",
           "has_run", "import_rows", "keep_unsaved", "load", "main", "matches", "newest_files", "rows_dir", "without_detail"]
