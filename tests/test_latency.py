"""The offloading runtime (infinigen/offload/) and the latency task.

Through the runtime, every method's decode steps must give what its sim mode gives (teacher-forced; float64, so a
disagreement is a logic bug, not rounding), and the bytes that cross the link must be the analytic size of what
the method keeps or selects.
"""

import os
import subprocess
import sys
from typing import ClassVar

import pytest
import torch
from omegaconf import OmegaConf

from conftest import DATA_DIR, METHODS, ROOT, load_model, method_from_conf, random_ids, sample_ids, variants
from infinigen import modes
from infinigen.offload.link import Link
from infinigen.offload.runtime import OffloadRuntime, run_kind, teacher_forced_logits
from infinigen.offload.timing import Timer

PROMPT, DECODED = 48, 24
TOL = 2e-4  # fp32 log-prob agreement, as tests/test_contract.py
TOL64 = 1e-5  # float64: the bound; measured differences are ~1e-12
# Every method and each setting its class declares (`variants`: eviction from a pool, each point where a
# speculated selection starts its gather, a codec's packed rows, Quest with every layer gathering, ...) go through
# the runtime on the GQA llama, and the other placements of a method's KV (runtime=...).
RUNTIME_MODEL = "tiny-llama-gqa"
RUNTIME_VARIANTS = [("full", {}, {"runtime": "offload"}), ("h2o", {}, {"runtime": "ideal"}),
                    ("infinigen", {}, {"runtime": "ideal"})]
# OPT (learned positions, skew folded into W_q/W_k, its own residual layout): each kind of run once, and the
# speculation points that read its residual stream
OPT_CASES = [("full", {}, {}), ("offload", {}, {}), ("infinigen", {}, {}),
             ("infinigen", {"speculate_from": "block_input"}, {}), ("infinigen", {"speculate_from": "after_attention"}, {})]


def case_id(method, overrides, kwargs):
    return "-".join([method] + [f"{k}={v}" for k, v in {**overrides, **kwargs}.items()])


def runtime_cases():
    cases = [(m, v, {}, RUNTIME_MODEL) for m in METHODS for v in variants(m)]
    cases += [(*c, RUNTIME_MODEL) for c in RUNTIME_VARIANTS]
    for method, overrides, kwargs, model in cases + [(*c, "tiny-opt") for c in OPT_CASES]:
        yield pytest.param(method, overrides, kwargs, model, id=f"{case_id(method, overrides, kwargs)}-{model}")


def check_against_sim(model_name, method, overrides, kwargs, prompt, decoded, dtype=None, tol=TOL, batch=1):
    model, _ = load_model(model_name, dtype)
    ids = sample_ids(model_name, prompt + decoded) if batch == 1 else random_ids(prompt + decoded,
                                                                                 model.config.vocab_size, batch)
    sim_m = method_from_conf(method, **overrides)
    sim = modes.sim_logits(model, sim_m, ids, dense_rows=prompt)[:, prompt - 1 : -1].log_softmax(-1)
    dec_m = method_from_conf(method, **overrides)
    dec, report = teacher_forced_logits(model, dec_m, ids, prompt, **kwargs)
    diff = float((dec.log_softmax(-1) - sim).abs().max())
    assert diff <= tol, f"max |delta log-prob| {diff:.3g} > {tol}"
    assert dec_m.stats.summary()["kv_fraction"] == pytest.approx(sim_m.stats.summary()["kv_fraction"], abs=1e-6)
    return report, diff


@pytest.mark.parametrize("method,overrides,kwargs,model_name", list(runtime_cases()))
def test_runtime_equals_sim(method, overrides, kwargs, model_name):
    report, _ = check_against_sim(model_name, method, overrides, kwargs, PROMPT, DECODED, dtype="float64",
                                  tol=TOL64)
    moved = sum(report.h2d_bytes)
    assert (moved == 0) == (report.kind == "resident")


@pytest.mark.parametrize("method", ["offload", "h2o", "infinigen"])
def test_runtime_equals_sim_float32(method):
    check_against_sim("tiny-llama-gqa", method, {}, {}, PROMPT, DECODED)


# the methods' defaults and their first declared variant (which changes the code path: a capacity, a reduction)
@pytest.mark.parametrize("method,overrides", [(m, v) for m in METHODS for v in variants(m)[1:2] or variants(m)[:1]],
                         ids=[f"{m}-{v or 'default'}" for m in METHODS for v in variants(m)[1:2] or variants(m)[:1]])
