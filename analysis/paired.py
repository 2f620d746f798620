"""Paired comparisons of a method with a reference (full attention) over the units both scored: the same
perplexity windows, the same lm-eval docs, the same needle prompts (each row's `metrics.units`).

Two rows that scored the same units are not independent samples: a hard doc is hard for both. The difference is
therefore computed per unit, and its 95% interval is a bootstrap over units (`scipy.stats.bootstrap`, paired
resampling, percentile interval, RESAMPLES draws from a fixed SEED so the report is byte-stable); an accuracy
difference also gets McNemar's exact p (`scipy.stats.binomtest` on the docs where exactly one of the two is right).

A claim of closeness is tested against a MARGIN stated before any data was read (`closeness`):

* accuracy: the method keeps accuracy when the whole 95% interval of (method - full) lies above -MARGIN_POINTS;
  it does not when the whole interval lies below it; otherwise it cannot be shown at this n;
* perplexity: the method keeps perplexity when the whole 95% interval of (method's / full's) lies below
  1 + MARGIN_PPL; it does not when the whole interval lies above it; otherwise it cannot be shown at this n.

Rows without units (stored before rows kept them) get no paired effect: `Unpaired` says so, and the callers say
"unpaired" where they fall back to the rows' own standard errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from analysis import like
from analysis.apart import apart, key_params
from analysis.columns import bytes_ratio, column, metric, ordered

SEED = 0
RESAMPLES = 10_000
CONFIDENCE = 0.95
MARGIN_POINTS = 0.02  # accuracy, as a fraction: 2 points (the paper's "within a small margin", made a number)
MARGIN_PPL = 0.05  # perplexity: 5% above full's

HOLDS, FAILS, OPEN = "holds", "does not hold", "cannot be shown at this n"


class Unpaired(ValueError):
    """The two rows did not score the same units (or one has none recorded)."""


@dataclass(frozen=True)
class Effect:
    """A method against its reference over `n` paired units: `value` with its 95% interval [low, high]."""

    value: float  # accuracy: method - reference (fraction); perplexity: method's / reference's
    low: float
    high: float
    n: int
    kind: str  # "accuracy" | "perplexity" | "nll" | "speed"
    p: float | None = None  # accuracy: McNemar's exact two-sided p
    gained: int | None = None  # accuracy: units the method gets right and the reference wrong ...
    lost: int | None = None  # ... and the other way round

    def closeness(self) -> str:
        return closeness(self)

    def text(self) -> str:
        """The effect in words with its interval, e.g. "-1.6 points (95% paired interval -4.1 to +0.9; McNemar p
        0.21, 12 docs gained, 20 lost)" or "x1.043 (95% paired interval 1.031 to 1.056)"."""
        if self.kind == "accuracy":
            return (f"{100 * self.value:+.1f} points (95% paired interval {100 * self.low:+.1f} to "
                    f"{100 * self.high:+.1f}; McNemar p {self.p:.2g}, {self.gained} docs gained, {self.lost} lost, "
                    f"n = {self.n})")
        if self.kind == "speed":
            return (f"{self.value:.2f}x (95% interval {self.low:.2f}-{self.high:.2f}, {self.n} decode steps)"
                    if self.n >= 2 else f"{self.value:.2f}x (no per-step times recorded: no spread measured)")
        if self.n < 2:
            return f"{self.value:+.3f} (n = 1 window: its spread is not measured)"
        if self.kind == "nll":
            return (f"{self.value:+.3f} nats/token (95% paired interval {self.low:+.3f} to {self.high:+.3f}, "
                    f"{self.n} windows)")
        return f"x{self.value:.3f} (95% paired interval x{self.low:.3f} to x{self.high:.3f}, {self.n} windows)"


