"""`make figures` on a synthetic results store: every figure (png, pdf, csv) is written, with the numbers it
was given; on an empty store every figure still comes out, naming the command that fills it."""

from __future__ import annotations

import hashlib
import json
import math

import pandas as pd
import pytest

from analysis import figures, store, tables

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
    out = {"kv_fraction": kv, "retain_ratio": (1 - math.sqrt(1 - min(kv, 1))) * 100}
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


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    for digest, rows in lm_eval_runs() + ppl_runs() + latency_runs() + needle_runs():
        store.append_rows(results, digest, rows)
    return results


def test_every_figure_from_a_synthetic_store(synthetic, tmp_path):
    written = figures.main(["--results", str(synthetic), "--out", str(tmp_path)])
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


def test_fig12_chunks_and_fig13_pairs(synthetic):
    df = store.load(synthetic)
    _, nll = figures.fig12_ppl_position(df)
    assert set(nll["method"]) == {"full", "h2o", "infinigen"}
    assert sorted(nll["position"].unique()) == list(range(0, 2048, 256))
    assert nll.loc[(nll["method"] == "h2o") & (nll["position"] == 256), "nll"].item() == pytest.approx(3.5)
    _, bars = figures.fig13_skew(df)
    assert set(bars["bar"]) == {"full", "infinigen (skew)", "infinigen (no skew)"}
    assert set(bars["task"]) == {"copa", "openbookqa", "winogrande", "piqa", "rte"}
    # full is only compared on the tasks the pair ran, at the same shots
    assert len(bars) == 15


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
    assert latency["alpha"].tolist() == [1, 4, 9] and latency["value"].tolist() == [121, 124, 129]
    _, table = figures.table2_eviction(df)
    assert len(table) == 8
    assert table.loc[table["pool"] == "pool 80%, fifo", "ppl"].tolist() == [23.0, 23.0]


def test_empty_store_still_writes_every_figure(tmp_path):
    written = figures.main(["--results", str(tmp_path / "nothing"), "--out", str(tmp_path / "figs")])
    assert len(written) == 3 * len(figures.FIGURES)
    for name in figures.FIGURES:
        assert (tmp_path / "figs" / f"{name}.png").stat().st_size > 0
        assert (tmp_path / "figs" / f"{name}.pdf").stat().st_size > 0
        assert pd.read_csv(tmp_path / "figs" / f"{name}.csv").empty


def test_empty_figures_name_the_preset_to_run():
    for name, build in figures.FIGURES.items():
        fig, _ = build(pd.DataFrame())
        text = "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)
        assert "python run.py -m +experiment=" in text and "_smoke" in text, name


@pytest.mark.parametrize("table", list(tables.TABLES))
def test_markdown_tables(synthetic, table, capsys):
    tables.main(["--results", str(synthetic), "--table", table])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| model | method |") and set(out[1]) <= {"|", "-", ":", " "}
    assert len(out) > 3


def test_accuracy_table_has_one_column_per_task(synthetic):
    out = tables.table(store.load(synthetic), "accuracy")
    five = ["copa", "openbookqa", "piqa", "rte", "winogrande"]
    assert set(five) <= set(out.columns) and "mean acc" in out
    full8 = out[(out["method"] == "full") & (out["limit"] == "8")].iloc[0]
    assert full8["mean acc"] == pytest.approx(0.75) and full8["kv_fraction"] == 1.0
    assert len(out) == len(out[["method", "params", "limit"]].drop_duplicates())  # one line per setting