def test_cuda_code_path_on_cpu_gives_the_same_run(method, overrides):
    """What runs on CUDA, run on CPU: host work on a worker thread (futures per layer) and/or fetched rows landing
    in the alternating staging slots (the current token's row dropped into its slot, gathered rows scattered to
    their destinations). Same logits, same bytes as the inline, zero-copy CPU path."""
    model, _ = load_model("tiny-llama-gqa")
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=2)
    ref, a = teacher_forced_logits(model, method_from_conf(method, **overrides), ids, PROMPT)
    for kwargs in ({"threaded": True}, {"copies": True}, {"threaded": True, "copies": True}):
        out, b = teacher_forced_logits(model, method_from_conf(method, **overrides), ids, PROMPT, **kwargs)
        assert torch.equal(ref, out), kwargs
        assert a.fetch_log == b.fetch_log, kwargs


def test_speculation_at_attention_end_runs_the_same_selection():
    """A method whose selection for layer i is known once layer i-1's attention has been added to the residual
    stream: the runtime starts its gather at that point (after layer i-1's attention, before its MLP), and the
    run equals the one speculating at the attention's start."""
    from infinigen.method.infinigen import InfiniGen

    class AtAttentionEnd(InfiniGen):
        speculation_point: ClassVar[str] = "attention_end"

    model, _ = load_model("tiny-llama-gqa", "float64")
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=2)
    conf = OmegaConf.create({"data_dir": DATA_DIR, "method": OmegaConf.load(ROOT / "conf" / "method" / "infinigen.yaml")})
    settings = OmegaConf.to_container(conf, resolve=True)["method"]  # no model: the knobs at the paper's values
    settings.pop("_target_")
    start, a = teacher_forced_logits(model, InfiniGen(**settings), ids, PROMPT)
    rt = OffloadRuntime(model, AtAttentionEnd(**settings))
    b = rt.generate(ids[:, :PROMPT], DECODED, teacher=ids[:, PROMPT:], keep_logits=True)
    assert torch.equal(start, b.logits[:, :-1])
    assert a.fetch_log == b.fetch_log
    marks = [name for name, _, _ in rt.timer.steps[-1]]
    spec = marks.index("spec0")
    between = marks[spec - 1 : marks.index("ffn0", spec) + 1]  # after layer i-1's attention, before its MLP
    assert between[0] == "attn1" and "spec1" in between and "attn0" not in between


# ----------------------------------------------------------------------------------------------- bytes


def shapes(model):
    cfg = model.config
    hk = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, hk, d, next(model.parameters()).element_size()


@pytest.mark.parametrize("model_name", ["tiny-opt", "tiny-llama-gqa"])
def test_offload_moves_the_whole_past(model_name):
    model, _ = load_model(model_name)
    L, hk, d, esize = shapes(model)
    b = 2
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=b)
    _, report = teacher_forced_logits(model, method_from_conf("offload"), ids, PROMPT)
    assert len(report.fetch_log) == DECODED * L  # every layer, every step, and no wasted prefetch at the end
    for step, layer, nbytes, rows in report.fetch_log:
        assert nbytes == (PROMPT + step) * b * hk * 2 * d * esize  # K and V of every past token
        assert rows == (PROMPT + step) * b * hk


