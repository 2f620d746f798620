"""`make figures` on a synthetic results store: every figure (png, pdf, csv) is written, with the numbers it
was given; on an empty store every figure still comes out, naming the command that fills it."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from analysis import draw, figures, store, tables
from analysis.figures.fig17 import ablation_rows

H2O = [0.25, 0.125, 0.0625, 0.03125]
BITS = [8, 4, 2, 1]
PAIRS = [(5.0, 0.2), (7.0, 0.2), (7.0, 0.6), (7.0, 0.8)]
SPECULATE = ("previous", "block_input", "after_attention", "current")
INFINIGEN = {"alpha": 4.0, "partial_ratio": 0.2, "budget": 0.2, "capacity": 1.0, "eviction": "counter",
             "skew": True, "skip_layers": 1, "calib_data_dir": "/data"}


def run(model, method, task, params, task_params, results):
    """One run in the runner's row schema: a config hash and one row per metrics dict."""
    body = {"model": model, "method": method, "task": task, "method_params": {"name": method, **params},
            "task_params": {"name": task, **task_params}}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    meta = {"device": "cpu"}
    return digest, [body | {"config_hash": digest, "metrics": m, "meta": meta, "config": {}} for m in results]


def stats(kv, recall=None):
    out = {"kv_fraction": kv, "density": kv, "retain": 1 - math.sqrt(1 - min(kv, 1))}
    return out | ({"recall": recall} if recall is not None else {})


def lm_eval_run(method, params, kv, tasks, limit, bonus=0.0):
    task_params = {"tasks": list(tasks), "num_fewshot": 5, "limit": limit, "protocol": "paper"}
    acc = 0.55 + 0.2 * kv + bonus
    return run("smollm2-135m", method, "lm_eval", params, task_params, [
        {"task": t, "acc": acc, "acc_norm": acc, "acc_stderr": 0.03, "n": limit, "num_fewshot": 5, "limit": limit,
         "protocol": "paper", "kv_fraction": kv, "stats": stats(kv, 0.9)} for t in tasks])


def lm_eval_runs():
    fig11 = [("full", {}, 1.0)]
    fig11 += [("h2o", {"heavy": r, "recent": r, "gqa_reduce": "sum"}, 2 * r) for r in H2O]
    fig11 += [("quant", {"bits": b, "group_size": 64}, 1.0) for b in BITS]  # attends all, smaller entries
    fig11 += [("infinigen", INFINIGEN | {"alpha": a, "budget": b}, b * 0.7) for a, b in PAIRS]
    runs = [lm_eval_run(m, p, kv, ("copa", "piqa"), 20) for m, p, kv in fig11]
    five = ("copa", "openbookqa", "winogrande", "piqa", "rte")
    runs.append(lm_eval_run("full", {}, 1.0, five, 8))
    for skew in (True, False):
        params = INFINIGEN | {"alpha": 99.0, "partial_ratio": 0.1, "skew": skew}
        runs.append(lm_eval_run("infinigen", params, 0.2, five, 8, bonus=0.02 if skew else 0.0))
    return runs


