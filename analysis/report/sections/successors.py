"""Beyond the paper: ShadowKV and RocketKV next to InfiniGen."""

from __future__ import annotations

import math

import numpy
import pandas as pd
import yaml

from analysis import columns as C
from analysis import tables as T
from analysis.report.compose import ROOT
from analysis.report.section import ONE_WINDOW, Contrast, Section, needs, num, on_every_model, signed

KERNEL = "python run.py -m +experiment=successors_kernel_smoke"  # RocketKV's stage-1 kernel at 31 and 63
# the protocol is 8 windows (task.max_windows=8); the preset and the rows: one window
SUCCESSORS = ("python run.py -m +experiment=successors_ppl_smoke",
              "python run.py -m +experiment=successors_latency_smoke", KERNEL)
# what a method's fractional budget is a fraction of (baselines/shadowkv.py: the prompt; RocketKV: the sequence;
# InfiniGen, the oracle, Quest: the row's past, whose longest is the window)
BUDGET_OF = {"shadowkv": "dense_rows"}


def default_kernel() -> int:
    return yaml.safe_load((ROOT / "conf" / "method" / "rocketkv.yaml").read_text())["kernel"]


def kernel_ablation(rows: pd.DataFrame) -> pd.Series:
    """RocketKV rows at another stage-1 kernel than conf/method/rocketkv.yaml's (successors_kernel_smoke)."""
    kernel = pd.to_numeric(C.column(rows, "method_params.kernel"), errors="coerce")
    return (rows["method"] == "rocketkv") & kernel.notna() & (kernel != default_kernel())


def budgets(rows: pd.DataFrame) -> pd.DataFrame:
    """Per ppl row with a budget: the budget as a fraction and as a token count over the length it is a fraction
    of (a row given in tokens: the count, and the fraction it makes). RocketKV and ShadowKV take the count as
    method.budget_tokens."""
    out = pd.DataFrame(index=rows.index)
    length = pd.Series([C.metric(rows.loc[[i]], BUDGET_OF.get(m, "seq_len")).iloc[0]
                        for i, m in rows["method"].items()], index=rows.index, dtype=float)
    fraction = pd.to_numeric(C.column(rows, "method_params.budget"), errors="coerce")
    tokens = pd.to_numeric(C.column(rows, "method_params.budget_tokens"), errors="coerce")
    # a fraction's count rounded up, as the methods round it: the count that gives the same selection
    out["budget tokens"] = tokens.clip(upper=length).fillna(numpy.ceil(fraction * length - 1e-9))
    out["budget"] = fraction.fillna(out["budget tokens"] / length)
    return out


def successors_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The successors table with each setting's budget as a fraction and as a token count beside its params."""
    out = T.table(rows, "successors")
    both = rows[rows["task"].isin(["ppl", "latency"])]
    ppl = both.assign(params=T.key_params(both))[lambda r: r["task"] == "ppl"]
    sizes = pd.concat([ppl[["model", "method", "params"]], budgets(ppl)], axis=1).drop_duplicates(
        ["model", "method", "params"])
    if not out.empty and not sizes.empty:
        out = out.merge(sizes, on=["model", "method", "params"], how="left")
        order = list(out.columns[:3]) + ["budget", "budget tokens"]
        out = out[order + [c for c in out.columns if c not in order]]
    return out.drop(columns=[c for c in ("model",) if c in out.columns])


def kernel_lines(rows: pd.DataFrame, full: float) -> list[str]:
    """RocketKV's decoded-row perplexity gap to full's per stage-1 kernel, at each budget with more than one."""
    gen = C.of_task(rows, "ppl")
    gen = gen[gen["method"] == "rocketkv"]
    gen = gen.assign(kernel=pd.to_numeric(C.column(gen, "method_params.kernel")), budget=budgets(gen)["budget"],
                     decoded=T.decoded_nll(gen).map(math.exp), recall=C.metric(gen, "recall"))
    out = []
    for budget, part in gen.groupby("budget"):
        if part["kernel"].nunique() < 2:
            continue
        part = part.sort_values("kernel")
        out.append(f"RocketKV's stage-1 pooling kernel at budget {num(budget)} (the reference's 63 at 8K-128K "
                   f"prompts; {default_kernel()} here by default): decoded-row perplexity gap to full's "
                   + ", ".join(f"kernel {r.kernel:.0f} {signed(r.decoded - full)} (recall {num(r.recall, 2)})"
                               for r in part.itertuples()))
    return out or [f"RocketKV's stage-1 pooling kernel 31 and 63 (the reference's): not in the store yet "
                   f"(`{KERNEL}` adds them)"]


def levels(rows: pd.DataFrame) -> tuple[float | None, pd.DataFrame]:
    """Full's decoded-row perplexity and the compared settings' table rows, each with its budget `level` (1: the
    method's lower setting) and its decoded-row perplexity `gap` to full's."""
    ablation = rows[kernel_ablation(rows)] if not rows.empty else rows
    table = T.table(rows.drop(ablation.index), "successors")
    table = table.reindex(columns=list(dict.fromkeys([*table.columns, "decoded ppl", "kv_fraction", "recall",
                                                      "h2d KiB/token", "device KV MiB"])))
    full = table.loc[table["method"] == "full", "decoded ppl"].dropna()
    parts = table[(table["method"] != "full") & table["kv_fraction"].notna()]
    if full.empty or parts.empty:
        return (None if full.empty else full.iloc[0]), parts
    return full.iloc[0], parts.assign(level=parts.groupby("method")["kv_fraction"].rank(method="first").astype(int),
                                      gap=parts["decoded ppl"] - full.iloc[0])


