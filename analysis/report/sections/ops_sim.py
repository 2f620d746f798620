"""Beyond the paper: ops and host syncs of a sim-mode forward (experiments/bench_ops.py rows; analysis/ops.py)."""

from __future__ import annotations

from analysis import ops as O
from analysis.report.section import Section

SECTION = Section(
    "ops_sim", "Beyond the paper: ops and host syncs of a sim-mode forward",
    "A sim-mode forward (perplexity, lm-eval scoring) is one batched pass, so its op count should not grow "
    "with the sequence; methods whose selection loops over rows in Python (H2O, TOVA, ...) dispatch ops per "
    "row, and their counts grow with it.",
    (), O.sim_table, O.sim_verdict, script=O.sim_rows,
    note="Rows from `make bench-ops` (as above): one `modes.sim_logits` forward of random ids (dense_rows=0; "
         "SnapKV and ShadowKV compress a prompt: half the tokens are theirs) at 512, 1024 and 2048 "
         "tokens on tiny-llama-gqa and on smollm2-135m's shape with random weights (model.random_init=true), "
         "every method's bind (InfiniGen's calibration) run before and not counted. A point projected "
         "(from the growth of the method's previous lengths) to take longer than the benchmark's "
         "--sim-budget (120 s) on this 2-core machine is skipped and marked so.",
    order=180)
