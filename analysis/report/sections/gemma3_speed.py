"""Beyond the paper: Gemma 3's shape in the performance model (one KV head of 256 channels, local layers) beside
SmolLM2's, modelled at the same batch, context and fetch (conf/experiment/gemma3_speed_modelled.yaml)."""

from __future__ import annotations

import pandas as pd

from analysis import columns as C
from analysis import tables as T
from analysis.report.section import Section, needs, num
from analysis.report.sections.c7_modelled import rests_on

PRESET = "gemma3_speed_modelled"
NAMES = {"full": "full (resident)", "offload": "offload", "quant": "INT4", "h2o": "H2O", "infinigen": "InfiniGen"}


def shape_of(row: pd.Series) -> dict:
    """What the model's config says about its K|V: per-token bytes and the local layers' windows."""
    cfg = row["config.model"]
    arch, dtype = cfg["arch"], cfg.get("dtype", "float32")
    elem = 4 if dtype == "float32" else 2
    layers = int(arch["num_hidden_layers"])
    heads = int(arch["num_attention_heads"])
    kv_heads = int(arch.get("num_key_value_heads") or heads)
    head_dim = int(arch.get("head_dim") or int(arch["hidden_size"]) // heads)
    types = arch.get("layer_types") or []
    local = sum(t == "sliding_attention" for t in types) if arch.get("sliding_window") else 0
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype, "local": local,
            "window": arch.get("sliding_window"), "kv_kib": layers * kv_heads * head_dim * 2 * elem / 2**10}


