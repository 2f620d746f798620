"""The backbone of trust: for every method in conf/method/, sim mode == decode mode (teacher-forced).

Rows >= dense_rows of one sim-mode forward must give the same log-probs as a real prefill of dense_rows
tokens followed by one-token decode steps through the method's cache, and report the same kv_fraction.
"""

import pytest
import torch

from conftest import METHODS, TINY, load_model, method_from_conf, sample_ids
from infinigen import runtime

# Extra settings a method is also checked under (e.g. eviction on); {} = its conf/method defaults.
VARIANTS = {
    "infinigen": [{}, {"capacity": 0.8}],
    "h2o": [{}, {"gqa_reduce": "max"}, {"heavy": 8, "recent": 8}],
    "quant": [{}, {"bits": 2}],
    "streaming": [{}, {"recent": 32}],
    # the defaults (pages of 16, 2 dense layers; window 32; residual 128) barely act on 72 tokens and 3 layers
    "quest": [{}, {"page_size": 4, "skip_layers": 0}, {"page_size": 8, "budget": 0.4, "gqa_reduce": "sum", "skip_layers": 1}],
    "snapkv": [{}, {"window": 8, "budget": 0.5, "kernel": 3}, {"window": 8, "budget": 20, "pooling": "avg"}],
    "kivi": [{}, {"residual": 32, "group_size": 16}, {"bits": 4, "residual": 16, "group_size": 8}],
}
TOL = 2e-4  # fp32 log-prob agreement; sim uses a masked softmax over all entries, decode a gathered subset

# The real model is checked in float64. In fp32, sim (one masked forward) and decode (token steps) differ by
# rounding (~3e-5 in log-probs), and a method's discrete choices (a score right at max - alpha, a value on a
# quantisation bin edge) amplify that into different keep sets a few tokens later. In float64 the attention
# is exact enough that the keep sets agree (the GGUF's packed linear layers still compute in fp32; the largest
# log-prob difference measured is 1.7e-5), so a disagreement left is a logic bug, not noise. The tiny models are
# still checked in fp32.
REAL_MODEL_DTYPE = "float64"


def cases(models):
    for method in METHODS:
        for overrides in VARIANTS.get(method, [{}]):
            for model in models:
                yield pytest.param(method, overrides, model, id=f"{method}-{model}-{overrides or 'default'}")


def check_contract(method_name, overrides, model_name, prompt, decoded, dtype=None):
    model, _ = load_model(model_name, dtype)
    ids = sample_ids(model_name, prompt + decoded)
    sim_method = method_from_conf(method_name, **overrides)
    sim = runtime.sim_logits(model, sim_method, ids, dense_rows=prompt)[:, prompt - 1 : -1].log_softmax(-1)
    dec_method = method_from_conf(method_name, **overrides)
    dec = runtime.decode_logits(model, dec_method, ids, dense_rows=prompt).log_softmax(-1)
    torch.testing.assert_close(dec, sim, atol=TOL, rtol=0)
    sim_stats, dec_stats = sim_method.stats.summary(), dec_method.stats.summary()
    assert sim_stats["kv_fraction"] == pytest.approx(dec_stats["kv_fraction"], abs=1e-6)
    return sim_stats


@pytest.mark.parametrize("method_name,overrides,model_name", list(cases(TINY)))
def test_sim_equals_decode_tiny(method_name, overrides, model_name):
    check_contract(method_name, overrides, model_name, prompt=48, decoded=24)


@pytest.mark.slow
@pytest.mark.parametrize("method_name,overrides,model_name", list(cases(["smollm2-135m"])))
def test_sim_equals_decode_smollm2(method_name, overrides, model_name):
    check_contract(method_name, overrides, model_name, prompt=256, decoded=64, dtype=REAL_MODEL_DTYPE)
