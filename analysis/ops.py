"""The op and host-sync census in the report: the rows experiments/bench_ops.py writes (task `ops`,
metrics.benchmark = "ops"), as the decode table (ops and host syncs per layer per steady decode step through the
offloading runtime, per method, runtime, tiny model, batch and prompt) and the sim table (ops and syncs of one
sim-mode forward per method, model and length).

Only rows of a method's conf/method defaults are shown (`--set` overrides are kept in the store, not tabulated);
a row whose recorded method config differs from conf/method today is stale: counted in the verdict, left out.
Of several rows of one point the newest is shown.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from analysis import columns as C
from infinigen.semantic import semantic_method

ROOT = Path(__file__).resolve().parent.parent
# the paper's rows: their steady decode step must not synchronise the host (tests/test_bench_ops.py, THE GATE)
PAPER_ROWS = (("full", "ideal"), ("full", "auto"), ("offload", "auto"), ("quant", "auto"), ("h2o", "auto"),
              ("infinigen", "auto"))
COMMAND = "make bench-ops && make export WHERE=task=ops && make report"


def is_ops(df: pd.DataFrame) -> pd.Series:
    return C.column(df, "metrics.benchmark") == "ops"


def _today(method: str) -> dict | None:
    path = ROOT / "conf" / "method" / f"{method}.yaml"
    if not path.exists():
        return None
    # resolved as bench_ops builds a method, with no model: InfiniGen's knobs at their value for no family
    root = OmegaConf.create({"method": OmegaConf.load(path), "data_dir": None})
    return semantic_method(OmegaConf.to_container(root, resolve=True)["method"])


def _stale(row: pd.Series) -> bool:
    recorded = row.get("config.method")
    return not isinstance(recorded, dict) or semantic_method(recorded) != _today(row["method"])


def _mode(df: pd.DataFrame, mode: str) -> pd.DataFrame:
    """Rows of one mode at conf/method defaults, the newest per point; stale ones dropped (counted in attrs)."""
    if df.empty:
        return df
    rows = df[is_ops(df) & (C.column(df, "metrics.mode") == mode)]
    rows = rows[C.column(rows, "task_params.overrides").map(lambda o: not o)]
    stale = rows.apply(_stale, axis=1) if not rows.empty else pd.Series(dtype=bool)
    fresh = rows[~stale] if not rows.empty else rows
    if not fresh.empty:
        keys = [k for k in ("method", "model", "task_params.runtime", "task_params.batch_size",
                            "task_params.prompt_len", "task_params.tokens") if k in fresh]
        point = ["|".join(map(str, r)) for r in fresh[keys].itertuples(index=False)]
        newest = [str(t) for t in C.column(fresh, "meta.finished")]
        fresh = fresh.assign(_point=point, _t=newest).sort_values(["_point", "_t"])
        fresh = fresh.drop_duplicates("_point", keep="last").drop(columns=["_point", "_t"])
    fresh = fresh.copy()
    fresh.attrs["stale"] = int(stale.sum()) if len(stale) else 0
    return fresh


def decode_rows(df: pd.DataFrame) -> pd.DataFrame:
    return _mode(df, "decode")


def sim_rows(df: pd.DataFrame) -> pd.DataFrame:
    return _mode(df, "sim")


def _points(rows: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "method": rows["method"], "runtime": C.column(rows, "task_params.runtime"), "model": rows["model"],
        "batch": C.metric(rows, "batch_size").astype(int), "prompt": C.metric(rows, "prompt_len").astype(int),
        "ops": C.metric(rows, "ops_per_layer_step"), "syncs": C.metric(rows, "syncs_per_layer_step"),
        "waits": C.metric(rows, "waits_per_layer_step"), "sync_ops": C.column(rows, "metrics.sync_ops"),
        "sync_sites": C.column(rows, "metrics.sync_sites"),
    })


def _count(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:.2f}"


def _sync_text(counts) -> str:
    if not isinstance(counts, dict) or not counts:
        return "-"
    return ", ".join(f"{k} {_count(v)}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _order(df: pd.DataFrame) -> pd.DataFrame:
    paper = {row: i for i, row in enumerate(PAPER_ROWS)}
    rank = [paper.get((m, r), len(paper)) for m, r in zip(df["method"], df["runtime"])]
    return (df.assign(_paper=rank).sort_values(["_paper", "method", "runtime", "model"], kind="stable")
            .drop(columns="_paper").reset_index(drop=True))


def decode_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, runtime, model): ops and host syncs per layer per steady decode step at each
    batch x prompt, the main thread's waits on the link per layer-step (the most of any point), and the syncs
    per step by op at the point with the most."""
    pts = _points(rows)
    if pts.empty:
        return pd.DataFrame(columns=["method", "runtime", "model"])
    sizes = sorted(set(zip(pts["batch"], pts["prompt"])))
    out = []
    for (method, runtime, model), group in pts.groupby(["method", "runtime", "model"], sort=False):
        at = {(r.batch, r.prompt): r for r in group.itertuples()}
        line = {"method": method, "runtime": runtime, "model": model}
        line |= {f"ops/layer {b} x {p}": round(at[(b, p)].ops, 1) if (b, p) in at else None for b, p in sizes}
        line |= {f"syncs/layer {b} x {p}": round(at[(b, p)].syncs, 2) if (b, p) in at else None for b, p in sizes}
        line["waits/layer"] = round(group["waits"].max(), 2)
        worst = group.sort_values(["syncs", "batch", "prompt"]).iloc[-1]  # of equals, the largest point
        line["syncs per step, by op (point with the most)"] = (
            f"{_sync_text(worst['sync_ops'])} ({worst['batch']} x {worst['prompt']})" if worst["syncs"] > 0 else "-")
        out.append(line)
    return _order(pd.DataFrame(out))


