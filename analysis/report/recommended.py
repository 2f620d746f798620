"""The InfiniGen setting recommended for a model, and how a verdict names the setting of its rows.

The recommended setting is each family's selected one (infinigen/selected.py: what `method=infinigen` gives,
chosen on held-out windows by analysis/report/selection.py); OPT keeps the paper's values. A claim's verdict leads
with its rows at the recommended setting, or says the store has none and which command adds them (`at_selected`
writes a section's command at each model's setting); other settings follow, named; the paper's OPT defaults on a
model they are not selected for get a line of their own, worded as a finding. tests/test_report.py holds the docs
to these values and every claim's first line to the recommended setting.
"""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis.report.section import num, on_model

from infinigen.selected import KEYS, LLAMA, PAPER, SELECTED

RECOMMENDED = SELECTED | {"opt": PAPER}  # by model_type: each family's selected setting (analysis/report/selection.py)
# rows recorded before an option existed ran with the behaviour its default keeps
BEFORE = {"skip_layers": 1, "speculate_from": "previous"}


def family(rows: pd.DataFrame) -> pd.Series:
    """Each row's model family: the recorded config's model.arch.model_type (a row without one: by its name)."""
    def one(config, model) -> str:
        arch = config.get("model", {}).get("arch", {}) if isinstance(config, dict) else {}
        return arch.get("model_type") or ("opt" if "opt" in str(model) else "llama")
    return pd.Series([one(c, m) for c, m in zip(C.column(rows, "config"), C.column(rows, "model"))], index=rows.index,
                     dtype=object)


def setting(rows: pd.DataFrame) -> pd.DataFrame:
    """The InfiniGen rows' KEYS (as numbers where they are numbers)."""
    out = pd.DataFrame(index=rows.index)
    for key in KEYS:
        value = C.column(rows, f"method_params.{key}")
        out[key] = value.where(value.notna(), BEFORE.get(key))
    return out


def matches(rows: pd.DataFrame, wanted: dict | pd.Series) -> pd.Series:
    """Which InfiniGen rows run at `wanted` (a setting, or one per row)."""
    if rows.empty:
        return pd.Series(dtype=bool)
    got = setting(rows)
    wanted = pd.DataFrame([wanted] * len(rows), index=rows.index) if isinstance(wanted, dict) else wanted
    same = pd.Series(rows["method"] == "infinigen", index=rows.index)
    for key in KEYS:
        if key == "speculate_from":
            same &= got[key].astype(str) == wanted[key].astype(str)
        else:
            same &= pd.to_numeric(got[key], errors="coerce") == pd.to_numeric(wanted[key], errors="coerce")
    return same


MODELS = ("smollm2-135m", "gemma3-270m")  # the real models every accuracy claim runs on
SPECULATE_POINTS = ("+point=speculate_block_input", "+point=speculate_previous")


def model_family(model: str) -> str | None:
    """A conf/model's model_type (its family), read from conf/ as run.py composes it."""
    from omegaconf import OmegaConf

    from analysis.report.compose import ROOT

    path = ROOT / "conf" / "model" / f"{model}.yaml"
    return OmegaConf.select(OmegaConf.load(path), "arch.model_type", default=None) if path.exists() else None


