"""The performance model's `paper` schedule (infinigen/offload/paper.py): the InfiniGen artifact's runtime, each
of its differences from this project's runtime a switch that moves the number the way its cost says, the paper's
metrics, and the Fig. 15 preset computed in seconds without weights."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import ROOT
from experiments.validate_gpu import method_of
from infinigen.offload import paper
from infinigen.offload.profile import hardware

POINTS = {"ideal": ("full", {}), "flexgen": ("offload", {}), "int4": ("quant", {"bits": 4}),
          "h2o": ("h2o", {"heavy": 0.1, "recent": 0.1}),
          "infinigen": ("infinigen", {"alpha": 4.0, "budget": 0.2, "partial_ratio": 0.2, "capacity": 1.0})}


def hw():
    return hardware(yaml.safe_load((ROOT / "conf" / "hardware" / "a6000_pcie3.yaml").read_text()))


def model(name: str = "opt-13b"):
    return OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")


def run(point: str, batch: int = 20, prompt: int = 1920, gen: int = 16, name: str = "opt-13b", **switches):
    conf, over = POINTS[point]
    return paper.modelled(method_of(conf, over), model(name), hw(), "auto", batch, prompt, gen, "paper", switches)


@pytest.mark.parametrize("point", list(POINTS))
def test_each_method_maps_to_the_artifacts_scheme(point):
    """From what the method declares (its layers' kinds and pools), not its class; InfiniGen's first two layers
    load their whole cache, as the artifact's do."""
    got = run(point, gen=2)["schemes"]
    assert set(got) == {point} if point != "infinigen" else got[:3] == ["flexgen", "flexgen", "infinigen"]


@pytest.mark.parametrize("point,switch,value,faster", [
    ("h2o", "serial", False, True),  # movement beside the previous layer's compute
    ("infinigen", "dense_layers", 0, True),  # layers 0-1 no longer load their whole cache
    ("h2o", "pageable", False, True),  # no host copy into pinned staging
    ("infinigen", "pageable", False, True),
    ("h2o", "fixed_h2o", False, True),  # no half-prompt heavy-hitter set on layers 0-1
    ("int4", "serial_dequant", False, True),  # attention reads the codes
    ("flexgen", "weight_offload", 0.3, False),  # 30% of the weights cross every layer
])
def test_each_switch_moves_the_step_as_its_cost_says(point, switch, value, faster):
    base, changed = run(point), run(point, **{switch: value})
    assert (changed["decode_ms_median"] < base["decode_ms_median"]) is faster, (base, changed)


def test_opt30b_runs_with_30_percent_of_its_weights_on_the_host_as_the_artifact_did():
    r = run("infinigen", batch=4, gen=2, name="opt-30b")
    assert r["switches"]["weight_offload"] == 0.3 and r["weights_ms"] > 0
    assert run("infinigen", batch=4, gen=2)["switches"]["weight_offload"] == 0.0


def test_throughput_is_flexgens_prefill_included():
    r = run("int4", batch=8, gen=16)
    assert r["tokens_per_s"] == pytest.approx(8 * 16 / (r["prefill_s"] + r["decode_s"]))
    assert r["total_s"] == pytest.approx(r["prefill_s"] + r["decode_s"])
    # run_flexgen: the prefill yields the first token, then gen_len - 1 timed decode steps (sum(costs[1:]))
    assert r["decode_tokens_per_s"] == pytest.approx(8 * 15 / r["decode_s"])
    one_more = run("int4", batch=8, gen=17)
    assert one_more["decode_s"] - r["decode_s"] == pytest.approx(r["decode_s"] / 15, rel=0.05)


def test_the_paper_fetch_interpolates_its_reported_points():
    assert paper.paper_fetch(512) == 37 and paper.paper_fetch(2048) == 73 and paper.paper_fetch(4096) == 73
    assert paper.paper_fetch(768) == pytest.approx(48.5)


def test_bad_switches_are_named():
    with pytest.raises(ValueError, match="task.paper.overlap: unknown switch"):
        paper.switches({"overlap": True})
    with pytest.raises(ValueError, match="task.paper.dense_layers must be an integer >= 0"):
        paper.switches({"dense_layers": -1})


def test_fig15_preset_prints_tokens_per_s_per_method_and_batch_in_seconds(tmp_path):
    """`python run.py -m +experiment=fig15_paper_modelled`: 25 modelled rows (7 s on an idle 2-core machine)."""
    out = subprocess.run([sys.executable, "run.py", "-m", "+experiment=fig15_paper_modelled",
                          f"results_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for f in (tmp_path / "rows").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(rows) == 25 and all(r["metrics"]["schedule"] == "paper" for r in rows)
    assert {(r["method"], r["metrics"]["batch_size"]) for r in rows} == {
        (m, b) for m in ("full", "offload", "quant", "h2o", "infinigen") for b in (4, 8, 12, 16, 20)}
    assert out.stdout.count("'tokens_per_s'") == 25


def unlike_pairs(lines: list[str]) -> list[str]:
    """Verdict lines that put a modelled ratio beside a paper ratio of another baseline (or a claim with none)."""
    bad = []
    for line in lines:
        if "paper" not in line or not re.search(r"\d\.\d+x", line):
            continue
        ours = re.search(r"over (?P<a>.+?) at ", line)
        theirs = re.search(r"\(paper: (?:up to )?[\d.]+x over (?P<b>[^)]+)\)", line)
        if theirs and (not ours or ours["a"] != theirs["b"]):
            bad.append(line)
    return bad


def test_the_like_with_like_check_catches_the_old_headline():
    old = ("InfiniGen over full offload at opt-13b, batch 20: 7.04x modelled (paper: up to 3.00x over prior "
           "offloading methods)")
    good = ("InfiniGen over INT4 at opt-13b, batch 20, 1920 + 128 (tokens/s, prefill included): modelled 2.88x on "
            "the paper's runtime (paper: 3.00x over INT4)")
    assert unlike_pairs([old, good]) == [old]


def test_c7s_generated_verdicts_compare_like_with_like():
    """docs/results.md (make report): every C7 line with a paper ratio names the same baseline on both sides."""
    text = (ROOT / "docs" / "results.md").read_text()
    c7 = [line for line in text.splitlines() if line.startswith(("* ", "| [C7"))
          and ("InfiniGen over" in line or "speedup" in line)]
    assert c7 and not unlike_pairs(c7), unlike_pairs(c7)
    assert "paper: up to 3.00x over prior offloading methods" not in text
