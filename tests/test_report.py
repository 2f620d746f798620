"""The reproduction report (issue 21): `make report` regenerates the committed docs/results.md, its figures and the
README's headline from docs/store alone, byte for byte; a stored row whose config no longer matches what
its command composes is reported stale and left out; `analysis.store export` copies runs without per-prompt
detail; the README stays a guide (<= 350 lines, no pasted result tables)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from analysis import columns, figures, report, speed, store
from analysis import paired as P
from analysis.report import compose, matching, render
from analysis.report.compose import REFERENCE
from analysis.report import recommended
from analysis.report.section import Contrast, across, on_model
from analysis.report.sections import c1_accuracy, c2_baselines, c6_ablation, gemma3_speed, sim_cost, successors
from conftest import ROOT
from experiments.lm_eval_tasks.ruler import ruler_names

DOCS = ROOT / "docs"


def regenerate(tmp_path: Path, store_dir: Path = DOCS / "store", figures: bool = True) -> Path:
    """The report written into tmp_path/docs from `store_dir`, with a copy of the README (figures=False:
    results.md only, which is what most checks read)."""
    out = tmp_path / "docs"
    out.mkdir(parents=True)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    report.report(store_dir, out, tmp_path / "README.md", figures=figures)
    return out


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    return regenerate(tmp_path_factory.mktemp("report"))


def test_committed_results_md_is_what_make_report_writes(regenerated):
    assert (regenerated / "results.md").read_text() == (DOCS / "results.md").read_text(), (
        "docs/results.md differs from what docs/store gives: run `make report` and commit docs/")


def test_committed_figures_are_what_make_report_writes(regenerated):
    made = sorted(p.name for p in (regenerated / "report").glob("*.png"))
    assert made == sorted(p.name for p in (DOCS / "report").glob("*.png"))
    for name in made:
        assert (regenerated / "report" / name).read_bytes() == (DOCS / "report" / name).read_bytes(), name


def test_readme_headline_numbers_are_the_stores(regenerated):
    """The README's numbers live in one generated paragraph; a hand edit of it, or a store that moved on, fails."""
    made = {m.group(2): m.group(3) for m in render.BLOCK.finditer((regenerated.parent / "README.md").read_text())}
    blocks = {m.group(2): m.group(3) for m in render.BLOCK.finditer((ROOT / "README.md").read_text())}
    assert "headline" in blocks, "README.md lost its <!-- report:headline --> block"
    assert made["headline"] == blocks["headline"], "README headline differs from docs/store: run `make report`"
    assert set(blocks) == {"headline", "memory", "speed", "sim_bench"}
    for name, text in made.items():
        assert text == blocks[name], f"README block {name} differs from docs/store: make report"
    scaling = {m.group(2): m.group(3) for m in render.BLOCK.finditer((DOCS / "scaling.md").read_text())}
    assert scaling["sim_bench"] == blocks["sim_bench"], "docs/scaling.md's sim_bench block differs: make report"
    numbers = re.findall(r"\d+\.\d+", blocks["headline"])
    assert numbers, "the headline quotes no number"
    results = (DOCS / "results.md").read_text()
    assert all(n in results for n in numbers)


def test_results_md_opens_with_its_summary_and_ends_with_its_bookkeeping():
    """Issue 71: a reader meets the findings first. The page's first section and first table are the summary; how the
    report is made and the stale rows it leaves out are its last sections."""
    text = (DOCS / "results.md").read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0] == "Summary", sections[:3]
    assert sections[-2:] == ["How this report is made", "Stale rows"], sections[-3:]
    first_table = next(i for i, line in enumerate(text.splitlines()) if line.startswith("|"))
    assert text.splitlines()[first_table] == "| claim | model | verdict | key number (95% interval) | section |"
    assert text.index("## Summary") < text.index("\n| claim | model |") < text.index("\n## ", text.index("## Summary"))


