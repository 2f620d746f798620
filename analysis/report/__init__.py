"""The reproduction report: docs/results.md and the figures it links, from the committed store alone.

    python -m analysis.report --store docs/store --out docs     # = make report (offline, seconds)

The one input besides the store: `--reference` (default tests/data/reference), the committed golden values of the
InfiniGen authors' code (docs/reference.md), which the section "The authors' code" sets beside the store's rows of
the reference settings (sections with `reference=True` get the folder).

One section per claim of the InfiniGen paper (C1-C7) and per finding beyond it, one module each under
analysis/report/sections/: its claim in words, the commands whose rows it shows (`python run.py ...`, expanded
exactly as Hydra's sweeper would), a table, a figure and a verdict computed from its rows, declared as
`SECTION = Section(...)`. A new section is a new module there; `discover()` finds it and places it by its `order`.
A claim checked on every real model lists its commands on each (`on_every_model`) and sets `per_model=True`: its
verdict, tables and figure come per model, then its `contrast` quantities side by side, agreeing or not.
Every number in the report comes from the store; a config missing from the store is named with the command that
fills it. A stored row is *stale* when its recorded config differs from what its command composes today (a
method's default changed, a preset moved): it is listed with the difference and left out of every table, figure
and verdict. The page opens with its summary (its first section and table) and ends with how it is made and the
stale rows. The README's generated blocks (between the `report:NAME` markers) are rewritten from the same numbers:
its headline a table of the paper's claims x model (verdict and key number, each cell linking its section) and one
figure, on one screen (render.headline). An accuracy verdict reads the rows of one clean build per model and task (matching.one_build: the newest
committed run's commit; rows of other commits and of uncommitted trees are refused and counted in its lines).
Output is byte-identical from run to run (sorted rows, no dates, PNG without software metadata).
Composing every command takes Hydra ~20 s on one core; the rest (tables, figures) a few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import pkgutil
from pathlib import Path

import pandas as pd

from analysis import columns as C
from analysis import ops as O
from analysis.report import sections as sections_package
from analysis.report.compose import REFERENCE, compose_all
from analysis.report.matching import Matched, load, match, one_build, stale_rows
from analysis.report.render import (HEADLINE_FIGURE, anchor, headline, label, section_text, speed_block, statuses, summary_table,
                                    update_readme, verdict)
from analysis.report.section import Section


# generated README blocks that a docs page under --out shows as well: block -> the page
DOC_BLOCKS = {"sim_bench": "scaling.md"}


def discover() -> list[Section]:
    """Every module's SECTION under analysis/report/sections/, in `order`."""
    found = [importlib.import_module(f"{sections_package.__name__}.{m.name}").SECTION
             for m in pkgutil.iter_modules(sections_package.__path__)]
    for key in ("slug", "order"):
        values = [getattr(s, key) for s in found]
        if len(set(values)) != len(values):
            raise ValueError(f"two report sections share the {key}: {sorted(v for v in values if values.count(v) > 1)}")
    return sorted(found, key=lambda s: s.order)


def with_reference(section: Section, reference: Path) -> Section:
    """A section that reads the golden values (`reference=True`), its table and verdict given their folder."""
    if not section.reference:
        return section
    return dataclasses.replace(section, table=functools.partial(section.table, reference=reference),
                               verdict=functools.partial(section.verdict, reference=reference))


def script_rows(df: pd.DataFrame) -> pd.Series:
    """Rows written by scripts (experiments/validate_perf.py, bench_memory.py, bench_ops.py, bench_sim.py, bench_lm_eval.py,
    validate_gpu.py), not
    by a run.py command: their sections select them, the stale check never sees them."""
    if df.empty:
        return pd.Series(dtype=bool)
    return (C.column(df, "metrics.validation_point").notna()
            | C.column(df, "metrics.benchmark").isin(["memory", "gpu", "sim", "lm_eval_speed"]) | O.is_ops(df))


