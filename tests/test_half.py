"""Every method in half precision, the dtype real checkpoints ship in (float16, bfloat16): sim == decode ==
runtime, half-precision log-probs against float32 ones, the real model's perplexity, and the tasks run.py runs.

The contract itself is proven in float64 (tests/test_contract.py, tests/test_latency.py); here the question is
what half precision adds. Two kinds of difference are expected and bounded separately:

* rounding: sim mode's batched products and decode's single rows, or a half and a float32 model, round
  differently. Methods whose choices cannot move with it (what they keep does not depend on values, or they keep
  every entry and see bit-identical inputs) are held to `ROUNDING` (`ROUNDING_VS_FLOAT32` against a float32 model);
* flips: a value-dependent choice (a top-k, an alpha threshold, an eviction, a quantisation bin edge) lands on
  the other side of a near-tie, and a different entry is attended from there on. Those methods are held to the
  same number of choices (`KV_TOL` on kv_fraction) and to a mean per-row deviation (`FLIPS`, `FLIPS_VS_FLOAT32`)
  well below what a genuinely different selection of the same size costs, so a broken half-precision path
  (overflow, NaN, scores ranked in the wrong dtype) still fails.

Which kernels the CPU has moves what is compared here: oneDNN computes bfloat16 (and, where the CPU has
avx512_fp16, float16) products with AMX, AVX512-BF16 or an AVX2 emulation, each rounding its own way, and MKL's
float32 path depends on MKL_CBWR. Every bound below holds at least 3x the largest value measured across those
paths (ONEDNN_MAX_CPU_ISA unset / AVX2 / AVX512_CORE, MKL_CBWR=COMPATIBLE, AVX2 + COMPATIBLE, on an AMD EPYC with
avx512f, avx512_bf16, avx512_vnni and no AMX), and `make test` runs these checks a second time on oneDNN's AVX2
and MKL's compatible paths (`make test-kernels`), so two kernel paths are checked on every machine.

Methods run at the settings under which they act on a 32-token prompt (their first declared test variant: the
defaults of KIVI, SnapKV and ShadowKV keep a 32-token prompt whole); the tasks run them at their defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
from omegaconf import OmegaConf

from conftest import DATA_DIR, METHODS, ROOT, load_model, method_from_conf, model_cfg, sample_ids, variants
from infinigen import adapter, modes
from infinigen.offload.runtime import teacher_forced_logits

HALF = ("float16", "bfloat16")
MODELS = ("tiny-opt", "tiny-llama-gqa", "tiny-gemma3")
PROMPT, DECODED = 32, 8

# Largest |delta log-prob| of any decoded row that rounding alone makes between sim and decode (one dtype; KIVI's
# sim sums its quantised and full-precision parts in two products, decode in one): 1.1e-3 (fp16, KIVI on OPT) in
# every kernel setting; bf16 7.8e-3 (KIVI on the GQA llama), and 9.7e-3 (full attention on tiny-gemma3) with
# ONEDNN_MAX_CPU_ISA=AVX512_CORE, where sim's batched products and decode's single rows take different bf16 kernels
# (in the other settings they agree bit for bit). >= 3.7x / 4.1x margin (bf16 keeps 8 significant bits to fp16's
# 11: its rounding is 8x coarser).
ROUNDING = {"float16": 4e-3, "bfloat16": 4e-2}
# The same against a float32 model (its weights rounded too), for keep sets that cannot move with values: largest
# 9.1e-3 (bf16) and 1.0e-3 (fp16) on OPT and the GQA llama, 2.2e-2 and 1.9e-3 on tiny-gemma3 (the same rounding
# carries 2-3x as far into its logits), in every kernel setting: >= 3.6x margin, and far below a different
# selection (random top-k at 0.2 vs full: 0.29-0.68 mean per row, more at the row maximum).
ROUNDING_VS_FLOAT32 = {"float16": 8e-3, "bfloat16": 8e-2}
# Mean over decoded rows of the row's largest |delta log-prob|, for methods whose choices may flip, between modes of
# one dtype (every choice made in float32): at most 3.2e-4 (fp16, RocketKV on tiny-gemma3) and 0 (bf16), except
# with ONEDNN_MAX_CPU_ISA=AVX512_CORE: 4.3e-3 (bf16, SnapKV on tiny-gemma3). A genuinely different selection of the
# same size moves this mean by >= 0.17 on these models (Quest at budget 0.2 vs 0.3: 0.18-0.48; random top-k vs
# full: 0.29-0.68), so the bounds sit well below that.
FLIPS = {"float16": 0.05, "bfloat16": 0.12}
# The same against a float32 model, per model: there a flip is a near-tie the rounding of every weight and
# activation may cross, and the models differ in how far one carries. Largest mean measured, over every kernel
# setting (they differ by < 5e-3 between settings), and the bound at >= 3.2x it:
#   fp16  tiny-opt 0.023 (Quest: one row's flip of 0.15), tiny-llama-gqa 0.014 (InfiniGen), tiny-gemma3 0.078
#         (infinigen_reference: its current token competes for the count, so a near-tie decides whether a row
#         attends itself; 0.020 for every other method, KIVI's)
#   bf16  tiny-opt 0.031 (RocketKV), tiny-llama-gqa 0.039 (RocketKV), tiny-gemma3 0.111 (2-bit quant: each bin edge
#         a rounding crosses moves a value by a third of its group's range; Quest 0.082, InfiniGen 0.015)
# each below what a different selection costs on that model (Quest at budget 0.2 vs 0.3, float32: 0.18 on tiny-opt,
# 0.25 on tiny-llama-gqa, 0.48 on tiny-gemma3; random top-k vs full 0.29 / 0.34 / 0.68).
FLIPS_VS_FLOAT32 = {"tiny-opt": {"float16": 0.08, "bfloat16": 0.12},
                    "tiny-llama-gqa": {"float16": 0.05, "bfloat16": 0.15},
                    "tiny-gemma3": {"float16": 0.25, "bfloat16": 0.36}}
# kv_fraction: a flipped threshold changes one row's count by one entry, ~1e-4 of these runs' mean (measured:
# identical to 1e-8 in every case); a count computed wrong moves it by far more.
KV_TOL = 1e-3
# keep sets that depend on no value (positions, a seeded draw, everything) ...
VALUE_FREE = ("full", "offload", "streaming", "random_topk")
# ... and the quantisers, which keep every entry and quantise bit-identical inputs with the same float32
# arithmetic in every mode (only against a float32 model, where inputs differ, can a value cross a bin edge)
QUANTISERS = ("quant", "kivi")


def acting(method_name: str) -> dict:
    """The settings under which a method acts on a 32-token prompt: its first declared test variant, else its
    defaults."""
    return (variants(method_name)[1:2] or [{}])[0]


def fresh_model(name: str, dtype: str):
    """A model of its own: InfiniGen folds its skew into OPT's weights, which must not reach another method's
    run (the cached test models are shared)."""
    return adapter.load(model_cfg(name, dtype=dtype))[0]


@dataclass
class Run:
    logprobs: torch.Tensor  # (b, decoded, vocab) float32
    kv_fraction: float


def scored(method, logits: torch.Tensor) -> Run:
    return Run(logits.float().log_softmax(-1), method.stats.summary()["kv_fraction"])


@lru_cache(maxsize=None)
def sim_run(method_name: str, model_name: str, dtype: str) -> Run:
    """Sim mode with the eager kernel (what decode steps use)."""
    model = fresh_model(model_name, dtype)
    ids = sample_ids(model_name, PROMPT + DECODED)
    m = method_from_conf(method_name, **acting(method_name))
    return scored(m, modes.sim_logits(model, m, ids, dense_rows=PROMPT, attention="exact")[:, PROMPT - 1 : -1])


@lru_cache(maxsize=None)
def runs(method_name: str, model_name: str, dtype: str) -> dict[str, Run]:
    """One method on one model in one dtype: sim and decode with the eager kernel on both sides (what decode
    steps use), decode with the fused prefill and the offloading runtime (which prefills fused)."""
    model = fresh_model(model_name, dtype)
    ids = sample_ids(model_name, PROMPT + DECODED)
    settings = acting(method_name)
    out = {"sim": sim_run(method_name, model_name, dtype)}
    m = method_from_conf(method_name, **settings)
    out["decode"] = scored(m, modes.decode_logits(model, m, ids, dense_rows=PROMPT, attention="exact"))
    m = method_from_conf(method_name, **settings)
    out["decode_fused"] = scored(m, modes.decode_logits(model, m, ids, dense_rows=PROMPT))
    m = method_from_conf(method_name, **settings)
    out["runtime"] = scored(m, teacher_forced_logits(model, m, ids, PROMPT)[0])
    return out


@lru_cache(maxsize=None)
def half_sim_against_float32(method_name: str, model_name: str, dtype: str) -> Run:
    """The half-precision sim run compared with float32's. InfiniGen's skew comes from float32's calibration (the
    serving path alone, as on smollm2 below): calibrated on its own half-precision queries, a random model's close
    singular values let the SVD pick other directions and columns, which moved the mean row deviation from 0.015
    to 0.10 (bf16, tiny-gemma3) and from 0.028 to 0.072 (tiny-llama-gqa) in every kernel setting: a different
    selection, not precision. Its own calibration runs in every sim == decode == runtime check."""
    if method_name != "infinigen":
        return sim_run(method_name, model_name, dtype)
    from infinigen.method import skew

    model, reference = fresh_model(model_name, dtype), fresh_model(model_name, "float32")
    ids = sample_ids(model_name, PROMPT + DECODED)
    capture = skew.capture_qk
    m = method_from_conf(method_name, cache_dir=None, **acting(method_name))  # no skew cached for the half model
    skew.capture_qk = lambda model, input_ids: capture(reference, input_ids)  # float32's queries and keys
    try:
        return scored(m, modes.sim_logits(model, m, ids, dense_rows=PROMPT, attention="exact")[:, PROMPT - 1 : -1])
    finally:
        skew.capture_qk = capture


def row_deviation(a: Run, b: Run) -> torch.Tensor:
    """Each decoded row's largest |delta log-prob| over the vocabulary, (b * decoded,)."""
    return (a.logprobs - b.logprobs).abs().amax(-1).flatten()