@pytest.mark.parametrize("bits", [4, 2])
def test_quant_moves_codes_and_scales(bits):
    """Per past token, row and KV head: K and V codes at `bits` per element + an fp16 scale and zero per group."""
    model, _ = load_model("tiny-llama-gqa")
    L, hk, d, _ = shapes(model)
    b, method = 2, method_from_conf("quant", bits=bits)
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=b)
    _, report = teacher_forced_logits(model, method, ids, PROMPT)
    per_entry = 2 * (d * bits // 8 + (d // method.group(d)) * 2 * 2)
    assert len(report.fetch_log) == DECODED * L
    for step, layer, nbytes, rows in report.fetch_log:
        assert nbytes == (PROMPT + step) * b * hk * per_entry


@pytest.mark.parametrize("model_name", ["tiny-opt", "tiny-llama-gqa"])
def test_infinigen_moves_exactly_the_selected_rows(model_name):
    """Per layer >= skip_layers: sum over steps and rows of the selected count (from the method's own decode mode)
    x h_kv x 2 (K and V) x head_dim x bytes; partial keys never cross, dense layers never cross."""
    model, _ = load_model(model_name)
    L, hk, d, esize = shapes(model)
    b = 2
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=b, seed=1)
    plain = method_from_conf("infinigen")
    modes.decode_logits(model, plain, ids, dense_rows=PROMPT)
    selected = plain.stats.sums["selected"]  # layer -> sum over steps and batch rows of the tokens selected
    _, report = teacher_forced_logits(model, method_from_conf("infinigen"), ids, PROMPT)
    moved = {}
    for step, layer, nbytes, rows in report.fetch_log:
        moved[layer] = moved.get(layer, 0) + nbytes
    skip = plain.skip_layers
    assert sorted(moved) == list(range(skip, L))
    for layer in range(skip, L):
        assert moved[layer] == selected[layer] * hk * 2 * d * esize
    full = sum(b * hk * 2 * d * esize * (PROMPT + s) for s in range(DECODED)) * L
    assert sum(report.h2d_bytes) < 0.5 * full


def test_h2o_moves_its_budget():
    """Each step a layer's kept entries cross (H2O's budget: what it kept after the previous step), plus the one
    slot the previous step's eviction freed, which this step's token refills right after."""
    model, _ = load_model("tiny-llama-gqa")
    L, hk, d, esize = shapes(model)
    b, method = 2, method_from_conf("h2o")
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=b)
    _, report = teacher_forced_logits(model, method, ids, PROMPT)
    held = [min(method.budget(PROMPT), PROMPT)]  # after the prefill's eviction
    for s in range(1, DECODED):  # H2O keeps min(budget, what it held + the new token)
        held.append(min(method.budget(PROMPT + s), held[-1] + 1))
    expected = [held[0]] + [held[s] + (held[s - 1] + 1 > held[s]) for s in range(1, DECODED)]
    assert len(report.fetch_log) == DECODED * L
    for step, layer, nbytes, rows in report.fetch_log:
        assert rows == expected[step] * b * hk
        assert nbytes == rows * 2 * d * esize
    assert max(expected) <= method.budget(PROMPT + DECODED) + 1


def test_run_kind():
    """Where each method's KV goes, decided from its declaration alone (no model needed)."""
    kinds = {name: run_kind(method_from_conf(name)) for name in METHODS}
    assert kinds["full"] == "resident" and kinds["offload"] == "held" and kinds["infinigen"] == "gather"
    assert kinds["oracle"] == "gather" and kinds["streaming"] == "held" and kinds["quant"] == "held"
    assert run_kind(method_from_conf("full"), "offload") == "held"
    assert all(run_kind(method_from_conf(name), "ideal") == "resident" for name in METHODS)
    with pytest.raises(ValueError, match="runtime"):
        run_kind(method_from_conf("full"), "gpu")


# ----------------------------------------------------------------------------------------------- link model


def test_modelled_link_stalls_only_what_it_cannot_hide():
    """Two 10 MB fetches at 1 GB/s, issued at t=0, the first with 5 ms of host gather: the first lands at 15 ms
    (needed at 10: 5 ms stall), the second queues behind it and lands at 25 ms (needed at 12 + 5: 8 ms more)."""
    timer = Timer(Link("cpu"))
    timer.steps = [[("step0", -1, 0.0), ("issue", 1, 0.0), ("issue", 2, 0.0), ("need", 1, 0.010),
                    ("need", 2, 0.012), ("step1", -1, 0.020)]]
    timer.fetches = {1: {"bytes": 10e6, "host_s": 0.005, "start": None, "end": None},
                     2: {"bytes": 10e6, "host_s": 0.0, "start": None, "end": None}}
    assert timer.modelled_steps(gbps=1.0) == pytest.approx([20 + 5 + 8])
    assert timer.modelled_steps(gbps=1e6) == pytest.approx([20])  # a fast link hides everything


# ----------------------------------------------------------------------------------------------- the task


def latency_task(**overrides):
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "task" / "latency.yaml"), overrides)
    return cfg


