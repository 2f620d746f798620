"""A doc's choices scored from one forward of their shared context (experiments/lm_eval_lm.py `_score_shared`):
under every method whose sim mode says it resumes after a prefix (`prefix_resumable`), the log-likelihoods, greedy
flags and stats of scoring each whole input, in fewer rows."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from conftest import METHODS, load_model, method_from_conf, variants
from experiments import lm_eval_lm
from experiments.lm_eval_protocols import PROTOCOLS
from infinigen import adapter
from test_lm_eval import MAX_LENGTH, RecentOnly, _ids, make_lm, tiny, token_requests  # noqa: F401 (tiny: a fixture)

CASES = [(name, v) for name in METHODS for v in variants(name)]


@pytest.fixture(autouse=True)
def short_prefixes(monkeypatch):
    """The tests' contexts are 23-57 tokens: groups saving 16 rows shared (the default's threshold is a matter of
    speed)."""
    from experiments import lm_eval_protocols

    monkeypatch.setattr(lm_eval_protocols, "SHARED_MIN", 16)


def requests() -> list:
    """token_requests (a doc's choices after one context, ...) and WinoGrande's shape: contexts that share a few-shot
    prefix and differ in their last tokens (the option), one continuation; contexts of two lengths, so that under
    serving the prefix is cut at the shorter context."""
    shots, cont = _ids(34, seed=11), _ids(5, seed=12)
    return token_requests(MAX_LENGTH) + [(None, shots + _ids(n, seed=13 + k), cont) for k, n in enumerate((3, 3, 6))]


def scored(lm, reqs, share: bool = True):
    """(log-likelihoods, greedy flags); share=False: every input scored whole, as under a method that does not resume."""
    with mock.patch.object(lm_eval_lm, "shared_prefixes", lm_eval_lm.shared_prefixes if share else lambda _: []):
        out = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    return torch.tensor([ll for ll, _ in out], dtype=torch.float64), [g for _, g in out]


def whole_and_shared(tiny, make, protocol, batch_size):
    reqs = requests()
    whole = make_lm(tiny, make(), protocol, batch_size=batch_size)
    shared = make_lm(tiny, make(), protocol, batch_size=batch_size)
    return reqs, whole, shared


@pytest.fixture(scope="module", params=["tiny-llama-gqa", "tiny-gemma3"])
def tiny64(request):
    """In float64, where two kernels' rounding is ~1e-15: what is left is what each path computes (Gemma 3: sliding
    windows beside global layers, two RoPE tables)."""
    model, _ = load_model(request.param, "float64")
    return model, adapter.byte_tokenizer()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name,overrides", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_shared_context_scores_as_whole_inputs(tiny64, name, overrides, protocol):
    make = lambda: method_from_conf(name, **overrides)  # noqa: E731
    if not make().prefix_resumable:
        pytest.skip(f"{name} does not resume after a prefix: every input is scored whole")
    if protocol == "paper" and make().needs_prompt:
        pytest.skip(f"{name} compresses a prompt: the paper protocol is refused")
    reqs, whole, shared = whole_and_shared(tiny64, make, protocol, batch_size="auto")
    (want, want_greedy), (got, got_greedy) = scored(whole, reqs, share=False), scored(shared, reqs)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    assert got_greedy == want_greedy
    a, b = whole.method.stats.summary(), shared.method.stats.summary()
    assert set(a) == set(b)
    for key in set(a) - {"per_layer"}:
        assert b[key] == pytest.approx(a[key], rel=1e-9), key
    assert shared.counts["rows"] < whole.counts["rows"]  # the prefixes were computed once


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["full", "h2o", "infinigen", "quant"])
def test_shared_context_in_half_precision(name, dtype):
    """The models' own dtypes: the same scores to half-precision rounding (a quantiser's code may flip where a
    K/V element sits at a level's edge: a few 1e-3 in a log-likelihood)."""
    model, _ = load_model("tiny-llama", dtype)
    reqs, whole, shared = whole_and_shared((model, adapter.byte_tokenizer()), lambda: method_from_conf(name),
                                           "paper", batch_size="auto")
    torch.testing.assert_close(scored(shared, reqs)[0], scored(whole, reqs, share=False)[0], atol=2e-2, rtol=0)


def test_row_local_method_resumes(tiny):
    """A sparse method whose rows attend their own recent window resumes exactly (stats included), so a method's
    selection is not what sharing needs: that its rows depend on the tokens up to them."""
    def make():
        method = RecentOnly(window=5)
        method.prefix_resumable = True
        return method

    for protocol, batch_size in zip(PROTOCOLS, (1, 4)):
        reqs, whole, shared = whole_and_shared(tiny, make, protocol, batch_size)
        torch.testing.assert_close(scored(shared, reqs)[0], scored(whole, reqs, share=False)[0], atol=1e-5, rtol=0)
        assert shared.method.stats.summary()["kv_fraction"] == pytest.approx(
            whole.method.stats.summary()["kv_fraction"], rel=1e-9)
        assert shared.counts["rows"] < whole.counts["rows"]


def test_shared_prefixes(tiny):
    """The groups: each doc's choices after its context, the WinoGrande-shaped inputs after their shared shots; the
    30-token context's two one-token continuations are one input, scored whole like the truncated one. A method that
    does not resume scores every input whole."""
    from baselines.full import Full
    from experiments.lm_eval_protocols import shared_prefixes

    lm = make_lm(tiny, Full(), "paper")
    reqs = requests()
    inputs = list(dict.fromkeys(lm.model_input(ctx, cont) for _, ctx, cont in reqs))
    groups = shared_prefixes(inputs)
    assert sorted((p, len(members)) for p, members in groups) == [(23, 3), (34, 3), (40, 3), (57, 3), (57, 3)]
    assert sorted(len(inputs[k]) for k in set(range(len(inputs))) - {k for _, m in groups for k in m}) == [30, 128]
    assert shared_prefixes(inputs, fewest=69) == [(p, m) for p, m in groups if p * (len(m) - 1) >= 69]
    lm.method.prefix_resumable = False
    lls_whole = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert lm.counts["rows"] == sum(map(len, inputs)) and len(lls_whole) == len(reqs)


def test_resume_refuses_dense_rows_past_the_prefix():
    """Rows resumed after a prefix are decoded rows: dense rows beyond it would be computed silently wrong."""
    from baselines.full import Full
    from infinigen import modes

    model, _ = load_model("tiny-llama")
    ids = torch.arange(12)[None]
    _, past = modes.sim_prefix(model, Full(), ids[:, :8], dense_rows=8)
    with pytest.raises(ValueError, match="reaches past the prefix"):
        modes.sim_resume(model, Full(), past, torch.zeros(1, dtype=torch.long), ids[:, 8:], dense_rows=10)