def check_agreement(a: Run, b: Run, choices_fixed: bool, rounding: float, flips: float, what: str) -> None:
    """Choices that cannot move: every row within `rounding`, the same kv_fraction. Choices that may flip: the
    same kv_fraction to KV_TOL, the mean row deviation within `flips`."""
    assert torch.isfinite(a.logprobs).all() and torch.isfinite(b.logprobs).all(), f"{what}: non-finite log-probs"
    rows = row_deviation(a, b)
    if choices_fixed:
        assert float(rows.max()) <= rounding, f"{what}: max |delta log-prob| {float(rows.max()):.3g}"
        assert a.kv_fraction == pytest.approx(b.kv_fraction, abs=1e-6), what
        return
    assert abs(a.kv_fraction - b.kv_fraction) <= KV_TOL, f"{what}: kv_fraction {a.kv_fraction} vs {b.kv_fraction}"
    assert float(rows.mean()) <= flips, f"{what}: mean row |delta log-prob| {float(rows.mean()):.3g}"


CASES = [pytest.param(m, model, dtype, id=f"{m}-{model}-{dtype}")
         for m in METHODS for model in MODELS for dtype in HALF]
@pytest.mark.parametrize("method_name,model_name,dtype", CASES)
def test_sim_decode_and_runtime_agree_in_half_precision(method_name, model_name, dtype):
    r = runs(method_name, model_name, dtype)
    fixed = method_name in VALUE_FREE + QUANTISERS
    bounds = ROUNDING[dtype], FLIPS[dtype]
    check_agreement(r["sim"], r["decode"], fixed, *bounds, "sim vs decode (eager kernel on both sides)")
    # the runtime runs the method's own decode step around the transfers, after the same fused prefill
    check_agreement(r["decode_fused"], r["runtime"], fixed, *bounds, "decode vs runtime (fused prefill on both)")


