"""The offloading runtime (infinigen/offload_runtime.py) and the latency task.

Through the runtime, a method's decode steps must give what its sim mode gives (teacher-forced), the bytes that
cross the link must be the analytic size of what the method keeps or selects, and left padding must never leak
into a row (a padded row equals that row run alone; InfiniGen never selects a padding entry).
"""

import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import DATA_DIR, ROOT, load_model, method_from_conf, random_ids, sample_ids
from infinigen import runtime
from infinigen.offload_runtime import HostPool, Link, Timer, resolve_kind, teacher_forced_logits

PROMPT, DECODED = 48, 24
TOL = 2e-4  # fp32 log-prob agreement, as tests/test_contract.py
CASES = [  # (method, method overrides, runtime kwargs)
    ("full", {}, {}),  # -> ideal
    ("full", {}, {"runtime": "offload"}),
    ("offload", {}, {}),
    ("quant", {}, {}),
    ("quant", {"bits": 2}, {}),
    ("h2o", {}, {}),
    ("h2o", {}, {"resident_h2o": True}),
    ("infinigen", {}, {}),
    ("infinigen", {"capacity": 0.8}, {}),
    ("infinigen", {"capacity": 0.6, "eviction": "lru"}, {}),
]


def case_id(method, overrides, kwargs):
    return "-".join([method] + [f"{k}={v}" for k, v in {**overrides, **kwargs}.items()])


def check_against_sim(model_name, method, overrides, kwargs, prompt, decoded, batch=1):
    model, _ = load_model(model_name)
    ids = sample_ids(model_name, prompt + decoded) if batch == 1 else random_ids(prompt + decoded,
                                                                                 model.config.vocab_size, batch)
    sim_m = method_from_conf(method, **overrides)
    sim = runtime.sim_logits(model, sim_m, ids, dense_rows=prompt)[:, prompt - 1 : -1].log_softmax(-1)
    dec_m = method_from_conf(method, **overrides)
    dec, report = teacher_forced_logits(model, dec_m, ids, prompt, **kwargs)
    torch.testing.assert_close(dec.log_softmax(-1), sim, atol=TOL, rtol=0)
    assert dec_m.stats.summary()["kv_fraction"] == pytest.approx(sim_m.stats.summary()["kv_fraction"], abs=1e-6)
    return report


@pytest.mark.parametrize("model_name", ["tiny-opt", "tiny-llama-gqa"])
@pytest.mark.parametrize("method,overrides,kwargs", CASES, ids=[case_id(*c) for c in CASES])
def test_runtime_equals_sim(method, overrides, kwargs, model_name):
    report = check_against_sim(model_name, method, overrides, kwargs, PROMPT, DECODED)
    moved = sum(report.h2d_bytes)
    assert (moved == 0) == (report.kind in ("ideal", "h2o_resident"))


@pytest.mark.parametrize("method,overrides", [("offload", {}), ("quant", {}), ("h2o", {}), ("infinigen", {}),
                                              ("infinigen", {"capacity": 0.8})])
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
    runtime.decode_logits(model, plain, ids, dense_rows=PROMPT)
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


# ----------------------------------------------------------------------------------------------- padding


