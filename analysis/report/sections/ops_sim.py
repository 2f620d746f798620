"""Beyond the paper: ops and host syncs of a sim-mode forward (experiments/bench_ops.py rows; analysis/ops.py)."""

from __future__ import annotations

from analysis import ops as O
from analysis.report.section import Section

SECTION = Section(
    "ops_sim", "Beyond the paper: ops and host syncs of a sim-mode forward", O.SIM_TEXT,
    (), O.sim_table, O.sim_verdict, script=O.sim_rows, note=O.SIM_NOTE, order=180)