def ppl_runs():
    runs = []
    chunks = lambda base: {str(p): base + 0.1 * i for i, p in enumerate(range(0, 2048, 256))}  # noqa: E731
    for method, params, base in [("full", {}, 3.0), ("h2o", {"heavy": 0.01875, "recent": 0.01875}, 3.4),
                                 ("infinigen", INFINIGEN | {"alpha": 5.2}, 3.05)]:
        kv = 1.0 if method == "full" else 0.2
        runs.append(run("smollm2-135m", method, "ppl", params, {"dataset": "wikitext2", "seq_len": 2048},
                        [{"ppl": math.exp(base), "nll": base, "nll_by_chunk": chunks(base), "kv_fraction": kv,
                          "stats": stats(kv, None if method == "full" else 0.85)}]))
    for dataset in ("wikitext2", "ptb"):
        for capacity, eviction, ppl in [(1.0, "counter", 20.0), (0.8, "counter", 20.5), (0.8, "lru", 21.0),
                                        (0.8, "fifo", 23.0)]:
            params = INFINIGEN | {"alpha": 5.0, "capacity": capacity, "eviction": eviction}
            runs.append(run("smollm2-135m", "infinigen", "ppl", params, {"dataset": dataset, "seq_len": 1024},
                            [{"ppl": ppl, "kv_fraction": 0.2, "stats": stats(0.2)}]))
    # Fig. 17: the alpha sweep (partial .2) and the partial sweep (alpha 4) share one config, as in the presets
    sweeps = {(float(a), 0.2) for a in range(1, 10)} | {(4.0, p) for p in (0.1, 0.2, 0.4, 0.6, 0.8, 1.0)}
    for alpha, partial in sorted(sweeps):
        runs.append(run("smollm2-135m", "infinigen", "ppl", INFINIGEN | {"alpha": alpha, "partial_ratio": partial},
                        {"dataset": "wikitext2", "seq_len": 1024, "max_windows": 1},
                        [{"ppl": 20 + 3 / alpha + 0.5 / partial, "kv_fraction": 0.02 * alpha,
                          "stats": stats(0.02 * alpha)}]))
    # Fig. 13's smoke preset: skew on/off at a fixed budget, full alongside, one 1024-token window
    shape = {"dataset": "wikitext2", "seq_len": 1024, "max_windows": 1}
    runs.append(run("smollm2-135m", "full", "ppl", {}, shape, [{"ppl": 30.0, "kv_fraction": 1.0}]))
    for skew, ppl, recall in ((True, 31.0, 0.9), (False, 35.0, 0.6)):
        params = INFINIGEN | {"alpha": 99.0, "partial_ratio": 0.1, "skew": skew}
        runs.append(run("smollm2-135m", "infinigen", "ppl", params, shape,
                        [{"ppl": ppl, "kv_fraction": 0.2, "stats": stats(0.2, recall)}]))
    # the speculation-input ablation: two budgets per option, the oracle and full on the same windows
    shape = {"dataset": "wikitext2", "seq_len": 2048, "max_windows": 8}
    runs.append(run("smollm2-135m", "full", "ppl", {}, shape, [{"ppl": 19.0}]))
    for budget in (0.1, 0.2):
        runs.append(run("smollm2-135m", "oracle", "ppl", {"alpha": math.inf, "budget": budget, "skip_layers": 2}, shape,
                        [{"ppl": 19.5 + 2 * (0.2 - budget), "kv_fraction": budget + 0.05,
                          "stats": stats(budget + 0.05, 0.9)}]))
        for i, option in enumerate(SPECULATE):
            params = INFINIGEN | {"alpha": 8.0, "budget": budget, "skip_layers": 2, "speculate_from": option}
            kv = budget + 0.06
            runs.append(run("smollm2-135m", "infinigen", "ppl", params, shape,
                            [{"ppl": 21.0 - 0.3 * i, "kv_fraction": kv, "stats": stats(kv, 0.8)}]))
    return runs


def latency_runs():
    methods = [("offload", {}), ("quant", {"bits": 4, "group_size": 64}), ("h2o", {"heavy": 0.1, "recent": 0.1}),
               ("infinigen", INFINIGEN)]
    shapes = [("smollm2-135m", b, 384) for b in (1, 2, 4)] + [("smollm2-135m", 1, p) for p in (896, 1408, 1920)]
    shapes += [("tiny-llama", 1, 384), ("tiny-llama-gqa", 1, 384)]
    runs = []
    for model, batch, prompt in shapes:
        for i, (method, params) in enumerate(methods):
            metrics = {"decode_ms_median": 10.0 * batch * (1 + i) + prompt / 100, "prefill_s": prompt / 1000,
                       "tokens_per_s": batch * 1000 / (10.0 * (1 + i)), "h2d_bytes_per_token": 2**20 * (4 - i),
                       "batch_size": batch, "prompt_len": prompt}
            if model == "smollm2-135m" and prompt == 384:  # a CPU run: the link-modelled step is what is plotted
                metrics["modelled_decode_ms_per_token"] = metrics["decode_ms_median"] + 100.0
            shape = {"batch_size": batch, "prompt_len": prompt, "gen_len": 16}
            runs.append(run(model, method, "latency", params, shape, [metrics]))
    for alpha in (1.0, 4.0, 9.0):
        runs.append(run("smollm2-135m", "infinigen", "latency", INFINIGEN | {"alpha": alpha},
                        {"batch_size": 1, "prompt_len": 384, "gen_len": 16},
                        [{"decode_ms_median": 20 + alpha, "modelled_decode_ms_per_token": 120 + alpha,
                          "batch_size": 1, "prompt_len": 384}]))
    return runs