def closeness(effect: Effect) -> str:
    """HOLDS / FAILS / OPEN for "the method is within the margin of its reference" (module docstring)."""
    if not (math.isfinite(effect.low) and math.isfinite(effect.high)):
        return OPEN
    if effect.kind == "accuracy":
        return HOLDS if effect.low > -MARGIN_POINTS else FAILS if effect.high < -MARGIN_POINTS else OPEN
    return HOLDS if effect.high < 1 + MARGIN_PPL else FAILS if effect.low > 1 + MARGIN_PPL else OPEN


def side(effect: Effect, threshold: float, below: bool = True) -> str:
    """HOLDS / FAILS / OPEN for "the effect lies below `threshold`" (`below` False: above it): HOLDS when the whole
    95% interval is on the claimed side, FAILS when it is wholly on the other, OPEN when it reaches across."""
    if not (math.isfinite(effect.low) and math.isfinite(effect.high)):
        return OPEN
    low, high = (effect.low, effect.high) if below else (-effect.high, -effect.low)
    threshold = threshold if below else -threshold
    return HOLDS if high < threshold else FAILS if low > threshold else OPEN


def margin(kind: str) -> float:
    """The threshold a closeness claim is tested against: -MARGIN_POINTS (accuracy), 1 + MARGIN_PPL (perplexity)."""
    return -MARGIN_POINTS if kind == "accuracy" else 1 + MARGIN_PPL


def units_to_settle(effect: Effect, threshold: float) -> float:
    """How many paired units would put the effect's 95% interval wholly on one side of `threshold` (its margin, or 1
    or 0 where two methods are compared), from the spread the interval measured: its half-width shrinks as
    1/sqrt(n), so n x (half-width / distance to the threshold)^2 (ratios on the log scale). inf when the estimate
    sits on the threshold or the interval is not finite; never less than the n measured."""
    ratio = effect.kind == "perplexity"
    value, low, high, at = ((math.log(v) for v in (effect.value, effect.low, effect.high, threshold)) if ratio else
                            (effect.value, effect.low, effect.high, threshold))
    half, distance = (high - low) / 2, abs(value - at)
    if not (math.isfinite(half) and math.isfinite(distance)) or distance == 0:
        return math.inf
    return max(float(effect.n), math.ceil(effect.n * (half / distance) ** 2))


def settle_text(effect: Effect, threshold: float, unit: str) -> str:
    """"about 3,400 paired docs would settle it" (its interval clear of the threshold), from units_to_settle."""
    if effect.n < 2:
        return f"one {unit.removesuffix('s')} measures no spread, so no n can be sized from it"
    n = units_to_settle(effect, threshold)
    if math.isfinite(n) and n <= effect.n:  # the bootstrap interval is lopsided and ends just past the threshold
        return (f"its interval just reaches {threshold:g}: a few more than the {effect.n:,} paired {unit} measured "
                "would settle it")
    return (f"no n settles it (the estimate sits on {threshold:g})" if not math.isfinite(n) else
            f"about {n:,.0f} paired {unit} would settle it (measured: {effect.n:,})")


def margin_text(kind: str) -> str:
    return (f"within {100 * MARGIN_POINTS:.0f} points of full's accuracy" if kind == "accuracy" else
            f"within {100 * MARGIN_PPL:.0f}% of full's perplexity")