def decode_verdict(rows: pd.DataFrame) -> list[str]:
    pts = _points(rows)
    if pts.empty:
        return [f"not computed: the store has no decode rows of experiments/bench_ops.py (`{COMMAND}`)"]
    worst = pts.groupby(["method", "runtime"])["syncs"].max()
    paper = [(m, r) for m, r in PAPER_ROWS if (m, r) in worst.index]
    syncing = [(m, r) for m, r in paper if worst[(m, r)] > 0]
    name = lambda m, r: f"{m} ({r})" if (m, r) != (m, "auto") else m  # noqa: E731
    if syncing:
        line = ("paper rows whose steady decode step synchronises the host (most syncs per layer-step over the "
                "points): " + ", ".join(f"{name(m, r)} {worst[(m, r)]:.2g}" for m, r in syncing))
        clean = [name(m, r) for m, r in paper if (m, r) not in syncing]
        line += f"; none: {', '.join(clean)}" if clean else ""
    else:
        line = f"no host sync in a steady decode step of any paper row ({', '.join(name(m, r) for m, r in paper)})"
    out = [line]
    ig = pts[(pts["method"] == "infinigen") & (pts["runtime"] == "auto") & (pts["model"] == "tiny-llama-gqa")]
    ops = {(r.batch, r.prompt): r.ops for r in ig.itertuples()}
    if {(1, 512), (1, 2048), (8, 512), (8, 2048)} <= set(ops):
        growth = max(ops[(b, 2048)] / ops[(b, 512)] for b in (1, 8))
        equal = all(ops[(1, p)] == ops[(8, p)] for p in (512, 2048))
        out.append("InfiniGen's ops per layer-step on tiny-llama-gqa: "
                   + ", ".join(f"{b} x {p}: {v:.1f}" for (b, p), v in sorted(ops.items()))
                   + f"; prompt 2048 / 512 up to {growth:.3f}x (gate <= 1.05), batch 8 "
                   + ("equals batch 1" if equal else "differs from batch 1 (gate: equal)"))
    others = worst[[(m, r) not in PAPER_ROWS for m, r in worst.index]]
    others = others[others > 0].sort_values(ascending=False, kind="stable")
    if not others.empty:
        out.append("other methods with host syncs per layer-step: "
                   + ", ".join(f"{name(m, r)} {v:.2g}" for (m, r), v in others.items()))
    if rows.attrs.get("stale"):
        out.append(f"{rows.attrs['stale']} stored point(s) left out: their method config differs from conf/method "
                   f"today (`{COMMAND}`)")
    return out