NEEDLE_LENGTHS, NEEDLE_DEPTHS = [1024, 2048], [0.0, 0.5, 1.0]


def needle_runs():
    """full finds every key; streaming only a needle at depth 1 (inside its window)."""
    runs = []
    for method, params in [("full", {}), ("streaming", {"sinks": 4, "recent": 0.2})]:
        cells = [{"length": n, "depth": d, "n": 2, "accuracy": 1.0 if method == "full" or d == 1.0 else 0.0,
                  "loglik": -0.1 if method == "full" or d == 1.0 else -9.0}
                 for n in NEEDLE_LENGTHS for d in NEEDLE_DEPTHS]
        metrics = {"accuracy": sum(c["accuracy"] for c in cells) / len(cells), "cells": cells}
        runs.append(run("smollm2-135m", method, "needle", params,
                        {"lengths": NEEDLE_LENGTHS, "depths": NEEDLE_DEPTHS, "seeds": 2}, [metrics]))
    return runs


def test_needle_heatmap_cells(synthetic):
    _, numbers = figures.needle_heatmap(store.load(synthetic))
    assert len(numbers) == 2 * len(NEEDLE_LENGTHS) * len(NEEDLE_DEPTHS)
    streaming = numbers[numbers["setting"].str.startswith("streaming")]
    assert set(streaming[streaming["depth"] == 1.0]["accuracy"]) == {1.0}
    assert set(streaming[streaming["depth"] < 1.0]["accuracy"]) == {0.0}
    assert set(numbers[numbers["setting"] == "full"]["accuracy"]) == {1.0}


RULER_TASKS, RULER_LENGTHS = ["niah_single_1", "ruler_cwe"], [1024, 2048]


def ruler_runs():
    """full does niah_single_1 and fails ruler_cwe (uninformative cells); streaming finds half the needles."""
    runs = []
    for method, params, kv, hit in [("full", {}, 1.0, 1.0), ("streaming", {"sinks": 4, "recent": 0.2}, 0.2, 0.5)]:
        rows = [{"task": t, "benchmark": "ruler", "length": n, "score": hit if t == "niah_single_1" else 0.0,
                 "n": 2, "kv_fraction": kv, "stats": stats(kv)} for t in RULER_TASKS for n in RULER_LENGTHS]
        runs.append(run("smollm2-135m", method, "lm_eval", params,
                        {"tasks": RULER_TASKS, "max_seq_lengths": RULER_LENGTHS, "limit": 2}, rows))
    return runs


def test_ruler_heatmap_cells(synthetic):
    _, numbers = figures.ruler_heatmap(store.load(synthetic))
    assert len(numbers) == 2 * len(RULER_TASKS) * len(RULER_LENGTHS)
    niah = numbers[numbers["task"] == "niah_single_1"].set_index("setting")
    assert set(niah.loc["full", "score"]) == {1.0} and niah["informative"].all()
    assert set(niah.filter(like="streaming", axis=0)["score"]) == {0.5}
    assert set(niah.filter(like="streaming", axis=0)["kv_fraction"]) == {0.2}
    assert not numbers[numbers["task"] == "ruler_cwe"]["informative"].any()  # full scores 0: no verdict


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    for digest, rows in lm_eval_runs() + ppl_runs() + latency_runs() + needle_runs() + ruler_runs():
        store.append_rows(results, digest, rows)
    return results


def test_every_figure_from_a_synthetic_store(synthetic, tmp_path, capsys):
    written = figures.main(["--results", str(synthetic), "--out", str(tmp_path)])
    assert "without data" not in capsys.readouterr().out  # every panel drew something
    for name in figures.FIGURES:
        for ext in ("png", "pdf", "csv"):
            path = tmp_path / f"{name}.{ext}"
            assert path in written and path.stat().st_size > 0, path
        assert len(pd.read_csv(tmp_path / f"{name}.csv")) > 0, f"{name} plotted nothing from a full store"