def aligned(units: dict, reference: dict, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    """`columns` of both rows' units over the units both scored, in the reference's order ("<col>" from `units`,
    "ref_<col>" from `reference`); Unpaired when either has no units or their ids differ."""
    if not isinstance(units, dict) or not isinstance(reference, dict) or not units.get("id") or not reference.get("id"):
        raise Unpaired("no per-unit results recorded (a row stored before rows kept them): unpaired")
    ids, ref_ids = [_key(i) for i in units["id"]], [_key(i) for i in reference["id"]]
    if sorted(ids) != sorted(ref_ids):
        raise Unpaired(f"the rows scored different units ({len(ids)} vs {len(ref_ids)}, "
                       f"{len(set(ids) & set(ref_ids))} shared)")
    where = {i: k for k, i in enumerate(ids)}
    order = [where[i] for i in ref_ids]
    out = {}
    for col in columns:
        if col not in units or col not in reference:
            raise Unpaired(f"no per-unit {col!r} recorded")
        out[col] = np.asarray(units[col], dtype=float)[order]
        out[f"ref_{col}"] = np.asarray(reference[col], dtype=float)
    return out


def _key(unit_id):
    return tuple(unit_id) if isinstance(unit_id, list) else unit_id


def _interval(data: tuple[np.ndarray, ...], statistic) -> tuple[float, float]:
    if len(data[0]) < 2:
        return math.nan, math.nan
    result = stats.bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=RESAMPLES,
                             confidence_level=CONFIDENCE, method="percentile", rng=np.random.default_rng(SEED))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def accuracy_difference(units: dict, reference: dict, metric: str = "acc") -> Effect:
    """The method's accuracy minus the reference's over the same docs (fractions), its paired bootstrap interval
    and McNemar's exact p."""
    got = aligned(units, reference, (metric,))
    mine, ref = got[metric], got[f"ref_{metric}"]
    gained, lost = int(((mine > 0) & (ref == 0)).sum()), int(((mine == 0) & (ref > 0)).sum())
    p = stats.binomtest(gained, gained + lost, 0.5).pvalue if gained + lost else 1.0
    low, high = _interval((mine - ref,), lambda d, axis: d.mean(axis=axis))
    return Effect(float((mine - ref).mean()), low, high, len(mine), "accuracy", float(p), gained, lost)


def mean(values, kind: str = "accuracy") -> Effect:
    """The mean of per-unit scores (0/1 or partial credit) with its 95% bootstrap interval over units."""
    data = np.asarray(values, dtype=float)
    low, high = _interval((data,), lambda d, axis: d.mean(axis=axis))
    return Effect(float(data.mean()) if len(data) else math.nan, low, high, len(data), kind)


