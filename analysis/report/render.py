"""Writing the report: a section as markdown, its figure as PNG, the README's generated blocks."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis import tables as T
from analysis.columns import MODEL_ORDER
from analysis.report.compose import ROOT
from analysis.report.matching import Matched, provenance
from analysis.report.section import Section, Status, across, by_model, needs

CELL = 200  # characters: a summary cell longer than this is cut at a clause

# every generated block of the README: <!-- report:NAME --> ... <!-- /report:NAME -->
BLOCK = re.compile(r"(<!-- report:(\w+) -->\n)(.*?)(<!-- /report:\2 -->)", re.DOTALL)


def save(fig: Figure, path: Path) -> None:
    """PNG without the software/version text, so the bytes depend on the data and matplotlib's drawing only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})


def verdict(section: Section, rows: pd.DataFrame) -> list[str]:
    """The section's verdict lines; a per-model claim's per model (each line prefixed with the model), then where
    the models agree and disagree."""
    if rows.empty:
        return needs("rows of this section")
    parts = by_model(section, rows)
    if parts[0][0] is None:
        return section.verdict(rows) or needs("rows of this section")
    # a line that names its model before its first colon (the recommended setting's lead) is left as it is
    out = [line if model in line.split(":")[0] else f"{model}: {line}"
           for model, part in parts for line in section.verdict(part)]
    if section.contrast is not None:
        out += across([(model, section.contrast(part)) for model, part in parts])
    return out


def tables_of(section: Section, rows: pd.DataFrame) -> list[pd.DataFrame]:
    """The section's tables; a per-model claim's with a model column, each model's rows one after another."""
    parts = by_model(section, rows)
    per = [(model, section.table(part)) for model, part in parts]
    per = [(model, list(t) if isinstance(t, (list, tuple)) else [t]) for model, t in per]
    if parts[0][0] is None:
        return per[0][1]
    out = []
    for i in range(max(len(t) for _, t in per)):
        pieces = [t[i].assign(model=model)[["model", *(c for c in t[i].columns if c != "model")]]
                  for model, t in per if i < len(t) and not t[i].empty]
        out.append(pd.concat(pieces, ignore_index=True) if pieces else pd.DataFrame())
    return out


