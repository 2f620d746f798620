"""The speed figures from modelled rows (task=latency task.timing=modelled: infinigen/offload/perf.py on a hardware
profile) and the model's validation on this machine (experiments/validate_perf.py rows).

Fig. 14: one batch size, each method's decode step split into its terms (compute, speculation, host-side gather,
exposed link), sorted, the speedup over full offload beside each bar; Figs. 15 / 16a / 16b: ms per token against
batch size, prompt length and model size. A configuration whose resident part exceeds the profile's device memory
is drawn hatched (fits=false). Every number here is modelled; the validation panel sets them beside what this
machine measured.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis import columns as C
from analysis import draw as D
from analysis import figures

TERMS = [("compute_ms", "compute", "#4c72b0"), ("speculation_ms", "speculation", "#dd8452"),
         ("host_ms", "host gather (exposed)", "#937860"), ("exposed_transfer_ms", "link (exposed)", "#c44e52")]
PRESETS = ("fig14_15_latency_batch_modelled", "fig16a_latency_prompt_modelled", "fig16b_latency_model_modelled")

WITHIN = 0.25  # the validation's goal: modelled within +-25% of measured


def modelled_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Latency rows of timing=modelled (validation rows aside), with the numbers flattened and a `label`."""
    if df.empty or "task" not in df:
        return pd.DataFrame()
    rows = df[(df["task"] == "latency") & (C.column(df, "metrics.timing") == "modelled")
              & C.column(df, "metrics.validation_point").isna()
              & (C.column(df, "metrics.schedule").fillna("overlapped") == "overlapped")].copy()  # this runtime's
    if rows.empty:
        return rows
    for name in ("batch_size", "prompt_len", "gen_len", "decode_ms_median", "over_gib", "h2d_bytes_per_token",
                 *(t for t, _, _ in TERMS)):
        rows[name] = C.metric(rows, name)
    rows["hardware"] = C.column(rows, "metrics.hardware")
    rows["fits"] = C.column(rows, "metrics.fits").map(lambda v: v is not False)
    rows["source"] = C.column(rows, "metrics.fractions_source")
    runtime = C.column(rows, "task_params.runtime")
    rows["label"] = [m if r in (None, "auto") or pd.isna(r) else f"{m} ({r})" for m, r in zip(rows["method"], runtime)]
    return rows


