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
from infinigen import corpora
from infinigen.offload.clock import Clock, Link, decode_steps, no_events
from infinigen.offload.perf import context_seconds, dispatch_seconds, modelled_steps
from infinigen.offload.plan import Shape, selected_counts, step_bytes
from infinigen.offload.plan import plan as layer_plan
from infinigen.offload.profile import HARDWARE_FIELDS, hardware
from infinigen.offload.roofline import layer_work
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
    shape = Shape.of(cfg)
    fresh = method_from_conf(method)
    plan = layer_plan(fresh, shape, runtime, PROMPT + DECODED)
    assert plan.kinds == [layer_kind(m, layer, runtime) for layer in OffloadRuntime(model, m, runtime).layers]
    logged = {(step, layer): (nbytes, rows) for step, layer, nbytes, rows in report.fetch_log}
    for step in range(DECODED):
        past = PROMPT + step
        selected = [logged.get((step, i), (0, 0))[1] / (batch * shape.kv_heads) if k == "gather" else 0.0
                    for i, k in enumerate(plan.kinds)]
        modelled = step_bytes(fresh, shape, plan, batch, past, PROMPT, selected)
        measured = [logged.get((step, i), (0, None))[0] for i in range(shape.layers)]
        assert modelled == pytest.approx(measured, abs=0), f"step {step}"
    assert sum(report.h2d_bytes) == sum(b for (b, _) in logged.values())


def test_opt_13b_point_from_its_config_alone():
    """An OPT-13B point is computed without weights (the census runs a 16-wide stand-in once, then is cached)."""
    cfg = model_cfg("opt-13b")
    hw = hardware(profile())
    method = method_from_conf("offload")
    modelled_steps(hw, cfg, method, "auto", 20, 1920, 4, None)  # census, cached
    t0 = time.perf_counter()
    steps = modelled_steps(hw, cfg, method, "auto", 20, 1920, 128, None)
    assert time.perf_counter() - t0 < 1.0
    # full offload of OPT-13B at batch 20: every step moves the whole fp16 KV over PCIe 3
    kv = 2 * 40 * 20 * 5120 * 2  # bytes per token: K and V, 40 layers, batch 20, hidden 5120, fp16
    assert steps[0]["h2d_bytes"] == 1920 * kv
    assert steps[0]["step_s"] >= steps[0]["h2d_bytes"] / (hw.h2d_gbps * 1e9)  # at least the link time


def test_prefetch_hides_a_fetch_behind_the_previous_layer():
    """A gather speculated at attention_start overlaps the previous layer; the same gather at `query` does not."""
    cfg = model_cfg("opt-13b")
    hw = hardware(profile())
    ahead = method_from_conf("infinigen", skew=False)
    assert ahead.speculation_point == "attention_start"
    sync = method_from_conf("infinigen", skew=False, speculate_from="current")
    shape = Shape.of(cfg)
    kinds = ["resident"] + ["gather"] * (shape.layers - 1)
    fractions = [1.0] + [0.1] * (shape.layers - 1)
    zero = [dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 0.0)] * (shape.layers + 1)
    runs = {name: decode_steps(m, cfg, hw, "auto", 8, 1920, 3, fractions, zero, zero)[-1]
            for name, m in (("ahead", ahead), ("sync", sync))}
    assert kinds == layer_plan(ahead, shape, "auto", 1923).kinds
    assert runs["ahead"]["h2d_bytes"] == runs["sync"]["h2d_bytes"]
    assert runs["ahead"]["exposed_transfer_s"] < runs["sync"]["exposed_transfer_s"]
    assert runs["ahead"]["step_s"] < runs["sync"]["step_s"]


def test_host_is_device_adds_host_work_and_crosses_nothing():
    cfg = model_cfg("smollm2-135m")
    hw = hardware(profile(h2d_gbps=None, d2h_gbps=None))
    steps = modelled_steps(hw, cfg, method_from_conf("offload"), "auto", 1, 256, 3, None)
    assert steps[-1]["exposed_transfer_s"] == 0 and steps[-1]["transfer_s"] == 0