def knobs(model: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The command-line overrides that pin the model family's selected setting (but the knobs in `skip`)."""
    chosen = RECOMMENDED.get(model_family(model), PAPER)
    return [f"method.{k}={chosen[k]}" for k in KEYS if k not in skip]


def at_selected(command: str, model: str, skip: tuple[str, ...] = ()) -> str:
    """`command` on `model` at its family's selected setting, written out (a speculate_* point becomes
    infinigen_selected, which only picks the method; the knobs but `skip` become explicit overrides), so that the
    command names the setting it measures and a change of selection shows as rows to re-run."""
    words = [w for w in command.split(" ") if not w.startswith("model=")
             and not any(w.startswith(f"method.{k}=") for k in KEYS if k not in skip)]
    words = ["+point=infinigen_selected" if w in SPECULATE_POINTS else w for w in words]
    return " ".join(words + knobs(model, skip) + [f"model={model}"])


def on_every_model_selected(command: str, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(at_selected(command, model, skip) for model in MODELS)


def is_recommended(rows: pd.DataFrame) -> pd.Series:
    wanted = pd.DataFrame([RECOMMENDED.get(f, LLAMA) for f in family(rows)], index=rows.index)
    return matches(rows, wanted) if not rows.empty else pd.Series(dtype=bool)


def is_paper(rows: pd.DataFrame) -> pd.Series:
    """InfiniGen rows at the paper's OPT defaults on a model they are not recommended for."""
    return matches(rows, PAPER) & ~is_recommended(rows) if not rows.empty else pd.Series(dtype=bool)


def describe(values: dict | pd.Series, skip: tuple[str, ...] = ()) -> str:
    return ", ".join(f"{k} {v if isinstance(v, str) else num(float(v))}" for k, v in ((k, values[k]) for k in KEYS)
                     if k not in skip)


def model_of(rows: pd.DataFrame) -> tuple[str, str]:
    """(model, family) of a section's InfiniGen rows (of its rows without any): the one most of them ran on."""
    gen = rows[rows["method"] == "infinigen"] if "method" in rows else rows
    gen = gen if not gen.empty else rows
    model = gen["model"].value_counts().index[0]
    return model, family(gen[gen["model"] == model]).iloc[0]


def lead(rows: pd.DataFrame) -> str:
    """How a claim's first verdict line opens: the recommended setting for the rows' model, named."""
    model, fam = model_of(rows)
    return f"at the recommended setting for {model} ({describe(RECOMMENDED.get(fam, LLAMA))}; selected on held-out windows)"


def missing(rows: pd.DataFrame, *commands: str) -> str:
    """A claim's first line when the store has none of its rows at the recommended setting: the commands that add
    them (those for the rows' model, where the commands name models)."""
    model = model_of(rows)[0]
    commands = tuple(c for c in commands if f"model={model}" in c.split(" ")) or tuple(
        c for c in commands if "model=" not in c) or tuple(on_model(c, model) for c in commands)
    verb = "adds" if len(commands) == 1 else "add"
    return f"{lead(rows)}: not in the store yet ({' and '.join(f'`{c}`' for c in commands)} {verb} them)"


def paper_name(rows: pd.DataFrame) -> str:
    return f"the paper's OPT defaults ({describe(PAPER)}) on {model_of(rows)[0]}"


def name(row: pd.Series) -> str:
    """A row's InfiniGen setting in words (the recommended one or the paper's, said so)."""
    frame = row.to_frame().T
    if bool(is_recommended(frame).iloc[0]):
        return "the recommended setting"
    if bool(matches(frame, PAPER).iloc[0]):
        return "the paper's OPT defaults"
    return describe(setting(frame).iloc[0])


def names(rows: pd.DataFrame) -> str:
    """The InfiniGen settings of `rows` in words: each one, or how many and what they vary in."""
    named = sorted({name(row) for _, row in rows.iterrows()})
    if len(named) <= 2:
        return " and ".join(named)
    values = setting(rows)
    varying = [k for k in KEYS if values[k].astype(str).nunique() > 1]
    ranges = ", ".join(f"{k} {num(pd.to_numeric(values[k]).min())}-{num(pd.to_numeric(values[k]).max())}"
                       if k != "speculate_from" else f"{k} {'/'.join(sorted(set(values[k])))}" for k in varying)
    return f"{len(named)} settings ({ranges}; {describe(values.iloc[0], skip=tuple(varying))})"


# C1 and C2 state each claim at the authors' semantics first (`method=infinigen_reference`, `method=h2o_reference`:
# what the InfiniGen artifact computes; the section "The authors' code"), then the harness's own variant, beyond the
# paper: its lines lead with BEYOND
AUTHORS = "at the authors' semantics"
BEYOND = "beyond the paper, the harness's variant (`method=infinigen`)"
AUTHORS_CLAIM, BEYOND_CLAIM = "the authors' semantics", "the harness's variant, beyond the paper"


def authors(rows: pd.DataFrame, what: str = "`method=infinigen_reference`") -> str:
    """How a line at the authors' semantics opens: the rows' model (its InfiniGen reference rows' where it has
    some), what runs and the artifact's knobs those rows ran with (each knob's most common value: a sweep of one
    knob holds the others at the preset's, so its swept points do not name the setting)."""
    gen = rows[rows["method"] == "infinigen_reference"] if "method" in rows else rows
    model = (gen if not gen.empty else rows)["model"].value_counts().index[0]
    gen = gen[gen["model"] == model]
    knobs = ""
    if not gen.empty:
        values = setting(gen).agg(lambda column: column.value_counts(sort=True).index[0])
        knobs = f" with skip_layers {num(float(values['skip_layers']))}, alpha {num(float(values['alpha']))}, " \
                f"partial_ratio {num(float(values['partial_ratio']))}"
    return f"{AUTHORS} on {model} ({what}, the InfiniGen artifact's algorithm{knobs}; [The authors' code](#the-authors-code))"


def authors_missing(rows: pd.DataFrame, *commands: str, what: str = "`method=infinigen_reference`") -> str:
    """A line at the authors' semantics when the store has none of its rows: the commands that add them (those for
    the rows' model)."""
    model = rows["model"].value_counts().index[0]
    commands = tuple(c for c in commands if f"model={model}" in c.split(" ")) or commands
    verb = "adds" if len(commands) == 1 else "add"
    return (f"{AUTHORS} on {model} ({what}, the InfiniGen artifact's algorithm; [The authors' code](#the-authors-code)): "
            f"not in the store yet ({' and '.join(f'`{c}`' for c in commands)} {verb} them)")