@pytest.mark.parametrize("method_name,model_name,dtype", CASES)
def test_half_precision_log_probs_follow_float32(method_name, model_name, dtype):
    check_agreement(half_sim_against_float32(method_name, model_name, dtype),
                    sim_run(method_name, model_name, "float32"), method_name in VALUE_FREE,
                    ROUNDING_VS_FLOAT32[dtype], FLIPS_VS_FLOAT32[model_name][dtype],
                    f"{dtype} vs float32 (sim, same ids)")


# ----------------------------------------------------------------------------------------------- the tasks


def task_cfg(name: str, **overrides):
    return OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "task" / f"{name}.yaml"), overrides)


# `python run.py model=tiny-opt model.dtype=D method=M task=ppl|latency`, the task code in-process at a few
# tokens: a prompt for the methods that compress one (SnapKV, ShadowKV), a warm-up generation and two steps
TINY_TASKS = {"ppl": task_cfg("ppl", seq_len=40, max_windows=1, dense_rows=PROMPT),
              "latency": task_cfg("latency", prompt_len=PROMPT, gen_len=3, warmup=1)}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("method_name", METHODS)
def test_every_method_runs_the_ppl_and_latency_tasks_in_half_precision(method_name, dtype, data_dir):
    from experiments import latency, ppl, runner

    model = fresh_model("tiny-opt", dtype)
    for name, module in (("ppl", ppl), ("latency", latency)):
        task = TINY_TASKS[name]
        module.validate(task, data_dir)
        result = module.run(model, None, method_from_conf(method_name), task, data_dir)
        runner.check_finite([result], name)  # what the runner does before it writes a row
        assert 0 < result["kv_fraction"] <= 1, (name, result["kv_fraction"])
    assert result["dtype"] == dtype


