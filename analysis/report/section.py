"""A report section: the claim in words, the commands whose rows it shows, its table, verdict and figure; and the
number formats the verdicts share."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
from matplotlib.figure import Figure

from analysis.figures import FIGURES


def needs(what: str) -> list[str]:
    return [f"not computed: the store has no {what} (run the commands below)"]


def num(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def signed(x: float) -> str:
    return f"{x:+.2f}"


@dataclass(frozen=True)
class Section:
    slug: str
    title: str
    claim: str  # what the paper (or the finding) says, in words
    commands: tuple[str, ...]
    table: Callable[[pd.DataFrame], pd.DataFrame | list[pd.DataFrame]]  # one table, or several one after another
    verdict: Callable[[pd.DataFrame], list[str]]
    figure: Callable[[pd.DataFrame], Figure] | None = None
    note: str = ""
    # a section fed by a script (not a run.py command): selects its rows among the store's script rows
    script: Callable[[pd.DataFrame], pd.DataFrame] | None = None
    order: int = 0  # where the section goes in the report: sections are sorted by it (gaps leave room for new ones)
    # the README block <!-- report:<slug> --> this section writes from its rows, if any
    readme: Callable[[pd.DataFrame], str] | None = None


def figure_of(name: str) -> Callable[[pd.DataFrame], Figure]:
    """A figure of analysis/figures/ (its numbers are in the section's table)."""
    return lambda rows: FIGURES[name](rows)[0]
