"""The authors' code: what the InfiniGen artifact computes beside this harness's reference settings, which compute
its algorithms (`method=infinigen_reference`, `method=h2o_reference`), and beside the harness's own variants at the
same settings (`method=infinigen`, `method=h2o`); then each difference between the two, alone (issue 61).

The artifact's side is read from the golden values committed under tests/data/reference (the report's second
input, `--reference`; docs/reference.md says how they were made), every other number from the store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis import columns as C
from analysis import paired as P
from analysis.report.compose import REFERENCE, composed
from analysis.report.golden import artifact, golden, heads, retain
from analysis.report.render import label
from analysis.report.section import Section, num

RUN = "python run.py -m"


@dataclass(frozen=True)
class Setup:
    """A model and task the artifact was run on, with the golden file holding its numbers."""

    model: str  # as the rows name it
    what: str  # in words
    short: str  # in a few
    golden: str  # the file under the reference folder
    prefix: str  # the command's overrides before the method's


SMOLLM2 = Setup("smollm2-135m", "SmolLM2-135M made multi-head, 4 WikiText-2 windows of 2,048 tokens, float32, eager "
                "attention", "multi-head, 4 x 2,048 tokens, float32", "smollm2_mha_2048.json", "model=smollm2-135m +model.multihead=true task=ppl "
                "task.seq_len=2048 task.max_windows=4 +task.attention=exact")
TINY_OPT = Setup("tiny-opt", "tiny-opt (random weights, through the artifact's OPT path), 2 WikiText-2 windows of "
                 "1,024 tokens, float64, eager attention", "2 x 1,024 tokens, float64", "tiny_opt_1024.json", "model=tiny-opt model.dtype=float64 "
                 "task=ppl task.seq_len=1024 task.max_windows=2 +task.attention=exact")
SETUPS = (SMOLLM2, TINY_OPT)

INFINIGEN = ((5.2, 0.2), (4.0, 0.2), (5.2, 0.1))  # (alpha, budget) of the artifact's InfiniGen runs
H2O = (0.01875, 0.1)  # heavy = recent of its H2O runs
# the harness's own InfiniGen at the artifact's speculation knobs (its selected setting otherwise differs in them)
VARIANT = "method.partial_ratio=0.2 method.skip_layers=2 method.speculate_from=previous"


@dataclass(frozen=True)
class Point:
    """One row of the comparison: a method at one setting, as the artifact ran it and as the harness runs it."""

    method: str  # full | InfiniGen | H2O
    setting: str  # in words
    golden: tuple[str, tuple[tuple[str, float], ...]]  # the artifact's run: its method and overrides
    reference: str  # the method overrides of the reference setting's run
    variant: str | None  # those of the harness's own variant's (full: none)


def points() -> list[Point]:
    out = [Point("full", "", ("full", ()), "method=full", None)]
    out += [Point("InfiniGen", f"alpha {alpha:g}, budget {budget:g}",
                  ("infinigen_reference", (("alpha", alpha), ("budget", budget))),
                  f"method=infinigen_reference method.alpha={alpha} method.budget={budget}",
                  f"method=infinigen method.alpha={alpha} method.budget={budget} {VARIANT}")
            for alpha, budget in INFINIGEN]
    out += [Point("H2O", f"heavy = recent = {r:g}", ("h2o_reference", (("heavy", r), ("recent", r))),
                  f"method=h2o_reference method.heavy={r} method.recent={r}", f"method=h2o method.heavy={r} method.recent={r}")
            for r in H2O]
    return out


def command(setup: Setup, overrides: str) -> str:
    return f"{RUN} {setup.prefix} {overrides}"


# each difference alone: one option of the reference flipped to the harness's value (docs/methods.md's table), from
# the reference at the artifact's setting on SmolLM2; (method, its reference run, ((option, artifact's value,
# harness's value), ...))
FLIPS = (("InfiniGen", "method=infinigen_reference method.alpha=5.2 method.budget=0.2",
          (("budget_of", "sequence", "prefix"), ("threshold_head", "first", "own"), ("current_token", "ranked", "kept"),
           ("column_count", "floor", "round"), ("column_tokens", "100", "null"), ("partial_select", "qk", "q"))),
         ("H2O", "method=h2o_reference method.heavy=0.1 method.recent=0.1",
          (("heavy_hitters", "mask", "cache"), ("budget_of", "sequence", "prefix"), ("dense_layers", "2", "0"))))


def commands() -> tuple[str, ...]:
    every = [command(s, o) for s in SETUPS for p in points() for o in (p.reference, p.variant) if o is not None]
    every += [command(SMOLLM2, f"{base} method.{option}={harness}") for _, base, flips in FLIPS
              for option, _, harness in flips]
    return tuple(dict.fromkeys(every))


# ---------------------------------------------------------------------------------------------- the artifact's side


def artifact_run(data: dict, point: Point) -> dict | None:
    method, overrides = point.golden
    for run in data["runs"].values():
        got = run.get("overrides") or {}
        if run["method"] == method and all(k in got and float(got[k]) == v for k, v in overrides):
            return run
    return None


# ---------------------------------------------------------------------------------------------- the harness's side


def row_of(rows: pd.DataFrame, wanted: str) -> pd.Series | None:
    """The store's row of a command (one job)."""
    if rows.empty:
        return None
    got = rows[rows["semantic"].isin(set(composed(wanted)))]
    return got.iloc[0] if not got.empty else None