# the bug this file started from (a float32 constant masked into a float16 tensor), end to end through the runner
RUNNER_CASES = [("float16", "ppl"), ("bfloat16", "latency")]


@pytest.mark.parametrize("dtype,task", RUNNER_CASES, ids=[f"{d}-{t}" for d, t in RUNNER_CASES])
def test_run_py_infinigen_in_half_precision(dtype, task, tmp_path, data_dir):
    from hydra import compose, initialize_config_dir

    from analysis import store
    from experiments import runner

    sizes = {"ppl": ["task.seq_len=40", "task.max_windows=1"],
             "latency": [f"task.prompt_len={PROMPT}", "task.gen_len=3", "task.warmup=1"]}[task]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny-opt", f"model.dtype={dtype}", "method=infinigen",
                                           f"task={task}", *sizes, f"data_dir={data_dir}", f"results_dir={tmp_path}"])
    row = runner.run(cfg)
    assert row["config"]["model"]["dtype"] == dtype and math.isfinite(row["metrics"]["kv_fraction"])
    assert len(store.load(tmp_path)) == 1


# ----------------------------------------------------------------------------------------------- the real model

# smollm2-135m (conf default float32) in bfloat16, one 256-token WikiText-2 window as task=ppl scores it, InfiniGen at
# a Llama-family setting pinned here (what method=infinigen gives by default is chosen on data and may change).
SMOLLM2_WINDOW = 256
LLAMA_SETTING = {"skip_layers": 2, "alpha": 8.0, "partial_ratio": 0.5, "speculate_from": "block_input"}
# bf16 against float32, measured in five kernel settings (ONEDNN_MAX_CPU_ISA unset / AVX2 / AVX512_CORE,
# MKL_CBWR=COMPATIBLE, AVX2 + COMPATIBLE; an AMD EPYC with avx512_bf16, no AMX; AVX512_CORE_VNNI and SSE41 give
# what AVX512_CORE and AVX2 give). InfiniGen with float32's calibration ("shared") and with its own ("own"):
#   full attention's perplexity       -0.24 / -0.15 / -0.46 / -0.39 / -0.16 %
#   InfiniGen's recall, shared        +0.024 / +0.068 / +0.018 / +0.024 / +0.071 %   (of 0.8786)
#                       own           +0.031 / +0.066 / -0.001 / +0.025 / +0.039 %
#   InfiniGen's kv_fraction           within 7e-5 of 0.272 in every case (KV_TOL: 14x)
#   InfiniGen's perplexity, shared    -1.9 / -2.7 / -2.4 / -2.0 / -2.6 %              (of 43.4)
#                           own       -1.4 / -1.6 / -1.7 / -3.1 / -2.0 %
# Perplexity under InfiniGen at one short window is chaotic: 2.7-3.0% of its selected entries differ from float32's
# in every setting, and which ones moves perplexity by percents (at the paper's setting, skip_layers 1, alpha 4,
# partial_ratio 0.2, where this test used to run: -0.3% here, -5.7% with AVX512_CORE, -6.0% on a Xeon with AMX). Its
# recall of the attention mass, a mean over every decoded row, head and layer, is what stays put: it measures
# precision, and a genuinely different selection moves it more (float32 at alpha 7: -0.42%; partial_ratio 0.45:
# -0.37%; the rotations transposed: -10%). Bounds at >= 3x the largest measured:
PPL_TOL = 0.015  # full attention: 0.46%
RECALL_TOL = 0.0025  # relative: 0.071%
INFINIGEN_PPL_TOL = 0.10  # relative: 3.1%; loose, but a broken bfloat16 path (perplexity x2, NaN) still fails


