"""C7 measured on a GPU: the H200 rows of docs/gpu, each beside the performance model's number for it, with the commit
it ran at and whether the runtime has changed since (experiments/validate_gpu.py --store rows)."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis import columns as C, draw as D
from analysis.report.section import Section, needs

WITHIN = 0.25
# the model's terms of a step (ms), as validate_gpu names them, and the runtime's measured segments (ms)
MODEL_TERMS = {"compute_ms": "compute", "speculation_ms": "speculation", "host_ms": "host gather (exposed)",
               "exposed_transfer_ms": "link (exposed)", "sync_wait_ms": "sync waits", "join_wait_ms": "joins",
               "host_work_ms": "host work"}
MEASURED_SEGMENTS = {"attention_ms": "attention", "ffn_ms": "MLP", "speculation_ms": "speculation",
                     "link_host_ms": "host gather", "transfer_ms": "link", "wait_ms": "wait on a copy"}
NAMES = {"full": "ideal", "quant": "INT4", "h2o": "H2O", "offload": "offload"}
# the paper's OPT-13B point (batch 20, 1920 + 128, RTX A6000; Fig. 14): InfiniGen over H2O and INT4 in tokens/s,
# prefill included (41.99 / 25.70 and 41.99 / 14.02)
PAPER = {"h2o": 1.63, "quant": 3.00}


def gpu_rows(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[C.column(rows, "metrics.benchmark") == "gpu"]


def largest(values: dict, names: dict, n: int = 2) -> str:
    got = sorted(((float(values.get(k) or 0.0), v) for k, v in names.items()), key=lambda t: -t[0])
    return ", ".join(f"{name} {value:.1f}" for value, name in got[:n] if value > 0) or "none"


def data(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per measured GPU row, latest run first, each run's rows in the order it ran them."""
    rows = gpu_rows(rows)
    if rows.empty:
        return pd.DataFrame()
    modelled = C.column(rows, "metrics.modelled_perf")
    measured = [{k: r.get(f"metrics.{k}") for k in MEASURED_SEGMENTS} for _, r in rows.iterrows()]
    out = pd.DataFrame({
        "run": C.column(rows, "metrics.run"), "order": C.metric(rows, "run_order"),
        "index": C.metric(rows, "row_index"), "row": C.column(rows, "metrics.gpu_row"), "method": rows["method"],
        "gather": C.column(rows, "task_params.gather").fillna("host"),
        "budget": pd.to_numeric(C.column(rows, "method_params.budget"), errors="coerce"),
        "model": rows["model"], "dtype": C.column(rows, "metrics.dtype"),
        "batch": C.metric(rows, "batch_size"), "prompt": C.metric(rows, "prompt_len"), "gen": C.metric(rows, "gen_len"),
        "measured": C.metric(rows, "decode_ms_median"), "modelled": C.metric(rows, "modelled_perf_ms_per_token"),
        "at_run": C.metric(rows, "modelled_at_run_ms_per_token"),
        "model_terms": [largest(m if isinstance(m, dict) else {}, MODEL_TERMS) for m in modelled],
        "measured_terms": [largest(m, MEASURED_SEGMENTS) for m in measured],
        "commit": C.column(rows, "meta.git_commit"), "code": C.column(rows, "meta.code"),
        "since": C.column(rows, "meta.code_since"), "also": C.column(rows, "meta.code_also"),
        "changed": C.column(rows, "meta.runtime_changed_since"),
        "model_changed": C.column(rows, "meta.model_changed_since"),
        "modelled_commit": C.column(rows, "meta.modelled_commit"),
        "cpu": C.column(rows, "meta.cpu_validation_commits"),
        "source": C.column(rows, "metrics.source"), "profile": C.column(rows, "metrics.modelled_profile"),
        "census": C.column(rows, "metrics.modelled_census"),
    })
    out["ratio"] = out["modelled"] / out["measured"]
    return out.sort_values(["order", "index"], ascending=[False, True]).reset_index(drop=True)


def short(commit) -> str:
    return commit[:7] + ("-dirty" if commit.endswith("-dirty") else "") if isinstance(commit, str) else "not recorded"


def table(rows: pd.DataFrame) -> pd.DataFrame:
    d = data(rows)
    if d.empty:
        return pd.DataFrame()
    return pd.DataFrame({
        "run": d["run"], "row": d["row"], "batch": d["batch"].astype(int),
        "prompt + gen": [f"{int(p)} + {int(g)}" for p, g in zip(d["prompt"], d["gen"])], "dtype": d["dtype"],
        "measured decode ms/token": d["measured"].round(1), "modelled ms/token": d["modelled"].round(1),
        "modelled / measured": d["ratio"].round(2),
        "modelled on the device at the run, ms/token": d["at_run"].round(1),
        "modelled, largest terms (ms per step)": d["model_terms"],
        "measured, largest segments (ms per step)": d["measured_terms"],
        "ran at": [str(code).split(" (", 1)[0] for code in d["code"]],
    })