def padded_batch(model, prompt=40, decoded=16, pad=13):
    ids = random_ids(prompt + decoded, model.config.vocab_size, batch=2, seed=3)
    ids[1, :pad] = 0
    mask = torch.ones(2, prompt, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask, prompt, pad


PADDED = [("full", {}), ("offload", {}), ("quant", {}), ("infinigen", {}), ("infinigen", {"copies": True})]


@pytest.mark.parametrize("model_name", ["tiny-opt", "tiny-llama-gqa"])
@pytest.mark.parametrize("method,kwargs", PADDED, ids=[case_id(m, {}, k) for m, k in PADDED])
def test_left_padded_rows_equal_their_own_runs(method, kwargs, model_name):
    model, _ = load_model(model_name)
    ids, mask, prompt, pad = padded_batch(model)
    both, _ = teacher_forced_logits(model, method_from_conf(method), ids, prompt, attention_mask=mask, **kwargs)
    short, _ = teacher_forced_logits(model, method_from_conf(method), ids[1:, pad:], prompt - pad, **kwargs)
    long, _ = teacher_forced_logits(model, method_from_conf(method), ids[:1], prompt, **kwargs)
    # batch shape changes matmul rounding (~1e-7), which a quantiser can turn into one code step: contract TOL
    torch.testing.assert_close(both[1:].log_softmax(-1), short.log_softmax(-1), atol=TOL, rtol=0)
    torch.testing.assert_close(both[:1].log_softmax(-1), long.log_softmax(-1), atol=TOL, rtol=0)


def test_infinigen_never_selects_padding(monkeypatch):
    model, _ = load_model("tiny-llama-gqa")
    _, hk, _, _ = shapes(model)
    ids, mask, prompt, pad = padded_batch(model)
    gathered = []
    original = HostPool.gather_job

    def spy(self, src_idx, dest, slot):
        gathered.append((self.bh, src_idx.clone()))
        return original(self, src_idx, dest, slot)

    monkeypatch.setattr(HostPool, "gather_job", spy)
    teacher_forced_logits(model, method_from_conf("infinigen"), ids, prompt, attention_mask=mask)
    assert gathered
    padded_rows = 0
    for bh, idx in gathered:
        slot, row = idx // bh, (idx % bh) // hk  # capacity 1: a pool slot is the token's cache position
        assert bool((slot[row == 1] >= pad).all()), "a padding entry was selected"
        padded_rows += int((row == 1).sum())
    assert padded_rows > 0


def test_ragged_batches_that_cannot_share_a_cache_are_refused():
    model, _ = load_model("tiny-llama-gqa")
    ids, mask, prompt, _ = padded_batch(model)
    for method, overrides in (("h2o", {}), ("infinigen", {"capacity": 0.8})):
        with pytest.raises(ValueError, match="padded|length"):
            teacher_forced_logits(model, method_from_conf(method, **overrides), ids, prompt, attention_mask=mask)
    right = torch.ones_like(mask)
    right[1, -3:] = 0
    with pytest.raises(ValueError, match="left padding"):
        teacher_forced_logits(model, method_from_conf("offload"), ids, prompt, attention_mask=right)


def test_resolve_kind():
    assert resolve_kind(method_from_conf("full")) == "ideal"
    assert resolve_kind(method_from_conf("offload"), "ideal") == "ideal"
    assert resolve_kind(method_from_conf("h2o"), resident_h2o=True) == "h2o_resident"
    for method, runtime_name in (("oracle", "auto"), ("streaming", "auto"), ("infinigen", "ideal"), ("full", "gpu")):
        with pytest.raises(ValueError):
            resolve_kind(method_from_conf(method), runtime_name)
    with pytest.raises(ValueError, match="speculate_from"):
        resolve_kind(method_from_conf("infinigen", speculate_from="current"))


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
    assert rows["full"]["h2d_bytes_per_token"] == 0 and rows["full"]["runtime"] == "ideal"
    assert 0 < rows["infinigen"]["h2d_bytes_per_token"] < rows["offload"]["h2d_bytes_per_token"]
    assert rows["infinigen"]["kv_fraction"] < 1
    assert rows["offload"]["kv_fraction"] == 1


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"prompt_len": 1}, {"gen_len": 4, "warmup": 4},
                                 {"link_gbps": 0}, {"link_gbps": "fast"}, {"runtime": "gpu"},
                                 {"resident_h2o": "yes"}, {"prompt": "lorem"}])
def test_latency_task_validation(bad):
    from experiments import latency

    with pytest.raises(ValueError):
        latency.validate(latency_task(**bad), DATA_DIR)


@pytest.mark.slow  # two interpreter starts (torch, transformers, hydra) + five runs each: ~20-60 s
def test_gpu_check_cpu_smoke():
    """experiments/gpu_check.sh --cpu-smoke: the GPU script's code path at tiny shapes on CPU."""
    env = {**os.environ, "PYTHON": sys.executable, "DATA_DIR": DATA_DIR, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", "experiments/gpu_check.sh", "--cpu-smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for row, kind in (("ideal", "ideal"), ("offload", "dense"), ("quant-int4", "quant"), ("h2o", "h2o"),
                      ("infinigen", "infinigen")):
        assert sum(line.split()[:2] == [row, kind] for line in lines) == 2, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("method", ["infinigen", "h2o", "quant"])
def test_runtime_equals_decode_mode_smollm2(method):
    """On the real model, the runtime gives what the method's own decode mode gives (whether that equals sim mode
    is tests/test_contract.py's question), with the same kv_fraction."""
    model, _ = load_model("smollm2-135m")
    prompt, decoded = 256, 32
    ids = sample_ids("smollm2-135m", prompt + decoded)
    plain_m, ours_m = method_from_conf(method), method_from_conf(method)
    plain = runtime.decode_logits(model, plain_m, ids, dense_rows=prompt).log_softmax(-1)
    ours, _ = teacher_forced_logits(model, ours_m, ids, prompt)
    torch.testing.assert_close(ours.log_softmax(-1), plain, atol=TOL, rtol=0)
    assert ours_m.stats.summary()["kv_fraction"] == pytest.approx(plain_m.stats.summary()["kv_fraction"], abs=1e-6)
