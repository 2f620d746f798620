"""Beyond the paper: what a sim-mode perplexity run costs per method."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from analysis import columns as C
from analysis import draw as D
from analysis import tables as T
from analysis.report.ppl import COMPARED, OTHERS
from analysis.report.section import Section, needs, num


def sim_cost(rows: pd.DataFrame) -> pd.DataFrame:
    """Seconds per ppl window in sim mode (wall time less the model load, over the windows) and the ratio to
    full's on the same task setting."""
    data = C.of_task(rows, "ppl")
    if data.empty:
        return pd.DataFrame(columns=["method", "params", "s / window", "x full"])
    seconds = (pd.to_numeric(data["meta.wall_s"]) - pd.to_numeric(data["meta.load_s"])) / C.metric(data, "windows")
    out = pd.DataFrame({"method": data["method"], "params": T.key_params(data), "s / window": seconds,
                        "threads": pd.to_numeric(C.column(data, "meta.threads")).astype("Int64"),
                        "device": C.column(data, "meta.device")})
    # the same window shape on the same device and thread count: a 1-thread run against a 2-thread full's is
    # no cost ratio
    setting = (C.metric(data, "seq_len").astype(str) + " | " + C.metric(data, "dense_rows").fillna(0).astype(str)
               + " | " + out["device"].astype(str) + " | " + out["threads"].astype(str))
    full = out.loc[out["method"] == "full"].groupby(setting)["s / window"].first()
    out["x full"] = out["s / window"] / setting.map(full)
    return out.sort_values(["x full", "method", "params"]).reset_index(drop=True)


def cost_bars(rows: pd.DataFrame, title: str) -> Figure:
    data = sim_cost(rows)
    fig, axes = D.grid(1, size=(7.5, 3.6))
    data = data.dropna(subset=["x full"]).sort_values("x full")  # a setting without a matched full: no bar
    axes[0].barh(range(len(data)), data["x full"], color=[D.color(m) for m in data["method"]])
    axes[0].set_yticks(range(len(data)), [f"{m} ({p})" if p else m for m, p in zip(data["method"], data["params"])],
                       fontsize=7)
    axes[0].axvline(1.0, color="black", linestyle="--", linewidth=1)
    axes[0].set(xlabel="seconds per window / full's at the same thread count (shared CPU, one run each)",
                ylabel="method setting")
    axes[0].grid(alpha=0.3, axis="x")
    D.titled(fig, title, C.of_task(rows, "ppl"))
    return fig


def cost_verdict(rows: pd.DataFrame) -> list[str]:
    cost = sim_cost(rows)
    if cost.empty or cost["x full"].isna().all():
        return needs("ppl rows of full and the other methods on the same device and thread count")
    parts = cost[cost["method"] != "full"].dropna(subset=["x full"])
    if parts.empty:
        return needs("ppl rows of methods other than full next to full's")
    by = parts.groupby("method")["x full"].median().sort_values()
    tokens = num(C.metric(C.of_task(rows, "ppl"), "seq_len").max(), 5)
    out = [f"sim-mode seconds per {tokens}-token window / full's on the same device and thread count, median over "
           "each method's settings: " + ", ".join(f"{m} {num(x)}x" for m, x in by.items())]
    unmatched = cost[(cost["method"] != "full") & cost["x full"].isna()]
    if not unmatched.empty:
        out.append(f"{len(unmatched)} setting(s) ({', '.join(sorted(set(unmatched['method'])))}) have no full run at "
                   "their thread count: no ratio")
    return out


SECTION = Section(
    "sim_cost", "Beyond the paper: sim-mode cost",
    "What a perplexity run costs per method in sim mode (all rows of a window in one forward), relative to "
    "full attention: wall time less the model load, per window.",
    COMPARED + OTHERS[:3], sim_cost, cost_verdict, lambda rows: cost_bars(rows, "sim-mode cost per window"),
    note="Wall time as the rows record it (meta.wall_s - meta.load_s), one run per setting. The committed "
         "rows ran on a 2-core CPU shared with other jobs, which at times paused them: their ratios say "
         "little about cost. `make bench` measures it in one quiet process (docs/scaling.md).",
    order=150)