def label(row: pd.Series) -> str:
    """An InfiniGen row in words: its budget and gather."""
    gather = "zero-copy gather" if row["gather"] == "zero_copy" else "host gather"
    budget = "" if pd.isna(row["budget"]) else f"budget {row['budget']:g}, "
    return f"InfiniGen ({budget}{gather})"


def over(part: pd.DataFrame, column: str) -> list[tuple[pd.Series, dict[str, float]]]:
    """Each InfiniGen row with its speed-up over each other offloading method of the run (H2O, INT4, offload:
    that method's ms/token over InfiniGen's)."""
    others = part[part["method"].isin(["h2o", "quant", "offload"])].drop_duplicates("method")
    others = others.set_index("method")[column].reindex([m for m in ("h2o", "quant", "offload")
                                                         if m in set(others["method"])])
    return [(gen, {m: o / gen[column] for m, o in others.items()})
            for _, gen in part[part["method"] == "infinigen"].iterrows()]


def run_lines(run: str, part: pd.DataFrame) -> list[str]:
    head = part.iloc[0]
    out = [f"H200, {head['model']}'s shape, batch {int(head['batch'])}, {int(head['prompt'])} + {int(head['gen'])} "
           f"({run}): measured " + ", ".join(f"{r} {m:.1f}" for r, m in zip(part["row"], part["measured"]))
           + " ms/token",
           f"{run} ({head['source']}) ran {head['code']}"]
    for (gen, meas), (_, model) in zip(over(part, "measured"), over(part, "modelled")):
        out.append(f"{run}, {label(gen)} over " + "; ".join(
            f"{NAMES[m]}: measured {v:.2f}x, modelled {model[m]:.2f}x" for m, v in meas.items()))
    census = "census of the code that ran" if not str(head["census"]).startswith("live") else \
        "census of the code now"
    profile = str(head["profile"]).rsplit("/", 1)[-1].removesuffix(".yaml")
    within = int(((part["ratio"] - 1).abs() <= WITHIN).sum())
    out.append(f"{run}, modelled / measured ({profile}, {census}): "
               + ", ".join(f"{r} {x:.2f}" for r, x in zip(part["row"], part["ratio"]))
               + f"; {within} of {len(part)} within ±{WITHIN:.0%}")
    return out + code_lines(run, head)


# the runtime's files a reader looks for first among those changed
FIRST_FILES = ("infinigen/offload/runtime.py", "infinigen/offload/link.py", "infinigen/offload/kernels.py",
               "infinigen/shared/select_evict.py", "infinigen/infinigen_method/select_evict.py", "baselines/h2o.py",
               "baselines/quant.py")  # (select_evict.py's path before issue 57 moved it, as stored rows name it)


def code_lines(run: str, head: pd.Series) -> list[str]:
    """Whether the runtime that ran the rows is the one in the code now (as git said when the rows were written)."""
    when = f"as of {short(head['modelled_commit'])}"
    if not isinstance(head["changed"], list):
        return [f"{run}: which runtime files changed after {head['since']} was not recorded (git could not tell "
                f"{when}): rerun `make validate-gpu` in a clone with history"]
    changed = head["changed"]
    if not changed and not isinstance(head["also"], str):
        return [f"{run}: no runtime file changed after {head['since']} ({when}): the code now is the code that ran"]
    rank = {f: i for i, f in enumerate(FIRST_FILES)}
    first = sorted(changed, key=lambda f: (rank.get(f, len(rank)), f))[:2]
    more = f" and {len(changed) - len(first)} more" if len(changed) > len(first) else ""
    names = ", ".join(f.rsplit("/", 1)[-1] for f in first)
    out = [f"{run}: {len(changed)} runtime files changed after {head['since']} ({names}{more}; {when}): this code "
           "has not run on a GPU"]
    if isinstance(head["also"], str):
        out.append(f"{run}: {head['also']}")
    return out


def model_line(d: pd.DataFrame) -> list[str]:
    """How far the model beside these rows is from the one the CPU validation checked (as git said then)."""
    head = d.iloc[0]
    since = head["model_changed"] if isinstance(head["model_changed"], dict) else {}
    cpu = [c for c in (head["cpu"] if isinstance(head["cpu"], list) else []) if c in since]
    out = []
    for commit in cpu:
        files = since[commit]
        if files is None:
            out.append(f"how far the model beside these rows is from the CPU validation at {commit} was not recorded")
            continue
        if not files:
            out.append(f"the model beside these rows ({short(head['modelled_commit'])}) is the code the CPU "
                       f"validation checked at {commit}")
            continue
        changes = ", ".join(f"{f.rsplit('/', 1)[-1]} +{a}/-{r}" for f, (a, r) in sorted(files.items()))
        out.append(f"the model beside these rows is the code at {short(head['modelled_commit'])}; since the CPU "
                   f"validation at {commit} (lines): {changes}")
    return out


