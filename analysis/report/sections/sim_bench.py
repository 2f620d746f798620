"""Beyond the paper: what each method's sim forward costs against full attention's, as `make bench` measured it
(experiments/bench_sim.py --results rows)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import like
from analysis import tables as T
from analysis.report.section import Section, needs, num

# issue 70's goal: each budget method's sim within 1.3x of full's (a capped pool within 2x), full's within 1.05x of
# the model's own SDPA forward
GOAL, CAPPED_GOAL, FULL_GOAL = 1.3, 2.0, 1.05
METHODS = "--methods full infinigen infinigen_reference h2o h2o_reference oracle quest"
CAPPED = " ".join(f"--variant infinigen:capacity=0.8,eviction={p}" for p in ("counter", "lru", "fifo"))
# what the committed rows ran (a capped pool replays its evictions row by row: at 2,048 tokens only)
COMMANDS = (f"python experiments/bench_sim.py {METHODS} {CAPPED} --tokens 2048 --scaling --repeats 1 --results docs/store",
            f"python experiments/bench_sim.py {METHODS} --tokens 8192 --scaling --repeats 1 --results docs/store",
            f"python experiments/bench_sim.py {METHODS} {CAPPED} --model gemma3-270m --tokens 2048 --scaling --repeats 1 "
            "--results docs/store")


LM_EVAL = ("python -m experiments.bench_lm_eval --hf-batch-sizes 16 --threads 2 --results docs/store  "
           "# make bench-lm-eval with lm-eval's best batch of the full sweep")
HF_GOAL = 1.0  # the harness's full against lm-eval's own HF backend at its best batch


def bench_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of make bench (sim) and make bench-lm-eval (lm_eval_speed)."""
    return rows[C.column(rows, "metrics.benchmark").isin(["sim", "lm_eval_speed"])]


def nested(row: pd.Series, name: str) -> dict:
    """A dict-valued metric, whether the frame kept it whole or flattened it into `name.<key>` columns."""
    if isinstance(row.get(name), dict):
        return row[name]
    return {c.removeprefix(f"{name}."): row[c] for c in row.index if c.startswith(f"{name}.") and pd.notna(row[c])}


def lm_eval_lines(rows: pd.DataFrame) -> list[str]:
    """make bench-lm-eval's comparisons: the harness's full against lm-eval's HF backend, each method against the
    harness's full, and the Fig. 11 preset's minutes per point."""
    data = rows[C.column(rows, "metrics.benchmark") == "lm_eval_speed"]
    if data.empty:
        return []
    data = data.assign(_order=(C.column(data, "metrics.kind") == "fig11").astype(int))
    out = []
    for _, r in data.sort_values(["model", "_order", "metrics.shots"]).iterrows():
        where = f"{r['meta.threads']} threads, commit {like.short_commit(r['meta.git_commit'])}"
        if r["metrics.kind"] == "piqa":
            methods = nested(r, "metrics.x_full")
            ratio = float(r["metrics.x_hf"])
            out.append(f"{r['model']}, lm-eval {r['metrics.task']} {int(r['metrics.docs'])} docs, "
                       f"{int(r['metrics.shots'])}-shot ({where}): the harness's full {num(r['metrics.harness_s'])} s, "
                       f"lm-eval's HF backend at batch {int(r['metrics.hf_batch'])} {num(r['metrics.hf_s'])} s: "
                       f"{num(ratio)}x (goal <= {HF_GOAL}x: {'met' if ratio <= HF_GOAL else 'not met'}); per-doc acc the "
                       f"same on {int(r['metrics.same_docs'])} of {int(r['metrics.compared_docs'])} docs"
                       + "".join(f"; {m} {num(float(x))}x the harness's full (goal <= {GOAL}x: "
                                 f"{'met' if float(x) <= GOAL else 'not met'})" for m, x in sorted(methods.items())))
        elif r["metrics.kind"] == "fig11":
            minutes = nested(r, "metrics.minutes")
            out.append(f"{r['model']}, the Fig. 11 preset's wall time per point ({int(r['metrics.shots'])}-shot, "
                       f"from each task's seconds per doc on its first {int(r['metrics.docs_timed'])} docs; {where}): "
                       + ", ".join(f"{p} {num(float(m))} min" for p, m in minutes.items()))
    return out


def goal(label: str) -> float:
    return FULL_GOAL if label == "full" else CAPPED_GOAL if "capacity=" in label else GOAL