def test_fig11_plots_measured_kv_fraction(synthetic):
    fig, numbers = figures.fig11_accuracy(store.load(synthetic))
    h2o = numbers[numbers["method"] == "h2o"]
    # the x of a point is its measured kv_fraction (here 2 * heavy), not the nominal budget
    assert sorted(h2o["kv_pct"].unique()) == pytest.approx(sorted(200 * r for r in H2O))
    # quantisation attends every entry (kv_fraction 1) in entries of bits/16 the size
    quant = numbers[numbers["method"] == "quant"]
    assert sorted(quant["kv_pct"].unique()) == pytest.approx([100 * b / 16 for b in sorted(BITS)])
    assert set(numbers["panel"].str.split(" / ").str[1]) == {"copa", "piqa", "openbookqa", "winogrande", "rte"}
    # Fig. 13's runs (other limit) get their own panels; there the two skew settings are two named curves
    copa = numbers[numbers["panel"].str.startswith("smollm2-135m / copa / 5-shot, 8 docs")]
    assert set(copa["curve"]) == {"full", "infinigen (skew=True)", "infinigen (skew=False)"}
    pairs = numbers[numbers["panel"].str.contains("20 docs") & (numbers["method"] == "infinigen")]
    assert set(pairs["curve"]) == {"infinigen"} and len(pairs) == 2 * len(PAIRS)
    # every point's error bar: the 95% interval of its accuracy, 1.96 x lm-eval's stderr, in points
    assert numbers["ci_pct"].to_numpy() == pytest.approx(100 * 1.96 * 0.03)
    bars = [c for ax in fig.axes for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert bars, "no error bars drawn"


def test_two_sweeps_of_one_task_setting_are_two_curves(synthetic, tmp_path):
    """An alpha sweep around the recommended setting beside the paper's, on the same windows: two named curves."""
    shutil.copytree(synthetic, tmp_path / "store")
    for alpha in (1.0, 5.0, 9.0):
        params = INFINIGEN | {"alpha": alpha, "partial_ratio": 0.5, "skip_layers": 2}
        digest, rows = run("smollm2-135m", "infinigen", "ppl", params,
                           {"dataset": "wikitext2", "seq_len": 1024, "max_windows": 1},
                           [{"ppl": 18 + 1 / alpha, "kv_fraction": 0.03 * alpha, "stats": stats(0.03 * alpha)}])
        store.append_rows(tmp_path / "store", digest, rows)
    rows = ablation_rows(store.load(tmp_path / "store"), "ppl", "alpha")
    assert set(rows["curve"]) == {"smollm2-135m / wikitext2 / seq 1024 (partial_ratio=0.2, skip_layers=1)",
                                  "smollm2-135m / wikitext2 / seq 1024 (partial_ratio=0.5, skip_layers=2)"}


def test_fig12_chunks_and_fig13_pairs(synthetic):
    df = store.load(synthetic)
    _, nll = figures.fig12_ppl_position(df)
    assert set(nll["method"]) == {"full", "h2o", "infinigen"}
    assert sorted(nll["position"].unique()) == list(range(0, 2048, 256))
    assert nll.loc[(nll["method"] == "h2o") & (nll["position"] == 256), "nll"].item() == pytest.approx(3.5)
    _, numbers = figures.fig13_skew(df)
    bars = numbers[numbers["metric"] == "acc_pct"]
    assert set(bars["bar"]) == {"full", "infinigen (skew)", "infinigen (no skew)"}
    assert set(bars["task"]) == {"copa", "openbookqa", "winogrande", "piqa", "rte"}
    # full is only compared on the tasks the pair ran, at the same shots
    assert len(bars) == 15
    # the smoke preset's ppl rows: perplexity of the three, speculation recall of the two InfiniGen runs
    ppl = numbers[numbers["metric"] == "ppl"].set_index("bar")["value"]
    assert ppl.to_dict() == {"full": 30.0, "infinigen (no skew)": 35.0, "infinigen (skew)": 31.0}
    recall = numbers[numbers["metric"] == "recall"].set_index("bar")["value"]
    assert recall.to_dict() == {"infinigen (no skew)": 0.6, "infinigen (skew)": 0.9}


def test_fig13_speculation_options_side_by_side(synthetic):
    _, numbers = figures.fig13_speculation(store.load(synthetic))
    assert set(numbers["panel"]) == {"smollm2-135m / wikitext2 / 8 x 2048"}
    curves = {f"infinigen (speculate_from={o})" for o in SPECULATE} | {"oracle", "full"}
    assert set(numbers["curve"]) == curves
    assert len(numbers) == 2 * len(SPECULATE) + 2 + 1  # the Fig. 17 sweeps (one option, 1 window) are left out
    block = numbers[numbers["curve"] == "infinigen (speculate_from=block_input)"].sort_values("kv_pct")
    assert block["kv_pct"].tolist() == pytest.approx([16.0, 26.0]) and block["ppl"].tolist() == [20.7, 20.7]


def test_latency_ablation_and_eviction_numbers(synthetic):
    df = store.load(synthetic)
    _, lat = figures.fig14_16_latency(df)
    assert set(lat["panel"]) == {"vs batch_size", "vs prompt_len", "vs model", "h2d bytes per token"}
    batch = lat[lat["panel"] == "vs batch_size"]
    assert sorted(batch["batch_size"].unique()) == [1, 2, 4]
    # the alpha-ablation runs at batch 1 are no batch sweep: not drawn there
    assert set(batch["curve"]) == {"offload", "quant (bits=4)", "h2o (heavy=0.1, recent=0.1)",
                                   "infinigen (alpha=4, budget=0.2)"} and len(batch) == 12
    assert (batch["metric"] == "modelled_decode_ms_per_token").all()
    offload = batch[batch["curve"] == "offload"].sort_values("batch_size")
    assert offload["value"].tolist() == pytest.approx([113.84, 123.84, 143.84])
    prompt = lat[lat["panel"] == "vs prompt_len"]
    assert set(prompt.loc[prompt["prompt_len"] > 384, "metric"]) == {"decode_ms_median"}
    _, abl = figures.fig17_ablation(df)
    acc = abl[abl["panel"] == "accuracy vs alpha"]
    assert sorted(acc["alpha"]) == list(range(1, 10)) and (acc["metric"] == "ppl").all()
    assert len(abl[abl["panel"] == "accuracy vs partial_ratio"]) == 6
    latency = abl[abl["panel"] == "latency vs alpha"].sort_values("alpha")
    # measured: the step's wall time (decode_ms_median), never measured compute + a modelled link
    assert latency["alpha"].tolist() == [1, 4, 9] and latency["value"].tolist() == [21, 24, 29]
    assert (latency["metric"] == "decode_ms_median").all()
    _, table = figures.table2_eviction(df)
    assert len(table) == 8
    assert table.loc[table["pool"] == "pool 80%, fifo", "ppl"].tolist() == [23.0, 23.0]


def test_empty_store_still_writes_every_figure_and_reports_its_empty_panels(tmp_path, capsys):
    written = figures.main(["--results", str(tmp_path / "nothing"), "--out", str(tmp_path / "figs")])
    assert len(written) == 3 * len(figures.FIGURES)
    assert "panels without data yet" in capsys.readouterr().out  # a png cannot be grepped: make smoke says it
    for name in figures.FIGURES:
        assert (tmp_path / "figs" / f"{name}.png").stat().st_size > 0
        assert (tmp_path / "figs" / f"{name}.pdf").stat().st_size > 0
        assert pd.read_csv(tmp_path / "figs" / f"{name}.csv").empty


def test_empty_figures_name_the_preset_to_run():
    for name, build in figures.FIGURES.items():
        fig, _ = build(pd.DataFrame())
        assert figures.panels_without_data(fig), name
        text = "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)
        assert "python run.py -m +experiment=" in text and "_smoke" in text, name


@pytest.mark.parametrize("table", list(tables.TABLES))
def test_markdown_tables(synthetic, table, capsys):
    tables.main(["--results", str(synthetic), "--table", table])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| model | method |" if table != "paired" else "| model | task | method |")
    assert set(out[1]) <= {"|", "-", ":", " "}
    assert len(out) > 3


def test_accuracy_table_has_one_column_per_task(synthetic):
    out = tables.table(store.load(synthetic), "accuracy")
    five = ["copa", "openbookqa", "piqa", "rte", "winogrande"]
    assert set(five) <= set(out.columns) and "mean acc" in out
    full8 = out[(out["method"] == "full") & (out["limit"] == "8")].iloc[0]
    assert full8["mean acc"] == pytest.approx(0.75) and full8["kv_fraction"] == 1.0
    assert len(out) == len(out[["method", "params", "limit"]].drop_duplicates())  # one line per setting


def tick_label_overlaps(fig) -> list[tuple[str, str]]:
    """Pairs of shown, non-empty tick labels of `fig` whose rendered bounding boxes intersect: along one axis, or
    of two panels. (An x and a y label of one panel may share a corner: the tick padding keeps their glyphs
    apart; their boxes, which include the font's ascent and descent, can touch there.)"""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    def drawn(ax, axis, label) -> bool:  # get_ticklabels also holds the locator's ticks outside the view
        lo, hi = sorted(axis.get_view_interval())
        at = label.get_position()[0 if axis is ax.xaxis else 1]
        return label.get_visible() and bool(label.get_text()) and lo - 1e-9 * (hi - lo) <= at <= hi + 1e-9 * (hi - lo)

    shown = [(i, axis, label) for i, ax in enumerate(fig.axes) if ax.axison for axis in (ax.xaxis, ax.yaxis)
             if axis.get_visible() for label in axis.get_ticklabels(which="both") if drawn(ax, axis, label)]
    boxes = [label.get_window_extent(renderer) for _, _, label in shown]
    return [(shown[i][2].get_text(), shown[j][2].get_text()) for i in range(len(shown)) for j in range(i + 1, len(shown))
            if boxes[i].overlaps(boxes[j]) and (shown[i][1] is shown[j][1] or shown[i][0] != shown[j][0])]


@pytest.mark.parametrize("name", figures.FIGURES)
def test_tick_labels_never_overlap_and_every_axis_is_labelled(synthetic, name):
    fig, _ = figures.FIGURES[name](store.load(synthetic))
    assert not tick_label_overlaps(fig), name
    for ax in fig.axes:  # a twin axis shares its x axis (hidden) with the panel it is drawn on
        if ax.axison and ax.get_label() != "<colorbar>":
            assert ax.get_ylabel() and (ax.get_xlabel() or not ax.xaxis.get_visible()), f"{name}: {ax.get_title()}"
    title = fig._suptitle.get_text()
    assert "smollm2-135m" in title and "cpu" in title, title  # model and hardware in the title


def test_latency_traffic_bars_sorted_and_readable_for_an_alpha_sweep(tmp_path):
    """The alpha-latency preset alone: nine InfiniGen settings share the traffic panel's largest shape."""
    for alpha in range(1, 10):
        digest, rows = run("smollm2-135m", "infinigen", "latency", INFINIGEN | {"alpha": float(alpha)},
                           {"batch_size": 1, "prompt_len": 384, "gen_len": 16},
                           [{"decode_ms_median": 20.0, "h2d_bytes_per_token": 2**20 * ((alpha * 7) % 9 + 1),
                             "batch_size": 1, "prompt_len": 384}])
        store.append_rows(tmp_path, digest, rows)
    fig, numbers = figures.fig14_16_latency(store.load(tmp_path))
    assert not tick_label_overlaps(fig)
    traffic = fig.axes[3]
    widths = [bar.get_width() for bar in traffic.patches]
    assert len(widths) == 9 and widths == sorted(widths)


def test_the_overlap_check_sees_overlapping_labels():
    fig, axes = draw.grid(1, size=(2.0, 2.0))
    axes[0].set_xticks(range(6), [f"a long tick label {i}" for i in range(6)])
    assert tick_label_overlaps(fig)


# ----------------------------------------------------------------------------------------------- a user's store

# rows of real runs (`python run.py ...` at this harness's commit): tiny-llama ppl (seq 64, one window) of every
# method then in conf/method/, tiny-llama latency (32 + 4 tokens) of five, smollm2-135m needle (128 tokens) of
# full and streaming and lm_eval (copa, 0-shot, 1 doc: full, h2o; 5 tasks, 5-shot, 2 docs: full)
REAL = [json.loads(line) for line in (Path(__file__).parent / "data" / "real_rows.jsonl").read_text().splitlines()]
CONF = Path(__file__).resolve().parent.parent / "conf"


def real_runs(rows=REAL) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    for row in rows:
        runs.setdefault(row["config_hash"], []).append(row)
    return runs


def yaml_of(group: str, name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))