def verdict(rows: pd.DataFrame) -> list[str]:
    d = data(rows)
    if d.empty:
        return needs("GPU rows (`make validate-gpu`: python -m experiments.validate_gpu --store docs/store)")
    out = []
    for run in dict.fromkeys(d["run"]):
        out += run_lines(run, d[d["run"] == run])
    paper = ("for comparison, the paper's InfiniGen at OPT-13B, batch 20, 1920 + 128 on its RTX A6000 (tokens/s, "
             f"prefill included): over H2O {PAPER['h2o']:.2f}x, over INT4 {PAPER['quant']:.2f}x")
    return out + [paper] + model_line(d)


def figure(rows: pd.DataFrame) -> Figure:
    d = data(rows)
    runs = list(dict.fromkeys(d["run"]))
    fig, axes = D.grid(len(runs), cols=2, size=(5.6, 3.8))
    for ax, run in zip(axes, runs):
        part = d[d["run"] == run].reset_index(drop=True)
        x = range(len(part))
        bars = [("measured", part["measured"], "black"), ("modelled (this checkout)", part["modelled"], "tab:blue")]
        if part["at_run"].notna().any():
            bars.append(("modelled on the device at the run", part["at_run"], "tab:orange"))
        width = 0.8 / len(bars)
        for i, (name, values, colour) in enumerate(bars):
            ax.bar([j + (i - (len(bars) - 1) / 2) * width for j in x], values, width, label=name, color=colour)
        ax.set_xticks(list(x), list(part["row"]), rotation=25, ha="right", fontsize=7)
        head = part.iloc[0]
        ax.set(ylabel="decode ms/token", title=f"{run}: batch {int(head['batch'])}, {int(head['prompt'])} + "
                                                f"{int(head['gen'])}, ran at {str(head['code']).split(' (', 1)[0]}")
        ax.title.set_fontsize(8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Measured on an NVIDIA H200 beside the performance model ({', '.join(sorted(set(d['model'])))}'s "
                 "shape, random weights)", fontsize=9)
    return fig


SECTION = Section(
    "gpu_measured", "C7. Speed measured on a GPU (H200)",
    "The only GPU speed this project has measured: OPT-13B's shape (random weights, float16) with the KV cache in "
    "host memory on one NVIDIA H200 (PCIe 5.0 x16, 16 host cores), batch 20, prompt 1920, in two runs of two "
    "versions of the offloading runtime (docs/gpu/). Each row is shown beside the performance model's number for "
    "it (infinigen/offload/perf.py), which every modelled speed verdict of this report rests on, with the commit "
    "the row ran at.",
    (), table, verdict, figure, script=gpu_rows,
    note="Rows from `make validate-gpu` (`python -m experiments.validate_gpu --store docs/store`: not a run.py "
         "command), which models each committed row of docs/gpu/h200_opt13b_b20_p1920_g32.jsonl and "
         "docs/gpu/run_20261204/latency.jsonl again with this checkout's model. Measured: the median decode step "
         "after the warm-up steps (`experiments/latency.py --device cuda`, prompts of random ids). Neither run "
         "recorded its commit: both are 2f67c00 with uncommitted changes (`ran at`; docs/gpu/README.md).\n\nThe "
         "first run is modelled with the census of the code that ran it (docs/gpu/census_2f67c00.json) on "
         "conf/hardware/h200_pcie5_measured.yaml; no census of run_20261204's tree was kept, so its rows are "
         "modelled with the census of the code now on conf/hardware/h200_pcie5_calibrated.yaml (measured by "
         "that run), and the device's own model of the code that ran, written beside the rows at the run "
         "(latency_modelled.jsonl), is shown too.\n\nWhich runtime files changed since each run is what git said when "
         "the rows were written (`as of`); a GPU run of the code now is `bash experiments/gpu_check.sh` on a lent "
         "GPU. The CPU validation (C7, the performance model against this machine) never exposes the link and its "
         "host gathers are small, so these rows are the only check of the model's link and host-gather terms. "
         "The paper machine's profile (conf/hardware/a6000_pcie3.yaml, the modelled C7 section) takes its "
         "per-op launch cost (20 us/op) and its host gather's thread scaling (51 GB/s at 12 threads) from these "
         "H200 runs' host, not from the paper's machine; its link rate derives from the paper's Fig. 18, the rest "
         "is datasheet or assumed (each number's source is a comment in the file).",
    order=75)