def measured(row: pd.Series | None) -> dict:
    """A row's perplexity, kv_fraction, density and retain (full attention: every entry); NaN without a row."""
    if row is None:
        return {"ppl": math.nan, "kv": math.nan, "density": math.nan, "retain": math.nan}
    frame = row.to_frame().T
    full = row["method"] == "full"
    value = lambda name: float(C.metric(frame, name).iloc[0])  # noqa: E731
    kv, density = value("kv_fraction"), value("density")
    kv, density = (1.0 if full and math.isnan(kv) else kv), (1.0 if full and math.isnan(density) else density)
    got = value("retain")
    return {"ppl": value("ppl"), "kv": kv, "density": density, "retain": retain(density) if math.isnan(got) else got}


def pct(x: float) -> float:
    return 100 * x


def comparison(rows: pd.DataFrame, reference: Path, setup: Setup) -> pd.DataFrame:
    """Per point: the artifact's perplexity and kept fraction, the reference setting's and the harness's variant's,
    and the runs not in the store yet (their method overrides)."""
    data, n_heads = golden(reference, setup.golden), heads(setup.model)
    out = []
    for point in points():
        run = artifact_run(data, point)
        ppl, density = artifact(run, n_heads) if run is not None else (math.nan, math.nan)
        ref = measured(row_of(rows, command(setup, point.reference)))
        var = measured(row_of(rows, command(setup, point.variant))) if point.variant else measured(None)
        absent = [f"`{o}`" for o, got in ((point.reference, ref), (point.variant, var))
                  if o is not None and math.isnan(got["ppl"])]
        out.append({"method": point.method, "setting": point.setting, "artifact ppl": ppl,
                    "artifact density (%)": pct(density), "artifact retain (%)": pct(retain(density)),
                    "reference ppl": ref["ppl"], "reference vs artifact (%)": pct(ref["ppl"] / ppl - 1),
                    "reference kv_fraction (%)": pct(ref["kv"]), "reference density (%)": pct(ref["density"]),
                    "reference retain (%)": pct(ref["retain"]), "variant ppl": var["ppl"],
                    "variant kv_fraction (%)": pct(var["kv"]), "variant density (%)": pct(var["density"]),
                    "variant retain (%)": pct(var["retain"]), "not in the store yet (its method overrides)":
                        "; ".join(absent)})
    return pd.DataFrame(out)


