"""The store's command line: `python -m analysis.store import|export ...` (analysis/store/__init__.py shows both)."""

from __future__ import annotations

import argparse

from analysis.store.export import export
from analysis.store.files import import_rows, rows_dir


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

