"""C7: the performance model against this machine (experiments/validate_perf.py rows)."""

from __future__ import annotations

from analysis import columns as C
from analysis import speed as S
from analysis.report.section import Section

SECTION = Section(
    "c7_validation", "C7. The performance model against this machine",
    "The same model, with a profile calibrated here, predicts what the offloading runtime measures on this "
    "CPU (smollm2-135m; nine methods; prompts 1024 and 2048; batch 1 and 8). Goal: every point within "
    "+-25%.",
    (), S.validation_rows, S.validation_verdict, lambda rows: S.speed_validation(rows)[0],
    script=lambda rows: rows[C.column(rows, "metrics.validation_point").notna()],
    note="Rows from `python -m experiments.calibrate && python -m experiments.validate_perf --results "
         "docs/store` (not a run.py command). Measured: one untimed run, then the median of 22 decode "
         "steps after a 2-step warm-up, median over 3 rounds. Modelled: with each method's census timed just "
         "before its rounds and the profile's rates measured beside each round (both sides within minutes). "
         "On this 2-vCPU VM the same configuration measured 74-136 ms/token in processes minutes apart, which "
         "bounds what any validation here can show.",
    order=90)
