"""Quest, SnapKV and KIVI: the pieces each paper's method rests on. sim == decode is tests/test_contract.py's job."""

import math
from types import SimpleNamespace

import pytest
import torch

from baselines.kivi import KIVI, KIVIStore, fake_quantize_keys, quantized_keys, quantized_values
from baselines.quest import Quest, page_metadata, page_minmax, page_scores
from baselines.snapkv import SnapKV
from conftest import load_model, random_ids
from infinigen import modes as runtime
from infinigen.shared.quantize import fake_quantize

GEN = lambda seed=0: torch.Generator().manual_seed(seed)  # noqa: E731


@pytest.mark.parametrize(
    "make",
    [
        lambda: Quest(budget=0), lambda: Quest(budget=1.5), lambda: Quest(page_size=0), lambda: Quest(page_size=4.0),
        lambda: Quest(skip_layers=-1), lambda: Quest(gqa_reduce="mean"),
        lambda: SnapKV(budget=0), lambda: SnapKV(window=0), lambda: SnapKV(kernel=4), lambda: SnapKV(pooling="min"),
        lambda: KIVI(bits=3), lambda: KIVI(bits=8), lambda: KIVI(group_size=3), lambda: KIVI(residual=100),
        lambda: KIVI(residual=16, group_size=32),
    ],
)
def test_invalid_hyperparameters_are_refused(make):
    with pytest.raises(ValueError, match="must be"):
        make()


# ----------------------------------------------------------------------------------------------- Quest


def test_quest_page_score_bounds_every_key_of_the_page():
    k = torch.randn(2, 3, 37, 16, generator=GEN()) * 2  # 37 = 2 full pages of 16 + a partial one
    q = torch.randn(2, 3, 4, 5, 16, generator=GEN(1))  # (b, hk, g, r, d)
    kmin, kmax = page_minmax(k, 16)
    assert kmin.shape == (2, 3, 3, 16)
    assert torch.equal(kmin[:, :, 2], k[:, :, 32:].amin(2)) and torch.equal(kmax[:, :, 2], k[:, :, 32:].amax(2))
    bound = page_scores(q, kmin, kmax)  # (b, hk, g, r, 3)
    dots = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2))  # (b, hk, g, r, 37)
    for page in range(3):
        best = dots[..., page * 16 : (page + 1) * 16].amax(-1)
        assert (bound[..., page] >= best - 1e-5).all()
    # the bound is exact for a one-key page
    assert torch.allclose(page_scores(q, k[:, :, :1], k[:, :, :1])[..., 0], dots[..., 0], atol=1e-5)


def test_quest_attends_own_page_plus_the_top_pages_within_the_budget():
    page, t, d = 4, 40, 8
    method = Quest(budget=0.25, page_size=page, skip_layers=0, gqa_reduce="max")
    q = torch.randn(1, 4, t, d, generator=GEN(2))  # 2 query heads per KV head
    k = torch.randn(1, 2, t, d, generator=GEN(3))
    state = method.sim_state(SimpleNamespace(), SimpleNamespace(index=0), q, k, k, None)
    keep = method.sim_keep(SimpleNamespace(chunk=(0, t)), SimpleNamespace(index=0), state, torch.arange(t), t)  # (1, 2, t, t)
    kmin, kmax = page_minmax(k, page)
    scores = page_scores(q.view(1, 2, 2, t, d), kmin, kmax).amax(2)  # (1, 2, t, pages)
    for row in range(t):
        own = row // page
        pages_allowed = math.ceil(math.ceil(0.25 * row - 1e-9) / page)  # besides the own page
        for h in range(2):
            kept = keep[0, h, row, : (own + 1) * page].view(-1, page)
            assert kept[own].all()  # own page (the caller cuts what lies after the row)
            kept_pages = [p for p in range(own) if kept[p].all()]
            assert all(kept[p].all() or not kept[p].any() for p in range(own))  # whole pages only
            assert not keep[0, h, row, (own + 1) * page :].any()
            assert len(kept_pages) == min(pages_allowed, own)
            dropped = [p for p in range(own) if p not in kept_pages]
            if kept_pages and dropped:
                assert scores[0, h, row, kept_pages].min() >= scores[0, h, row, dropped].max()