def speed_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per row; a config column that varies among rows of one model and method gets a column of its own
    (analysis/tables.py apart), and `x offload` compares a row with the offload row of its model and task
    parameters."""
    if rows.empty:
        return pd.DataFrame(columns=["model", "method"])
    out = pd.DataFrame({
        "model": rows["model"], "method": rows["method"],
        "ms/token": C.metric(rows, "decode_ms_median"),
        "MiB per step": C.metric(rows, "h2d_bytes_per_token") / 2**20,
        "compute ms": C.metric(rows, "compute_ms"), "speculation ms": C.metric(rows, "speculation_ms"),
        "host gather ms": C.metric(rows, "host_ms"), "exposed link ms": C.metric(rows, "exposed_transfer_ms"),
        "fetch": C.column(rows, "metrics.fractions_source"),
    })
    # the fraction a gathering row attends (modelled from its fetch); other rows' kv_fraction is not modelled
    out.insert(8, "kv_fraction", C.metric(rows, "kv_fraction").where(out["fetch"].notna()))
    extra = T.apart(out, rows, ["model", "method"])  # named in the order of T.varying's columns
    tasks = [name for name, c in zip(extra, T.varying(rows, rows["model"] + " | " + rows["method"]))
             if c.startswith("task_params.")]
    out["_key"] = out[["model", *tasks]].astype(str).agg(" | ".join, axis=1)
    offload = out[out["method"] == "offload"].drop_duplicates("_key").set_index("_key")["ms/token"]
    out["x offload"] = offload.reindex(out["_key"]).to_numpy() / out["ms/token"]
    model_rank = {m: i for i, m in enumerate(C.models_by_size(out["model"]))}
    method_rank = {m: i for i, m in enumerate(NAMES)}
    out = out.assign(_m=out["model"].map(model_rank), _k=out["method"].map(method_rank))
    return out.sort_values(["_m", *extra, "_k"]).drop(columns=["_m", "_k", "_key"]).round(3)


def table(rows: pd.DataFrame) -> pd.DataFrame:
    return speed_rows(rows).reset_index(drop=True)


def verdict(rows: pd.DataFrame) -> list[str]:
    data = speed_rows(rows)
    twice = sorted(set(data.loc[data.duplicated(["model", "method"], keep=False), "model"]))
    if twice:  # the lines compare one row per model and method; the table shows what sets the others apart
        return needs(f"one modelled row per model and method ({', '.join(twice)} have several: see the table)")
    models = [m for m in C.models_by_size(data["model"].unique())
              if {"full", "offload", "infinigen"} <= set(data.loc[data["model"] == m, "method"])]
    if not models:
        return needs(f"modelled rows of full, offload and InfiniGen (`python run.py -m +experiment={PRESET}`)")
    setting = (f"batch {int(C.metric(rows, 'batch_size').iloc[0])}, {int(C.metric(rows, 'prompt_len').iloc[0])} + "
               f"{int(C.metric(rows, 'gen_len').iloc[0])} tokens on {C.column(rows, 'metrics.hardware').iloc[0]}")
    out, lead, moved = [], {}, {}
    for model in models:
        part = data[data["model"] == model].set_index("method")
        s = shape_of(rows[rows["model"] == model].iloc[0])
        local = (f"{s['local']} local layers with a {s['window']}-token window" if s["local"]
                 else "every layer global")
        lead[model] = part.loc["infinigen", "x offload"]
        moved[model] = part.loc["offload", "MiB per step"]
        others = ", ".join(f"over {NAMES[m]} {num(part.loc[m, 'ms/token'] / part.loc['infinigen', 'ms/token'])}x"
                           for m in ("h2o", "quant") if m in part.index)
        out.append(f"{model} ({s['layers']} layers x {s['kv_heads']} KV head(s) x {s['head_dim']}, {s['dtype']}; "
                   f"{local}): K|V {num(s['kv_kib'])} KiB per token; at {setting}, offload moves "
                   f"{moved[model]:,.0f} MiB per step")
        out.append(f"{model}: offload {num(part.loc['offload', 'ms/token'])} ms/token, full resident "
                   f"{num(part.loc['full', 'ms/token'])} ms/token; InfiniGen {num(part.loc['infinigen', 'ms/token'])} "
                   f"ms/token, speed over offload {num(lead[model])}x, {others}; largest term: "
                   f"{largest(part.loc['infinigen'])}")
    if len(models) > 1:
        a, b = models[0], models[-1]
        out.append(f"what the shape does: {b}'s single KV head and local windows leave full offload "
                   f"{num(moved[b] / moved[a])}x the bytes per step of {a}'s ({moved[b]:,.0f} vs {moved[a]:,.0f} "
                   "MiB)")
        out.append(f"so InfiniGen's modelled speed over offload's goes from {num(lead[a])}x ({a}) to "
                   f"{num(lead[b])}x ({b}): with less K|V to move, what the selection costs (speculation, the host "
                   "gather) weighs more")
    return out + rests_on(rows)


def largest(row: pd.Series) -> str:
    terms = {"compute": row["compute ms"], "speculation": row["speculation ms"],
             "host gather (exposed)": row["host gather ms"], "link (exposed)": row["exposed link ms"]}
    name = max(terms, key=terms.get)
    return f"{name} {num(terms[name])} ms"


SECTION = Section(
    "gemma3_speed", "Beyond the paper: Gemma 3's shape, modelled",
    "Gemma-3-270M stores one KV head of 256 channels per layer and 15 of its 18 layers attend only a 512-token "
    "window, so at long contexts it has far less K|V to move than a model of its size whose layers are all global; "
    "the offloading runtime sends a local layer only its window's rows (held pools) or selects within it "
    "(gathering methods). MODELLED on conf/hardware/h200_pcie5.yaml beside SmolLM2-135M at the same batch, context "
    "and fetch (InfiniGen fetching 0.2 of what each row may attend on both: task.fetch_fraction), so the "
    "difference is the shapes'.",
    (f"python run.py -m +experiment={PRESET}",),
    table, verdict,
    note="`MiB per step`: host->device bytes of one decode step (MiB = 2^20 bytes; K|V per token in KiB = 2^10 "
         "bytes); `x offload`: the model's offload ms/token over the "
         "row's. Modelled by infinigen/offload/perf.py on the H200's datasheet profile (conf/hardware/h200_pcie5.yaml: "
         "datasheet peaks and link rate, launch cost and host gather assumed); no GPU measured these. The model was "
         "checked against this CPU (C7. The performance model against this machine: no link is exposed there) and "
         "against two H200 runs of OPT-13B's shape (C7. Speed measured on a GPU), not on Gemma 3 or SmolLM2.",
    order=85)