def sim_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, model): ops and host syncs of one sim forward at each length ("skipped" where the
    benchmark projected the point past its time budget), and the syncs by op at the longest counted length."""
    if rows.empty:
        return pd.DataFrame(columns=["method", "model"])
    pts = pd.DataFrame({
        "method": rows["method"], "model": rows["model"], "tokens": C.metric(rows, "tokens").astype(int),
        "dense": C.metric(rows, "dense_rows").astype(int), "ops": C.metric(rows, "ops"),
        "layers": C.metric(rows, "layers"), "syncs": C.metric(rows, "syncs"),
        "skipped": C.column(rows, "metrics.skipped"), "sync_ops": C.column(rows, "metrics.sync_ops"),
    })
    lengths = sorted(pts["tokens"].unique())
    pts["syncs"] = pts["syncs"] - model_syncs(pts)  # beyond the model's own forward
    out = []
    for (method, model), group in pts.groupby(["method", "model"], sort=True):
        at = {r.tokens: r for r in group.itertuples()}
        counted = group[group["ops"].notna()]
        line = {"method": method, "model": model,
                "layers": int(counted["layers"].iloc[0]) if not counted.empty else None,
                "prompt rows": "half" if (group["dense"] > 0).any() else "0"}
        for kind, label in (("ops", "ops"), ("syncs", "syncs beyond full")):
            for n in lengths:
                r = at.get(n)
                line[f"{label} {n}"] = ("" if r is None else "skipped" if pd.isna(getattr(r, kind))
                                        else f"{int(getattr(r, kind)):,}")
        line["ops per added token and layer"] = _marginal(counted)
        last = counted.sort_values("tokens").iloc[-1] if not counted.empty else None
        line["syncs by op (longest counted)"] = (f"{_sync_text(last['sync_ops'])} ({last['tokens']})"
                                                if last is not None and last["syncs"] > 0 else "-")
        out.append(line)
    return pd.DataFrame(out).sort_values(["model", "method"], kind="stable").reset_index(drop=True)


# ops per added token and layer from which a method's sim forward replays rows one by one (H2O: ~3.8, TOVA: ~3.4,
# infinigen/shared/eviction.py); closed-form methods add none from 1024 to 8192 tokens (rows.chunk_rows: 8 chunks of
# rows), a few chunks' ops below (512 tokens: 4 chunks): < 0.3
PER_ROW = 1.0
# The sim section's text (analysis/report/sections/ops_sim.py shows it): what the table and verdict say
SIM_TEXT = ("A sim-mode forward (perplexity, lm-eval scoring) is one batched pass: a closed-form method dispatches as "
            "many ops at 2048 tokens as at 1024 (sim attention splits a sequence into 8 chunks of rows from 1024 to "
            "8192 tokens, rows.chunk_rows; fewer below, chunks of 1024 rows beyond) and synchronises the host only "
            "where transformers does (once per forward: its packed-sequence check of the position ids, before any "
            "mask function the adapter registers). H2O and TOVA evict in order, so sim mode replays their decoded "
            "rows one by one (infinigen/shared/eviction.py): at most four static-shape ops per row and layer, nothing "
            "read back; on a GPU the replay can run as a captured CUDA graph per block of rows (capture=graph or "
            "compile).")
SIM_NOTE = ("Rows from `make bench-ops` (as above): one `modes.sim_logits` forward of random ids (dense_rows=0; "
            "SnapKV and ShadowKV compress a prompt: half the tokens are theirs) at 512, 1024 and 2048 tokens on "
            "tiny-llama-gqa and on smollm2-135m's shape with random weights (model.random_init=true), every "
            "method's bind (InfiniGen's calibration) run before and not counted. `syncs beyond full`: a "
            "method's host syncs less those of full attention's forward at the same length (the model's own: "
            "transformers' packed-sequence check, once per forward). A point projected (from the growth of the "
            "method's previous lengths) to take longer than "
            "the benchmark's --sim-budget (120 s) on this 2-core machine is skipped and marked so.")


def model_syncs(pts: pd.DataFrame) -> pd.Series:
    """Per point, the syncs of the model's own forward at that (model, length): full attention's count there
    (transformers' packed-sequence check of the position ids, once per forward), 0 where full was not counted."""
    full = pts[pts["method"] == "full"].set_index(["model", "tokens"])["syncs"]
    keys = pd.MultiIndex.from_frame(pts[["model", "tokens"]])
    return pd.Series(full.reindex(keys).fillna(0).to_numpy(), index=pts.index)


def _marginal(counted: pd.DataFrame) -> float | None:
    """Ops per added token and layer between the shortest and the longest counted length."""
    if counted["tokens"].nunique() < 2:
        return None
    lo, hi = counted.loc[counted["tokens"].idxmin()], counted.loc[counted["tokens"].idxmax()]
    return round((hi["ops"] - lo["ops"]) / (hi["tokens"] - lo["tokens"]) / hi["layers"], 2)


def sim_verdict(rows: pd.DataFrame) -> list[str]:
    if rows.empty:
        return [f"not computed: the store has no sim rows of experiments/bench_ops.py (`{COMMAND}`)"]
    pts = pd.DataFrame({"method": rows["method"], "model": rows["model"], "tokens": C.metric(rows, "tokens"),
                        "ops": C.metric(rows, "ops"), "layers": C.metric(rows, "layers"),
                        "syncs": C.metric(rows, "syncs")})
    out = []
    for model, group in pts.groupby("model", sort=False):
        counted = group.dropna(subset=["ops"])
        if counted.empty:
            continue
        hi = counted["tokens"].max()
        slope = {m: _marginal(g) for m, g in counted.groupby("method")}
        looping = sorted((m for m, v in slope.items() if v is not None and v >= PER_ROW), key=lambda m: -slope[m])
        full = counted[(counted["method"] == "full") & (counted["tokens"] == hi)]
        line = f"{model}: "
        if not full.empty:
            line += (f"full attention dispatches {int(full['ops'].iloc[0]):,} ops at {int(hi)} tokens, whatever the "
                     "length; ")
        layers = int(counted["layers"].max())
        line += ("row-by-row replays, ops per added token and layer (per decoded row over the model's "
                 f"{layers} layers): " + ", ".join(f"{m} {slope[m]:.3g} ({slope[m] * layers:.3g})" for m in looping)
                 if looping else "no method replays rows one by one")
        chunked = [m for m, v in slope.items() if v is not None and 0 < v < PER_ROW]
        if chunked:
            line += f"; {len(chunked)} more grow by sim attention's row chunks (< {PER_ROW:g} op per token and layer)"
        long = counted[counted["tokens"] >= 1024]
        ratio = {m: g.loc[g["tokens"].idxmax(), "ops"] / g.loc[g["tokens"].idxmin(), "ops"]
                 for m, g in long.groupby("method") if m not in looping and g["tokens"].nunique() > 1}
        if ratio:
            top = max(ratio, key=ratio.get)
            line += (f"; the {len(ratio)} others' ops at {int(long['tokens'].max())} / {int(long['tokens'].min())} "
                     f"tokens: at most {ratio[top]:.3g}x" + (f" ({top})" if ratio[top] > 1 else ""))
        own = int(counted.loc[counted["method"] == "full", "syncs"].max()) if (counted["method"] == "full").any() else 0
        beyond = (counted["syncs"] - model_syncs(counted)).groupby(counted["method"]).max()
        extra = beyond[beyond > 0].sort_values(ascending=False, kind="stable")
        line += (f"; host syncs per forward beyond full attention's ({own}: transformers' packed-sequence check): "
                 + ("0 for every method" if extra.empty else ", ".join(f"{m} {int(v):,}" for m, v in extra.items())))
        skipped = int(group["ops"].isna().sum())
        if skipped:
            line += f"; {skipped} point(s) skipped (projected past the benchmark's time budget)"
        out.append(line)
    if rows.attrs.get("stale"):
        out.append(f"{rows.attrs['stale']} stored point(s) left out: their method config differs from conf/method "
                   f"today (`{COMMAND}`)")
    return out or [f"not computed: no counted sim point (`{COMMAND}`)"]
