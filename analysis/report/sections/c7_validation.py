"""C7: the performance model against this machine (experiments/validate_perf.py rows)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import speed as S
from analysis.report.section import Section



def validation_script_rows(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[C.column(rows, "metrics.validation_point").notna()]


def commits(rows: pd.DataFrame) -> str:
    """The commits the validation rows were measured and modelled at (7 hex digits, -dirty kept)."""
    def short(c) -> str | None:
        return c[:7] + ("-dirty" if c.endswith("-dirty") else "") if isinstance(c, str) else None

    modelled = C.column(rows, "metrics.timing") == "modelled"
    # a modelled row of `validate_perf --remodel` keeps the commit its measured row ran at as meta.measured_commit
    measured = {short(c) for c in C.column(rows[~modelled], "meta.git_commit")} | {
        short(c) for c in C.column(rows[modelled], "meta.measured_commit")}
    model = {short(c) for c in C.column(rows[modelled], "meta.git_commit")}
    measured, model = sorted(measured - {None}), sorted(model - {None})
    if measured == model:
        return f"measured and modelled at {', '.join(measured) or 'a commit not recorded'}"
    return f"measured at {', '.join(measured) or 'not recorded'}, modelled at {', '.join(model) or 'not recorded'}"


def verdict(rows: pd.DataFrame) -> list[str]:
    val = S.validation_rows(rows)
    if val.empty:
        return S.validation_verdict(rows)
    out = S.validation_verdict(rows, f" ({commits(validation_script_rows(rows))})")
    link, host = val["link (exposed)"].max(), val["host gather (exposed)"].max()
    exposed = ("the modelled exposed link time is 0 ms at every point" if link == 0 else
               f"the modelled exposed link time is at most {link:.1f} ms per step")
    out.append(f"what a CPU cannot test: no link is exposed ({exposed}) and the host gather is small (at most "
               f"{host:.1f} ms per step); on the H200 both are among the largest segments")
    out.append("these rows validate the model as it was at their commit: later changes to infinigen/offload/perf.py "
               "or census.py are not covered (C7 measured on a GPU lists them)")
    return out


SECTION = Section(
    "c7_validation", "C7. The performance model against this machine",
    "The same model, with a profile calibrated here, predicts what the offloading runtime measures on this "
    "CPU (smollm2-135m; nine methods; prompts 1024 and 2048; batch 1 and 8). Goal: every point within "
    "±25%.",
    (), S.validation_rows, verdict, lambda rows: S.speed_validation(rows)[0],
    script=validation_script_rows,
    note="Rows from `python -m experiments.calibrate && python -m experiments.validate_perf --results "
         "docs/store` (not a run.py command). Measured: one untimed run, then the median of 22 decode "
         "steps after a 2-step warm-up, median over 3 rounds. Modelled: with each method's census timed just "
         "before its rounds and the profile's rates measured beside each round (both sides within minutes). "
         "On this 2-vCPU VM the same configuration measured 74-136 ms/token in processes minutes apart, which "
         "bounds what any validation here can show. What it cannot show: on a CPU the runtime runs on one thread "
         "and nothing crosses a link (the profile has no link rate), so the model's link terms (transfer, the "
         "wait on a fetch) are never exercised, and the host gathers of smollm2-135m's rows are small (the verdict "
         "gives the largest): the "
         "terms that decide the GPU predictions (the modelled C7 section, Gemma 3's shape) are checked only by the "
         "H200 rows (C7. Speed measured on a GPU). The verdict names the commit the rows were measured and "
         "modelled at; a validation of the code now is `make validate-perf` (1-2 h on a quiet machine here).",
    order=90)
