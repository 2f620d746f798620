"""The evidence a verdict rests on (issue 54): per-unit results in every row, paired statistics with a stated
margin, the held-out selection of InfiniGen's setting, and comparisons that refuse unlike rows."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis import like, paired, store
from analysis.report import matching
from analysis.report import recommended as R
from analysis.report import selection as S
from analysis.report.sections import c3_position, c7_speed, selection
from conftest import ROOT

SMOLLM2 = {"model_type": "llama"}


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


# ----------------------------------------------------------------------------------------------- per-unit rows


def test_a_ppl_row_keeps_each_windows_nll_and_tokens(tmp_path, data_dir):
    from experiments import runner

    cfg = compose("model=tiny-llama", "method=h2o", "task=ppl", "task.seq_len=48", "task.max_windows=4",
                  f"data_dir={data_dir}", f"results_dir={tmp_path}")
    row = runner.run(cfg)
    units = row["metrics"]["units"]
    assert units["id"] == [0, 48, 96, 144] and units["tokens"] == [47] * 4
    assert sum(units["nll"]) / sum(units["tokens"]) == pytest.approx(row["metrics"]["nll"], rel=1e-12)
    assert [sum(c) for c in units["chunk_nll"]] == pytest.approx(units["nll"], rel=1e-12)
    # make export keeps them (they are small), and drops only the per-prompt detail
    store.export(tmp_path, tmp_path / "docs")
    exported = json.loads(next((tmp_path / "docs" / "rows").glob("*.jsonl")).read_text())
    assert exported["metrics"]["units"] == units


def test_skip_windows_reads_windows_after_the_skipped_ones(tmp_path, data_dir):
    from experiments import cli_errors, runner, validation

    cfg = compose("model=tiny-llama", "method=full", "task=ppl", "task.seq_len=48", "task.max_windows=2",
                  "task.skip_windows=3", f"data_dir={data_dir}", f"results_dir={tmp_path}")
    assert runner.run(cfg)["metrics"]["units"]["id"] == [144, 192]
    with pytest.raises(cli_errors.UserError, match="task.skip_windows"):
        validation.validate(compose("model=tiny-llama", "task=ppl", "task.seq_len=48", "task.skip_windows=-1",
                                f"data_dir={data_dir}"))


def test_an_lm_eval_row_keeps_each_docs_result(tmp_path, data_dir):
    from experiments import runner

    cfg = compose("model=tiny-llama", "method=infinigen", "task=lm_eval", "task.tasks=[copa]", "task.limit=6",
                  "task.num_fewshot=0", f"data_dir={data_dir}", f"results_dir={tmp_path}")
    metrics = runner.run(cfg)["metrics"]
    assert metrics["units"]["id"] == list(range(6))
    assert set(metrics["units"]["acc"]) <= {0.0, 1.0}
    assert np.mean(metrics["units"]["acc"]) == pytest.approx(metrics["acc"])


# ----------------------------------------------------------------------------------------------- paired statistics


def units(values, ids=None, key="acc"):
    return {"id": list(ids if ids is not None else range(len(values))), key: list(values)}


def test_a_paired_accuracy_interval_is_narrower_than_the_unpaired_one_and_counts_discordant_docs():
    rng = np.random.default_rng(1)
    full = (rng.random(500) < 0.65).astype(float)
    mine = full.copy()
    flip = rng.random(500) < 0.06
    mine[flip] = 1 - mine[flip]
    effect = paired.accuracy_difference(units(mine), units(full[::-1], ids=range(499, -1, -1)))  # any order
    assert effect.value == pytest.approx(mine.mean() - full.mean())
    assert effect.gained + effect.lost == int(flip.sum())
    unpaired = 1.96 * math.sqrt(2 * 0.65 * 0.35 / 500)
    assert effect.high - effect.low < unpaired  # the docs' agreement narrows it
    assert effect.low < effect.value < effect.high
    assert 0 <= effect.p <= 1


def test_closeness_holds_fails_or_cannot_be_shown_against_the_margin():
    make = lambda lo, hi: paired.Effect((lo + hi) / 2, lo, hi, 100, "accuracy")  # noqa: E731
    assert make(-0.01, 0.01).closeness() == paired.HOLDS
    assert make(-0.08, -0.03).closeness() == paired.FAILS
    assert make(-0.05, 0.01).closeness() == paired.OPEN  # "not significant" is not "close"
    ratio = lambda lo, hi: paired.Effect((lo + hi) / 2, lo, hi, 16, "perplexity")  # noqa: E731
    assert ratio(1.01, 1.03).closeness() == paired.HOLDS and ratio(1.08, 1.1).closeness() == paired.FAILS
    assert ratio(1.02, 1.07).closeness() == paired.OPEN


def test_a_perplexity_ratio_is_token_weighted_and_paired_over_windows():
    nll = [3000.0, 3300.0, 2800.0, 3100.0]
    ref = {"id": [0, 1, 2, 3], "nll": nll, "tokens": [1000] * 4}
    mine = {"id": [0, 1, 2, 3], "nll": [v + 50 for v in nll], "tokens": [1000] * 4}
    effect = paired.perplexity_ratio(mine, ref)
    assert effect.value == pytest.approx(math.exp(0.05)) and effect.n == 4
    assert effect.low == pytest.approx(effect.value) == pytest.approx(effect.high)  # the same gap in every window
    with pytest.raises(paired.Unpaired):
        paired.perplexity_ratio(mine | {"id": [0, 1, 2, 9]}, ref)
    with pytest.raises(paired.Unpaired):
        paired.perplexity_ratio(mine, None)


# ----------------------------------------------------------------------------------------------- refusing unlike rows


def latency_run(path, digest, method, params, ms, commit, threads=2):
    store.append_rows(path, digest, [{
        "config_hash": digest, "model": "smollm2-135m", "method": method, "task": "latency",
        "method_params": {"name": method, **params}, "task_params": {"name": "latency", "batch_size": 1,
                                                                     "prompt_len": 384, "gen_len": 16},
        "metrics": {"decode_ms_median": ms, "modelled_decode_ms_per_token": ms, "batch_size": 1, "prompt_len": 384,
                    "gen_len": 16, "dtype": "float32", "timing": "measured", "kv_fraction": 0.2},
        "config": {"model": {"arch": SMOLLM2}},
        "meta": {"git_commit": commit, "device": "cpu", "threads": threads}}])


def test_a_speed_ratio_over_rows_of_two_commits_is_refused(tmp_path):
    from infinigen.selected import LLAMA

    latency_run(tmp_path, "a" * 16, "infinigen", LLAMA | {"budget": 0.2}, 50.0, "1" * 40)
    latency_run(tmp_path, "b" * 16, "offload", {}, 90.0, "2" * 40)
    lines = c7_speed.c7_verdict(matching.load(tmp_path))
    assert "refused" in lines[0] and "commit 1111111 vs 2222222" in lines[0], lines
    assert "x" not in lines[0].split("refused")[0].split(":")[-1]  # no ratio is printed
    latency_run(tmp_path, "b" * 16, "offload", {}, 90.0, "1" * 40)  # the same commit: a ratio
    (tmp_path / "rows" / sorted(p.name for p in (tmp_path / "rows").glob("b*"))[0]).unlink()
    lines = c7_speed.c7_verdict(matching.load(tmp_path))
    assert "offload 1.8x" in lines[0] and "refused" not in lines[0], lines


def test_a_dirty_commit_or_another_thread_count_is_refused_too():
    a = pd.Series({"meta.git_commit": "1" * 40, "meta.device": "cpu", "meta.threads": 2, "model": "m"})
    with pytest.raises(like.Unlike, match="threads 2 vs 1"):
        like.check(a, a.copy().replace({2: 1}), "speed")
    with pytest.raises(like.Unlike, match="not a clean commit"):
        like.check(a, a.copy().replace({"1" * 40: "1" * 40 + "-dirty"}), "speed")
    like.check(a, a.copy(), "speed")


def chunk_run(path, digest, method, params, kv, gaps, model="smollm2-135m"):
    """A 2,048-token ppl run over len(gaps) windows whose NLL per token is 3 + each window's gap in every 256-token
    chunk."""
    n = len(gaps)
    chunks = {str(p): 3.0 + sum(gaps) / n for p in range(0, 2048, 256)}
    units = {"id": [2048 * i for i in range(n)], "nll": [2047 * (3.0 + g) for g in gaps], "tokens": [2047] * n,
             "chunk_nll": [[255 * (3.0 + g)] + [256 * (3.0 + g)] * 7 for g in gaps],
             "chunk_tokens": [[255] + [256] * 7] * n}
    store.append_rows(path, digest, [{
        "config_hash": digest, "model": model, "method": method, "task": "ppl",
        "method_params": {"name": method, **params},
        "task_params": {"name": "ppl", "dataset": "wikitext2", "seq_len": 2048, "max_windows": n},
        "metrics": {"ppl": math.exp(3.0 + sum(gaps) / n), "kv_fraction": kv, "windows": n, "seq_len": 2048,
                    "nll_by_chunk": chunks, "units": units}, "config": {"model": {"arch": SMOLLM2}},
        "meta": {"device": "cpu", "threads": 2}}])


def test_c3_refuses_an_h2o_row_at_another_kv_fraction_and_interpolates_inside_h2os_range(tmp_path):
    """InfiniGen against H2O at the same kv_fraction, paired over windows and per chunk: refused when H2O's rows
    do not reach InfiniGen's size, interpolated window by window between the two around it."""
    from infinigen.selected import LLAMA

    chunk_run(tmp_path, "0" * 16, "full", {}, 1.0, (0.0, 0.0))
    chunk_run(tmp_path, "1" * 16, "infinigen", LLAMA | {"budget": 0.2, "capacity": 1.0}, 0.224, (0.02, 0.04))
    chunk_run(tmp_path, "2" * 16, "h2o", {"heavy": 0.01875, "recent": 0.01875}, 0.0455, (1.2, 1.4))  # 5x less KV
    line = c3_position.c3_verdict(matching.load(tmp_path))[-1]
    assert "refused" in line and "span kv_fraction 4.55-4.55%" in line, line
    chunk_run(tmp_path, "3" * 16, "h2o", {"heavy": 0.1, "recent": 0.1}, 0.20, (0.4, 0.6))
    chunk_run(tmp_path, "4" * 16, "h2o", {"heavy": 0.125, "recent": 0.125}, 0.26, (0.2, 0.4))
    line = c3_position.c3_verdict(matching.load(tmp_path))[-1]
    w = (0.224 - 0.2) / 0.06
    expected = 0.03 - (0.5 + w * (0.3 - 0.5))  # InfiniGen's mean NLL minus H2O's interpolated one
    assert "(interpolated)" in line and f"{expected:+.3f} nats/token" in line, line
    assert "below h2o's: holds" in line and "below in 8 of 8 chunks" in line, line
    (status,) = [s for s in c3_position.c3_status(matching.load(tmp_path)) if "variant" in s.claim]
    assert status.verdict == paired.HOLDS and "2 windows" in status.number, status


