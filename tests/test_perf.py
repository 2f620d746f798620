"""The decode performance model (infinigen/offload/perf.py): its bytes are the runtime's, its structure replays the
runtime's overlap, it needs no weights, and bad profiles are refused by name."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import METHODS, ROOT, load_model, method_from_conf, random_ids
from infinigen.offload import perf
from infinigen.offload.runtime import OffloadRuntime, layer_kind

PROMPT, DECODED = 24, 6


def model_cfg(name: str):
    return OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")


def profile(name: str = "a6000_pcie3", **overrides):
    return OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "hardware" / f"{name}.yaml"), overrides)


def byte_cases():
    """Every method as it declares itself on the GQA llama; the resident ones offloaded too; OPT once per kind."""
    for method in METHODS:
        yield pytest.param(method, "auto", "tiny-llama-gqa", id=f"{method}-auto")
        if OmegaConf.load(ROOT / "conf" / "method" / f"{method}.yaml")._target_.endswith(("Full", "KIVI")):
            yield pytest.param(method, "offload", "tiny-llama-gqa", id=f"{method}-offload")
    for method in ("offload", "h2o", "infinigen"):
        yield pytest.param(method, "auto", "tiny-opt", id=f"{method}-auto-opt")


@pytest.mark.parametrize("method,runtime,model_name", list(byte_cases()))
def test_modelled_bytes_are_the_runtimes(method, runtime, model_name):
    """Per step and layer, the model's host->device bytes equal the runtime's counters (gathering layers: given
    the rows the run selected, which the model takes as its input)."""
    model, _ = load_model(model_name)
    m = method_from_conf(method)
    cfg = model_cfg(model_name)
    batch = 2
    report = OffloadRuntime(model, m, runtime=runtime).generate(random_ids(PROMPT, cfg.arch.vocab_size, batch),
                                                                DECODED)
    shape = perf.Shape.of(cfg)
    fresh = method_from_conf(method)
    plan = perf.plan(fresh, shape, runtime, PROMPT + DECODED)
    assert plan.kinds == [layer_kind(m, layer, runtime) for layer in OffloadRuntime(model, m, runtime).layers]
    logged = {(step, layer): (nbytes, rows) for step, layer, nbytes, rows in report.fetch_log}
    for step in range(DECODED):
        past = PROMPT + step
        selected = [logged.get((step, i), (0, 0))[1] / (batch * shape.kv_heads) if k == "gather" else 0.0
                    for i, k in enumerate(plan.kinds)]
        modelled = perf.step_bytes(fresh, shape, plan, batch, past, PROMPT, selected)
        measured = [logged.get((step, i), (0, None))[0] for i in range(shape.layers)]
        assert modelled == pytest.approx(measured, abs=0), f"step {step}"
    assert sum(report.h2d_bytes) == sum(b for (b, _) in logged.values())


def test_opt_13b_point_from_its_config_alone():
    """An OPT-13B point is computed without weights (the census runs a 16-wide stand-in once, then is cached)."""
    cfg = model_cfg("opt-13b")
    hw = perf.hardware(profile())
    method = method_from_conf("offload")
    perf.modelled_steps(hw, cfg, method, "auto", 20, 1920, 4, None)  # census, cached
    t0 = time.perf_counter()
    steps = perf.modelled_steps(hw, cfg, method, "auto", 20, 1920, 128, None)
    assert time.perf_counter() - t0 < 1.0
    # full offload of OPT-13B at batch 20: every step moves the whole fp16 KV over PCIe 3
    kv = 2 * 40 * 20 * 5120 * 2  # bytes per token: K and V, 40 layers, batch 20, hidden 5120, fp16
    assert steps[0]["h2d_bytes"] == 1920 * kv
    assert steps[0]["step_s"] >= steps[0]["h2d_bytes"] / 12e9  # at least the link time


def test_prefetch_hides_a_fetch_behind_the_previous_layer():
    """A gather speculated at attention_start overlaps the previous layer; the same gather at `query` does not."""
    cfg = model_cfg("opt-13b")
    hw = perf.hardware(profile())
    ahead = method_from_conf("infinigen", skew=False)
    assert ahead.speculation_point == "attention_start"
    sync = method_from_conf("infinigen", skew=False, speculate_from="current")
    shape = perf.Shape.of(cfg)
    kinds = ["resident"] + ["gather"] * (shape.layers - 1)
    fractions = [1.0] + [0.1] * (shape.layers - 1)
    zero = [dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 0.0)] * (shape.layers + 1)
    runs = {name: perf.decode_steps(m, cfg, hw, "auto", 8, 1920, 3, fractions, zero, zero)[-1]
            for name, m in (("ahead", ahead), ("sync", sync))}
    assert kinds == perf.plan(ahead, shape, "auto", 1923).kinds
    assert runs["ahead"]["h2d_bytes"] == runs["sync"]["h2d_bytes"]
    assert runs["ahead"]["exposed_transfer_s"] < runs["sync"]["exposed_transfer_s"]
    assert runs["ahead"]["step_s"] < runs["sync"]["step_s"]


def test_host_is_device_adds_host_work_and_crosses_nothing():
    cfg = model_cfg("smollm2-135m")
    hw = perf.hardware(profile(h2d_gbps=None, d2h_gbps=None))
    steps = perf.modelled_steps(hw, cfg, method_from_conf("offload"), "auto", 1, 256, 3, None)
    assert steps[-1]["exposed_transfer_s"] == 0 and steps[-1]["transfer_s"] == 0


@pytest.mark.parametrize("field,value", [("memory_gbps", 0), ("launch_us", -1), ("matmul_tflops", "fast"),
                                         ("h2d_gbps", None), ("dispatch", "guess"),
                                         ("head_tflops", 0)])
def test_bad_profiles_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"hardware.{field}|h2d_gbps and hardware.d2h_gbps"):
        perf.hardware(profile(**{field: value}))
    cfg = profile()
    del cfg["host_gbps"]
    with pytest.raises(ValueError, match="hardware.host_gbps is missing"):
        perf.hardware(cfg)


def test_the_lm_head_is_priced_at_its_own_rate_where_a_profile_has_one():
    """head_tflops (a CPU's rate for the (vocab, hidden) shape) moves the step by exactly the head's FLOPs at the
    two rates; absent or null, the head runs at matmul_tflops."""
    cfg = model_cfg("smollm2-135m")
    shape = perf.Shape.of(cfg)
    zeros = [dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 0.0)] * (shape.layers + 1)

    def step_s(**rates) -> float:
        hw = perf.hardware(profile(h2d_gbps=None, d2h_gbps=None, matmul_tflops=1e-3, **rates))
        return perf.decode_steps(method_from_conf("full"), cfg, hw, "auto", 8, 64, 1, None, zeros, zeros)[0]["step_s"]

    flops = 2 * 8 * shape.hidden * shape.vocab
    assert step_s(head_tflops=None) == step_s()
    assert step_s(head_tflops=0.25e-3) - step_s() == pytest.approx(flops / 0.25e9 - flops / 1e9, rel=1e-9)


def test_modelled_run_needs_no_weights_and_refuses_bad_input_before_anything(tmp_path):
    """run.py with timing=modelled writes a row for OPT-13B (no weights here); an unknown profile is refused."""
    base = [sys.executable, "run.py", "model=opt-13b", "method=offload", "task=latency", "task.timing=modelled",
            "task.batch_size=4", "task.prompt_len=512", "task.gen_len=4", f"results_dir={tmp_path}"]
    done = subprocess.run(base + ["hardware=a6000_pcie3"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "decode_ms_median" in done.stdout
    bad = subprocess.run(base + ["hardware=a6000_pcie3", "hardware.memory_gbps=0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert bad.returncode == 2 and "error: hardware.memory_gbps: must be a positive number" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert missing.returncode == 2 and "hardware is not set" in missing.stderr


def test_the_papers_point_is_modelled_without_a_data_folder(tmp_path):
    """InfiniGen at the paper's Fig. 14 point with no data folder: its fetched fractions come from the committed
    store and nothing is calibrated on text; a measured run, which calibrates, is refused before the model loads."""
    env = {k: v for k, v in os.environ.items() if k != "DATA_DIR"}
    base = [sys.executable, "run.py", "method=infinigen", "task=latency", f"results_dir={tmp_path}"]
    modelled = ["model=opt-13b", "task.timing=modelled", "hardware=a6000_pcie3", "task.batch_size=20",
                "task.prompt_len=1920", "task.gen_len=128"]
    done = subprocess.run(base + modelled, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'modelled_decode_ms_per_token'" in done.stdout
    (row_file,) = (tmp_path / "rows").glob("*.jsonl")
    assert "calibration" not in json.loads(row_file.read_text())["data"]  # it read none
    refused = subprocess.run(base + ["model=tiny-llama"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=240)
    assert refused.returncode == 2 and "error: method: dataset 'pg19' has no hub source" in refused.stderr


def test_a_profile_of_this_machine_times_the_context_cost_a_gpu_profile_prices_bytes(monkeypatch):
    """A CPU profile calibrated here (dispatch: stand_in) takes each method's context-proportional seconds from
    its code timed here; a GPU profile prices the census's bytes at its copy and gather rates."""
    from infinigen.offload import census

    asked = []

    def fake(model_cfg, method, runtime, batch, kinds, measure="ops", prompt=None):
        asked.append(measure)
        value = {"stream": 2e9, "indexed": 1e9, "context_seconds": 7e-6}.get(measure, 1.0)
        return [dict.fromkeys(census.SEGMENTS, value) for _ in range(len(kinds) + 1)]

    monkeypatch.setattr(census, "census", fake)
    cfg, kinds = model_cfg("smollm2-135m"), ["resident"] * 30
    gpu = perf.hardware(profile())
    priced = perf.context_seconds(gpu, cfg, method_from_conf("full"), "auto", 1, kinds)
    assert priced[0]["attention"] == pytest.approx(2 / gpu.copy_gbps + 1 / gpu.gather_gbps)
    assert asked == ["stream", "indexed"]
    local = perf.hardware(profile(dispatch="stand_in"))
    assert perf.context_seconds(local, cfg, method_from_conf("full"), "auto", 1, kinds)[0]["attention"] == 7e-6
    assert asked[-1] == "context_seconds"


def test_a_profile_of_this_machine_times_the_code_at_the_runs_size(monkeypatch):
    """A CPU profile takes each segment's seconds from the stand-in timed at the run's own prompt and batch (the
    host segment at the census's short prompt: host work is priced from the real selection's bytes); the context
    slope adds only what grows past the timed context. A GPU profile prices ops from no context."""
    from infinigen.offload import census

    asked = []

    def fake(model_cfg, method, runtime, batch, kinds, measure="ops", prompt=None):
        asked.append((measure, prompt))
        value = {"point_seconds": 1e-3, "seconds": 5e-3, "context_seconds": 1e-6}.get(measure, 1.0)
        return [dict.fromkeys(census.SEGMENTS, value) for _ in range(len(kinds) + 1)]

    monkeypatch.setattr(census, "census", fake)
    cfg, method = model_cfg("smollm2-135m"), method_from_conf("infinigen")
    shape = perf.Shape.of(cfg)
    p = perf.plan(method, shape, "auto", 2048)
    local = perf.hardware(profile(dispatch="stand_in"))
    dispatch, timed_at = perf.dispatch_seconds(local, cfg, method, "auto", 8, 1024, p.kinds)
    assert ("point_seconds", 1024) in asked and timed_at == census.timed_context(1024) > 1024
    assert dispatch[1]["speculation"] == 1e-3 and dispatch[1]["host"] == 5e-3
    context_s = perf.context_seconds(local, cfg, method, "auto", 8, p.kinds)[1]
    work = {n: perf.layer_work(local, shape, p, method, 1, 8, n, n, context_s, timed_at) for n in (timed_at,
                                                                                                 timed_at + 100)}
    assert work[timed_at + 100].attention - work[timed_at].attention == pytest.approx(8 * 100 * 1e-6)
    assert work[timed_at + 100].speculation - work[timed_at].speculation == pytest.approx(8 * 100 * 1e-6)
    gpu = perf.hardware(profile())
    ops, at = perf.dispatch_seconds(gpu, cfg, method, "auto", 8, 1024, p.kinds)
    assert at == 0 and ops[1]["attention"] == pytest.approx(gpu.launch_us * 1e-6)


def test_a_profile_of_this_machine_prices_attending_once():
    """The stand-in's seconds per context token already hold the scores and the weighted sum over the attended
    entries (and the selection's partial Q.K): a CPU profile's roofline prices the weights only, a GPU profile's
    the FLOPs over what is attended."""
    cfg = model_cfg("smollm2-135m")
    shape, method = perf.Shape.of(cfg), method_from_conf("infinigen")
    p = perf.plan(method, shape, "auto", 4096)
    gather = p.kinds.index("gather")
    context_s = dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 0.0)
    for dispatch, grows in (("stand_in", False), ("ops", True)):
        hw = perf.hardware(profile(dispatch=dispatch, matmul_tflops=1e-3))
        work = {n: perf.layer_work(hw, shape, p, method, gather, 8, n, n, context_s) for n in (64, 4096)}
        assert (work[4096].attention > 2 * work[64].attention) is grows
        assert (work[4096].speculation > 2 * work[64].speculation) is grows


def test_a_census_is_keyed_by_the_code_it_times_not_by_the_model_that_reads_it():
    """Editing the runtime or the method re-times its census; editing perf.py (the model) does not, so a model
    change can be checked against the censuses a validation run timed."""
    from infinigen.offload import census

    files = {Path(f).relative_to(ROOT).as_posix() for f in census.code_files(method_from_conf("infinigen"))}
    assert {"infinigen/adapter.py", "infinigen/offload/runtime.py", "infinigen/offload/census.py",
            "infinigen/infinigen_method/infinigen.py"} <= files
    assert "infinigen/offload/perf.py" not in files
    assert "baselines/h2o.py" in {Path(f).relative_to(ROOT).as_posix()
                                  for f in census.code_files(method_from_conf("h2o"))}