def report(store_dir: str | Path, out: str | Path, readme: str | Path | None = None,
           figures: bool = True, reference: str | Path = REFERENCE) -> dict[str, list[str]]:
    """Writes <out>/results.md and <out>/report/*.png; rewrites the README's generated blocks when given.
    `reference`: the folder of the authors' code's golden values (the report's one input besides the store)."""
    out, every = Path(out), [with_reference(s, Path(reference)) for s in discover()]
    df = load(store_dir)
    verdicts: dict[str, list[str]] = {}
    standing: dict[str, list] = {}
    scripted = script_rows(df)
    scripts, df = (df[scripted], df[~scripted]) if not df.empty else (df, df)
    commands = list(dict.fromkeys(c for s in every for c in s.commands))
    compose_all(commands)
    stale = stale_rows(df, commands)
    fresh = df[~df["_file"].isin({line.split("`")[1] for line in stale})] if stale else df
    body, blocks, drawn_slugs = [], {}, set()
    for section in every:
        if section.script is not None:
            rows = section.script(scripts) if not scripts.empty else scripts
            n = int(section.table(rows).shape[0]) if not rows.empty else 0
            matched = Matched(rows, {}, n, n)
        else:
            matched = match(fresh, section.commands)
        rows, refused = one_build(matched.rows) if section.script is None else (matched.rows, [])
        matched = dataclasses.replace(matched, rows=rows)
        verdicts[section.slug] = verdict(section, matched.rows) + refused
        standing[section.slug] = statuses(section, matched.rows)
        if section.audit is not None and not matched.rows.empty:
            verdicts[section.slug] += section.audit(matched.rows, fresh)
        body.append(section_text(section, matched, verdicts[section.slug], out, "report", figures))
        if not matched.rows.empty and section.figure is not None:
            drawn_slugs.add(section.slug)
        if figures and (matched.rows.empty or section.figure is None):  # no figure now: none left from before
            (out / "report" / f"{section.slug}.png").unlink(missing_ok=True)
        if section.readme is not None:
            blocks[section.slug] = section.readme(matched.rows)
    summary = summary_table(every, verdicts, standing)
    # the findings first: the summary is the page's first section and table; how the report is made, its sizes and
    # the stale rows it leaves out come at the end of the page
    head = [
        "# Reproduction report", "",
        "The InfiniGen paper's claims, and findings beyond it, on SmolLM2-135M and Gemma-3-270M on a 2-core CPU, "
        f"generated by `make report` from the committed store `{label(store_dir)}` (do not edit by hand). How it is "
        "made, the sizes it tests at and the stale rows it leaves out: [at the end of the page](#how-this-report-is-made).",
        "",
        "## Summary", "",
        "Each claim of the paper on each model: holds, does not hold, or cannot be shown at this n (the interval "
        "reaches past the margin; the n that would settle it beside), with its key number and 95% interval; not "
        "measured where the build's rows lack it (its section names the commands). First the count per model; "
        "findings beyond the paper follow.", "",
        *summary, "",
    ]
    tail = [
        "## How this report is made", "",
        f"Generated by `make report` (`python -m analysis.report`) from the committed store `{label(store_dir)}` "
        f"only, and the golden values of the authors' code under `{label(reference)}` (`--reference`; read by "
        "[The authors' code](#the-authors-code) alone); do not edit by hand. Every other number above is computed "
        "from the store's rows; each section names the commands that produce its rows. Rows land in `results/` (`run.py`'s `results_dir`); `make export` copies "
        "them into docs/store without per-prompt detail (`python -m analysis.store export --results results --to "
        "docs/store`). `make evidence` (`python -m analysis.evidence`) runs every command above whose configs the "
        "store lacks, two at a time, after printing its plan and each section's estimated time from the store's "
        "per-unit seconds, then export and this report.",
        "", "Sizes are what a 2-core CPU affords (SmolLM2-135M and Gemma-3-270M): a perplexity claim is paired over 16 "
        "windows of 1,024 tokens (C3: 8 of 2,048, 16 where 8 left it open), an lm-eval claim over every doc of "
        "five tasks zero-shot (3,807 docs; the harness's variant: PIQA and COPA, 1,938), each difference with its 95% interval; they test each claim's direction, not the paper's magnitudes "
        "on its 6.7B-30B models. Each verdict (a model's perplexity or lm-eval rows in a section) reads the rows of "
        "one clean build (the newest committed run's commit): rows of other commits and of uncommitted trees are refused, and the section counts "
        "them. The accuracy claims (C1-C6, the speculation input, the successors, needle retrieval) are checked on "
        "both models: verdict lines name their model, and a last line per claim says where the models agree and "
        "disagree.", "",
        "## Stale rows", "",
        "Stored runs whose recorded config differs from what their command composes today: left out of every table, "
        "figure and verdict above.", "",
        *(stale or ["None: every stored run matches what its command composes today."]), "",
    ]
    (out / "results.md").write_text("\n".join(head + body + tail).rstrip() + "\n")
    if readme is not None:
        docs = Path(os.path.relpath(out.resolve(), Path(readme).resolve().parent)).as_posix()
        # the figure as its section draws it from these rows (written now, or already there with figures=False)
        readme_blocks = {"headline": headline(standing, every, docs, HEADLINE_FIGURE[0] in drawn_slugs),
                         **blocks, "speed": speed_block(verdicts)}
        update_readme(Path(readme), readme_blocks)
    for name, page in DOC_BLOCKS.items():  # blocks of other docs pages, from the same rows
        if name in blocks and (out / page).exists():
            update_readme(out / page, {name: blocks[name]})
    return verdicts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="docs/store", help="the results store the report reads")
    parser.add_argument("--out", default="docs", help="where results.md and report/*.png go")
    parser.add_argument("--readme", default="README.md", help="README whose generated blocks are rewritten ('' = none)")
    parser.add_argument("--reference", default=str(REFERENCE),
                        help="the golden values of the authors' code that the section \"The authors' code\" reads "
                             "beside the store (default: tests/data/reference; docs/reference.md)")
    args = parser.parse_args(argv)
    report(args.store, args.out, args.readme or None, reference=args.reference)
    print(f"[report] {Path(args.out) / 'results.md'}")