def test_c3_decides_on_the_most_windows_where_a_claim_was_run_at_two_sizes(tmp_path):
    """SmolLM2's C3 ran at 8 windows and, left open there, at 16: the verdict is the larger sample's, the smaller
    one's line stays beside it."""
    h2o = {"heavy": 0.1, "recent": 0.1}
    for n, gaps in ((2, (0.0, 0.3)), (4, (0.1, 0.15, 0.2, 0.12))):
        chunk_run(tmp_path, f"{n}0".ljust(16, "0"), "full", {}, 1.0, (0.0,) * n)
        chunk_run(tmp_path, f"{n}1".ljust(16, "0"), "infinigen_reference",
                  {"budget": 0.2, "alpha": 5.0, "partial_ratio": 0.2, "skip_layers": 2}, 0.2, gaps)
        chunk_run(tmp_path, f"{n}2".ljust(16, "0"), "h2o_reference", h2o, 0.2, (0.3,) * n)
    rows = matching.load(tmp_path)
    (status,) = [s for s in c3_position.c3_status(rows) if "authors" in s.claim]
    assert "4 windows" in status.number and status.verdict == paired.HOLDS, status
    lines = [line for line in c3_position.c3_verdict(rows) if "h2o_reference's" in line]
    assert len(lines) == 2 and "4 windows" in lines[0] and "2 windows" in lines[1], lines