def their_prompt(reference: Path, setup: Setup) -> str | None:
    """The artifact's one run with its own partial-weight calibration prompt, against the same run with PG-19's
    first 100 tokens."""
    data = golden(reference, setup.golden)
    other = data.get("their_prompt")
    if not other or other.get("run") not in data["runs"]:
        return None
    run = data["runs"][other["run"]]
    n_heads = heads(setup.model)
    ppl, density = artifact(run, n_heads)
    own_ppl, own_density = artifact(run | {"kept": other.get("kept", run["kept"])}, n_heads, other["window_nll"])
    overrides = ", ".join(f"{k} {v:g}" for k, v in (run.get("overrides") or {}).items())
    return (f"The artifact with its own six-sentence partial-weight calibration prompt (InfiniGen {overrides}; "
            f"[reference.md](reference.md) item 5): perplexity {own_ppl:.4f} against {ppl:.4f} with PG-19's first 100 "
            f"tokens ({pct(own_ppl / ppl - 1):+.2f}%), density {pct(own_density):.2f}% against {pct(density):.2f}%.")


def flips(rows: pd.DataFrame) -> pd.DataFrame:
    """Each difference alone: the reference's perplexity and kept fraction, then each option flipped to the
    harness's value, its perplexity over the reference's paired over the windows."""
    out = []
    for method, base, options in FLIPS:
        ref_row = row_of(rows, command(SMOLLM2, base))
        ref = measured(ref_row)
        out.append({"method": method, "option flipped": f"none: the reference ({base.split(' ', 1)[1]})",
                    "ppl": ref["ppl"], "x reference (95% paired interval)": "", "kv_fraction (%)": pct(ref["kv"]),
                    "density (%)": pct(ref["density"]),
                    "not in the store yet": "" if ref_row is not None else f"`{base}`"})
        for option, theirs, harness in options:
            flipped = f"{base} method.{option}={harness}"
            row = row_of(rows, command(SMOLLM2, flipped))
            got = measured(row)
            effect = paired_effect(row, ref_row)
            out.append({"method": method, "option flipped": f"{option}: {theirs} -> {harness}", "ppl": got["ppl"],
                        "x reference (95% paired interval)": ratio_text(effect),
                        "kv_fraction (%)": pct(got["kv"]), "density (%)": pct(got["density"]),
                        "not in the store yet": "" if row is not None else f"`{flipped}`"})
    return pd.DataFrame(out)


def paired_effect(row: pd.Series | None, ref_row: pd.Series | None) -> P.Effect | None:
    if row is None or ref_row is None:
        return None
    try:
        return P.perplexity_ratio(row.get("metrics.units"), ref_row.get("metrics.units"))
    except P.Unpaired:
        return None


def ratio_text(effect: P.Effect | None) -> str:
    return "" if effect is None else f"x{effect.value:.3f} ({effect.low:.3f}-{effect.high:.3f})"


def tables(rows: pd.DataFrame, reference: Path = REFERENCE) -> list[pd.DataFrame | str]:
    out: list[pd.DataFrame | str] = []
    for setup in SETUPS:
        out += [f"**{setup.what}** (each run: `{RUN} {setup.prefix}` and the row's method overrides; the artifact's "
                f"numbers from `{label(Path(reference) / setup.golden)}`):", comparison(rows, reference, setup)]
        line = their_prompt(reference, setup)
        out += [line] if line else []
    out += [f"**Each difference alone** ({SMOLLM2.what}: `{RUN} {SMOLLM2.prefix}` and the overrides named; one "
            "option of the reference flipped to the harness's value, its perplexity over the reference's paired over "
            "the 4 windows):", flips(rows)]
    return out


# ---------------------------------------------------------------------------------------------- verdict