def test_latency_task_reports_what_it_measured():
    from experiments import latency

    model, tok = load_model("tiny-llama-gqa")
    task = latency_task(batch_size=2, prompt_len=96, gen_len=6, warmup=1)
    latency.validate(task, DATA_DIR)
    rows = {m: latency.run(model, tok, method_from_conf(m), task, DATA_DIR) for m in ("offload", "infinigen", "full")}
    for name, row in rows.items():
        assert row["random_init"] is True and row["prompt"] == "random"
        assert row["measured_steps"] == 5
        assert 0 < row["decode_ms_median"] <= row["decode_ms_p90"]
        assert row["modelled_decode_ms_per_token"] >= row["compute_ms"] - 1e-9
        assert row["modelled_transfer_ms_per_token"] == pytest.approx(row["h2d_bytes_per_token"] / 25e9 * 1e3)
        assert row["peak_device_bytes"] is None  # CPU: nothing measured, nothing invented
    assert rows["full"]["h2d_bytes_per_token"] == 0 and rows["full"]["runtime"] == "resident"
    assert 0 < rows["infinigen"]["h2d_bytes_per_token"] < rows["offload"]["h2d_bytes_per_token"]
    assert rows["infinigen"]["kv_fraction"] < 1
    assert rows["offload"]["kv_fraction"] == 1


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"prompt_len": 1}, {"gen_len": 4, "warmup": 4},
                                 {"link_gbps": 0}, {"link_gbps": "fast"}, {"runtime": "gpu"},
                                 {"prompt": "lorem"}])
def test_latency_task_validation(bad):
    from experiments import latency

    with pytest.raises(ValueError):
        latency.validate(latency_task(**bad), DATA_DIR)


@pytest.mark.slow  # three interpreter starts (torch, transformers, hydra): ~20-30 s
def test_gpu_check_cpu_smoke(tmp_path):
    """experiments/gpu_check.sh --cpu-smoke: the GPU script's steps at tiny-opt's shape (float16) on CPU: the
    calibration's dry run, the five latency rows, each modelled beside what it measured."""
    import json

    import yaml

    from experiments import calibrate
    from infinigen.offload.profile import hardware

    env = {**os.environ, "PYTHON": sys.executable, "DATA_DIR": DATA_DIR, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", "experiments/gpu_check.sh", "--cpu-smoke", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for row, kind in (("ideal", "resident"), ("offload", "held"), ("quant-int4", "held"), ("h2o", "held"),
                      ("infinigen-b0.05", "gather")):
        assert sum(line.split()[:2] == [row, kind] for line in lines) == 1, out.stdout
    profile = yaml.safe_load((tmp_path / "smoke_profile.yaml").read_text())
    hardware(profile)  # calibrate's dry run: valid
    # the gather as the runtime runs it (beside its busy launching thread), at its threads and on every core
    busy = profile["host_gbps_threads_busy"]
    assert profile["host_gbps"] in busy.values() and max(busy) == (calibrate.physical_cores() or os.cpu_count())
    modelled = [json.loads(line) for line in (tmp_path / "latency_modelled.jsonl").read_text().splitlines()]
    assert [r["row"] for r in modelled] == ["ideal", "quant-int4", "h2o", "infinigen-b0.05",
                                            "infinigen-b0.05-zero-copy", "offload"]
    assert all(r["modelled_perf_ms_per_token"] > 0 and r["decode_ms_median"] > 0 for r in modelled)
    assert "rows within +-25%" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("method", ["infinigen", "h2o", "quant"])
def test_runtime_equals_decode_mode_smollm2(method):
    """On the real model, the runtime gives what the method's own decode mode gives (whether that equals sim mode
    is tests/test_contract.py's question), with the same kv_fraction."""
    model, _ = load_model("smollm2-135m")
    prompt, decoded = 64, 16  # each decode step is a forward through the packed real model: the suite's costliest
    ids = sample_ids("smollm2-135m", prompt + decoded)
    plain_m, ours_m = method_from_conf(method), method_from_conf(method)
    plain = modes.decode_logits(model, plain_m, ids, dense_rows=prompt).log_softmax(-1)
    ours, _ = teacher_forced_logits(model, ours_m, ids, prompt)
    torch.testing.assert_close(ours.log_softmax(-1), plain, atol=TOL, rtol=0)
    assert ours_m.stats.summary()["kv_fraction"] == pytest.approx(plain_m.stats.summary()["kv_fraction"], abs=1e-6)