def number(value: str):
    """A swept value as Hydra reads it: a number where it is one (speculate_from=previous stays text)."""
    try:
        return float(value)
    except ValueError:
        return value


def preset_rows(preset: str) -> list[list[dict]]:
    """The runs `python run.py -m +experiment=<preset>` writes, shaped as real rows: each point's method and the
    preset's task settings (read from the YAML files, as Hydra composes them) on a real run's row of that
    method and task (or of `full`)."""
    spec = yaml_of("experiment", preset)
    chosen = {k.removeprefix("override /"): v for entry in spec.get("defaults", []) for k, v in entry.items()}
    task = yaml_of("task", chosen.get("task", "ppl")) | spec.get("task", {})
    params = {k: [v.strip() for v in str(values).split(",")]
              for k, values in (spec.get("hydra", {}).get("sweeper", {}).get("params") or {}).items()}
    runs = []
    for combo in itertools.product(*params.values()):
        point = dict(zip(params, combo))
        method_name, method = chosen.get("method", "full"), dict(spec.get("method", {}))
        if "+point" in point:
            p = yaml_of("point", point["+point"])
            method_name = next(v for e in p["defaults"] for k, v in e.items() if k.endswith("/method"))
            method = p.get("method", {})
        method = yaml_of("method", method_name) | method
        method |= {k.split(".", 1)[1]: number(v) for k, v in point.items() if k.startswith("method.")}
        task_point = task | {k.split(".", 1)[1]: int(v) if v.isdigit() else v for k, v in point.items()
                             if k.startswith("task.")}
        model = yaml_of("model", point.get("model", chosen.get("model", "smollm2-135m")))["name"]
        like = [r for r in REAL if r["task"] == task["name"] and r["method"] == method_name] or \
               [r for r in REAL if r["task"] == task["name"] and r["method"] == "full"]
        digest = hashlib.sha256(json.dumps([preset, point], sort_keys=True).encode()).hexdigest()[:16]
        params_row = {k: v for k, v in method.items() if k != "_target_"}
        runs.append([copy.deepcopy(r) | {"config_hash": digest, "model": model, "method": method_name,
                                         "method_params": {"name": method_name, **params_row,
                                                           "size_params": r["method_params"]["size_params"]},
                                         "task_params": task_point}
                     for r in real_runs(like)[like[0]["config_hash"]]])
    return runs