def test_readme_headline_is_one_screen_of_a_table_and_a_figure():
    """Issue 71: the README's headline is a claim x model table, each cell the verdict and key number linking that
    claim's section of docs/results.md, and one figure of docs/report/; it fits one screen (<= 25 lines)."""
    block = {m.group(2): m.group(3) for m in render.BLOCK.finditer((ROOT / "README.md").read_text())}["headline"]
    lines = block.splitlines()
    assert len(lines) <= render.HEADLINE_LINES == 25, len(lines)
    table = [line for line in lines if line.startswith("|")]
    assert table[0].startswith("| the paper's claim") and table[1].startswith("|---|")
    models = [c.strip() for c in table[0].strip("|").split("|")][1:]
    assert models == ["smollm2-135m", "gemma3-270m"]
    results = (DOCS / "results.md").read_text()
    anchors = {render.anchor(t) for t in re.findall(r"^## (.+)$", results, re.M)}
    for row in table[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 1 + len(models) and re.match(r"C\d", cells[0]), row
        for cell in cells[1:]:
            if cell == "-":
                continue
            got = re.fullmatch(r"\[(holds|\*\*does not hold\*\*|cannot be shown at this n|not measured)(: .+)?\]"
                               r"\(docs/results\.md#([\w-]+)\)", cell)
            assert got and got.group(3) in anchors, cell
    figures_ = re.findall(r"!\[[^]]*\]\((docs/report/[\w-]+\.png)\)", block)
    assert len(figures_) == 1 and (ROOT / figures_[0]).exists(), figures_
    assert "beyond the paper" not in "\n".join(table), "the harness's variants stay in docs/results.md's summary"


def test_readme_is_a_guide():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 350
    outside = render.BLOCK.sub("", text)
    pasted = [line for line in outside.splitlines()
              if line.startswith("|") and re.search(r"\|\s*-?\d+\.\d+\s*\|", line)]
    assert not pasted, f"result rows pasted into the README (they belong in docs/results.md): {pasted[:3]}"
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        if link not in ("docs/adding_a_method.md", "docs/scaling.md", "docs/speed.md"):  # written by other issues
            assert (ROOT / link).exists(), link


def test_a_row_whose_config_changed_is_reported_stale_and_left_out(tmp_path, regenerated):
    """A method's default changing is the same, for the report, as the row recording another value than today's
    composition: it must be listed as stale and not counted."""
    copy = tmp_path / "store"
    shutil.copytree(DOCS / "store", copy)
    path = next(p for p in sorted(store.rows_dir(copy).glob("*.jsonl"))
                if json.loads(p.read_text().splitlines()[0])["method"] == "infinigen"
                and "validation_point" not in json.loads(p.read_text().splitlines()[0])["metrics"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row["config"]["method"]["alpha"] = row["config"]["method"]["alpha"] + 1.5
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = regenerate(tmp_path / "gen", copy, figures=False)
    text = (out / "results.md").read_text()
    stale = text.split("\n## Stale rows\n", 1)[1]  # the page's last section
    assert f"`{path.name}`" in stale and "method.alpha: row" in stale
    counts = lambda t: [int(n) for n in re.findall(r"^(\d+) of \d+ configs in the store", t, re.M)]  # noqa: E731
    assert sum(counts(text)) < sum(counts((regenerated / "results.md").read_text()))


def test_sweep_expansion_matches_hydra():
    """A preset's sweeper params and the command line expand as run.py -m does (the command line wins)."""
    jobs = compose.compose_jobs("python run.py -m +experiment=fig13_speculation_smoke +point=speculate_block_input")
    assert sorted(j["method"]["budget"] for j in jobs) == [0.1, 0.2]
    assert {j["method"]["speculate_from"] for j in jobs} == {"block_input"}
    assert {j["task"]["seq_len"] for j in jobs} == {1024}


# ----------------------------------------------------------------------------------------------- export


def row(digest: str, method: str = "full", **metrics) -> dict:
    return {"config_hash": digest, "model": "tiny", "method": method, "task": "needle",
            "method_params": {"name": method}, "task_params": {"name": "needle", "lengths": [64]},
            "metrics": {"accuracy": 1.0, "per_prompt": [{"key": "12345"}] * 3, "seconds_per_prompt": {"64": 0.1},
                        **metrics}, "meta": {"git_commit": "abc"}, "config": {}}


def test_export_drops_per_prompt_detail_filters_and_keeps_one_run_per_config(tmp_path):
    results, docs = tmp_path / "results", tmp_path / "docs"
    store.append_rows(results, "a" * 16, [row("a" * 16)])
    store.append_rows(results, "b" * 16, [row("b" * 16, method="h2o")])
    written = store.export(results, docs, ["method=full"])
    assert [p.name.split("__")[0] for p in written] == ["a" * 16]
    exported = json.loads(written[0].read_text())
    assert "per_prompt" not in exported["metrics"] and "seconds_per_prompt" not in exported["metrics"]
    assert exported["metrics"]["accuracy"] == 1.0 and exported["meta"] == {"git_commit": "abc"}
    assert store.export(results, docs, ["method=full"]) == []  # nothing new: nothing rewritten
    store.append_rows(results, "a" * 16, [row("a" * 16, accuracy=0.5)])  # a forced re-run of the same config
    store.export(results, docs)
    files = sorted(p.name.split("__")[0] for p in store.rows_dir(docs).glob("*.jsonl"))
    assert files == ["a" * 16, "b" * 16]
    assert store.load(docs).set_index("method").loc["full", "metrics.accuracy"] == 0.5


def test_export_where_reads_dotted_paths_and_numbers(tmp_path):
    results = tmp_path / "results"
    store.append_rows(results, "c" * 16, [row("c" * 16) | {"task_params": {"name": "ppl", "seq_len": 1024}}])
    assert store.export(results, tmp_path / "a", ["task_params.seq_len=2048"]) == []
    assert len(store.export(results, tmp_path / "b", ["task_params.seq_len=1024.0", "method=h2o,full"])) == 1
    with pytest.raises(store.StoreError, match="COLUMN=VALUE"):
        store.export(results, tmp_path / "c", ["method"])


# ----------------------------------------------------------------------------------------------- every section


def method_presets() -> dict[str, list[tuple[str, dict]]]:
    """conf/method's presets by the class path a composed config carries (a moved class's as its rows were hashed,
    infinigen/semantic.py): several presets may name one class (infinigen and infinigen_reference, h2o and
    h2o_reference)."""
    import yaml

    from infinigen.semantic import MOVED_TARGETS

    out: dict[str, list[tuple[str, dict]]] = {}
    for p in sorted((ROOT / "conf" / "method").glob("*.yaml")):
        preset = yaml.safe_load(p.read_text())
        out.setdefault(MOVED_TARGETS.get(preset["_target_"], preset["_target_"]), []).append((p.stem, preset))
    return out


def method_name(method: dict, presets: dict[str, list[tuple[str, dict]]]) -> str:
    """The conf/method preset a composed method config came from, as run.py names its rows: of the presets of its
    class, the one whose literal values it differs from in the fewest keys (a key a semantic config leaves out is
    at its neutral value, infinigen/semantic.py)."""
    from infinigen.semantic import LATER_METHOD_OPTIONS

    def differs(preset: dict) -> int:
        return sum(1 for k, v in preset.items() if k != "_target_" and not (isinstance(v, str) and "${" in v)
                   and method.get(k, LATER_METHOD_OPTIONS.get(k)) != v)

    return min(presets[method["_target_"]], key=lambda named: (differs(named[1]), named[0]))[0]


def synthetic_metrics(method: str, params: dict, task: dict, i: int) -> list[dict]:
    """Plausible metrics of a run: kv_fraction from the method's size, a loss growing as it shrinks."""
    kv = {"full": 1.0, "quant": 1.0, "kivi": 1.0, "offload": 1.0, "streaming": params.get("recent", 0.2),
          "h2o": params.get("heavy", 0.1) + params.get("recent", 0.1)}.get(method.removesuffix("_reference"))
    alpha = params.get("alpha", 0) if params.get("alpha", 0) < 100 else 0  # the oracle's is inf
    kv = kv if kv is not None else min(1.0, 1.3 * params.get("budget", 0.2) + 0.01 * alpha)
    kv *= 0.9 if params.get("capacity", 1.0) < 1 else 1.0
    loss = 2.9 + (1 - kv) * (0.6 + 0.01 * i) + (0.3 if params.get("bits", 16) <= 2 else 0.0)
    common = {"kv_fraction": kv, "recall": 0.8 + 0.15 * kv if "budget" in params else None}
    if task["name"] == "ppl":
        chunks = {str(p): loss + 0.1 * (p // 256 % 3) for p in range(0, task["seq_len"], 256)}
        windows = range(task.get("skip_windows", 0), task.get("skip_windows", 0) + task["max_windows"])
        per = [loss * (1 + 0.01 * (w % 3)) * (task["seq_len"] - 1) for w in windows]  # each window's summed NLL
        units = {"id": [w * task["seq_len"] for w in windows], "nll": per, "tokens": [task["seq_len"] - 1] * len(per)}
        return [common | {"ppl": 2.718 ** loss, "nll": loss, "windows": task["max_windows"],
                          "seq_len": task["seq_len"], "nll_by_chunk": chunks, "units": units}]
    if task["name"] == "lm_eval" and ruler_names(task["tasks"]):  # one row per (task, length); full fails cwe
        score = {name: 0.0 if name == "ruler_cwe" else round(min(1.0, 0.3 + kv), 2) for name in task["tasks"]}
        return [common | {"benchmark": "ruler", "task": name, "length": n, "n": task["limit"], "score": score[name],
                          "units": {"id": list(range(task["limit"])), str(n): [score[name]] * task["limit"]}}
                for name in ruler_names(task["tasks"]) for n in task["max_seq_lengths"]]
    if task["name"] == "lm_eval":
        acc = round(0.4 + 0.4 * kv, 2)
        docs = task["limit"] or 200  # every doc: a task's size, here 200
        right = round(acc * docs)  # the first `right` docs right: full's right docs include the method's
        return [common | {"task": name, "acc": acc, "acc_stderr": 0.02, "n": docs,
                          "limit": task["limit"], "num_fewshot": task["num_fewshot"], "protocol": task["protocol"],
                          "units": {"id": list(range(docs)), "acc": [float(d < right) for d in range(docs)]}}
                for name in task["tasks"]]
    if task["name"] == "needle":
        cells = [{"length": n, "depth": d, "accuracy": float(kv > 0.5 or d == 1.0), "loglik": -1.0, "n": task["seeds"]}
                 for n in task["lengths"] for d in task["depths"]]
        return [common | {"accuracy": sum(c["accuracy"] for c in cells) / len(cells), "cells": cells}]
    if task["name"] == "generate":
        n = task["num_prompts"]
        agree = 1.0 if method == "full" else round(kv, 2)
        return [common | {"agreement": agree, "exact": float(agree == 1.0), "first_divergence": None if agree == 1.0
                          else 3.0, "prompts": n, "new_tokens": float(task["max_new_tokens"]),
                          "units": {"id": list(range(n)), "agreement": [agree] * n},
                          "texts": {"prompt": ["p"] * n, "full": ["a b c"] * n, "method": ["a b d"] * n}}]
    if task["name"] == "latency":
        ms = 20.0 + 80.0 * kv * task["batch_size"] * task["prompt_len"] / 384
        return [common | {"decode_ms_median": ms, "modelled_decode_ms_per_token": ms * 1.1,
                          "h2d_bytes_per_token": kv * 2**20, "batch_size": task["batch_size"],
                          "prompt_len": task["prompt_len"], "gen_len": task["gen_len"]}]
    return []


def synthetic_store(path: Path, keep=lambda i: True) -> None:
    """One run per configuration the report's commands compose today, of those whose index `keep` accepts."""
    presets = method_presets()
    commands = {c for section in report.discover() for c in section.commands}
    for i, text in enumerate(sorted({t for c in commands for t in compose.composed(c)})):
        config = json.loads(text) | {"data_dir": "/data", "results_dir": "results", "force": False,
                                     "logger": {"backends": []}}
        method = method_name(config["method"], presets)
        params = {k: v for k, v in config["method"].items() if k != "_target_"}
        digest = f"{i:016x}"
        rows = [{"config_hash": digest, "model": config["model"]["name"], "method": method,
                 "task": config["task"]["name"], "data": {},
                 "method_params": {"name": method, **params,
                                   "size_params": sorted(columns.LEGACY_SIZE_PARAMS.get(method, set()))},
                 "task_params": config["task"], "metrics": metrics, "config": config,
                 "meta": {"git_commit": "0" * 40, "device": "cpu", "threads": 2, "wall_s": 10.0 + i % 7,
                          "load_s": 5.0, "versions": {"torch": "2.13.0"}}}
                for metrics in synthetic_metrics(method, params, config["task"], i)]
        if rows and keep(i):
            store.append_rows(path, digest, rows)


def test_every_section_renders_a_verdict_from_a_full_store(tmp_path):
    synthetic_store(tmp_path / "store")
    out = regenerate(tmp_path / "gen", tmp_path / "store")
    text = (out / "results.md").read_text()
    # the speed sections read the performance model's own metrics (terms, validation ratios), which synthetic
    # rows do not carry: tests/test_perf.py runs the model; C4's verdict reads Fig. 13's twin rows
    # (tests/test_figures.py)
    own_rows = {"c7_modelled", "c7_validation", "c4_skewing", "memory", "sim_bench", "ops_decode", "ops_sim",
                "gemma3_speed", "gpu_measured"}
    missing = [s.title for s in report.discover() if s.slug not in own_rows
               and "not computed" in text.split(f"## {s.title}", 1)[1].split("\n## ", 1)[0]]
    assert not missing, f"sections without a verdict from a store holding every config: {missing}"
    assert "None: every stored run matches" in text
    for section in report.discover():
        if section.figure is not None and section.slug not in own_rows:
            assert (out / "report" / f"{section.slug}.png").exists(), section.slug


def test_a_partial_store_still_renders_with_missing_configs_named(tmp_path):
    """Every other config, and never a section's first: every section renders (figures with lone points, a verdict
    or the rows it needs) and names the commands of what is missing."""
    texts = sorted({t for s in report.discover() for c in s.commands for t in compose.composed(c)})
    first = {texts.index(min(t for c in s.commands for t in compose.composed(c))) for s in report.discover()
             if s.commands}
    synthetic_store(tmp_path / "store", keep=lambda i: i % 2 == 1 and i not in first)
    text = (regenerate(tmp_path / "gen", tmp_path / "store") / "results.md").read_text()
    # the op census sections are filled by a script (make bench-ops), never by a run config: no Missing line
    assert text.count("Missing (run, then `make export report`)") >= len([s for s in report.discover() if s.commands])


def test_memory_rows_of_bench_memory_give_the_slope(tmp_path):
    """Script rows (task memory) feed their own section, never the stale check of run.py commands."""
    from types import SimpleNamespace

    from experiments import bench_memory

    for model, points in (("gemma3-270m", ((1024, 2.3, 4.1), (2048, 2.9, 6.2))),
                          ("smollm2-135m", ((1024, 1.3, 1.6), (8192, 1.65, 5.2)))):
        for tokens, task_gb, forward_gb in points:
            bench_memory.write_row(str(tmp_path / "store"), SimpleNamespace(model=model, method="full"), tokens,
                                   int(task_gb * 1e9), int(forward_gb * 1e9), int(1.2e9), 14.0851, 14.0849)
    text = (regenerate(tmp_path / "gen", tmp_path / "store", figures=False) / "results.md").read_text()
    section = text.split("## Beyond the paper: evaluation memory along the sequence", 1)[1]
    # per model, the smaller first whatever order the rows were written in
    assert ("* smollm2-135m: peak RSS at 8192 tokens: ppl task 1.65 GB, the model's own forward 5.2 GB; growth "
            "1024..8192 tokens: ppl task 0.0488 MB/token, forward 0.502 MB/token\n* gemma3-270m: peak RSS at 2048 "
            "tokens: ppl task 2.9 GB, the model's own forward 6.2 GB; growth 1024..2048 tokens: ppl task 0.586 "
            "MB/token, forward 2.05 MB/token") in section
    assert "None: every stored run matches" in text


# ----------------------------------------------------------------------------------------------- verdict wording


def ppl_run(path: Path, digest: str, method: str, params: dict, ppl: float, kv: float = 1.0, threads: int = 1,
            wall_s: float = 105.0, model: str = "smollm2-135m", windows: int = 1, density: float | None = None) -> None:
    """A ppl run's row; over several windows each window's NLL varies by +-1% around the run's (paired units);
    `density`: the kept fraction on the artifact's axis (metrics.stats)."""
    nll = [math.log(ppl) * 1023 * (1 + 0.01 * ((w % 3) - 1)) for w in range(windows)]
    store.append_rows(path, digest, [{
        "config_hash": digest, "model": model, "method": method, "task": "ppl",
        "method_params": {"name": method, **params},
        "task_params": {"name": "ppl", "dataset": "wikitext2", "seq_len": 1024, "max_windows": windows},
        "metrics": {"ppl": ppl, "kv_fraction": kv, "windows": windows, "seq_len": 1024,
                    "units": {"id": [1024 * w for w in range(windows)], "nll": nll, "tokens": [1023] * windows}}
        | ({"stats": {"density": density}} if density is not None else {}),
        "config": {}, "meta": {"device": "cpu", "threads": threads, "wall_s": wall_s, "load_s": 5.0}}])


def test_sim_cost_ratios_only_against_full_at_the_same_thread_count(tmp_path):
    ppl_run(tmp_path, "a" * 16, "full", {}, 14.0, threads=2, wall_s=105.0)  # 100 s per window
    ppl_run(tmp_path, "b" * 16, "h2o", {"heavy": 0.1, "recent": 0.1}, 30.0, 0.2, threads=2, wall_s=55.0)
    ppl_run(tmp_path, "c" * 16, "quant", {"bits": 2}, 40.0, threads=1, wall_s=45.0)  # 1 thread: no full to match
    cost = sim_cost.sim_cost(matching.load(tmp_path)).set_index("method")
    assert cost.loc["h2o", "x full"] == pytest.approx(0.5)
    assert pd.isna(cost.loc["quant", "x full"])
    verdict = sim_cost.cost_verdict(matching.load(tmp_path))
    assert "h2o 0.5x" in verdict[0] and "quant" not in verdict[0]
    assert "1 setting(s) (quant) have no full run at their thread count" in verdict[1]


def test_an_alpha_sweep_still_falling_at_its_end_is_no_plateau(tmp_path):
    """Each point against the sweep's best, paired over 4 windows: a plateau is the run of points at the end that the
    best cannot be told apart from, not a fixed percentage."""
    for i, (alpha, ppl) in enumerate([(1.0, 1177.0), (3.0, 139.3), (5.0, 41.89), (7.0, 26.41), (9.0, 24.26)]):
        ppl_run(tmp_path, f"{i:016x}", "infinigen", {"alpha": alpha, "partial_ratio": 0.2, "budget": 0.2}, ppl,
                kv=0.05 + 0.02 * alpha, windows=4)
    ((who, verdict, words),) = c6_ablation.lines(matching.load(tmp_path), "alpha")
    assert verdict == "does not hold" and "perplexity still falls at the largest alpha swept" in words, words
    assert "7: x1.088 (1.088-1.089)" in words and "9: best" in words and "4 windows" in words, words
    ppl_run(tmp_path, f"{5:016x}", "infinigen", {"alpha": 11.0, "partial_ratio": 0.2, "budget": 0.2}, 24.26,
            kv=0.27, windows=4)
    ((who, verdict, words),) = c6_ablation.lines(matching.load(tmp_path), "alpha")
    assert verdict == "holds" and "plateau from alpha = 9 on" in words and "11: x1.000" in words, words


def test_successors_verdict_reads_the_oracle_as_the_bound_and_prints_no_missing_recall():
    """The successors section's verdict (committed rows): every compared method at each budget level; the oracle is
    the exact top-k, so when it leads the line also names the best of the others; Quest records no recall, and the
    line says nothing of it rather than 'recall n/a'."""
    rows = matching.match(matching.load(DOCS / "store"), successors.SUCCESSORS).rows
    levels = [line for line in successors.successors_verdict(rows) if line.split(" budgets (kv_fraction", 1)[0]
              in ("lower", "higher")]
    assert len(levels) == 2
    for line in levels:
        assert all(f"{m} " in line for m in ("rocketkv", "shadowkv", "infinigen", "oracle", "quest")), line
        assert "n/a" not in line
        best = line.split("most accurate: ", 1)[1]
        assert not best.startswith("oracle") or best.startswith("oracle (the exact top-k), of the others "), line


def test_gemma3_speed_reads_each_models_shape_from_its_config():
    """The Gemma 3 speed section (committed rows): each model's K|V per token and local layers from its own config,
    the bytes full offload moves from the model, and the comparison line naming both."""
    rows = matching.match(matching.load(DOCS / "store"), gemma3_speed.SECTION.commands).rows
    lines = gemma3_speed.verdict(rows)
    assert lines[0].startswith("smollm2-135m (30 layers x 3 KV head(s) x 64, bfloat16; every layer global): K|V 22.5 KiB")
    assert lines[2].startswith("gemma3-270m (18 layers x 1 KV head(s) x 256, bfloat16; 15 local layers with a "
                               "512-token window): K|V 18 KiB")
    assert lines[4].startswith("what the shape does: gemma3-270m's single KV head and local windows")
    table = gemma3_speed.table(rows)
    sent = table[table["method"] == "offload"].set_index("model")["MiB per step"]
    # per batch row: smollm2 sends 4096 positions x 22.5 KB; gemma3 1 KB per layer and position, of 4096 positions
    # on its 3 global layers and at most 511 on its 15 local ones
    assert sent["gemma3-270m"] / sent["smollm2-135m"] == pytest.approx((3 * 4096 + 15 * 511) / (4096 * 22.5), rel=0.01)


def test_validation_table_carries_each_points_measured_rounds():
    """The measured row's rounds give the table its range and the verdict the measured side's noise."""
    point = {"task": "latency", "metrics.validation_point": "h2o", "metrics.batch_size": 8, "metrics.prompt_len": 2048}
    df = pd.DataFrame([
        {**point, "metrics.timing": None, "metrics.decode_ms_median": 300.0,
         "metrics.decode_ms_rounds": [280.0, 300.0, 360.0]},
        {**point, "metrics.timing": "modelled", "metrics.decode_ms_median": 240.0,
         "metrics.measured_decode_ms": 300.0, "metrics.ratio": 0.8},
    ])
    row = speed.validation_rows(df).iloc[0]
    assert (row["measured_min"], row["measured_ms"], row["measured_max"]) == (280.0, 300.0, 360.0)
    assert speed.validation_verdict(df)[-1].endswith("= 27% at the median point, up to 27%")


def test_make_smoke_draws_the_modelled_speed_figure_beside_the_measured_ones(tmp_path, capsys):
    """`python -m analysis.speed --results R --out D` (make smoke, make figures): Figs. 14-16 modelled, every panel
    filled from the committed store's modelled rows; an empty store gets the panel saying what to run."""
    written = figures.main(["--results", str(ROOT / "docs" / "store"), "--out", str(tmp_path / "full")],
                           registry=speed.FIGURES)
    assert tmp_path / "full" / "fig14_16_modelled.png" in written
    assert "without data" not in capsys.readouterr().out
    figures.main(["--results", str(tmp_path / "nothing"), "--out", str(tmp_path / "empty")], registry=speed.FIGURES)
    assert "fig14_16_modelled: latency rows with task.timing=modelled" in capsys.readouterr().out



# ----------------------------------------------------------------------------------------------- recommended setting

# the claims whose verdicts report InfiniGen at a setting (c7_modelled models OPT-13B at the paper's values, the
# recommended ones for OPT; c7_validation checks the performance model, whatever the setting)
CLAIMS = ("c1_accuracy", "c2_baselines", "c3_position", "c4_skewing", "c5_eviction", "c6_ablation", "c7_speed")
LEAD = f"at the recommended setting for smollm2-135m ({recommended.describe(recommended.LLAMA)}"


# the claims that lead with the authors' semantics (The authors' code), their lines at the harness's own variant after
AUTHORS_FIRST = ("c1_accuracy", "c2_baselines", "c3_position", "c4_skewing", "c6_ablation")


def verdict_lines(text: str) -> dict[str, list[str]]:
    """Each section's verdict lines (the bullets under its "Verdict" heading) in a results.md."""
    titles = {s.title: s.slug for s in report.discover()}
    out = {}
    for chunk in text.split("\n## ")[1:]:
        title, _, body = chunk.partition("\n")
        verdict = body.split("**Verdict (computed from the store):**", 1)
        if title in titles and len(verdict) == 2:
            lines = verdict[1].strip().split("\n\n", 1)[0].splitlines()
            out[titles[title]] = [line.removeprefix("* ") for line in lines if line.strip()]
    return out


def first_lines(text: str) -> dict[str, str]:
    """Each section's first verdict line (the first bullet under its "Verdict" heading) in a results.md."""
    return {slug: lines[0] for slug, lines in verdict_lines(text).items()}


def leading_lines(text: str) -> dict[str, str]:
    """Each claim's first verdict line at the harness's own setting: its first line, or for the claims stated at the
    authors' semantics first (C1, C2), their first line beyond the paper, without that label."""
    beyond = f"{recommended.BEYOND} "
    return {slug: next((line.removeprefix(beyond) for line in lines if line.startswith(beyond)), lines[0])
            if slug in AUTHORS_FIRST else lines[0] for slug, lines in verdict_lines(text).items()}


def at_a_setting_other_than_recommended(line: str) -> list[str]:
    """The InfiniGen hyperparameters a verdict line names at other values than the recommended setting's."""
    def same(key: str, value: str) -> bool:
        wanted = recommended.LLAMA[key]
        return value == wanted if isinstance(wanted, str) else float(value) == wanted

    text = re.sub(r"`[^`]*`", "", line)  # a command that adds rows is not a setting the line reports
    found = re.findall(r"\b(skip_layers|alpha|partial_ratio|speculate_from)[ =](\w+(?:\.\d+)?)", text)
    return [f"{k}={v}" for k, v in found if not same(k, v)]


def test_every_claim_leads_with_the_recommended_setting(regenerated, tmp_path):
    """The committed store (where several claims have no rows at the recommended setting yet: their first line says
    so and names the command) and a store holding every config (where each claim has them): every claim's first
    verdict line at the harness's own setting is at the recommended setting, and none names another setting; C1 and
    C2 (and C3, C4, C6) state the claim at the authors' semantics before it (issue 61), that line beyond the paper."""
    synthetic_store(tmp_path / "store")
    texts = {"committed": (regenerated / "results.md").read_text(),
             "synthetic": (regenerate(tmp_path / "gen", tmp_path / "store", figures=False) / "results.md").read_text()}
    for store_name, text in texts.items():
        first, lead = first_lines(text), leading_lines(text)
        for slug in CLAIMS:
            line = lead[slug]
            assert line.startswith(LEAD) or line.startswith("not computed"), f"{store_name} {slug}: {line}"
            assert at_a_setting_other_than_recommended(line) == [], f"{store_name} {slug}: {line}"
            if slug in AUTHORS_FIRST:
                assert first[slug].startswith(f"{recommended.AUTHORS} on smollm2-135m ("), f"{store_name} {slug}"
                assert first[slug] != line, f"{store_name} {slug}: no line beyond the paper"
    full, lead = first_lines(texts["synthetic"]), leading_lines(texts["synthetic"])
    measured = [slug for slug in CLAIMS if "not in the store yet" not in full[slug] + lead[slug]]
    assert measured == list(CLAIMS), "with every config stored, each claim leads with a measurement"
    # the committed store: a claim's harness line is measured, or its rows are not of the section's one build (the
    # section counts the runs it refused: re-run at one commit, docs/store.md)
    committed, every = leading_lines(texts["committed"]), verdict_lines(texts["committed"])
    for slug in ("c1_accuracy", "c2_baselines"):
        assert "not in the store yet" not in committed[slug] or any(
            "one build per verdict" in line for line in every[slug]), f"{slug}: {committed[slug]}"


def test_the_checker_catches_a_first_line_at_the_papers_setting():
    line = "infinigen (skip_layers=1, partial_ratio=0.2) at measured kv_fraction >= 10%: at most 457% above full's"
    assert at_a_setting_other_than_recommended(line) == ["skip_layers=1", "partial_ratio=0.2"]
    assert at_a_setting_other_than_recommended(LEAD + "; selected on held-out windows): 12.4% above") == []


def test_the_docs_recommend_the_setting_the_report_leads_with():
    flat = lambda path: " ".join((ROOT / path).read_text().split())  # noqa: E731
    for family, setting in (("Llama", recommended.LLAMA), ("Gemma 3", recommended.SELECTED["gemma3_text"])):
        words = (f"skip_layers={setting['skip_layers']} alpha={setting['alpha']:g} "
                 f"partial_ratio={setting['partial_ratio']:g} speculate_from={setting['speculate_from']}")
        assert f"{family}: `{words}`" in flat("docs/methods.md"), family
        assert f"{family}: `{words}`" in flat("README.md"), family
    from omegaconf import OmegaConf

    # with no model (a method built on its own) the knobs resolve to the paper's values; per family: test_evidence.py
    alone = OmegaConf.create({"data_dir": None, "method": OmegaConf.load(ROOT / "conf" / "method" / "infinigen.yaml")})
    defaults = OmegaConf.to_container(alone, resolve=True)["method"]
    assert {k: defaults[k] for k in recommended.KEYS} == recommended.PAPER


def test_a_missing_line_names_the_commands_of_the_rows_model():
    """Gemma 3's rows lacking a claim's runs get Gemma 3's commands, not the SmolLM2 commands the section lists."""
    rows = pd.DataFrame({"model": ["gemma3-270m"], "method": ["full"], "method_params.budget": [float("nan")]})
    line = recommended.missing(rows, "python run.py -m model=smollm2-135m task=ppl method=full")
    assert "`python run.py -m task=ppl method=full model=gemma3-270m` adds them" in line, line
    assert "smollm2" not in line, line


def test_c1_leads_with_the_recommended_rows_whatever_order_the_rows_come_in(tmp_path):
    """The paper's rows sort first in the store and are worse: the harness's line is still the recommended
    setting's (the paired 16-window comparison, or the command that adds it); one-window rows give no verdict line
    (they are in the table)."""
    ppl_run(tmp_path, "0" * 16, "full", {}, 14.0)
    paper = {"alpha": 4.0, "partial_ratio": 0.2, "skip_layers": 1, "speculate_from": "previous"}
    for i, budget in enumerate((0.1, 0.2)):
        ppl_run(tmp_path, f"{i + 1:016x}", "infinigen", paper | {"budget": budget}, 70.0 - 10 * i, kv=0.11 + 0.02 * i)
    ppl_run(tmp_path, "f" * 16, "infinigen", recommended.LLAMA | {"budget": 0.1}, 15.8, kv=0.17)
    line = c1_accuracy.paired_ppl_line(matching.load(tmp_path))
    assert line.startswith(LEAD) and "not in the store yet" in line, line
    assert not [v for v in c1_accuracy.c1_verdict(matching.load(tmp_path)) if "one window" in v]
    ppl_run(tmp_path, "e" * 16, "full", {}, 14.0, windows=16)
    for i, (ppl, kv) in enumerate(((16.1, 0.13), (14.5, 0.2), (14.2, 0.3))):
        ppl_run(tmp_path, f"d{i}".ljust(16, "0"), "infinigen", recommended.LLAMA | {"budget": kv / 2}, ppl, kv=kv,
                windows=16)
    line = c1_accuracy.paired_ppl_line(matching.load(tmp_path))
    assert line.startswith(LEAD + "; selected on held-out windows): WikiText-2, 16 windows of 1,024 tokens"), line
    assert "kv 13% x1.150" in line and "within 5% of full's perplexity at kv_fraction >= 10%: does not hold " \
        "(holds from kv_fraction 20% on)" in line, line


def test_a_per_model_claim_gives_verdicts_tables_and_figures_per_model_and_says_where_they_disagree(tmp_path):
    """C1 on two models: each model's lines (the recommended setting's lead names its model, the others are
    prefixed with it), then the models side by side; the table gets a model column; one figure per model."""
    for model, full, gen in (("smollm2-135m", 14.0, 14.2), ("gemma3-270m", 10.0, 30.0)):
        ppl_run(tmp_path, f"{model[:1]}0".ljust(16, "0"), "full", {}, full, model=model, windows=16)
        ppl_run(tmp_path, f"{model[:1]}1".ljust(16, "0"), "infinigen", recommended.LLAMA | {"budget": 0.1}, gen,
                kv=0.17, model=model, windows=16)
    rows = matching.load(tmp_path)
    lines = render.verdict(c1_accuracy.SECTION, rows)
    # no row at the authors' semantics: its line first, naming the command that adds them; the harness's next
    assert lines[0].startswith(f"{recommended.AUTHORS} on smollm2-135m (") and "not in the store yet" in lines[0] \
        and "method=infinigen_reference method.budget=0.1,0.2,0.3,0.4,0.6`" in lines[0], lines
    assert lines[1].startswith(f"{recommended.AUTHORS} on smollm2-135m (") and lines[1].endswith("(lm-eval)"), lines
    assert lines[2].startswith(f"{recommended.BEYOND} {LEAD}") and "kv 17% x1.014" in lines[2] \
        and ": holds (" in lines[2], lines
    gemma = [line for line in lines if line.startswith(f"{recommended.BEYOND} at the recommended setting for gemma3")]
    assert len(gemma) == 1 and "kv 17% x2.998" in gemma[0] and "does not hold" in gemma[0], lines
    assert lines[-1].startswith("across models, InfiniGen's (recommended) perplexity over full's") \
        and lines[-1].endswith("smollm2-135m 1.01 (holds), gemma3-270m 3 (does not hold): the models disagree (holds "
                               "on smollm2-135m only)"), lines[-1]
    assert [line.split(":")[0] for line in lines if "lm-eval rows" in line] == ["smollm2-135m", "gemma3-270m"]
    table = render.tables_of(c1_accuracy.SECTION, rows)[0]
    assert list(table["model"]) == ["smollm2-135m"] * 2 + ["gemma3-270m"] * 2 and table.columns[0] == "model"
    assert [stem for stem, _ in render.figure_parts(c1_accuracy.SECTION, rows)] == [
        "c1_accuracy", "c1_accuracy_gemma3-270m"]
    one = rows[rows["model"] == "smollm2-135m"]  # one model: the section as before, no prefix, no contrast
    assert render.verdict(c1_accuracy.SECTION, one) == c1_accuracy.c1_verdict(one)
    summary = [(model, st.claim.split(" (", 1)[1], st.verdict) for model, st in
               render.statuses(c1_accuracy.SECTION, rows) if st.claim.startswith("C1: perplexity")]
    assert summary == [("smollm2-135m", "the authors' semantics)", "not measured"),
                       ("smollm2-135m", "the harness's variant, beyond the paper)", "holds"),
                       ("gemma3-270m", "the authors' semantics)", "not measured"),
                       ("gemma3-270m", "the harness's variant, beyond the paper)", "does not hold")]
    held = [("smollm2-135m", [Contrast("gap ratio", 2.0, True)]), ("gemma3-270m", [Contrast("gap ratio", 0.5, False)])]
    assert across(held) == ["across models, gap ratio: smollm2-135m 2 (holds), gemma3-270m 0.5 (does not hold): "
                            "the models disagree (holds on smollm2-135m only)"]
    assert across([(m, [Contrast("x", 1.0, True)]) for m in ("a", "b")])[0].endswith("agree (holds on every one)")
    assert on_model("python run.py -m model=smollm2-135m task=ppl", "gemma3-270m") == \
        "python run.py -m task=ppl model=gemma3-270m"


def lm_eval_run(path: Path, digest: str, method: str, params: dict, accs: dict, n: int, kv: float,
                limit: int | None = 500, per_doc: bool = True, shots: int = 5) -> None:
    """A run's rows; each doc right or wrong (per_doc): the first round(acc x n) docs right, so two runs disagree
    only on the docs between their counts."""
    store.append_rows(path, digest, [{
        "config_hash": digest, "model": "smollm2-135m", "method": method, "task": "lm_eval",
        "method_params": {"name": method, **params}, "task_params": {"name": "lm_eval", "limit": limit},
        "metrics": {"task": task, "acc": acc, "acc_stderr": (acc * (1 - acc) / (n - 1)) ** 0.5, "n": n,
                    "limit": limit, "num_fewshot": shots, "protocol": "paper", "kv_fraction": kv}
        | ({"units": {"id": list(range(n)), "acc": [float(d < round(acc * n)) for d in range(n)]}} if per_doc else {}),
        "config": {}, "meta": {"git_commit": "a" * 40 if method == "full" else "b" * 40 + "-dirty"}}
        for task, acc in accs.items()])


def test_accuracy_differences_are_paired_per_doc_against_the_margin(tmp_path):
    """n per task, each accuracy's 95% interval, and the difference from full's on the same docs with its paired
    interval; C1 pools the docs of the tasks where full is above chance and tests the 2-point margin; C2 pairs
    InfiniGen with H2O at the same relative KV size."""
    full = {"copa": 0.70, "piqa": 0.65}
    lm_eval_run(tmp_path, "0" * 16, "full", {}, full, 500, 1.0)
    lm_eval_run(tmp_path, "1" * 16, "infinigen", recommended.LLAMA | {"budget": 0.07}, {"copa": 0.69, "piqa": 0.55},
                500, 0.15)
    lm_eval_run(tmp_path, "2" * 16, "h2o", {"heavy": 0.0625, "recent": 0.0625}, {"copa": 0.60, "piqa": 0.54}, 500,
                0.16)
    rows = matching.load(tmp_path)
    table = c1_accuracy.A.table(rows).set_index(["method", "task"])
    assert table.loc[("infinigen", "piqa"), "n"] == 500
    assert table.loc[("infinigen", "piqa"), "± 95% (points)"] == pytest.approx(196 * (0.55 * 0.45 / 499) ** 0.5)
    assert table.loc[("infinigen", "piqa"), "interval"] == "paired"
    assert table.loc[("infinigen", "piqa"), "Δ full (points)"] == pytest.approx(-10.0)
    line = c1_accuracy.lm_eval_lines(rows)[0][0]
    assert line.startswith("lm-eval at the recommended setting, budget 0.07 (up to the first 500 docs of each task)"), \
        line
    assert "over the 1000 docs of copa, piqa (full above chance; each doc alike): -5.5 points" in line, line
    assert "0 docs gained, 55 lost" in line and "within 2 points of full's accuracy: does not hold" in line, line
    versus = c2_baselines.lm_eval_lines(rows)
    assert len(versus) == 1 and "h2o (heavy=0.0625, recent=0.0625)" in versus[0], versus
    assert ("InfiniGen minus h2o over the 1000 docs of copa, piqa (full above chance; the tasks both ran): +5.0 "
            "points") in versus[0], versus
    # rows stored before per-doc results: the unpaired interval, said so
    lm_eval_run(tmp_path / "old", "0" * 16, "full", {}, full, 500, 1.0, per_doc=False)
    lm_eval_run(tmp_path / "old", "1" * 16, "infinigen", recommended.LLAMA | {"budget": 0.07},
                {"copa": 0.69, "piqa": 0.55}, 500, 0.15, per_doc=False)
    line = c1_accuracy.lm_eval_lines(matching.load(tmp_path / "old"))[0][0]
    assert "unpaired: rows without per-doc results" in line and "does not hold" not in line, line


def test_c1_and_c2_on_lm_eval_at_the_authors_semantics_pool_every_doc_of_the_tasks_above_chance(tmp_path):
    """Zero-shot, every doc: infinigen_reference against full (the 2-point margin) and against h2o_reference (above
    it), pooled over the tasks where full is above chance (ARC-Challenge's 24% is not above its 25%)."""
    knobs = {"skip_layers": 2, "alpha": 5.0, "partial_ratio": 0.2, "speculate_from": "previous", "budget": 0.2}
    args = dict(n=1000, limit=None, shots=0)
    lm_eval_run(tmp_path, "0" * 16, "full", {}, {"piqa": 0.65, "arc_easy": 0.50, "arc_challenge": 0.24}, kv=1.0,
                **args)
    lm_eval_run(tmp_path, "1" * 16, "infinigen_reference", knobs, {"piqa": 0.64, "arc_easy": 0.49,
                                                                   "arc_challenge": 0.20}, kv=0.4, **args)
    lm_eval_run(tmp_path, "2" * 16, "h2o_reference", {"heavy": 0.1, "recent": 0.1},
                {"piqa": 0.60, "arc_easy": 0.45, "arc_challenge": 0.20}, kv=0.45, **args)
    rows = matching.load(tmp_path)
    effect, line = c1_accuracy.authors_lm_effect(rows)
    assert effect.n == 2000 and effect.value == pytest.approx(-0.01) and effect.lost == 20, effect
    assert "over the 2,000 docs of arc_easy, piqa (full above chance" in line and line.endswith(": holds"), line
    status = [s for s in c1_accuracy.c1_status(rows) if "lm-eval" in s.claim and "authors" in s.claim][0]
    assert status.verdict == "holds" and status.number.startswith("-1.0 points (") and "n = 2,000 docs" in \
        status.number, status
    line = c2_baselines.authors_lm_line(rows)
    assert "InfiniGen's accuracy minus H2O's over the 2,000 docs of arc_easy, piqa" in line, line
    assert "+4.0 points" in line and line.endswith("above H2O's: holds"), line


def test_lines_over_more_docs_per_task_come_first(tmp_path):
    """The same points at 100 and 500 docs per task, the 100-doc runs first in the store: C1's and C2's lines over
    500 docs come first, each compared with full's and H2O's rows at its own size."""
    for limit in (100, 500):
        tag = str(limit)[0]
        lm_eval_run(tmp_path, tag + "0" * 15, "full", {}, {"copa": 0.70}, limit, 1.0, limit=limit)
        lm_eval_run(tmp_path, tag + "1" * 15, "infinigen", recommended.LLAMA | {"budget": 0.07}, {"copa": 0.69},
                    limit, 0.15, limit=limit)
        lm_eval_run(tmp_path, tag + "2" * 15, "h2o", {"heavy": 0.0625, "recent": 0.0625}, {"copa": 0.60}, limit,
                    0.16, limit=limit)
    rows = matching.load(tmp_path)
    c1 = c1_accuracy.lm_eval_lines(rows)[0]
    for lines in (c1[:2], c2_baselines.lm_eval_lines(rows)):
        assert len(lines) == 2, lines
        assert "(up to the first 500 docs of each task" in lines[0] and "over the 500 docs of copa" in lines[0], lines
        assert "(up to the first 100 docs of each task" in lines[1] and "over the 100 docs of copa" in lines[1], lines
    assert [line.split(":")[0] for line in c1[2:]] == [
        "lm-eval, full attention (up to the first 500 docs of each task)",
        "lm-eval, full attention (up to the first 100 docs of each task)"], c1


def test_c1_says_on_which_tasks_full_attention_is_above_chance(tmp_path):
    """OpenBookQA has four choices: 22% over 500 docs is not above its 25% (interval +-3.6 points), nor is 17%
    (below it); COPA's 70% is above 50%; the line names each with its chance level."""
    lm_eval_run(tmp_path, "0" * 16, "full", {}, {"copa": 0.70, "openbookqa": 0.22, "piqa": 0.17}, 500, 1.0)
    line = c1_accuracy.lm_eval_lines(matching.load(tmp_path))[0][-1]
    assert line == ("lm-eval, full attention (up to the first 500 docs of each task): above chance (95% interval) on "
                    "copa 70.0% (chance 50%); not on openbookqa 22.0% (chance 25%), piqa 17.0% (chance 50%); the "
                    "pooled differences above leave those out"), line


def test_each_section_says_which_commits_produced_its_rows(tmp_path):
    lm_eval_run(tmp_path, "0" * 16, "full", {}, {"copa": 0.7}, 100, 1.0)
    lm_eval_run(tmp_path, "1" * 16, "h2o", {"heavy": 0.1, "recent": 0.1}, {"copa": 0.6}, 100, 0.2)
    lm_eval_run(tmp_path, "2" * 16, "quant", {"bits": 4}, {"copa": 0.6}, 100, 1.0)
    assert matching.commits(matching.load(tmp_path)) == (
        "bbbbbbb-dirty (2 runs), aaaaaaa (1 run); -dirty: uncommitted changes on top of the commit")
    assert "rows by commit: bbbbbbb-dirty (2 runs), aaaaaaa (1 run)" in matching.provenance(matching.load(tmp_path))


def test_the_semantic_configs_ruler_names_are_the_generators():
    from experiments.lm_eval_tasks import ruler
    from infinigen import semantic

    assert set(semantic.RULER_TASK_NAMES) == set(ruler.RULER_TASKS)
    assert set(semantic.RULER_QA_TASKS) == set(ruler.QA)


def test_a_section_is_one_module_found_by_its_order(tmp_path, monkeypatch):
    """Sections are discovered from the package, placed by `order`; two sharing an order (or a slug) are refused."""
    package = tmp_path / "more_sections"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = ("from analysis.report.section import Section\n"
            "SECTION = Section({slug!r}, 'T', 'claim', (), lambda r: r, lambda r: [], order={order})\n")
    (package / "late.py").write_text(body.format(slug="late", order=20))
    (package / "early.py").write_text(body.format(slug="early", order=10))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    monkeypatch.setattr(report, "sections_package", importlib.import_module("more_sections"))
    assert [s.slug for s in report.discover()] == ["early", "late"]
    (package / "clash.py").write_text(body.format(slug="clash", order=10))
    with pytest.raises(ValueError, match="share the order"):
        report.discover()


# ----------------------------------------------------------------------------------------------- the authors' code


def authors_run(path: Path, digest: str, command: str, nll: list[float], kv: float, density: float | None) -> None:
    """The row a command's (one) job writes: its composed config, each window's summed NLL, kv_fraction and the
    kept fraction on the artifact's axes (density, retain) where given."""
    config = compose.jobs(command)[0]
    method = method_name(config["method"], method_presets())
    t, windows = config["task"]["seq_len"], len(nll)
    stats = {} if density is None else {"density": density, "retain": 1 - math.sqrt(1 - density)}
    store.append_rows(path, digest, [{
        "config_hash": digest, "model": config["model"]["name"], "method": method, "task": "ppl",
        "method_params": {"name": method, **{k: v for k, v in config["method"].items() if k != "_target_"}},
        "task_params": config["task"], "config": config,
        "metrics": {"ppl": math.exp(sum(nll) / (windows * (t - 1))), "kv_fraction": kv, "windows": windows,
                    "seq_len": t, "units": {"id": [t * w for w in range(windows)], "nll": nll,
                                            "tokens": [t - 1] * windows}, "stats": stats},
        "meta": {"git_commit": "0" * 40, "device": "cpu", "threads": 2}}])


def test_the_authors_code_sets_the_artifact_beside_the_reference_and_names_each_missing_run(tmp_path):
    """The section "The authors' code" (issue 61) from a few rows: per model the artifact's perplexity and kept
    fraction (from the golden files: density over the recorded layers, every head and window; retain = 1 -
    sqrt(1 - density)) beside the reference setting's and the harness's variant's, each missing run named by the
    overrides that add it (and its command in the Missing list); the artifact's side shows with no row at all."""
    from analysis.report.sections import authors_code as A

    gold = json.loads((REFERENCE / "smollm2_mha_2048.json").read_text())
    runs = gold["runs"]
    ref, variant = "method=infinigen_reference method.alpha=5.2 method.budget=0.2", \
        f"method=infinigen method.alpha=5.2 method.budget=0.2 {A.VARIANT}"
    base = runs["2048/infinigen_a5.2_b0.2"]["window_nll"]
    authors_run(tmp_path, "1" * 16, A.command(A.SMOLLM2, "method=full"), runs["2048/full"]["window_nll"], 1.0, None)
    authors_run(tmp_path, "2" * 16, A.command(A.SMOLLM2, ref), [x * 1.001 for x in base], 0.3, 0.15)
    authors_run(tmp_path, "3" * 16, A.command(A.SMOLLM2, variant), [x * 1.05 for x in base], 0.25, 0.2)
    flipped = f"{ref} method.budget_of=prefix"
    authors_run(tmp_path, "4" * 16, A.command(A.SMOLLM2, flipped), [x * (1.02 + 0.01 * (w % 2))
                                                                       for w, x in enumerate(base)], 0.28, 0.14)
    rows = matching.match(matching.load(tmp_path), A.SECTION.commands).rows
    assert rows["method"].tolist() == ["full", "infinigen_reference", "infinigen", "infinigen_reference"]

    table = A.comparison(rows, REFERENCE, A.SMOLLM2).set_index(["method", "setting"])
    point = table.loc[("InfiniGen", "alpha 5.2, budget 0.2")]
    kept = runs["2048/infinigen_a5.2_b0.2"]["kept"]
    density = sum(map(sum, kept.values())) / (28 * 9 * 4 * 2048 * 2049 / 2)  # layers 2-29, 9 heads, 4 windows
    assert point["artifact ppl"] == pytest.approx(math.exp(sum(base) / (4 * 2047)))
    assert point["artifact density (%)"] == pytest.approx(100 * density)
    assert point["artifact retain (%)"] == pytest.approx(100 * (1 - math.sqrt(1 - density)))
    assert point["reference vs artifact (%)"] == pytest.approx(100 * (math.exp(0.001 * sum(base) / (4 * 2047)) - 1))
    assert (point["reference kv_fraction (%)"], point["reference density (%)"]) == pytest.approx((30, 15))
    assert point["variant ppl"] == pytest.approx(math.exp(1.05 * sum(base) / (4 * 2047)))
    assert point["not in the store yet (its method overrides)"] == ""
    full = table.loc[("full", "")]
    assert (full["artifact density (%)"], full["reference density (%)"], full["reference vs artifact (%)"]) == \
        pytest.approx((100, 100, 0))
    missing = table.loc[("InfiniGen", "alpha 4, budget 0.2"), "not in the store yet (its method overrides)"]
    assert missing == ("`method=infinigen_reference method.alpha=4.0 method.budget=0.2`; "
                       f"`method=infinigen method.alpha=4.0 method.budget=0.2 {A.VARIANT}`")
    assert table.loc[("H2O", "heavy = recent = 0.01875"), "artifact ppl"] == pytest.approx(
        math.exp(sum(runs["2048/h2o_0.01875"]["window_nll"]) / (4 * 2047)))

    flips = A.flips(rows).set_index(["method", "option flipped"])
    effect = P.perplexity_ratio(rows.iloc[3]["metrics.units"], rows.iloc[1]["metrics.units"])
    assert flips.loc[("InfiniGen", "budget_of: sequence -> prefix"), "x reference (95% paired interval)"] == \
        f"x{effect.value:.3f} ({effect.low:.3f}-{effect.high:.3f})"
    assert flips.loc[("InfiniGen", "threshold_head: first -> own"), "not in the store yet"] == \
        f"`{ref} method.threshold_head=own`"

    lines = A.verdict(rows, REFERENCE)
    # NLL x 1.001: perplexity x exp(0.001 x 3.38 nats per token)
    assert lines[0] == ("smollm2-135m (multi-head, 4 x 2,048 tokens, float32): the reference settings' perplexity is "
                        "within 0.34% of the artifact's on 2 of 6 runs (largest: InfiniGen alpha 5.2, budget 0.2 "
                        "+0.338%), their density within 0.97 points of the artifact's; the harness's own variants: "
                        "perplexity +18.4% to +18.4% from the artifact's (1 of 5 runs); 4 setting(s) with runs not in "
                        "the store yet (the table's last column)"), lines[0]
    assert lines[1].startswith("tiny-opt (2 x 1,024 tokens, float64): the reference settings are not in the store "
                               "yet"), lines[1]
    assert lines[2].startswith("each difference alone (SmolLM2-135M multi-head, 4 x 2,048 tokens), perplexity over "
                               f"the reference's (95% paired interval over the windows): InfiniGen budget_of=prefix "
                               f"x{effect.value:.3f}") and lines[2].endswith("(8 not in the store yet)"), lines[2]

    out = tmp_path / "docs"
    section = report.with_reference(A.SECTION, REFERENCE)
    text = render.section_text(section, matching.match(matching.load(tmp_path), section.commands),
                               render.verdict(section, rows), out, "report", figures=False)
    assert text.startswith("## The authors' code\n") and render.anchor(A.SECTION.title) == "the-authors-code"
    assert "4 of 31 configs in the store" in text
    assert f"* 1 config(s) of `{A.command(A.SMOLLM2, 'method=infinigen_reference method.alpha=4.0 method.budget=0.2')}`" \
        in text
    smollm2, rest = text.split("**SmolLM2-135M made multi-head", 1)[1].split("**tiny-opt", 1)
    assert "with its own six-sentence partial-weight calibration prompt" in smollm2
    assert smollm2.index("| InfiniGen | alpha 5.2, budget 0.2 |") < smollm2.index("six-sentence")
    assert "tests/test_reference.py (float64, 256-token windows: perplexity within 0.1%, kept entries within 1%, " \
        "kept sets identical on >= 99.9% of rows)" in text and "[reference.md](reference.md)" in text
    # an empty store: the artifact's columns, every run named
    empty = render.section_text(section, matching.match(matching.load(tmp_path / "none"), section.commands),
                                ["none"], out, "report", figures=False)
    assert "| full |  | 24.15 | 100 | 100 | `method=full` |" in empty
    assert "| H2O | heavy = recent = 0.1 | 499.4 | 35.86 | 19.91 | `method=h2o_reference method.heavy=0.1 " \
           "method.recent=0.1`; `method=h2o method.heavy=0.1 method.recent=0.1` |" in empty


def test_the_reports_second_input_is_the_reference_folder(tmp_path, monkeypatch):
    """`--reference` names the golden values' folder (default tests/data/reference): the section reads it, no other."""
    seen = {}
    monkeypatch.setattr(report, "report", lambda *args, **kw: seen.update(args=args, kw=kw))
    report.main(["--store", str(tmp_path), "--out", str(tmp_path / "out"), "--readme", ""])
    assert Path(seen["kw"]["reference"]) == REFERENCE == ROOT / "tests" / "data" / "reference"
    report.main(["--store", str(tmp_path), "--out", str(tmp_path / "out"), "--readme", "", "--reference", "elsewhere"])
    assert seen["kw"]["reference"] == "elsewhere"
    assert [s.slug for s in report.discover() if s.reference] == ["authors_code"]


def test_c1_and_c2_state_each_claim_at_the_authors_semantics_first(tmp_path):
    """C1 and C2 (issue 61): the line at the authors' semantics (infinigen_reference against full, and against
    h2o_reference at the same kv_fraction, paired over 16 windows, density beside kv_fraction) first, then the
    harness's variant, beyond the paper (here: not in the store yet); the summary lists both, the authors' first."""
    ppl_run(tmp_path, "0" * 16, "full", {}, 14.0, windows=16)
    ref = {"skip_layers": 2, "alpha": 5.0, "partial_ratio": 0.2, "speculate_from": "previous", "budget_of": "sequence"}
    for i, (budget, ppl, kv, density) in enumerate(((0.1, 16.0, 0.2, 0.1), (0.2, 14.5, 0.3, 0.19),
                                                     (0.3, 14.2, 0.4, 0.28))):
        ppl_run(tmp_path, f"a{i}".ljust(16, "0"), "infinigen_reference", ref | {"budget": budget}, ppl, kv=kv,
                windows=16, density=density)
    for i, (r, ppl, kv, density) in enumerate(((0.05, 20.0, 0.25, 0.1), (0.1, 15.5, 0.35, 0.2))):
        ppl_run(tmp_path, f"b{i}".ljust(16, "0"), "h2o_reference", {"heavy": r, "recent": r}, ppl, kv=kv, windows=16,
                density=density)
    rows = matching.load(tmp_path)
    authors = (f"{recommended.AUTHORS} on smollm2-135m (`method=infinigen_reference`, the InfiniGen artifact's "
               "algorithm with skip_layers 2, alpha 5, partial_ratio 0.2; [The authors' code](#the-authors-code)): ")
    c1 = render.verdict(c1_accuracy.SECTION, rows)
    assert c1[0].startswith(authors + "WikiText-2, 16 windows of 1,024 tokens, perplexity over full's with its 95% "
                            "paired interval: kv 20% (density 10%) x1.143 ("), c1[0]
    assert "kv 30% (density 19%) x1.036 (" in c1[0] and "kv 40% (density 28%) x1.014 (" in c1[0], c1[0]
    assert c1[0].endswith("within 5% of full's perplexity at kv_fraction >= 10%: does not hold (holds from "
                          "kv_fraction 30% on)"), c1[0]
    assert c1[2].startswith(f"{recommended.BEYOND} {LEAD}") and "not in the store yet" in c1[2], c1[2]
    c2 = render.verdict(c2_baselines.SECTION, rows)
    assert c2[0].startswith(authors.replace("`method=infinigen_reference`", "`method=infinigen_reference` vs "
                                            "`method=h2o_reference`") + "WikiText-2, 16 windows, InfiniGen's "
                            "perplexity over H2O's at the same kv_fraction (95% paired interval): vs H2O (0.05 + "
                            "0.05) at 25% (density 10%): x0.762 ("), c2[0]
    assert "InfiniGen interpolated): better; vs H2O (0.1 + 0.1) at 35% (density 20%): x0.926 (" in c2[0], c2[0]
    assert c2[2].startswith(f"{recommended.BEYOND} {LEAD}") and "not in the store yet" in c2[2], c2[2]
    summary = [(st.claim, st.verdict) for section in (c1_accuracy.SECTION, c2_baselines.SECTION)
               for _, st in render.statuses(section, rows) if "perplexity" in st.claim]
    assert summary == [
        ("C1: perplexity within 5% of full's above 10% KV (the authors' semantics)", "does not hold"),
        ("C1: perplexity within 5% of full's above 10% KV (the harness's variant, beyond the paper)", "not measured"),
        ("C2: perplexity below H2O's at the same KV size (the authors' semantics)", "holds"),
        ("C2: perplexity below H2O's at the same KV size (the harness's variant, beyond the paper)", "not measured"),
        ("C2: perplexity below KV quantisation's at the same KV size (the harness's variant, beyond the paper)",
         "not measured")]
    number = render.statuses(c1_accuracy.SECTION, rows)[0][1].number
    assert number.startswith("x1.143 (") and "at kv 20% (density 10%); holds from kv_fraction 30% on" in number
