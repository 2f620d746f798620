"""ShadowKV and RocketKV beyond the contract tests every method runs: ShadowKV moves values only and rebuilds its
keys from the low-rank factors; RocketKV's stage-2 approximation is exact where it compresses nothing."""

import pandas as pd
import pytest
import torch

from baselines.rocketkv import RocketKV, chunk_prefix
from baselines.shadowkv import ShadowKV
from conftest import load_model, method_from_conf, sample_ids
from infinigen import modes
from infinigen.offload.runtime import teacher_forced_logits

PROMPT, DECODED = 48, 8
SMALL = {"local": 1, "outliers": 1, "budget": 0.25}  # a 48-token prompt with chunks left to select


def test_shadowkv_moves_values_only():
    """Every fetch is the selected rows x head_dim (a K|V row is twice that), and the rows are the sparse chunks."""
    model, _ = load_model("tiny-llama-gqa", "float64")
    ids = sample_ids("tiny-llama-gqa", PROMPT + DECODED)
    method = method_from_conf("shadowkv", **SMALL)
    _, report = teacher_forced_logits(model, method, ids, PROMPT)
    d, hk = model.config.head_dim, model.config.num_key_value_heads
    chunks = method.layout(PROMPT)[2]  # selected chunks per KV head
    assert chunks > 0 and len(report.fetch_log) == DECODED * model.config.num_hidden_layers
    for step, layer, nbytes, rows in report.fetch_log:
        assert rows == hk * chunks * method.chunk
        assert nbytes == rows * d * 8  # float64 values, no keys
    assert report.h2d_bytes == [model.config.num_hidden_layers * hk * chunks * method.chunk * d * 8] * DECODED


class Recorded(ShadowKV):
    def sim_state(self, session, layer, q, k, v, allowed):
        state = super().sim_state(session, layer, q, k, v, allowed)
        self.states = getattr(self, "states", []) + [state]
        return state


@pytest.mark.parametrize("rank,exact", [(64, True), (4, False)])
def test_shadowkv_rebuilds_the_keys_from_the_factors(rank, exact):
    """Full rank (2 KV heads x 32): RoPE undone, factored, rebuilt and rotated again gives the model's keys; a low
    rank does not."""
    model, _ = load_model("tiny-llama-gqa", "float64")
    ids = sample_ids("tiny-llama-gqa", PROMPT + DECODED)
    method = Recorded(**SMALL, rank=rank)
    modes.sim_logits(model, method, ids, dense_rows=PROMPT)
    for state in method.states:
        cand = state["cand"][..., None]  # the rebuilt positions
        assert bool(cand.any())
        rebuilt, true = state["keys"][:, :, :PROMPT], state["k"][:, :, :PROMPT]
        err = float(((rebuilt - true) * cand).abs().max())
        # 1e-6: transformers computes the RoPE tables in fp32 (cos^2 + sin^2 = 1 to ~1e-8), so rotating back and
        # forth is exact to that; the rank-4 keys miss by O(1)
        assert (err < 1e-6) == exact, err


def test_rocketkv_chunk_prefix_and_exact_scores():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 11, 8, dtype=torch.float64)
    hi, lo = chunk_prefix(k, 3)
    for j in range(11):
        start = j // 3 * 3
        assert torch.equal(hi[:, :, j], k[:, :, start : j + 1].amax(2))
        assert torch.equal(lo[:, :, j], k[:, :, start : j + 1].amin(2))
    # chunks of one entry on every channel: the approximate logits are the exact ones, at the model's temperature
    layer = type("Layer", (), {"logit_scale": 0.125})()
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    scores, temperature = RocketKV(chunk=1, channels=8).approx_scores(layer, q, k, k, 8)
    exact = torch.matmul(q.view(1, 2, 2, 1, 8), k.unsqueeze(2).transpose(-1, -2))
    torch.testing.assert_close(scores, exact)
    torch.testing.assert_close(temperature, torch.full_like(temperature, 0.125))


def test_rocketkv_stage_split_follows_the_reference():
    """L = 2048, token budget 0.2 (408 tokens): c = 5.02, r = 0.2 + 0.06 log2 c, stage 1 keeps 2048 / c^r = 1183 tokens
    (of which the 256 generated), stage 2 compresses 1183 / 408 = 2.9x: chunks of 2, 44 of 64 channels."""
    plan = RocketKV(budget=0.2).plan(2048, 1792, 64)
    assert plan == {"top_k": 204, "prompt_budget": 1183 - 256, "chunk": 2, "channels": 44}


# ----------------------------------------------------------------------------------------------- budgets in tokens


@pytest.mark.parametrize("cls", [RocketKV, ShadowKV])
def test_a_budget_is_a_fraction_or_a_token_count_never_both(cls):
    for given, match in [({"budget": 0.2, "budget_tokens": 256}, r"exactly one of .* got both \(0.2 and 256\)"),
                         ({"budget": None, "budget_tokens": None}, "got neither"),
                         ({"budget": None, "budget_tokens": 0}, "budget_tokens must be a token count >= 1"),
                         ({"budget": 1.5}, r"budget must be a fraction in \(0, 1\]")]:
        with pytest.raises(ValueError, match=match):
            cls(**given)


def test_a_token_budget_selects_what_its_fraction_does():
    """The papers' form (a token count) and the fraction of the same length give the same plan: RocketKV's B over
    the sequence, ShadowKV's sparse budget over the prompt; a count past the length is the whole length. The
    successors table's `budget tokens` column is that count (analysis/report/sections/successors.py)."""
    from analysis.report.sections.successors import budgets

    assert RocketKV(budget=None, budget_tokens=384).plan(2048, 1792, 64) == RocketKV(budget=0.1875).plan(2048, 1792, 64)
    assert RocketKV(budget=None, budget_tokens=10**6).top_k(2048) == RocketKV(budget=1.0).top_k(2048)
    assert ShadowKV(budget=None, budget_tokens=216).layout(1792) == ShadowKV(budget=0.12).layout(1792)
    assert ShadowKV(budget=None, budget_tokens=23).layout(1792) == ShadowKV(budget=0.0125).layout(1792)
    rows = pd.DataFrame({"method": ["rocketkv", "shadowkv", "shadowkv", "rocketkv"],
                         "method_params.budget": [0.1875, 0.12, 0.0125, None],
                         "method_params.budget_tokens": [None, None, None, 256],
                         "task_params.seq_len": [2048] * 4, "task_params.dense_rows": [1792] * 4})
    table = budgets(rows)
    assert table["budget tokens"].tolist() == [384, 216, 23, 256]
    assert table["budget"].iloc[3] == 256 / 2048
