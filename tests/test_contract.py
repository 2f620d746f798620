"""The backbone of trust: for every method in conf/method/, sim mode == decode mode (teacher-forced).

Rows >= dense_rows of one sim-mode forward must give the same log-probs as a real prefill of dense_rows
tokens followed by one-token decode steps through the method's cache, and report the same kv_fraction.
"""

import pytest
import torch

from conftest import METHODS, TINY, load_model, method_from_conf, sample_ids, variants
from infinigen import modes

TOL = 1e-6  # float64 log-prob agreement: a disagreement left is a logic bug, not rounding
FP32_TOL = 2e-4  # fp32 log-prob agreement for methods without value-dependent choices (~50x the rounding seen)

# The contract runs in float64 on every model. In fp32, sim (one masked forward) and decode (token steps) differ
# by rounding (~1e-6 on the tiny models, ~3e-5 on smollm2), and which side of a threshold a value lands on
# differs between CPUs' kernels: a speculated score right at max - alpha, a K/V value on a quantisation bin
# edge, an accumulated-attention tie. A method's discrete choices amplify that into different keep sets a few
# tokens later (quant 2-bit on tiny-llama failed by 6e-3 on another machine in fp32). In float64 those
# coincidences are ~1e9 times rarer, so the keep sets agree (the GGUF's packed linear layers still compute in
# fp32; the largest log-prob difference measured on smollm2 is 1.7e-5).
REAL_MODEL_DTYPE = "float64"
TINY_DTYPE = "float64"
REAL_TOL = 1e-4  # smollm2: its packed fp32 linear layers bound the agreement (1.7e-5 measured)
# fp32 is still checked for the methods whose keep sets do not depend on values (so rounding cannot flip them)
FP32_METHODS = ["full", "offload", "streaming"]


# Every method's defaults run on a GQA llama (RoPE, grouped heads), on OPT (learned positions, post-projection
# biases, one head per KV head) and on Gemma 3 (one KV head, QK-norm, local layers whose window is shorter than the
# sequence); each variant's logic (eviction, capacity, bits, pages, ...) is model-independent and is proven once, on
# the GQA llama (the one model where gqa_reduce acts). The residual-stream speculation inputs read each family's own
# norms and residual layout, so they run on OPT and Gemma 3 as well.
DEFAULT_MODELS = ["tiny-llama-gqa", "tiny-opt", "tiny-gemma3"]
VARIANT_MODEL = "tiny-llama-gqa"
VARIANTS_ON_EVERY_MODEL = [{"speculate_from": "block_input"}, {"speculate_from": "after_attention"}]
def cases(models, with_variants=True):
    for method in METHODS:
        for overrides in variants(method) if with_variants else [{}]:
            on = models if not overrides or overrides in VARIANTS_ON_EVERY_MODEL else [VARIANT_MODEL]
            for model in on:
                yield pytest.param(method, overrides, model, id=f"{method}-{model}-{overrides or 'default'}")


def check_contract(method_name, overrides, model_name, prompt, decoded, dtype=None, tol=TOL):
    model, _ = load_model(model_name, dtype)
    ids = sample_ids(model_name, prompt + decoded)
    sim_method = method_from_conf(method_name, **overrides)
    # the exact kernel on both sides: the eager math decode steps use too (tests/test_longctx.py: fused == exact)
    sim = modes.sim_logits(model, sim_method, ids, dense_rows=prompt, attention="exact")
    sim = sim[:, prompt - 1 : -1].log_softmax(-1)
    dec_method = method_from_conf(method_name, **overrides)
    dec = modes.decode_logits(model, dec_method, ids, dense_rows=prompt, attention="exact").log_softmax(-1)
    torch.testing.assert_close(dec, sim, atol=tol, rtol=0)
    sim_stats, dec_stats = sim_method.stats.summary(), dec_method.stats.summary()
    assert sim_stats["kv_fraction"] == pytest.approx(dec_stats["kv_fraction"], abs=1e-6)
    return sim_stats


@pytest.mark.parametrize("method_name,overrides,model_name", list(cases(DEFAULT_MODELS)))
def test_sim_equals_decode_tiny(method_name, overrides, model_name):
    check_contract(method_name, overrides, model_name, prompt=48, decoded=24, dtype=TINY_DTYPE)