# ----------------------------------------------------------------------------------------------- the selection


def selection_run(path, digest, params, kv, gap, windows=(64, 65, 66, 67), model="smollm2-135m"):
    method = "infinigen" if params else "full"
    ids = [w * 1024 for w in windows]
    store.append_rows(path, digest, [{
        "config_hash": digest, "model": model, "method": method, "task": "ppl",
        "method_params": {"name": method, **params},
        "task_params": {"name": "ppl", "dataset": "wikitext2", "seq_len": 1024, "max_windows": len(windows),
                        "skip_windows": windows[0]},
        "metrics": {"ppl": math.exp(3 + gap), "kv_fraction": kv, "windows": len(windows), "seq_len": 1024,
                    "units": {"id": ids, "nll": [1023 * (3 + gap)] * len(ids), "tokens": [1023] * len(ids)}},
        "data": {"sha256": "abc"}, "config": {"model": {"arch": SMOLLM2}}, "meta": {}}])


def test_the_rule_picks_the_least_gap_at_the_target_sizes_among_settings_that_reach_them(tmp_path):
    from infinigen.selected import SELECTED

    selection_run(tmp_path, "f" * 16, {}, 1.0, 0.0)
    good = dict(SELECTED["llama"])  # the rule's pick here is the conf's: the line says it agrees
    close = good | {"speculate_from": "block_input" if good["speculate_from"] == "previous" else "previous"}
    small = {"skip_layers": 1, "alpha": 4.0, "partial_ratio": 0.2, "speculate_from": "previous"}
    for i, (kv, gap) in enumerate(((0.11, 0.3), (0.17, 0.1), (0.24, 0.05))):
        selection_run(tmp_path, f"a{i}".ljust(16, "0"), good | {"budget": 0.05 * 2 ** i}, kv, gap)
        selection_run(tmp_path, f"b{i}".ljust(16, "0"), close | {"budget": 0.05 * 2 ** i}, kv, gap + 0.02)
        selection_run(tmp_path, f"c{i}".ljust(16, "0"), small | {"budget": 0.05 * 2 ** i}, 0.08 + 0.01 * i, 0.0)
    rows = matching.load(tmp_path)
    assert S.selected(rows) == {"smollm2-135m": good}
    table = S.scores(S.points(rows))
    assert not table.set_index("alpha").loc[4.0, "eligible"]  # never reaches 15%: however good, not a candidate
    line = selection.verdict(rows)[0]
    assert line.startswith(f"smollm2-135m: selected {R.describe(good)} (") and "agrees" in line, line