@pytest.mark.parametrize("field,value", [("memory_gbps", 0), ("launch_us", -1), ("matmul_tflops", "fast"),
                                         ("h2d_gbps", None), ("dispatch", "guess"),
                                         ("head_tflops", 0), ("job_us", -1), ("host_op_gbps", 0),
                                         ("pageable_gbps", "slow")])
def test_bad_profiles_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"hardware.{field}|h2d_gbps and hardware.d2h_gbps"):
        hardware(profile(**{field: value}))
    cfg = profile()
    del cfg["host_gbps"]
    with pytest.raises(ValueError, match="hardware.host_gbps is missing"):
        hardware(cfg)


def test_the_lm_head_is_priced_at_its_own_rate_where_a_profile_has_one():
    """head_tflops (a CPU's rate for the (vocab, hidden) shape) moves the step by exactly the head's FLOPs at the
    two rates; absent or null, the head runs at matmul_tflops."""
    cfg = model_cfg("smollm2-135m")
    shape = Shape.of(cfg)
    zeros = [dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 0.0)] * (shape.layers + 1)

    def step_s(**rates) -> float:
        hw = hardware(profile(h2d_gbps=None, d2h_gbps=None, matmul_tflops=1e-3, **rates))
        return decode_steps(method_from_conf("full"), cfg, hw, "auto", 8, 64, 1, None, zeros, zeros)[0]["step_s"]

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
    store and nothing is calibrated on text; a measured run calibrates on the PG-19 text the package ships."""
    env = {k: v for k, v in os.environ.items() if k != "DATA_DIR"}
    base = [sys.executable, "run.py", "method=infinigen", "task=latency", f"results_dir={tmp_path}"]
    modelled = ["model=opt-13b", "task.timing=modelled", "hardware=a6000_pcie3", "task.batch_size=20",
                "task.prompt_len=1920", "task.gen_len=128"]
    done = subprocess.run(base + modelled, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'modelled_decode_ms_per_token'" in done.stdout
    (row_file,) = (tmp_path / "rows").glob("*.jsonl")
    assert "calibration" not in json.loads(row_file.read_text())["data"]  # it read none
    measured = subprocess.run(base + ["model=tiny-llama", "task.prompt_len=32", "task.gen_len=4"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=240)
    assert measured.returncode == 0, measured.stderr[-2000:]
    (row_file,) = set((tmp_path / "rows").glob("*.jsonl")) - {row_file}
    calibration = json.loads(row_file.read_text())["data"]["calibration"]
    assert calibration["path"] == str(corpora.BUNDLED / "pg19" / "pg19_firstbook.txt")
    assert calibration["sha256"] == corpora.file_sha256(corpora.BUNDLED / "pg19" / "pg19_firstbook.txt")


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
    gpu = hardware(profile())
    priced = context_seconds(gpu, cfg, method_from_conf("full"), "auto", 1, kinds)
    assert priced[0]["attention"] == pytest.approx(2 / gpu.copy_gbps + 1 / gpu.gather_gbps)
    assert asked == ["stream", "indexed"]
    local = hardware(profile(dispatch="stand_in"))
    assert context_seconds(local, cfg, method_from_conf("full"), "auto", 1, kinds)[0]["attention"] == 7e-6
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
    shape = Shape.of(cfg)
    p = layer_plan(method, shape, "auto", 2048)
    local = hardware(profile(dispatch="stand_in"))
    dispatch, timed_at = dispatch_seconds(local, cfg, method, "auto", 8, 1024, p.kinds)
    assert ("point_seconds", 1024) in asked and timed_at == census.timed_context(1024) > 1024
    assert dispatch[1]["speculation"] == 1e-3 and dispatch[1]["host"] == 5e-3
    context_s = context_seconds(local, cfg, method, "auto", 8, p.kinds)[1]
    work = {n: layer_work(local, shape, p, method, 1, 8, n, n, context_s, timed_at) for n in (timed_at,
                                                                                                 timed_at + 100)}
    assert work[timed_at + 100].attention - work[timed_at].attention == pytest.approx(8 * 100 * 1e-6)
    assert work[timed_at + 100].speculation - work[timed_at].speculation == pytest.approx(8 * 100 * 1e-6)
    gpu = hardware(profile())
    ops, at = dispatch_seconds(gpu, cfg, method, "auto", 8, 1024, p.kinds)
    assert at == 0 and ops[1]["attention"] == pytest.approx(gpu.launch_us * 1e-6)


def test_a_profile_of_this_machine_prices_attending_once():
    """The stand-in's seconds per context token already hold the scores and the weighted sum over the attended
    entries (and the selection's partial Q.K): a CPU profile's roofline prices the weights only, a GPU profile's
    the FLOPs over what is attended."""
    cfg = model_cfg("smollm2-135m")
    shape, method = Shape.of(cfg), method_from_conf("infinigen")
    p = layer_plan(method, shape, "auto", 4096)
    gather = p.kinds.index("gather")
    context_s = dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 0.0)
    for dispatch, grows in (("stand_in", False), ("ops", True)):
        hw = hardware(profile(dispatch=dispatch, matmul_tflops=1e-3))
        work = {n: layer_work(hw, shape, p, method, gather, 8, n, n, context_s) for n in (64, 4096)}
        assert (work[4096].attention > 2 * work[64].attention) is grows
        assert (work[4096].speculation > 2 * work[64].speculation) is grows


def test_a_census_is_keyed_by_the_code_it_times_not_by_the_model_that_reads_it():
    """Editing the runtime or the method re-times its census; editing perf.py (the model) does not, so a model
    change can be checked against the censuses a validation run timed."""
    from infinigen.offload import census

    files = {Path(f).relative_to(ROOT).as_posix() for f in census.code_files(method_from_conf("infinigen"))}
    assert {"infinigen/adapter/__init__.py", "infinigen/adapter/loading.py", "infinigen/adapter/layers.py",
            "infinigen/adapter/store.py", "infinigen/adapter/session.py", "infinigen/adapter/generation.py",
            "infinigen/offload/runtime.py", "infinigen/offload/census.py",
            "infinigen/method/infinigen.py"} <= files
    assert "infinigen/offload/perf.py" not in files
    assert "baselines/h2o.py" in {Path(f).relative_to(ROOT).as_posix()
                                  for f in census.code_files(method_from_conf("h2o"))}
    # narrowed to what a method's census runs (issue 57): another method's file, or the model's, re-times nothing
    h2o = {Path(f).relative_to(ROOT).as_posix() for f in census.code_files(method_from_conf("h2o"))}
    assert "baselines/tova.py" not in h2o and "infinigen/method/infinigen.py" not in h2o
    assert not {f"infinigen/offload/{m}.py" for m in ("perf", "profile", "plan", "roofline", "clock")} & (files | h2o)


# ----------------------------------------------------------------------------------------------- the model on a GPU


def test_the_interim_h200_profile_is_valid_and_says_where_each_number_comes_from():
    """conf/hardware/h200_pcie5_measured.yaml (until calibrate --device cuda replaces it): a valid profile whose
    every field is labelled measured, derived (from a row of docs/gpu that docs/speed.md does not validate) or
    datasheet / assumed, in its own line or the comment lines just above it."""
    path = ROOT / "conf" / "hardware" / "h200_pcie5_measured.yaml"
    hw = hardware(OmegaConf.load(path))
    assert hw.h2d_gbps == 54.6 and hw.pageable_gbps == 18.0 and hw.dispatch == "ops"
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        name = line.split(":")[0]
        if name in HARDWARE_FIELDS:
            said = " ".join(lines[max(0, i - 6): i + 1])
            assert any(w in said for w in ("measured", "derived", "datasheet", "assumed")), name


def test_the_census_counts_in_the_models_dtype():
    """A float16 model's KV is float16 bytes: the census's stand-in runs in the model's dtype (a float32 stand-in
    counted them twice); the float32 softmax over the scores stays float32."""
    from baselines.full import Full
    from infinigen.offload import census

    streamed = {}
    for dtype in ("float32", "float16"):
        cfg = model_cfg("tiny-opt")
        cfg.dtype = dtype
        streamed[dtype] = census.census(cfg, Full(), "auto", 2, ["resident"] * 3, "stream")[1]["attention"]
    assert 0.45 < streamed["float16"] / streamed["float32"] < 0.55


def test_syncs_are_counted_where_a_gpu_host_waits():
    """A scalar read, a bool-mask index and a blocking `.cpu()` of a device tensor make a GPU's host wait; the same
    ops on a tensor already on the host (a `.cpu()` result, one made without a device) do not, and are host work
    (bytes on the host), and a non-blocking copy to the host is no sync."""
    import torch

    from infinigen.offload.op_counter import OpCounter

    dev = torch.device("cpu")  # a tensor made on "the device" (a CPU run stands it in for one)
    counter = OpCounter(("syncs", "host", "ops"))
    with torch.inference_mode(), counter:
        x = torch.arange(16, dtype=torch.float32, device=dev)
        int(x.max())  # sync 1
        x[x > 3]  # sync 2: the mask's count sets the output's shape
        y = x.cpu()  # sync 3: a blocking device->host copy
        int(y.max()), y[y > 3]  # on the host: no sync
        z = torch.arange(8)  # made without a device: host memory
        bool(z.all())
        x.to("cpu", non_blocking=True)  # no sync
        (x * 2).sum()
    syncs, host_bytes, ops = counter.counts
    assert syncs == 3
    assert host_bytes > 0 and ops > syncs


def test_a_host_sync_serialises_host_and_device():
    """Between syncs the host queues ops ahead of the device; at each the host waits for the device to drain, so
    a segment whose device work outlasts its dispatch ends, with syncs, when the device does, and a decode step
    whose every layer syncs takes longer than the same step without."""
    clock = Clock(overlap=True)
    clock.segment(1.0, 4.0)
    assert (clock.host, clock.device) == (1.0, 4.0)  # queued ahead
    clock = Clock(overlap=True)
    clock.segment(1.0, 4.0, syncs=2)  # half the ops (0.5 s, 2 s of device), sync, the other half, sync
    assert (clock.host, clock.device) == (4.0, 4.0) and clock.waits["syncs"] == 2
    assert clock.waits["sync_wait"] == pytest.approx(1.5 + 1.5)
    clock = Clock(overlap=True, lead=0.1)  # after a sync the device waits for the next op to be queued
    clock.segment(1.0, 4.0, syncs=2)
    assert clock.device == pytest.approx(0.1 + 2 + 0.1 + 2)

    cfg = model_cfg("opt-13b")
    shape = Shape.of(cfg)
    hw = hardware(profile(launch_us=5.0))
    method = method_from_conf("full")
    dispatch = [dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 40e-6)] * (shape.layers + 1)
    zero = [dict.fromkeys(("attention", "speculation", "ffn", "norms", "host"), 0.0)] * (shape.layers + 1)
    events = no_events(shape.layers)
    free = decode_steps(method, cfg, hw, "auto", 20, 1920, 2, None, dispatch, zero, 0, events)[-1]
    for layer in events[:-1]:
        layer["syncs"]["attention"] = 1.0
    synced = decode_steps(method, cfg, hw, "auto", 20, 1920, 2, None, dispatch, zero, 0, events)[-1]
    assert synced["syncs"] == shape.layers and synced["sync_wait_s"] > 0 == free["sync_wait_s"]
    assert synced["step_s"] > free["step_s"]


def test_a_write_back_on_the_fetch_worker_queues_behind_the_copies():
    """A write-back job on the fetch worker (the 2f67c00 runtime's pool scatter) waits for its device->host copy,
    queued on the copy stream behind the fetch already there; a fetch issued after it queues behind the job."""
    hw = hardware(profile(h2d_gbps=10.0, d2h_gbps=10.0, host_gbps=1e6))
    clock, link = Clock(overlap=True), Link(hw)
    landed, _, _ = link.fetch(clock, 0.0, 0.0, 10e9, gathered=False)  # 1 s on the link
    assert landed == pytest.approx(1.0)
    done = link.writeback(clock, 10e6)  # behind it: 1 ms of copy
    assert done == pytest.approx(1.001)
    after, _, _ = link.fetch(clock, 0.0, 0.0, 10e9, gathered=False)
    assert after == pytest.approx(2.001)
    clock.join(done)
    assert clock.host == pytest.approx(1.001) and clock.waits["join_wait"] == pytest.approx(1.001)


def test_the_first_gpu_measurement_is_modelled_within_25_percent_but_infinigen():
    """experiments/validate_gpu.py on the committed numbers: the five batch-20 rows measured on an H200 at
    2f67c00 (+ the one-line fix), modelled with the census of that code (docs/gpu/census_2f67c00.json) on the
    interim profile: four within +-25%; InfiniGen's at about half (its gather, at 16 threads, reached half its
    isolated rate in the step: contention the model does not price, docs/speed.md). The census recorded
    InfiniGen's four syncs per gathering layer, H2O's nonzero, write-back and settle."""
    from experiments import validate_gpu

    results, header = validate_gpu.validate()
    assert [r["row"] for r, _ in results] == ["ideal", "infinigen", "h2o", "quant-int4", "offload"]
    ratio = {r["row"]: m["decode_ms_median"] / r["decode_ms_median"] for r, m in results}
    assert all(abs(ratio[row] - 1) <= 0.25 for row in ("ideal", "h2o", "quant-int4", "offload")), ratio
    assert 0.4 < ratio["infinigen"] < 0.6, ratio  # the known miss docs/speed.md states
    by_row = {r["row"]: m for r, m in results}
    assert by_row["infinigen"]["syncs_per_step"] == 4 * 39 and by_row["h2o"]["syncs_per_step"] == 40
    assert by_row["infinigen"]["fetch_fraction"] == pytest.approx(0.2, abs=0.002)  # its bytes: 387.9 rows of 1938
    assert by_row["ideal"]["syncs_per_step"] == 0 and "16 threads" in header
    census = json.loads((ROOT / "docs" / "gpu" / "census_2f67c00.json").read_text())
    assert census["rows"]["infinigen"]["speculation_point"] == "attention_start"
    assert census["rows"]["h2o"]["kinds"] == ["held"] * 40


def test_validate_gpu_writes_its_table_into_a_marked_block(tmp_path):
    """make validate-gpu: the table replaces what stood between the block's markers, and only that."""
    from experiments import validate_gpu

    key = "docs/gpu/h200_opt13b_b20_p1920_g32.jsonl"
    doc = tmp_path / "speed.md"
    doc.write_text(f"before\n<!-- validate_gpu:{key} -->\nstale\n<!-- /validate_gpu:{key} -->\nafter\n")
    validate_gpu.main(["--markdown", str(doc)])
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "stale" not in text
    assert "| infinigen | 437.2 |" in text and "4 of 5 rows within +-25%." in text


def test_local_layers_are_priced_within_their_window():
    """Gemma 3's local layers in the model: a held pool that never evicts sends only the window's rows (as
    HeldExecutor does), and a gathering layer's measured kv_fraction is a share of the window, not of the whole
    context; global layers send and select over everything."""
    from conftest import model_cfg

    shape = Shape.of(model_cfg("gemma3-270m"))
    assert shape.windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert Shape.of(model_cfg("tiny-llama-gqa")).windows == ()
    offload = method_from_conf("offload")
    p = layer_plan(offload, shape, "auto", 4096)
    row = shape.kv_heads * p.row_bytes[0]
    sent = step_bytes(offload, shape, p, 1, 3000, 2048, [0.0] * shape.layers)
    assert sent == [(3000 if w is None else 511) * row for w in shape.windows]
    gather = layer_plan(method_from_conf("infinigen"), shape, "auto", 4096)
    assert any(k == "gather" and w for k, w in zip(gather.kinds, shape.windows))
    selected = selected_counts([0.25] * shape.layers, gather, 3001)
    for i, w in enumerate(shape.windows):
        if gather.kinds[i] == "gather":
            assert selected[i] == pytest.approx(0.25 * (3001 if w is None else 512) - 1)