def setup_line(rows: pd.DataFrame, reference: Path, setup: Setup) -> str:
    table = comparison(rows, reference, setup)
    have = table.dropna(subset=["reference ppl"])
    head = f"{setup.model} ({setup.short})"
    if have.empty:
        return (f"{head}: the reference settings are not in the store yet ({len(table)} runs; the table's last "
                f"column names each)")
    gap = have["reference vs artifact (%)"]
    worst = have.loc[gap.abs().idxmax()]
    line = (f"{head}: the reference settings' perplexity is within {num(gap.abs().max(), 2)}% of the artifact's on "
            f"{len(have)} of {len(table)} runs (largest: {worst['method']}"
            f"{' ' + worst['setting'] if worst['setting'] else ''} {worst['reference vs artifact (%)']:+.3f}%)")
    kept = (have["reference density (%)"] - have["artifact density (%)"]).dropna()
    if not kept.empty:
        line += f", their density within {num(kept.abs().max(), 2)} points of the artifact's"
    variant = table.dropna(subset=["variant ppl"])
    if not variant.empty:
        diff = pct(variant["variant ppl"] / variant["artifact ppl"] - 1)
        line += (f"; the harness's own variants: perplexity {diff.min():+.1f}% to {diff.max():+.1f}% from the "
                 f"artifact's ({len(variant)} of {sum(p.variant is not None for p in points())} runs)")
    absent = int((table["not in the store yet (its method overrides)"] != "").sum())
    return line + (f"; {absent} setting(s) with runs not in the store yet (the table's last column)" if absent else "")


def flips_line(rows: pd.DataFrame) -> str:
    table = flips(rows)
    done = table[table["x reference (95% paired interval)"] != ""]
    if done.empty:
        return ("each difference alone (SmolLM2-135M multi-head, 4 x 2,048 tokens): not in the store yet (the "
                "second table's last column names each run)")
    each = "; ".join(f"{r['method']} {r['option flipped'].split(':')[0]}={r['option flipped'].split(' -> ')[1]} "
                     f"{r['x reference (95% paired interval)']}" for _, r in done.iterrows())
    return (f"each difference alone (SmolLM2-135M multi-head, 4 x 2,048 tokens), perplexity over the reference's "
            f"(95% paired interval over the windows): {each}"
            + (f" ({len(table) - 2 - len(done)} not in the store yet)" if len(done) < len(table) - 2 else ""))


def verdict(rows: pd.DataFrame, reference: Path = REFERENCE) -> list[str]:
    return [*(setup_line(rows, reference, s) for s in SETUPS), flips_line(rows)]


NOTE = ("The artifact's columns are golden values from running the authors' code, read from the report's one input "
        "besides the store (`python -m analysis.report --reference DIR`, by default the committed "
        "tests/data/reference; each table names its file): its perplexity "
        "from each window's summed NLL (seq_len - 1 tokens scored per window), its kept fraction as it measures it, "
        "density = kept entries over the causal area of its selecting layers (layers 2+, every head and window) "
        "and retain = 1 - sqrt(1 - density), the paper's retain ratio. The harness's rows record both (`density`, "
        "`retain`, over the layers a method selects on; `method=h2o`: every layer) beside its own kv_fraction (the "
        "mean per-row fraction attended, every layer).\n\nThe reference settings are pinned to the artifact by "
        "tests/test_reference.py (float64, 256-token windows: perplexity within 0.1%, kept entries within 1%, kept "
        "sets identical on >= 99.9% of rows); in float32 at 2,048 tokens the differences are what the table shows: "
        "a near-tie the two codes round differently early in a window changes what every later layer sees, and "
        "cascades ([reference.md](reference.md)).")


SECTION = Section(
    "authors_code", "The authors' code",
    "This harness's reference settings (`method=infinigen_reference`, `method=h2o_reference`) compute what the "
    "InfiniGen authors' artifact computes (snu-comparch/InfiniGen `3754f52d`, `accuracy/`; docs/methods.md): the "
    "same perplexity and the same kept entries at the same settings, where the harness's own `method=infinigen` "
    "and `method=h2o` differ by design. C1 and C2 below are stated at these settings first.",
    commands(), tables, verdict, note=NOTE, order=8, reference=True)