def test_the_audit_flags_a_verdict_row_that_reads_the_held_out_windows(tmp_path):
    selection_run(tmp_path, "f" * 16, {}, 1.0, 0.0)
    sweep = matching.load(tmp_path)
    selection_run(tmp_path / "other", "e" * 16, {}, 1.0, 0.0, windows=tuple(range(16)))
    clean = matching.load(tmp_path / "other")
    assert "no verdict row reads them" in selection.audit(sweep, pd.concat([sweep, clean]))[0]
    selection_run(tmp_path / "bad", "d" * 16, {}, 1.0, 0.0, windows=tuple(range(70)))
    bad = matching.load(tmp_path / "bad")
    assert "the selection is not held out" in selection.audit(sweep, pd.concat([sweep, bad]))[0]


def test_the_committed_selection_is_what_the_conf_gives():
    """infinigen/selected.py holds, for each family swept, the rule's pick from the committed sweep."""
    from infinigen.selected import SELECTED, SELECTED_ON

    df = matching.load(ROOT / "docs" / "store")
    rows = matching.match(df, selection.SECTION.commands).rows
    picks = S.selected(rows)
    assert set(picks) == set(SELECTED_ON.values()), "the committed sweep lacks a model: run its command"
    for family, model in SELECTED_ON.items():
        assert picks[model] == SELECTED[family], (family, picks[model])


def test_method_infinigen_gives_each_family_its_selected_setting():
    from infinigen.selected import PAPER, SELECTED

    for model, family in (("smollm2-135m", "llama"), ("gemma3-270m", "gemma3_text"), ("opt-13b", None)):
        method = compose(f"model={model}", "method=infinigen").method
        assert {k: method[k] for k in PAPER} == SELECTED.get(family, PAPER), model
    pinned = compose("model=smollm2-135m", "method=infinigen", "method.alpha=4").method
    assert pinned.alpha == 4 and pinned.skip_layers == SELECTED["llama"]["skip_layers"]