@pytest.mark.parametrize("model_name", TINY + ["tiny-gemma3"])
@pytest.mark.parametrize("method_name", FP32_METHODS)
def test_sim_equals_decode_tiny_fp32(method_name, model_name):
    check_contract(method_name, {}, model_name, prompt=48, decoded=24, tol=FP32_TOL)


# The real model's decode steps dominate the suite's time (each one a full forward through its packed layers), so
# its prompt is just long enough for every method's defaults to act on it (the budgets are fractions; SnapKV keeps
# its 32-token window of the prompt; Quest's pages of 16) and 16 steps carry that through eviction and selection.
# KIVI's defaults quantise nothing before 128 tokens (its fp residual), so its prompt crosses that.
REAL_LENGTHS = {"kivi": (136, 16)}
REAL_DEFAULT_LENGTHS = (64, 16)


# The real model at each method's defaults: the variants' logic is proven on the tiny models (same code, every
# variant); this proves the real model's shapes (GQA 9/3, 30 layers, RoPE) and text through every method.
@pytest.mark.slow
@pytest.mark.parametrize("method_name,overrides,model_name", list(cases(["smollm2-135m"], with_variants=False)))
def test_sim_equals_decode_smollm2(method_name, overrides, model_name):
    prompt, decoded = REAL_LENGTHS.get(method_name, REAL_DEFAULT_LENGTHS)
    check_contract(method_name, overrides, model_name, prompt, decoded, dtype=REAL_MODEL_DTYPE, tol=REAL_TOL)


def test_decode_kernel_equals_eager_with_repeated_kv_heads():
    """`attend` folds each KV head's query heads into rows instead of repeating the KV (transformers' eager): the
    same numbers (float64), with a per-KV-head mask, a batch-broadcast one and none; `grouped_matmul` likewise."""
    from infinigen.attention import attend, grouped_matmul

    gen = torch.Generator().manual_seed(0)
    b, hk, g, t, s, d = 2, 3, 3, 4, 37, 16
    q = torch.randn(b, hk * g, t, d, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(b, hk, s, d, dtype=torch.float64, generator=gen) for _ in range(2))
    kr, vr = (x.repeat_interleave(g, dim=1) for x in (k, v))  # (b, h, s, d): eager's repeat_kv
    for keep in (None, torch.rand(b, hk, t, s, generator=gen) > 0.4, torch.rand(1, 1, t, s, generator=gen) > 0.4):
        scores = q @ kr.transpose(2, 3) * 0.25
        if keep is not None:
            mask = keep.repeat_interleave(g, dim=1) if keep.shape[1] > 1 else keep
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # eager's softmax is float32 in any dtype
        out, got = attend(q, k, v, keep, 0.25, need_probs=True)
        torch.testing.assert_close(out, probs.double() @ vr, atol=1e-12, rtol=0)
        torch.testing.assert_close(got, probs.view(b, hk, g, t, s), atol=1e-12, rtol=0)
    q5 = q.view(b, hk, g, t, d)
    torch.testing.assert_close(grouped_matmul(q5, k), q5 @ k.unsqueeze(2).transpose(-1, -2), atol=1e-12, rtol=0)


def test_stats_fold_unread_recordings_without_changing_the_means(monkeypatch):
    """KVStats keeps recordings unread (a GPU step never waits to record) and folds every PENDING of them into
    running sums: the means are those of the recordings, however many were folded."""
    from infinigen.stats import KVStats

    gen = torch.Generator().manual_seed(0)
    values = [torch.rand(2, 3, generator=gen, dtype=torch.float64) for _ in range(11)]
    expect = float(sum(((v + 1) * 0.25).sum() for v in values)) / sum(v.numel() for v in values)
    for pending in (3, 4096):
        monkeypatch.setattr(KVStats, "PENDING", pending)
        stats = KVStats()
        for v in values:
            stats.add(5, "kv_fraction", v, offset=1, scale=0.25)
        assert stats.per_layer("kv_fraction")[5] == pytest.approx(expect, rel=1e-12)