def successors_contrast(rows: pd.DataFrame) -> list[Contrast]:
    """Each offloading method's decoded-row perplexity gap to full at its lower budget."""
    _, parts = levels(rows)
    lower = parts[parts["level"] == 1].set_index("method")["gap"] if "level" in parts else pd.Series(dtype=float)
    return [Contrast(f"{m}'s decoded-row perplexity gap to full at its lower budget", lower.get(m))
            for m in ("infinigen", "shadowkv", "rocketkv", "quest")]


def successors_verdict(rows: pd.DataFrame) -> list[str]:
    """Per budget level (each method's lower and higher setting): the decoded rows' perplexity gap to full's, with
    kv_fraction and recall, and the bytes the latency rows of the same settings count; then RocketKV's stage-1
    kernel ablation."""
    full, parts = levels(rows)
    if full is None:
        return needs("ppl rows of full and of the compared methods (with task.dense_rows)")
    if parts.empty:
        return needs("ppl rows of the compared methods")
    out = []
    for level, part in parts.groupby("level"):
        part = part.sort_values(["gap", "method"])
        name = {1: "lower", 2: "higher"}.get(level, f"setting {level}")
        line = (f"{name} budgets (kv_fraction {num(part['kv_fraction'].min(), 2)}-{num(part['kv_fraction'].max(), 2)}"
                f" on the decoded rows): decoded-row perplexity gap to full's {num(full, 4)}: "
                + ", ".join(f"{r.method} {signed(r.gap)} (kv {num(r.kv_fraction, 2)}"
                            + (f", recall {num(r.recall, 2)})" if pd.notna(r.recall) else ")")
                            for r in part.itertuples())
                + f"; most accurate: {part.iloc[0]['method']}")
        others = part[part["method"] != "oracle"]
        if part.iloc[0]["method"] == "oracle" and not others.empty:  # the exact top-k is the bound, not a contender
            line += f" (the exact top-k), of the others {others.iloc[0]['method']}"
        if C.metric(rows[rows["task"] == "ppl"], "windows").max() < 2:
            line += f" ({ONE_WINDOW})"
        out.append(line)
        moved = part.rename(columns={"h2d KiB/token": "h2d", "device KV MiB": "device"})
        if "h2d" in moved and moved["h2d"].notna().any():
            moved = moved.dropna(subset=["h2d"]).sort_values(["h2d", "method"])
            line = (f"{name} budgets, link bytes per decoded token (2048-token prompt): "
                    + ", ".join(f"{r.method} {r.h2d:,.0f} KiB" for r in moved.itertuples()))
            if "device" in moved and moved["device"].notna().any():
                line += "; held on the device: " + ", ".join(
                    f"{r.method} {num(r.device)} MiB" for r in moved.sort_values(["device", "method"]).itertuples())
            out.append(line)
    return out + kernel_lines(rows, full)


SECTION = Section(
    "successors", "Beyond the paper: ShadowKV and RocketKV",
    "Two offloading-era successors of InfiniGen through the same method interface "
    "(docs/methods_successors.md), next to InfiniGen (block_input speculation), the oracle and Quest at "
    "kv_fraction ~0.1 and ~0.2: ShadowKV moves values only (its keys are rebuilt on the device from a "
    "low-rank copy), RocketKV selects single tokens on the query's own top channels. WikiText-2, each "
    "2048-token window a 1792-token dense prompt and 256 decoded rows (ShadowKV and RocketKV compress a "
    "prompt): `ppl` over every predicted token, `decoded ppl`, kv_fraction and recall over the decoded rows "
    "(sim mode); the bytes from a latency run of the same setting (2048-token prompt + 16 decode steps "
    "through the offloading runtime, fp32): `h2d KiB/token` crossed the host-to-device link per decoded "
    "token (counted), `device KV MiB` the method keeps on the device (stores, per-layer state, landing "
    "buffers), `host pool MiB` in the host pools.\n\n`budget` and `budget tokens`: each setting's budget "
    "as a fraction and as a token count of what it is a fraction of (RocketKV: the 2048-token window; "
    "ShadowKV: the 1792-token prompt; InfiniGen, the oracle and Quest: a row's past, at most the "
    "window), the count rounded up as the methods round it; RocketKV and ShadowKV take either "
    "(method.budget=null method.budget_tokens=N, the papers' form). RocketKV's stage-1 pooling kernel: "
    "15 by default, the reference's 63 (at 8K-128K prompts) and 31 as the ablation.",
    on_every_model(*SUCCESSORS),
    successors_table, successors_verdict,
    note="One window per setting (the preset's; the issue asks 8: task.max_windows=8): on the shared 2-core "
         "machine a config took ~5 min of wall time for one window (model load, the window, the decode-mode "
         "cache measurement), and 11 settings x (ppl + latency) had to fit one afternoon. The decoded ppl is "
         "over 256 tokens: differences of a few percent are noise. The latency rows' times mean nothing "
         "here (a shared CPU; nothing really crosses a link), only their bytes. ShadowKV's landmark "
         "softmax divides by sqrt(head_dim) (8 on SmolLM2, 16 on Gemma-3), the reference by sqrt(128) "
         "whatever the head size: a head's ranking of the chunks is the same under both, only the max over the "
         "query heads sharing a KV head (3 on SmolLM2, 4 on Gemma-3) can differ (baselines/shadowkv.py). On "
         "Gemma-3 the InfiniGen rows speculate from `block_input` as on SmolLM2, not from its recommended "
         "`previous` (C1 and the speculation input compare the two). RocketKV on Gemma-3 attends far less "
         "than its budget on the decoded rows (its kv_fraction) and loses most: its budgets count the whole "
         "sequence, while a local layer attends only its window and its stage-1 votes come from the prompt's "
         "last queries; a window-aware RocketKV is not built here.",
    order=120, per_model=True, contrast=successors_contrast)