def smollm2_run(model, tokenizer, method) -> dict:
    from experiments import ppl

    task = task_cfg("ppl", seq_len=SMOLLM2_WINDOW, max_windows=1)
    return ppl.run(model, tokenizer, method, task, DATA_DIR)


@pytest.mark.slow
def test_smollm2_perplexity_in_bfloat16_is_float32s(data_dir, monkeypatch):
    from infinigen.method import infinigen as infinigen_module
    from infinigen.method.skew import Skew

    fp32, tokenizer = load_model("smollm2-135m")
    assert fp32.dtype == torch.float32  # the conf default: bfloat16 is this test's override
    bf16 = fresh_model("smollm2-135m", "bfloat16")
    full = smollm2_run(fp32, tokenizer, method_from_conf("full"))["ppl"]
    assert smollm2_run(bf16, tokenizer, method_from_conf("full"))["ppl"] == pytest.approx(full, rel=PPL_TOL)
    calibrated = method_from_conf("infinigen", **LLAMA_SETTING)
    reference = smollm2_run(fp32, tokenizer, calibrated)
    own = smollm2_run(bf16, tokenizer, method_from_conf("infinigen", **LLAMA_SETTING))
    # the serving path alone: the bfloat16 model speculates with the rotations and columns float32 calibrated
    ref = calibrated.skewing
    monkeypatch.setattr(infinigen_module, "calibrate", lambda model, *args, **kwargs: Skew(
        rotations=list(ref.rotations), columns=[c.to(model.dtype) for c in ref.columns]))
    shared = smollm2_run(bf16, tokenizer, method_from_conf("infinigen", **LLAMA_SETTING))
    for what, run in (("float32's calibration", shared), ("its own calibration", own)):
        assert run["stats"]["recall"] == pytest.approx(reference["stats"]["recall"], rel=RECALL_TOL), what
        assert abs(run["kv_fraction"] - reference["kv_fraction"]) <= KV_TOL, what
        assert run["ppl"] == pytest.approx(reference["ppl"], rel=INFINIGEN_PPL_TOL), what


# ----------------------------------------------------------------------------------------------- ranges and folds


@pytest.mark.parametrize("dtype", HALF)
def test_skew_is_folded_in_float32_and_rounded_once(dtype):
    """fold_opt on a half-precision OPT layer writes its float32 fold, rounded once: A rounded to half first is no
    longer orthogonal, and W_q W_k^T (the attention, not only its rounding) would change."""
    from infinigen.method.skew import fold_opt

    layer = adapter.attention_layers(fresh_model("tiny-opt", dtype))[0]
    dtype = getattr(torch, dtype)
    h, d = layer.num_heads, layer.head_dim
    A = torch.linalg.qr(torch.randn(h, d, d, generator=torch.Generator().manual_seed(0)))[0]  # orthogonal
    weight, bias = layer.q_proj.weight.float().view(h, d, -1), layer.q_proj.bias.float().view(h, d)
    expected = (torch.einsum("hde,hdi->hei", A, weight).reshape(h * d, -1).to(dtype),
                torch.einsum("hde,hd->he", A, bias).reshape(-1).to(dtype))
    fold_opt(layer, A)
    assert torch.equal(layer.q_proj.weight, expected[0]) and torch.equal(layer.q_proj.bias, expected[1])


def test_shadowkv_factors_stay_in_float16_range_on_a_long_prompt():
    """The low-rank key factors of a long prompt: keys with an outlier channel (as real keys have) of 300 over 2^16
    tokens have a top singular value of 300 x 2^8 = 76,800 along that channel, so S V^T holds it, past float16's
    65,504. Kept with U, the factors stay as large as the keys, and the keys rebuilt from them are the keys."""
    from baselines.shadowkv import ShadowKV

    gen = torch.Generator().manual_seed(0)
    n, d = 1 << 16, 64
    outlier = torch.zeros(d)
    outlier[5] = 300.0
    keys = (outlier + torch.randn(n, 2, generator=gen) @ torch.randn(2, d, generator=gen)).half().view(1, 1, n, d)
    method = ShadowKV(rank=4)
    state = method.analyse(None, keys, None, None)  # no RoPE tables: the keys as they are (OPT)
    index = torch.arange(0, n, 997).view(1, 1, -1)
    rebuilt = method.rebuilt_keys(None, state, index)
    assert torch.isfinite(rebuilt).all()
    torch.testing.assert_close(rebuilt.float(), keys[:, :, index[0, 0]].float(), atol=0.5, rtol=1e-2)