def older(rows: list[dict]) -> list[dict]:
    """Rows as earlier commits wrote them: no size_params or speculate_from, kv_fraction only in stats."""
    out = copy.deepcopy(rows)
    for row in out:
        row["method_params"].pop("size_params", None)
        row["method_params"].pop("speculate_from", None)
        row["metrics"].pop("kv_fraction", None)
        row["meta"]["git_commit"] = "0bf7288"
    return out


PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
USER_STORES = ([f"run:{task}" for task in ("ppl", "lm_eval", "latency", "needle")]
               + [f"method:{m}" for m in sorted({r["method"] for r in REAL})]
               + [f"preset:{p}" for p in PRESETS] + ["older", "mix"])


def user_store(name: str) -> list[list[dict]]:
    kind, _, what = name.partition(":")
    if kind == "run":  # a single run of the task
        return [next(rows for rows in real_runs().values() if rows[0]["task"] == what)]
    if kind == "method":
        return list(real_runs([r for r in REAL if r["method"] == what]).values())
    if kind == "preset":
        return preset_rows(what)
    if kind == "older":
        return list(real_runs(older(REAL)).values())
    return [*real_runs().values(), *[run for p in PRESETS for run in preset_rows(p)]]


@pytest.mark.parametrize("name", USER_STORES)
def test_every_figure_from_a_users_store(name, tmp_path):
    """What a user has after a few runs (real rows; a preset's rows alone; rows of an older commit; all mixed):
    every figure draws what it has or names the command that fills it, and nothing raises."""
    for rows in user_store(name):
        store.append_rows(tmp_path, rows[0]["config_hash"], rows)
    df = store.load(tmp_path)
    if name == "mix":  # the whole command: every file written, exit 0
        written = figures.main(["--results", str(tmp_path), "--out", str(tmp_path / "figures")])
        assert len(written) == 3 * len(figures.FIGURES)
        return
    for build in figures.FIGURES.values():
        fig, numbers = build(df)
        assert fig.axes and isinstance(numbers, pd.DataFrame)


def test_one_failing_figure_costs_only_itself(tmp_path, monkeypatch, capsys):
    def broken(df):
        raise TypeError("a bug in one figure")

    monkeypatch.setitem(figures.FIGURES, "fig12_ppl_position", broken)
    with pytest.raises(SystemExit) as exit_:
        figures.main(["--results", str(tmp_path), "--out", str(tmp_path / "figures")])
    assert exit_.value.code == 1
    assert "fig12_ppl_position: FAILED (TypeError: a bug in one figure)" in capsys.readouterr().err
    for name in figures.FIGURES:  # the others written; the failed one as a panel saying so
        assert (tmp_path / "figures" / f"{name}.png").stat().st_size > 0