def test_quest_store_keeps_everything_and_page_metadata():
    model, _ = load_model("tiny-llama-gqa")
    method = Quest(page_size=8, skip_layers=1)
    runtime.decode_logits(model, method, random_ids(60, 512), dense_rows=45)
    dense, paged = method.last_cache.layers[0], method.last_cache.layers[1]
    assert page_metadata(dense) == {}  # dense layers need no metadata
    assert paged.stored == 60
    meta = page_metadata(paged)  # 7 full pages and an open one, appended token by token after the prefill
    kmin, kmax = page_minmax(paged.keys[:, :, :56], 8)
    assert torch.equal(meta["kmin"], kmin) and torch.equal(meta["kmax"], kmax) and kmin.shape[2] == 7
    assert torch.equal(meta["open"][0], paged.keys[:, :, 56:].amin(2, keepdim=True))
    assert torch.equal(meta["open"][1], paged.keys[:, :, 56:].amax(2, keepdim=True))
    kv = 2 * paged.keys.numel() * 4
    assert method.store_bytes([paged]) == kv + 2 * (kmin.numel() + meta["open"][0].numel()) * 4
    assert 0 < method.stats.per_layer("kv_fraction")[1] < 1 == method.stats.per_layer("kv_fraction")[0]


# ----------------------------------------------------------------------------------------------- SnapKV