def test_the_n_that_would_settle_a_claim_follows_the_measured_spread():
    """Half-width 0.02335 at n = 600 around -0.0217 (margin -0.02): the distance 0.0017 needs (0.02335/0.0017)^2 x 600
    docs; a ratio is sized on the log scale; an estimate on the threshold has no n; a settled one needs no more."""
    open_ = paired.Effect(-0.0217, -0.045, 0.0017, 600, "accuracy")
    assert paired.side(open_, paired.margin("accuracy"), below=False) == paired.OPEN
    n = math.ceil(600 * (0.02335 / 0.0017) ** 2)
    assert paired.units_to_settle(open_, -0.02) == n
    assert paired.settle_text(open_, -0.02, "docs") == f"about {n:,} paired docs would settle it (measured: 600)"
    ratio = paired.Effect(1.04, 1.0, 1.08, 16, "perplexity")
    half = (math.log(1.08) - math.log(1.0)) / 2
    assert paired.units_to_settle(ratio, 1.05) == math.ceil(16 * (half / abs(math.log(1.04 / 1.05))) ** 2)
    assert paired.units_to_settle(paired.Effect(0.0, -0.1, 0.1, 9, "nll"), 0.0) == math.inf
    assert paired.units_to_settle(paired.Effect(0.5, 0.4, 0.6, 9, "nll"), 0.0) == 9
    assert paired.side(paired.Effect(0.5, 0.4, 0.6, 9, "nll"), 0.0, below=False) == paired.HOLDS
    assert paired.side(paired.Effect(0.5, 0.4, 0.6, 9, "nll"), 0.0) == paired.FAILS
    # a lopsided bootstrap interval that ends just past the threshold: the symmetric estimate is no more than measured
    lopsided = paired.Effect(-0.0134, -0.0265, 0.0001, 1938, "accuracy")
    assert paired.side(lopsided, 0.0, below=False) == paired.OPEN
    assert paired.settle_text(lopsided, 0.0, "docs") == ("its interval just reaches 0: a few more than the 1,938 "
                                                         "paired docs measured would settle it")


def test_an_accuracy_verdict_refuses_rows_of_another_commit_and_of_a_dirty_tree(tmp_path):
    """Rows of two commits and of an uncommitted tree: the verdict keeps the newest committed run's commit only,
    and says what it refused; a verdict on another task (lm-eval) keeps its own build; a speed row passes as it is
    (its own verdicts refuse unlike rows)."""
    def run(digest, method, commit, when, task="ppl"):
        store.append_rows(tmp_path, digest, [{
            "config_hash": digest, "model": "smollm2-135m", "method": method, "task": task,
            "method_params": {"name": method}, "task_params": {"name": task}, "metrics": {"ppl": 10.0},
            "config": {}, "meta": {"git_commit": commit}}])
        (path,) = (tmp_path / "rows").glob(f"{digest}__*.jsonl")
        path.rename(path.with_name(f"{digest}__2026120{when}T000000000000Z.jsonl"))

    run("a" * 16, "full", "1" * 40, 1)
    run("b" * 16, "infinigen", "1" * 40, 2)
    run("c" * 16, "h2o", "2" * 40, 3)  # the newest committed run: its commit is the build
    run("d" * 16, "full", "2" * 40, 4)
    run("e" * 16, "quant", "2" * 40 + "-dirty", 5)  # newer still, but of an uncommitted tree
    run("f" * 16, "offload", "1" * 40, 6, task="latency")
    run("h" * 16, "full", "1" * 40, 7, task="lm_eval")  # the newest run, of another verdict: its build is its own
    kept, lines = matching.one_build(matching.load(tmp_path))
    assert sorted(kept["method"] + " " + kept["task"]) == ["full lm_eval", "full ppl", "h2o ppl", "offload latency"]
    assert lines == ["smollm2-135m, ppl: one build per verdict: the rows of commit 2222222 (the newest run's of a committed "
                     "tree); refused 3 runs of other builds: 1111111 (2 runs), 2222222-dirty (1 run)"], lines
    for digest in "cd":
        next((tmp_path / "rows").glob(f"{digest * 16}__*")).unlink()
    run("g" * 16, "full", "3" * 40 + "-dirty", 7)
    kept, lines = matching.one_build(matching.load(tmp_path)[lambda d: d["meta.git_commit"].str.endswith("-dirty")])
    assert kept["task"].eq("ppl").sum() == 0 and "refused all 2 runs, none of a committed tree" in lines[0], lines