def _latest(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    return rows.sort_values("_file").drop_duplicates(keys, keep="last") if "_file" in rows else rows


def fig14_16_modelled(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    rows = modelled_rows(df)
    title = "Figs. 14-16 (modelled)"
    cols = ["panel", "label", "model", "hardware", "batch_size", "prompt_len", "decode_ms_median", "speedup", "fits"]
    if rows.empty:
        hint = "\n".join(f"python run.py -m +experiment={p}" for p in PRESETS)
        return D.empty_figure(title, "latency rows with task.timing=modelled", hint), pd.DataFrame(columns=cols)
    hw = rows["hardware"].mode().iloc[0]
    rows = rows[rows["hardware"] == hw]
    fig, axes = D.grid(4, cols=2, size=(5.6, 3.6))
    out = []
    # (a) Fig. 14: the largest batch of the batch sweep, terms stacked
    ax = axes[0]
    sweep = rows[rows["prompt_len"] == rows["prompt_len"].max()]
    sweep = sweep[sweep["model"] == sweep["model"].mode().iloc[0]]
    top = _latest(sweep[sweep["batch_size"] == sweep["batch_size"].max()], ["label"])
    top = top.sort_values("decode_ms_median", ascending=False)
    base = top.loc[top["label"] == "offload", "decode_ms_median"]
    y = np.arange(len(top))
    left = np.zeros(len(top))
    for name, legend, c in TERMS:
        width = top[name].fillna(0).to_numpy()
        ax.barh(y, width, left=left, color=c, label=legend, edgecolor="white")
        left += width
    for i, (_, r) in enumerate(top.iterrows()):
        if not r["fits"]:
            ax.barh(i, r["decode_ms_median"], fill=False, hatch="///", edgecolor="black", linewidth=0)
        note = f"{base.iloc[0] / r['decode_ms_median']:.2f}x" if len(base) else ""
        note += "" if r["fits"] else f"  (+{r['over_gib']:.0f} GiB)"
        ax.text(r["decode_ms_median"], i, f" {note}", va="center", fontsize=7)
    ax.set_yticks(y, top["label"], fontsize=7)
    ax.set_xlabel("decode ms/token (modelled)")
    ax.set_xlim(0, left.max() * 1.35 if len(left) else 1)
    head = top.iloc[0]
    ax.set_title(f"Fig. 14: {head['model']}, batch {int(head['batch_size'])}, {int(head['prompt_len'])}+"
                 f"{int(C.metric(top, 'gen_len').iloc[0])}; speedup vs offload", fontsize=8)
    ax.legend(fontsize=6, loc="upper right")  # the longest bar (and its note) is the bottom one
    out.append(top.assign(panel="fig14", speedup=(base.iloc[0] / top["decode_ms_median"]) if len(base) else np.nan))
    # (b)-(d): lines over batch, prompt length, model
    for ax, (along, fixed, name) in zip(axes[1:], [("batch_size", ["model", "prompt_len"], "Fig. 15"),
                                                    ("prompt_len", ["model", "batch_size"], "Fig. 16a"),
                                                    ("model", ["batch_size", "prompt_len"], "Fig. 16b")]):
        keys = rows[fixed].astype(str).agg(" | ".join, axis=1)
        spread = rows.groupby(keys)[along].transform(lambda s: s.astype(str).nunique())
        keys = keys[spread >= 2]
        if keys.empty:
            D.no_data(ax, f"modelled rows over >= 2 values of {along}", D.run_hint(*PRESETS))
            continue
        data = _latest(rows.loc[keys.index[keys == keys.value_counts().index[0]]], ["label", along])
        order = C.models_by_size(data["model"]) if along == "model" else sorted(data[along].unique())
        x = {v: i for i, v in enumerate(order)}
        for label, part in data.groupby("label"):
            part = part.assign(pos=part[along].map(x)).sort_values("pos")
            ax.plot(part["pos"], part["decode_ms_median"], marker="o", markersize=3, linewidth=1.2, label=label,
                    color=D.color(label.split(" ", 1)[0]))
            misfit = part[~part["fits"]]
            ax.scatter(misfit["pos"], misfit["decode_ms_median"], s=30, marker="x", color="black", linewidths=0.8)
        ax.set_xticks(range(len(order)), [str(int(v)) if along != "model" else str(v) for v in order], fontsize=7)
        ax.set_yscale("log")
        ax.set(xlabel=along.replace("_", " "), ylabel="decode ms/token (modelled, log)")
        head = data.iloc[0]
        ax.set_title(f"{name}: " + ", ".join(f"{k}={head[k] if k == 'model' else int(head[k])}" for k in fixed),
                     fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        base = data[data["label"] == "offload"].set_index(along)["decode_ms_median"]
        out.append(data.assign(panel=name, speedup=data[along].map(base) / data["decode_ms_median"]))
    source = rows["source"].dropna()
    fig.suptitle(f"{title} on {hw}: decode step by the performance model (infinigen/offload/perf.py)", fontsize=10)
    fig.supxlabel("selection fractions: " + (source.iloc[0].split(":")[0] + " rows of "
                                              + source.iloc[0].split("(")[-1].rstrip(")") if len(source) else "none")
                  + "; hatched bar / x: does not fit the device's memory", fontsize=7)
    numbers = pd.concat(out)
    return fig, numbers[cols].reset_index(drop=True)


def validation_rows(df: pd.DataFrame) -> pd.DataFrame:
    """One row per validation point: measured and modelled decode ms/token on this machine, and their ratio."""
    if df.empty or "task" not in df:
        return pd.DataFrame(columns=["point", "batch_size", "prompt_len", "measured_ms", "measured_min",
                                     "measured_max", "modelled_ms", "ratio"])
    points = df[(df["task"] == "latency") & C.column(df, "metrics.validation_point").notna()]
    is_modelled = C.column(points, "metrics.timing") == "modelled"
    rows, measured = points[is_modelled].copy(), points[~is_modelled]
    key = lambda part: list(zip(C.column(part, "metrics.validation_point"), C.metric(part, "batch_size"),  # noqa: E731
                                C.metric(part, "prompt_len")))
    # each measured row keeps its rounds' medians: their range is what this machine's noise allows the ratio
    rounds = dict(zip(key(measured), C.column(measured, "metrics.decode_ms_rounds")))
    spread = [rounds.get(k) if isinstance(rounds.get(k), list) else [np.nan] for k in key(rows)]
    out = pd.DataFrame({
        "point": rows["metrics.validation_point"] if len(rows) else [],
        "batch_size": C.metric(rows, "batch_size"), "prompt_len": C.metric(rows, "prompt_len"),
        "measured_ms": C.metric(rows, "measured_decode_ms"),
        "measured_min": [min(r) for r in spread], "measured_max": [max(r) for r in spread],
        "modelled_ms": C.metric(rows, "decode_ms_median"), "ratio": C.metric(rows, "ratio"),
        **{legend: C.metric(rows, t) for t, legend, _ in TERMS},
    })
    return out.sort_values(["batch_size", "prompt_len", "point"]).reset_index(drop=True)


def speed_validation(df: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    data = validation_rows(df)
    title = "Performance model vs this machine (smollm2-135m, CPU)"
    if data.empty:
        return D.empty_figure(title, "validation rows", "python -m experiments.calibrate && "
                                                      "python -m experiments.validate_perf --results docs/store"), data
    fig = Figure(figsize=(5.2, 4.4), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    values = data[["measured_min", "measured_max", "measured_ms", "modelled_ms"]].to_numpy(dtype=float)
    lo, hi = np.nanmin(values) / 1.3, np.nanmax(values) * 1.3  # log axes: batch 1 and batch 8 both readable
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    ax.fill_between([lo, hi], [0.75 * lo, 0.75 * hi], [1.25 * lo, 1.25 * hi], color="grey", alpha=0.15, label="+-25%")
    for (b, p), part in data.groupby(["batch_size", "prompt_len"]):
        ax.errorbar(part["measured_ms"], part["modelled_ms"], fmt="o", markersize=4, elinewidth=0.8,
                    xerr=[(part["measured_ms"] - part["measured_min"]).fillna(0),
                          (part["measured_max"] - part["measured_ms"]).fillna(0)],
                    label=f"batch {int(b)}, prompt {int(p)}")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="measured decode ms/token (median of rounds; bar: their range)", ylabel="modelled decode ms/token")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return fig, data


def _table(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
    cells = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    return head + "\n".join("| " + " | ".join(cells(v) for v in row) + " |" for row in df.itertuples(index=False))


def claims(df: pd.DataFrame) -> list[str]:
    """Computed verdict lines: the modelled Fig. 14-16 numbers against the paper's claims, and what explains them."""
    rows = modelled_rows(df)
    if rows.empty:
        return []
    _, numbers = fig14_16_modelled(df)
    out = []
    fig14 = numbers[numbers["panel"] == "fig14"]
    if "infinigen" in set(fig14["label"]):
        ig = fig14[fig14["label"] == "infinigen"].iloc[0]
        match = rows[(rows["label"] == "infinigen") & (rows["batch_size"] == ig["batch_size"])
                     & (rows["prompt_len"] == ig["prompt_len"]) & (rows["model"] == ig["model"])]
        r = match.iloc[-1] if len(match) else None
        out.append(f"On this project's runtime (overlapped), InfiniGen over full offload at {ig['model']}, batch "
                   f"{int(ig['batch_size'])}: {ig['speedup']:.2f}x modelled decode ms/token (a finding about this "
                   f"runtime: the paper's numbers are compared on its own runtime above)")
        others = fig14[~fig14["label"].isin(["infinigen", "full"])].set_index("label")["decode_ms_median"]
        if len(others):
            best = others.idxmin()
            out.append(f"InfiniGen vs the fastest other offloading/compressing row ({best}): "
                       f"{others[best] / ig['decode_ms_median']:.2f}x")
        if r is not None:
            terms = {legend: r[t] for t, legend, _ in TERMS}
            out.append("InfiniGen's step there: " + ", ".join(f"{k} {v:.1f} ms" for k, v in terms.items())
                       + f"; the largest term is {max(terms, key=terms.get)}")
    for panel, along in (("Fig. 15", "batch_size"), ("Fig. 16a", "prompt_len"), ("Fig. 16b", "model")):
        part = numbers[(numbers["panel"] == panel) & (numbers["label"] == "infinigen")].dropna(subset=["speedup"])
        if len(part) >= 2:
            order = C.models_by_size(part["model"]) if along == "model" else sorted(part[along])
            part = part.set_index(along).loc[order]
            grows = part["speedup"].is_monotonic_increasing
            out.append(f"{panel}: InfiniGen's decode speedup over offload along {along} "
                       f"{' -> '.join(f'{v:.2f}x' for v in part['speedup'])}: "
                       f"{'grows' if grows else 'does not grow monotonically'} on this project's runtime")
    return out


def section(df: pd.DataFrame) -> str:
    """Markdown for the speed claim: the validation table, the modelled Fig. 14 breakdown and the verdicts."""
    lines = []
    val = validation_rows(df)
    if val.empty:
        lines.append("No validation rows: `python -m experiments.calibrate && python -m experiments.validate_perf "
                     "--results docs/store`.")
    else:
        within = (val["ratio"] - 1).abs() <= 0.25
        lines.append(f"Validation on this machine (smollm2-135m, CPU, calibrated profile): {int(within.sum())} of "
                     f"{len(val)} points within +-25%; worst |modelled / measured - 1| = "
                     f"{(val['ratio'] - 1).abs().max():.2f}.")
        lines.append("")
        lines.append(_table(val.round(3)))
    rows = modelled_rows(df)
    if not rows.empty:
        _, numbers = fig14_16_modelled(df)
        fig14 = numbers[numbers["panel"] == "fig14"].merge(
            rows[["label", "batch_size", "prompt_len", "model", *(t for t, _, _ in TERMS)]],
            on=["label", "batch_size", "prompt_len", "model"], how="left").drop_duplicates("label")
        keep = ["label", "decode_ms_median", *(t for t, _, _ in TERMS), "speedup", "fits"]
        lines += ["", "Modelled Fig. 14 point (every number modelled):", "", _table(fig14[keep].round(2))]
        lines += [""] + [f"- {c}" for c in claims(df)]
    return "\n".join(lines)


def validation_verdict(df: pd.DataFrame, source: str = "") -> list[str]:
    """The model's modelled / measured ratios on this machine, overall and per batch x prompt, and the measured
    side's noise; `source` (e.g. " (measured at f7a4402)") follows the first line's count."""
    val = validation_rows(df)
    if val.empty:
        return ["not computed: no validation rows (python -m experiments.calibrate && "
                "python -m experiments.validate_perf --results docs/store)"]
    within = (val["ratio"] - 1).abs() <= WITHIN
    lines = [f"{int(within.sum())} of {len(val)} points within ±{WITHIN:.0%} of what this CPU measured{source}; "
             f"largest deviation of modelled from measured: {(val['ratio'] - 1).abs().max():.0%}; modelled / "
             f"measured: median {val['ratio'].median():.2f}, range {val['ratio'].min():.2f}-{val['ratio'].max():.2f}"]
    for (b, p), part in val.groupby(["batch_size", "prompt_len"]):
        lines.append(f"batch {int(b)}, prompt {int(p)}: median modelled / measured {part['ratio'].median():.2f} over "
                     f"{len(part)} methods")
    spread = ((val["measured_max"] - val["measured_min"]) / val["measured_ms"]).dropna()
    if len(spread):
        lines.append(f"noise of the measured side: a point's rounds span (max - min) / median = "
                     f"{spread.median():.0%} at the median point, up to {spread.max():.0%}")
    return lines


def fig14_table(df: pd.DataFrame) -> pd.DataFrame:
    """The modelled Fig. 14 point: each method's ms/token, its terms, speedup over offload and whether it fits."""
    rows = modelled_rows(df)
    if rows.empty:
        return pd.DataFrame()
    _, numbers = fig14_16_modelled(df)
    fig14 = numbers[numbers["panel"] == "fig14"]
    terms = rows[["label", "batch_size", "prompt_len", "model", *(t for t, _, _ in TERMS)]]
    out = fig14.merge(terms, on=["label", "batch_size", "prompt_len", "model"], how="left").drop_duplicates("label")
    out = out.rename(columns={"label": "method", "decode_ms_median": "ms/token"})
    return out[["method", "model", "hardware", "batch_size", "prompt_len", "ms/token",
                *(t for t, _, _ in TERMS), "speedup", "fits"]].round(2)


# what `make smoke` and `make figures` draw beside those of analysis/figures/ (the report draws both from docs/store)
FIGURES = {"fig14_16_modelled": fig14_16_modelled}

if __name__ == "__main__":
    figures.main(registry=FIGURES)
