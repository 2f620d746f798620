"""A report section: the claim in words, the commands whose rows it shows, its table, verdict and figure; and the
number formats the verdicts share."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
from matplotlib.figure import Figure

from analysis.columns import MODEL_ORDER
from analysis.figures import FIGURES


def needs(what: str) -> list[str]:
    return [f"not computed: the store has no {what} (run the commands below)"]


def num(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


# what a comparison over one window says instead of a verdict: one window measures no spread between windows
ONE_WINDOW = ("n = 1 window: cannot be shown at this n, the windows' spread is not measured (16 windows, "
              "`task.max_windows=16`, is this report's sample for a perplexity claim)")


def signed(x: float) -> str:
    return f"{x:+.2f}"


@dataclass(frozen=True)
class Section:
    slug: str
    title: str
    claim: str  # what the paper (or the finding) says, in words
    commands: tuple[str, ...]
    # one table, or several one after another (a str among them, outside a per-model section: a paragraph of its
    # own between two tables)
    table: Callable[[pd.DataFrame], pd.DataFrame | list[pd.DataFrame | str]]
    verdict: Callable[[pd.DataFrame], list[str]]
    figure: Callable[[pd.DataFrame], Figure] | None = None
    note: str = ""
    # a section fed by a script (not a run.py command): selects its rows among the store's script rows
    script: Callable[[pd.DataFrame], pd.DataFrame] | None = None
    order: int = 0  # where the section goes in the report: sections are sorted by it (gaps leave room for new ones)
    # the README block <!-- report:<slug> --> this section writes from its rows, if any
    readme: Callable[[pd.DataFrame], str] | None = None
    # a claim checked on each real model: verdict, tables and figure per model (columns.MODEL_ORDER), then, from
    # `contrast` on each model's rows, the quantities the models are compared on (on_model() writes the commands)
    per_model: bool = False
    contrast: Callable[[pd.DataFrame], list[Contrast]] | None = None
    # more verdict lines from the section's rows and every fresh row of the store (what other sections read)
    audit: Callable[[pd.DataFrame, pd.DataFrame], list[str]] | None = None
    # the claims the summary table lists for this section, from one model's rows (each model's, per_model)
    status: Callable[[pd.DataFrame], list["Status"]] | None = None
    # a section that also reads the golden values of the authors' code (the report's second input, `--reference`,
    # tests/data/reference): its table and verdict take that folder as `reference=`, and its tables show even
    # while the store has none of its rows (the artifact's side is never missing)
    reference: bool = False


@dataclass(frozen=True)
class Status:
    """One claim's standing on one model, for the summary table: `verdict` is holds / does not hold / cannot be
    shown at this n / not measured; `number` the key number with its interval, in a few words."""

    claim: str
    verdict: str
    number: str


@dataclass(frozen=True)
class Contrast:
    """One quantity a claim is compared on across models: its value on one model, and whether the claim's
    direction holds there (None: the quantity has no direction, only a size)."""

    what: str
    value: float | None
    holds: bool | None = None


# the real models besides SmolLM2-135M (the commands' own) that the per-model claims run on (issue 42)
OTHER_MODELS = ("gemma3-270m",)


def on_every_model(*commands: str) -> tuple[str, ...]:
    """The commands as written, then each on every model of OTHER_MODELS."""
    return (*commands, *(on_model(c, m) for m in OTHER_MODELS for c in commands))


def on_model(command: str, model: str) -> str:
    """A section's `python run.py ...` command run on another model (its model= replaced, or added)."""
    words = [w for w in command.split(" ") if not w.startswith("model=")]
    return " ".join(words + [f"model={model}"])


def by_model(section: Section, rows: pd.DataFrame) -> list[tuple[str | None, pd.DataFrame]]:
    """The rows a section's verdict, tables and figure are computed on: per model (MODEL_ORDER) for a per-model
    claim with rows of more than one model, else all of them at once (model None)."""
    models = list(dict.fromkeys(rows["model"])) if section.per_model and "model" in rows else []
    if len(models) < 2:
        return [(None, rows)]
    models.sort(key=lambda m: (MODEL_ORDER.index(m) if m in MODEL_ORDER else len(MODEL_ORDER), m))
    return [(m, rows[rows["model"] == m]) for m in models]


def across(parts: list[tuple[str, list[Contrast]]]) -> list[str]:
    """Each contrast's values side by side, and whether the models agree on the claim's direction."""
    out = []
    for i, first in enumerate(parts[0][1]):
        got = [(m, c[i]) for m, c in parts if i < len(c)]
        values = ", ".join(f"{m} {num(c.value)}" + ("" if c.holds is None else
                                                     f" ({'holds' if c.holds else 'does not hold'})") for m, c in got)
        line = f"across models, {first.what}: {values}"
        verdicts = {m: c.holds for m, c in got if c.holds is not None}
        if len(verdicts) == len(got) > 1:
            held = [m for m, h in verdicts.items() if h]
            line += (": the models agree (holds on every one)" if len(held) == len(got) else
                     ": the models agree (holds on neither)" if not held else
                     f": the models disagree (holds on {', '.join(held)} only)")
        out.append(line)
    return out


def figure_of(name: str) -> Callable[[pd.DataFrame], Figure]:
    """A figure of analysis/figures/ (its numbers are in the section's table)."""
    return lambda rows: FIGURES[name](rows)[0]