def pooled(rows: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Several tasks' (units, reference units) as one pair of unit sets, each id prefixed by its task's position:
    a difference over every doc of those tasks, each doc weighted alike."""
    units, reference = {}, {}
    if not all(isinstance(part, dict) and part.get("id") for pair in rows for part in pair):
        raise Unpaired("no per-unit results recorded (a row stored before rows kept them): unpaired")
    for k, (mine, ref) in enumerate(rows):
        for out, part in ((units, mine), (reference, ref)):
            for col, values in part.items():
                out.setdefault(col, []).extend([[k, _key(v)] for v in values] if col == "id" else values)
    return units, reference


def perplexity_ratio(units: dict, reference: dict) -> Effect:
    """The method's perplexity over the reference's on the same windows (token-weighted: exp of the difference of
    their mean NLLs per token), with a paired bootstrap interval over windows."""
    got = aligned(units, reference, ("nll", "tokens"))
    if not np.array_equal(got["tokens"], got["ref_tokens"]):
        raise Unpaired("the rows scored different tokens in the same windows")

    def ratio(nll, ref_nll, tokens, axis=-1):
        return np.exp((nll.sum(axis=axis) - ref_nll.sum(axis=axis)) / tokens.sum(axis=axis))

    value = float(ratio(got["nll"], got["ref_nll"], got["tokens"]))
    low, high = _interval((got["nll"], got["ref_nll"], got["tokens"]), ratio)
    return Effect(value, low, high, len(got["nll"]), "perplexity")


def step_time_ratio(steps, reference_steps) -> Effect:
    """The reference's median decode step time over the method's (above 1: the method is faster), the two runs'
    steps paired by index (the same decode position, so the same KV length), with a bootstrap interval over steps.
    The interval holds the spread of steps within the two runs, not the machine's drift from run to run."""
    if any(x is None or np.ndim(x) != 1 or len(x) == 0 for x in (steps, reference_steps)):
        raise Unpaired("no per-step decode times recorded")
    mine, ref = np.asarray(steps, dtype=float), np.asarray(reference_steps, dtype=float)
    n = min(len(mine), len(ref))
    mine, ref = mine[:n], ref[:n]

    def ratio(m, r, axis=-1):
        return np.median(r, axis=axis) / np.median(m, axis=axis)

    low, high = _interval((mine, ref), ratio)
    return Effect(float(ratio(mine, ref)) if n else math.nan, low, high, n, "speed")


def nll_gap(units: dict, reference: dict) -> Effect:
    """The method's mean NLL minus the reference's on the same windows, in nats per token (kind "nll"), with a
    paired bootstrap interval over windows."""
    got = aligned(units, reference, ("nll", "tokens"))

    def gap(nll, ref_nll, tokens, axis=-1):
        return (nll.sum(axis=axis) - ref_nll.sum(axis=axis)) / tokens.sum(axis=axis)

    low, high = _interval((got["nll"], got["ref_nll"], got["tokens"]), gap)
    return Effect(float(gap(got["nll"], got["ref_nll"], got["tokens"])), low, high, len(got["nll"]), "nll")


def table(df: pd.DataFrame) -> pd.DataFrame:
    """Every ppl and lm-eval row against full attention's row on the same model, data and windows or docs
    (analysis/like.py), paired over those units (analysis/paired.py): perplexity over full's, or accuracy minus
    full's in points, with the 95% paired interval and the standing against the stated margin."""
    rows = df[df["task"].isin(["ppl", "lm_eval"])]
    rows = rows[column(rows, "metrics.benchmark").isna()] if not rows.empty else rows
    lines, index = [], []
    params = key_params(rows) if not rows.empty else pd.Series(dtype=object)
    full = rows[rows["method"] == "full"]
    for i, row in rows.iterrows():
        ref = next((r for _, r in full.iterrows() if not like.differences(row, r, like.ACCURACY)), None)
        ppl = row["task"] == "ppl"
        line = {"model": row["model"], "task": row.get("task_params.dataset") if ppl else row.get("metrics.task"),
                "method": row["method"], "params": params[i],
                "kv_fraction (%)": 100 * metric(row.to_frame().T, "kv_fraction").iloc[0],
                "rel. KV size (%)": 100 * (metric(row.to_frame().T, "kv_fraction") * bytes_ratio(row.to_frame().T)).iloc[0],
                "ppl" if ppl else "acc (%)": row.get("metrics.ppl") if ppl else 100 * row.get("metrics.acc", math.nan)}
        if row["method"] == "full":
            line["kv_fraction (%)"] = line["rel. KV size (%)"] = 100.0
        elif ref is not None:
            try:
                effect = (perplexity_ratio if ppl else accuracy_difference)(
                    row.get("metrics.units"), ref.get("metrics.units"))
                line["vs full (95% paired interval)"] = (
                    f"x{effect.value:.3f} ({effect.low:.3f} to {effect.high:.3f})" if ppl else
                    f"{100 * effect.value:+.1f} points ({100 * effect.low:+.1f} to {100 * effect.high:+.1f})")
                line["units"] = f"{effect.n} {'windows' if ppl else 'docs'}"
                line[f"within the margin ({margin_text('perplexity' if ppl else 'accuracy')})"] = \
                    effect.closeness()
            except Unpaired as err:
                line["vs full (95% paired interval)"] = f"unpaired: {err}"
        else:
            line["vs full (95% paired interval)"] = "no full-attention row on the same units"
        lines.append(line)
        index.append(i)
    out = pd.DataFrame(lines, index=index)
    if out.empty:
        return pd.DataFrame(columns=["model", "method", "params"])
    apart(out, rows, ["model", "task", "method", "params"])
    return ordered(out.assign(_kv=-out["rel. KV size (%)"]), ["task", "_kv"]).drop(columns="_kv")