def test_ruler_cells_get_an_interval_over_samples_and_a_method_is_paired_with_full_per_sample(tmp_path):
    """20 samples a cell: full right on all of niah_single_1 and on none of ruler_cwe (left out: full below 0.5),
    the method wrong on 4 needles: -20 points over the 20 samples of the one cell, beyond the 2-point margin."""
    from analysis.report.sections import ruler

    def run(digest, method, scores):
        store.append_rows(tmp_path, digest, [{
            "config_hash": digest, "model": "smollm2-135m", "method": method, "task": "lm_eval",
            "method_params": {"name": method}, "task_params": {"name": "lm_eval", "limit": 20},
            "metrics": {"benchmark": "ruler", "task": task, "length": 1024, "n": 20, "score": sum(s) / 20,
                        "kv_fraction": 1.0 if method == "full" else 0.3,
                        "units": {"id": list(range(20)), "1024": s}},
            "config": {}, "meta": {"git_commit": "1" * 40}} for task, s in scores.items()])

    run("a" * 16, "full", {"niah_single_1": [1.0] * 20, "ruler_cwe": [0.0] * 20})
    run("b" * 16, "infinigen_reference", {"niah_single_1": [0.0] * 4 + [1.0] * 16, "ruler_cwe": [0.0] * 20})
    lines = ruler.paired_lines(matching.load(tmp_path))
    assert "full niah_single_1 @ 1024 1 (1-1, n = 20)" in lines[0] and "niah_single_1 @ 1024 0.8 (" in lines[0], lines
    (line,) = [x for x in lines[1:] if "minus full" in x]
    assert "over the 20 samples of 1 cells where full scores >= 0.5 (niah_single_1 @ 1024): -20.0 points" in line, line
    assert "0 samples gained, 4 lost" in line and line.endswith("within 2 points of full's score: does not hold"), line


def test_a_speed_ratio_gets_an_interval_over_decode_steps_paired_by_position():
    """Offload's steps twice InfiniGen's: the ratio of medians is 2 with an interval above 1 (holds); equal steps
    up to noise: the interval reaches across 1 (cannot be shown)."""
    rng = np.random.default_rng(0)
    mine = 10 + rng.normal(0, 0.5, 14)
    faster = paired.step_time_ratio(mine, 2 * mine)
    assert faster.value == pytest.approx(2.0) and faster.low > 1 and faster.kind == "speed" and faster.n == 14
    assert paired.side(faster, 1.0, below=False) == paired.HOLDS and "14 decode steps" in faster.text()
    alike = paired.step_time_ratio(mine, 10 + rng.normal(0, 0.5, 14))
    assert alike.low < 1 < alike.high and paired.side(alike, 1.0, below=False) == paired.OPEN


def test_an_authors_line_names_the_knobs_the_sweep_holds_not_its_first_point():
    """An alpha sweep listed first (alpha 7) beside a partial_ratio sweep at the preset's alpha 5: the line names
    alpha 5 and partial_ratio 0.2, each knob's most common value."""
    rows = pd.DataFrame({"method": ["infinigen_reference"] * 6, "model": ["smollm2-135m"] * 6,
                         "method_params.alpha": [7.0, 1.0, 5.0, 5.0, 5.0, 9.0],
                         "method_params.partial_ratio": [0.2, 0.2, 0.2, 0.1, 0.5, 0.2],
                         "method_params.skip_layers": [2] * 6})
    assert "with skip_layers 2, alpha 5, partial_ratio 0.2;" in R.authors(rows), R.authors(rows)


def test_a_speed_row_without_per_step_times_has_no_interval_and_decides_nothing():
    with pytest.raises(paired.Unpaired):
        paired.step_time_ratio(None, [1.0, 2.0])
    none = paired.Effect(0.9, math.nan, math.nan, 0, "speed")
    assert paired.side(none, 1.0, below=False) == paired.OPEN and "no per-step times recorded" in none.text()