def bench_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per model, length and label: seconds, over full's sim and over the model's SDPA forward in the same run, and
    the goal it is held to."""
    data = rows[C.column(rows, "metrics.benchmark") == "sim"]
    if data.empty:
        return pd.DataFrame(columns=["model", "tokens", "label", "seconds", "x full", "x sdpa", "goal (x full; full: x sdpa)"])
    data = data[C.column(data, "metrics.skipped").isna()] if "metrics.skipped" in data else data
    out = pd.DataFrame({"model": data["model"], "tokens": C.metric(data, "tokens").astype(int),
                        "label": C.column(data, "metrics.label").astype(str),
                        "seconds": C.metric(data, "seconds").round(2), "x full": C.metric(data, "x_full"),
                        "x sdpa": C.metric(data, "x_sdpa"), "kv_fraction": C.metric(data, "kv_fraction").round(4),
                        "threads": C.column(data, "meta.threads"),
                        "commit": C.column(data, "meta.git_commit").map(like.short_commit)})
    out["goal (x full; full: x sdpa)"] = [None if label.startswith("model ") else goal(label) for label in out["label"]]
    rank = {m: i for i, m in enumerate(C.models_by_size(out["model"]))}
    return (out.assign(_rank=out["model"].map(rank)).sort_values(["_rank", "tokens", "x full", "label"])
            .drop(columns="_rank").reset_index(drop=True))


def bench_lines(rows: pd.DataFrame) -> list[str]:
    """Per model and length: each label's sim seconds over full's in the same run, met or not against its goal."""
    data = bench_table(rows)
    out = []
    for (model, tokens), part in data.groupby(["model", "tokens"], sort=False):
        full = part[part["label"] == "full"]
        methods = part[~part["label"].isin(["full", "model sdpa", "model eager"])].dropna(subset=["x full"])
        if full.empty or methods.empty:
            continue
        missed = [r for _, r in methods.iterrows() if r["x full"] > r["goal (x full; full: x sdpa)"]]
        cells = ", ".join(f"{r['label']} {num(r['x full'])}x" for _, r in methods.iterrows())
        sdpa = full["x sdpa"].iloc[0]
        out.append(f"{model}, {tokens} tokens ({full['threads'].iloc[0]} threads, commit {full['commit'].iloc[0]}): sim "
                   f"seconds over full's in the same run: {cells}; full {num(sdpa)}x the model's SDPA forward; goal "
                   f"<= {GOAL}x (capped pool <= {CAPPED_GOAL}x): "
                   + ("met by every label" if not missed else
                      f"met by {len(methods) - len(missed)} of {len(methods)}, not by "
                      + ", ".join(r["label"] for r in missed)))
    return out


def bench_verdict(rows: pd.DataFrame) -> list[str]:
    return bench_lines(rows) + lm_eval_lines(rows) or needs("sim benchmark rows (" + ", ".join(f"`{c}`" for c in COMMANDS) + ")")


def bench_block(rows: pd.DataFrame) -> str:
    """The lines README and docs/scaling.md show, from the same rows."""
    lines = bench_lines(bench_rows(rows)) + lm_eval_lines(bench_rows(rows)) if not rows.empty else []
    if not lines:
        return f"No sim benchmark rows in docs/store yet: `{COMMANDS[0]}` (docs/results.md), then `make report`.\n"
    return "; ".join(lines) + " (measured here; generated by `make report` from docs/store).\n"


SECTION = Section(
    "sim_bench", "Beyond the paper: sim-mode cost per method, measured in one process",
    "Each budget method's sim forward (one teacher-forced pass, per-row keep decisions) costs at most 1.3x full "
    "attention's (a capped pool 2x), and full's at most 1.05x the model's own SDPA forward (issue 70's goal).",
    (), bench_table, bench_verdict, script=bench_rows,
    note="Rows from experiments/bench_sim.py and experiments/bench_lm_eval.py with `--results docs/store` (not run.py "
         "commands: " + ", ".join(f"`{c}`" for c in (*COMMANDS, LM_EVAL)) + "): each label's median seconds of `modes.sim_logits` over WikiText-2's first tokens, and its "
         "ratio to `full`'s sim forward and to the model's own SDPA forward measured in the same process, on an "
         "otherwise idle machine. A label's goal: full 1.05x SDPA; a capped pool (capacity=0.8) 2x full; every "
         "other 1.3x full. lm-eval: the harness's full at most lm-eval's own HF backend at its best batch (1.0x), "
         "each method at most 1.3x the harness's full.",
    order=151, readme=bench_block)