def peaked(n: int, d: int, hot: list[int], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head, 2 query heads: every window query points at the keys in `hot`, the rest is noise."""
    k = torch.randn(1, 1, n, d, generator=GEN(4)) * 0.1
    direction = torch.zeros(d)
    direction[0] = 1.0
    k[0, 0, hot] += 4 * direction
    q = torch.randn(1, 2, window, d, generator=GEN(5)) * 0.1 + 4 * direction
    return q, k


def test_snapkv_keeps_the_window_and_the_voted_tokens():
    n, w = 64, 8
    q, k = peaked(n, 16, hot=[5, 30], window=w)
    method = SnapKV(budget=w + 2, window=w, kernel=1)
    kept = method.prompt_kept(q, k, 1.0)[0, 0].tolist()
    assert kept == [5, 30] + list(range(n - w, n))
    assert method.prompt_kept(q, k[:, :, :w], 1.0) is None  # nothing before the window
    assert SnapKV(budget=1.0, window=w).prompt_kept(q, k, 1.0) is None  # the budget covers the prompt
    assert SnapKV(budget=w, window=w).prompt_kept(q, k, 1.0)[0, 0].tolist() == list(range(n - w, n))


def test_snapkv_max_pooling_keeps_the_neighbours_of_a_voted_token():
    n, w = 64, 8
    q, k = peaked(n, 16, hot=[20], window=w)
    alone = SnapKV(budget=w + 3, window=w, kernel=1).prompt_kept(q, k, 1.0)[0, 0, :3].tolist()
    pooled = SnapKV(budget=w + 3, window=w, kernel=3).prompt_kept(q, k, 1.0)[0, 0, :3].tolist()
    assert 20 in alone and alone != [19, 20, 21]
    assert pooled == [19, 20, 21]  # the peak spreads to its neighbours, ties go to the earlier position
    avg = SnapKV(budget=w + 3, window=w, kernel=3, pooling="avg").prompt_kept(q, k, 1.0)[0, 0, :3].tolist()
    assert avg == [19, 20, 21]


def test_snapkv_needs_a_prompt_in_sim_mode():
    model, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match="dense_rows"):
        runtime.sim_logits(model, SnapKV(), random_ids(40, 512), dense_rows=0)


def test_snapkv_decode_store_is_the_compressed_prompt_plus_every_generated_token():
    model, _ = load_model("tiny-llama-gqa")
    method = SnapKV(budget=20, window=8, kernel=3)
    runtime.decode_logits(model, method, random_ids(70, 512), dense_rows=50)
    for store in method.last_cache.layers:
        assert store.stored == 20 + 20  # 20 prompt entries per KV head, then all 20 tokens fed one by one
        pos = store.positions[0]
        assert (pos[:, 12:] == torch.arange(42, 70)).all()  # window (42..49) + generated (50..69)
        assert (pos[:, :12] < 42).all()
    expected = sum(((20 + seen - 50) / seen) for seen in range(51, 71)) / 20
    assert method.stats.mean("kv_fraction") == pytest.approx(expected, abs=1e-6)


# ----------------------------------------------------------------------------------------------- KIVI


def test_kivi_per_channel_keys_beat_per_token_on_outlier_channels():
    k = torch.randn(1, 2, 128, 64, generator=GEN(6))
    k[..., [3, 17]] += 20  # a few channels sit far from the others in every token, as real keys' outliers do
    per_channel = (fake_quantize_keys(k, 2, 32) - k).pow(2).mean()
    per_token = (fake_quantize(k, 2, 32) - k).pow(2).mean()
    assert per_channel < 0.25 * per_token


@pytest.mark.parametrize("seen,keys,values", [(10, 0, 0), (32, 32, 0), (40, 32, 8), (64, 64, 32), (95, 64, 63)])
def test_kivi_residual_rule(seen, keys, values):
    assert quantized_keys(seen, 32) == keys and quantized_values(seen, 32) == values


def test_kivi_store_holds_codes_params_and_residual():
    model, _ = load_model("tiny-llama-gqa")  # head_dim 32, 2 KV heads, 3 layers
    method = KIVI(bits=2, group_size=8, residual=16)
    ids = random_ids(61, 512)
    runtime.decode_logits(model, method, ids, dense_rows=37)
    store = method.last_cache.layers[0]
    assert isinstance(store, KIVIStore) and store.seen == store.stored == 61
    assert store.keys.shape[2] == 61 - 48 and store.values.shape[2] == 16  # fp residuals
    assert store.quant["k_codes"].shape == (1, 2, 6, 32, 8 * 2 // 8)  # 48 keys = 6 groups of 8, per channel
    assert store.quant["v_codes"].shape == (1, 2, 45, 32 * 2 // 8)
    b_hk = 2
    key_bytes = 48 * 32 * 2 // 8 + 6 * 32 * 2 * 2  # codes + fp16 scale/zero per channel and group
    value_bytes = 45 * (32 * 2 // 8 + 32 // 8 * 2 * 2)  # codes + fp16 scale/zero per token and channel group
    residual_bytes = (13 + 16) * 32 * 4  # fp32 model
    assert store.nbytes() == b_hk * (key_bytes + value_bytes + residual_bytes)
    k, v = store.kv()
    assert torch.equal(k[:, :, 48:], store.keys) and torch.equal(v[:, :, 45:], store.values)
    assert method.stats.mean("kv_fraction") == 1.0


def test_kivi_without_flushed_groups_equals_full():
    from baselines.full import Full

    model, _ = load_model("tiny-llama")
    ids = random_ids(60, 512)
    full = runtime.sim_logits(model, Full(), ids, dense_rows=20)
    kivi = runtime.sim_logits(model, KIVI(residual=128), ids, dense_rows=20)  # 60 tokens < residual: all fp
    torch.testing.assert_close(kivi, full, atol=1e-5, rtol=0)
    quantised = runtime.sim_logits(model, KIVI(residual=32), ids, dense_rows=20)
    assert torch.equal(quantised[:, :20], kivi[:, :20])  # the prompt rows attend fp KV
    assert (quantised[:, 40:] - full[:, 40:]).abs().max() > 1e-3