def figure_parts(section: Section, rows: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(file stem, rows) of each figure: one, or a per-model claim's one per model (the first keeps the slug)."""
    return [(section.slug if i == 0 else f"{section.slug}_{model}", part)
            for i, (model, part) in enumerate(by_model(section, rows))]


def section_text(section: Section, matched: Matched, verdicts: list[str], out: Path, figure_dir: str,
                 figures: bool = True) -> str:
    rows = matched.rows
    lines = [f"## {section.title}", "", f"*Claim.* {section.claim}", ""]
    lines += [f"**Verdict (computed from the store):** {verdicts[0]}" if len(verdicts) == 1
              else "**Verdict (computed from the store):**", ""]
    if len(verdicts) > 1:
        lines += [f"* {v}" for v in verdicts] + [""]
    if section.commands:  # a script's section names its command in its note
        lines += ["Rows from:", "", "```bash", *section.commands, "```", ""]
    lines.append(f"{matched.present} of {matched.total} configs in the store"
                 + (f" ({provenance(rows)})." if matched.present else "."))
    if matched.missing:
        lines += ["", "Missing (run, then `make export report`):", ""]
        lines += [f"* {n} config(s) of `{command}`" for command, n in matched.missing.items()]
    if section.note:
        lines += ["", section.note]
    lines.append("")
    if not rows.empty and section.figure is not None:
        for stem, part in figure_parts(section, rows):
            if figures:
                save(section.figure(part), out / figure_dir / f"{stem}.png")
            lines += [f"![{stem}]({figure_dir}/{stem}.png)", ""]
    if not rows.empty or section.reference:
        for table in tables_of(section, rows):
            if isinstance(table, str):
                lines += [table, ""]
            elif not table.empty:
                table = table.dropna(axis=1, how="all")
                lines += [T.markdown(table, right={c for c in table.columns if c not in T.TEXT and c != "setting"
                                                   and pd.api.types.is_numeric_dtype(table[c])}), ""]
    return "\n".join(lines)


def statuses(section: Section, rows: pd.DataFrame) -> list[tuple[str | None, Status]]:
    """(model, status) of each of the section's claims on each model its rows hold (its `status`)."""
    if rows.empty or section.status is None:
        return []
    return [(model or rows["model"].iloc[0], status) for model, part in by_model(section, rows)
            for status in section.status(part)]


KINDS = ("holds", "does not hold", "cannot be shown at this n", "not measured")


def counts(standing: dict[str, list[tuple[str | None, Status]]]) -> list[str]:
    """Per model, how many of the claims' verdicts hold, do not hold, cannot be shown at this n, are not measured."""
    per: dict[str, dict[str, int]] = {}
    for each in standing.values():
        for model, st in each:
            kind = st.verdict if st.verdict in KINDS else "not measured"
            per.setdefault(model, dict.fromkeys(KINDS, 0))[kind] += 1
    return [f"{model}: {sum(n.values())} verdicts: " + ", ".join(f"{k} {n[k]}" for k in KINDS)
            for model, n in sorted(per.items())]


def cut(text: str, limit: int = CELL) -> str:
    """`text` cut at its last clause (`; `) that ends within `limit` characters."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    stop = max(head.rfind("; "), head.rfind(", "))
    return (head[:stop] if stop > limit // 2 else head.rsplit(" ", 1)[0]) + " ..."


def summary_table(sections: list[Section], verdicts: dict[str, list[str]],
                  standing: dict[str, list[tuple[str | None, Status]]]) -> list[str]:
    """The front page: a row per claim and model (holds / does not hold / cannot be shown / not measured, its
    number, the section), then one row per finding beyond the paper with its first verdict line, cut to CELL."""
    out = [*(f"* {line}" for line in counts(standing)), "",
           "| claim | model | verdict | key number (95% interval) | section |", "|---|---|---|---|---|"]
    for s in sections:
        link = f"[{s.title.split('.')[0] if s.title[:1] == 'C' else 'section'}](#{anchor(s.title)})"
        for model, st in standing.get(s.slug, []):
            verdict = st.verdict if st.verdict not in ("does not hold",) else "**does not hold**"
            out.append(f"| {st.claim} | {model} | {verdict} | {cut(st.number).replace('|', '/')} | {link} |")
    out += ["", "| finding | first verdict line | section |", "|---|---|---|"]
    for s in sections:
        if not standing.get(s.slug):
            out.append(f"| {s.title} | {cut(verdicts[s.slug][0]).replace('|', '/')} | [section](#{anchor(s.title)}) |")
    return out


HEADLINE_FIGURE = ("c2_baselines", "perplexity against relative KV size, every method")  # the README's figure
HEADLINE_LINES = 25  # the README's headline block fits one screen
KEY = 110  # characters: a headline cell's key number is its number's first clause, cut to this


def key(number: str) -> str:
    """A summary number's first clause, cut to KEY characters at a clause (else a word) outside parentheses;
    ' ...' where more follows (in docs/results.md)."""
    first = number.split("; ", 1)[0]
    if len(first) <= KEY:
        return first if first == number else first + " ..."
    balanced = [i for i in range(1, KEY) if first[:i].count("(") == first[:i].count(")")]
    clauses = [i for i in balanced if first.startswith(", ", i)]
    words = [i for i in balanced if first[i] == " "]
    stop = clauses[-1] if clauses and clauses[-1] > KEY // 4 else (words or [KEY])[-1]
    return first[:stop] + " ..."


def headline(standing: dict[str, list[tuple[str | None, Status]]], sections: list[Section] = (),
             docs: str = "docs", figure: bool = False) -> str:
    """The README's headline: a table of the paper's claims at the authors' semantics (rows) on each model
    (columns), each cell the verdict and its key number, linking the claim's section of docs/results.md; then
    HEADLINE_FIGURE (`figure`: it was drawn) and a caption. The harness's variants, the findings beyond the paper and
    every interval stay in docs/results.md's summary. `docs`: the folder of results.md, relative to the README."""
    titles = {s.slug: s.title for s in sections}
    results = f"{docs}/results.md"
    rows: dict[str, dict[str, tuple[Status, str]]] = {}
    for slug, each in standing.items():
        link = f"{results}#{anchor(titles[slug])}" if slug in titles else f"{results}#summary"
        for model, st in each:
            if "beyond the paper" not in st.claim:
                rows.setdefault(st.claim.replace(" (the authors' semantics)", ""), {})[model] = (st, link)
    if not rows:
        return f"No headline numbers yet: docs/store has no rows of the paper's claims (see [{results}]({results})).\n"
    models = sorted({m for cells in rows.values() for m in cells},
                    key=lambda m: (MODEL_ORDER.index(m) if m in MODEL_ORDER else len(MODEL_ORDER), m))

    def cell(model: str, cells: dict[str, tuple[Status, str]]) -> str:
        if model not in cells:
            return "-"
        st, link = cells[model]
        verdict = "**does not hold**" if st.verdict == "does not hold" else st.verdict
        text = (f"{verdict}: {key(st.number)}" if st.number else verdict).replace("[", "(").replace("]", ")")
        return f"[{text}]({link})".replace("|", "/")

    lines = [f"| the paper's claim (the authors' semantics) | {' | '.join(models)} |", "|---|" + "---|" * len(models),
             *(f"| {claim} | {' | '.join(cell(m, cells) for m in models)} |" for claim, cells in rows.items()), ""]
    stem, what = HEADLINE_FIGURE
    where = f"{results}#{anchor(titles[stem])}" if stem in titles else f"{results}#summary"
    if figure:
        lines.append(f"[![{stem}: {what}]({docs}/report/{stem}.png)]({where})\\")
    lines.append(f"Each claim's verdict on {', '.join(models)} (a 2-core CPU) with its key number, linking its section "
                 f"of [{results}]({results}); the harness's variants, the findings beyond the paper and every interval: "
                 f"[its summary]({results}#summary)"
                 + (f". Figure: [{stem.split('_')[0].upper()}]({where}), {what}, on {models[0]}" if figure else "")
                 + " (generated by `make report` from docs/store).")
    return "\n".join(lines) + "\n"


def speed_block(results: dict[str, list[str]]) -> str:
    """The README's speed summary: the verdicts of the modelled paper figures and of the model's validation here."""
    # (title, section, how many of its first verdict lines, lines kept wherever they are): the rest is in results.md
    picks = [("Measured on an H200 (OPT-13B's shape, batch 20), beside the model", "gpu_measured", 4, ()),
             ("Modelled (RTX A6000 + PCIe 3.0 profile, OPT shapes)", "c7_modelled", 4,
              ("what these modelled numbers rest on",)),
             ("The model against this machine (calibrated CPU profile, smollm2-135m)", "c7_validation", 1,
              ("what a CPU cannot test",))]
    lines = []
    for name, slug, first, always in picks:
        verdict = results.get(slug) or ["not computed"]
        kept = [line for i, line in enumerate(verdict) if i < first or line.startswith(always)]
        rest = f" ({len(verdict) - len(kept)} more lines in docs/results.md)" if len(kept) < len(verdict) else ""
        # the list right under its title line (a list interrupts a paragraph: rendered the same, a line shorter)
        lines += [f"{name}{rest}:"] + [f"* {line}" for line in kept] + [""]
    return "\n".join(lines) + "\n(generated by `make report` from docs/store; tables, figures and commands: " \
        "[docs/results.md](docs/results.md), C7)\n"


def label(path: str | Path) -> str:
    """A path as the report prints it: relative to the repository when inside it (the same text wherever the
    report is written from)."""
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def anchor(title: str) -> str:
    """GitHub's heading anchor."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def update_readme(path: Path, blocks: dict[str, str]) -> None:
    """Rewrites each named generated block of the README; every block must be there."""
    text = path.read_text()
    for name in blocks:
        if f"<!-- report:{name} -->" not in text:
            raise SystemExit(f"{path} has no <!-- report:{name} --> ... <!-- /report:{name} --> block")
    path.write_text(BLOCK.sub(lambda m: m.group(1) + blocks.get(m.group(2), m.group(3)) + m.group(4), text))
