"""InfiniGen and oracle: skewing is exact, limits hold, the selection and eviction rules do what they say."""

import itertools
import math

import pytest
import torch
from hydra.errors import InstantiationException

from conftest import load_model, method_from_conf, model_cfg, sample_ids
from infinigen import adapter, modes
from infinigen.attention import logits
from infinigen.method.skew import calibrate, capture_qk
from infinigen.shared.select_evict import budget_cap, pool_limit, select, top_n, victim


def fresh(name):
    return adapter.load(model_cfg(name))[0]  # not the shared cached model: OPT skewing rewrites weights


def test_opt_folded_skew_leaves_outputs_unchanged():
    model = fresh("tiny-opt")
    ids = sample_ids("tiny-opt", 64)
    with torch.inference_mode():
        before = model(ids).logits
    skew = calibrate(model, lambda: ids, skew=True, partial_ratio=0.25, partial_select="q", cache_dir=None, settings="t")
    assert all(A is None for A in skew.rotations)  # folded into W_q / W_k
    with torch.inference_mode():
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=0)
    q, _ = capture_qk(model, ids)[1]
    energy = q.pow(2).sum(1)  # (h, d): skewed queries concentrate their energy in the first columns
    assert (energy[:, :8].sum(-1) / energy.sum(-1)).min() > 0.5


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-gqa"])
def test_rope_skew_preserves_attention_logits(name):
    model = fresh(name)
    ids = sample_ids(name, 64)
    skew = calibrate(model, lambda: ids, skew=True, partial_ratio=1.0, partial_select="q", cache_dir=None, settings="t")
    for layer, (q, k) in zip(adapter.attention_layers(model), capture_qk(model, ids)):
        A = skew.rotations[layer.index]  # (hk, d, d)
        torch.testing.assert_close(A @ A.transpose(-1, -2), torch.eye(layer.head_dim).expand_as(A), atol=1e-4, rtol=0)
        hk, g = layer.num_kv_heads, layer.groups
        qs = skew.partial(q.reshape(1, hk, g, -1, layer.head_dim), layer.index).reshape(1, -1, q.shape[1], q.shape[2])
        ks = skew.partial(k[None], layer.index)
        torch.testing.assert_close(logits(qs, ks, 1.0), logits(q[None], k[None], 1.0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama-gqa"])
def test_unbounded_infinigen_equals_full(name):
    model, _ = load_model(name)
    ids = sample_ids(name, 64)
    full = modes.sim_logits(model, method_from_conf("full"), ids)
    method = method_from_conf("infinigen", alpha=math.inf, budget=1.0, capacity=1.0, cache_dir=None)
    torch.testing.assert_close(modes.sim_logits(model, method, ids), full, atol=1e-5, rtol=0)
    assert method.stats.mean("kv_fraction") == pytest.approx(1.0)
    assert method.stats.mean("recall") == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-gqa"])
def test_full_ratio_unskewed_speculation_from_the_true_query_is_the_oracle(name):
    model, _ = load_model(name)
    ids = sample_ids(name, 64)
    oracle = method_from_conf("oracle", budget=0.25)
    spec = method_from_conf("infinigen", budget=0.25, alpha=math.inf, partial_ratio=1.0, skew=False,
                            speculate_from="current", cache_dir=None)
    torch.testing.assert_close(modes.sim_logits(model, spec, ids), modes.sim_logits(model, oracle, ids), atol=0, rtol=0)
    assert spec.stats.mean("kv_fraction") == oracle.stats.mean("kv_fraction")
    assert oracle.stats.mean("kv_fraction") < 0.6


def _randomise_norms(model, seed=0):
    """Give every layer its own input-norm weights (random init makes them all ones, bias zero)."""
    gen = torch.Generator().manual_seed(seed)
    for layer in adapter.attention_layers(model):
        for p in layer.input_norm.parameters():
            p.data.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama-gqa"])
def test_residual_captures_are_the_block_stream(name):
    """block_inputs[i] is what layer i normalises into its attention input; attn_residuals[i] is that plus layer i's
    attention output (the residual before the MLP)."""
    model = fresh(name)
    _randomise_norms(model)
    ids = sample_ids(name, 40)
    method = method_from_conf("full")
    method.captures = ("block_inputs", "attn_residuals")
    captured = {}
    # read when each layer's attention joined the residual stream: the session holds two layers' captures at once
    method.attention_end = lambda session, layer: captured.__setitem__(layer.index, (
        session.block_inputs[layer.index], session.attn_inputs[layer.index], session.attn_residuals[layer.index]))
    attn_out = {}
    blocks = adapter.decoder_layers(model)
    hooks = [b.self_attn.register_forward_hook(lambda m, a, out, i=i: attn_out.__setitem__(i, out[0]))
             for i, b in enumerate(blocks)]
    with torch.inference_mode(), adapter.install(model, method, mode="sim", max_len=ids.shape[1]) as session:
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    assert len(session.attn_inputs) == 2  # only the last two layers stay captured
    for layer in session.layers:
        block_input, attn_input, attn_residual = captured[layer.index]
        torch.testing.assert_close(layer.input_norm(block_input), attn_input, atol=0, rtol=0)
        torch.testing.assert_close(attn_residual, block_input + attn_out[layer.index], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama-gqa"])
def test_block_input_speculation_differs_from_the_paper_only_by_the_norm(name):
    """norm_i(h_{i-1}) is the paper's norm_{i-1}(h_{i-1}) when the two norms are equal, and not otherwise."""
    model = fresh(name)
    ids = sample_ids(name, 64)

    def run(speculate_from):
        method = method_from_conf("infinigen", budget=0.25, speculate_from=speculate_from, cache_dir=None)
        return modes.sim_logits(model, method, ids), method.stats.mean("kv_fraction")

    paper = run("previous")
    torch.testing.assert_close(run("block_input")[0], paper[0], atol=0, rtol=0)  # random init: identical norms
    _randomise_norms(model)
    paper, shared = run("previous"), run("block_input")
    assert not torch.allclose(shared[0], paper[0], atol=1e-3)
    assert not torch.allclose(run("after_attention")[0], shared[0], atol=1e-3)


def test_residual_speculation_needs_pre_norm_blocks():
    model = adapter.load(model_cfg("tiny-opt", arch={"do_layer_norm_before": False}))[0]
    ids = sample_ids("tiny-opt", 32)
    modes.sim_logits(model, method_from_conf("infinigen", cache_dir=None), ids)  # the paper's option still runs
    for option in ("block_input", "after_attention"):
        with pytest.raises(ValueError, match="do_layer_norm_before"):
            modes.sim_logits(model, method_from_conf("infinigen", speculate_from=option, cache_dir=None), ids)


def test_speculation_points():
    points = {o: method_from_conf("infinigen", speculate_from=o).speculation_point
              for o in ("previous", "block_input", "after_attention", "current")}
    assert points == {"previous": "attention_start", "block_input": "attention_start",
                      "after_attention": "attention_end", "current": "query"}


def test_select_respects_the_cap_and_the_candidates():
    gen = torch.Generator().manual_seed(0)
    b, hk, g, r, L = 2, 3, 3, 40, 40
    scores = torch.randn(b, hk, g, r, L, generator=gen) * 3
    rows = torch.arange(r)
    candidates = (torch.arange(L)[None, :] < rows[:, None])[None, None]  # strictly causal
    for alpha, budget in [(0.5, 0.1), (2.0, 0.3), (math.inf, 0.5), (math.inf, 1.0)]:
        cap = budget_cap(budget, rows)
        keep, n = select(scores, candidates, cap, alpha, "prob_sum", L)
        assert (n <= cap[None]).all()
        assert (keep.sum(-1) == n[:, None]).all()  # every KV head fetches exactly n
        assert not (keep & ~candidates).any()
    keep, n = select(scores, candidates, budget_cap(1.0, rows), math.inf, "prob_sum", L)
    assert torch.equal(keep, candidates.expand_as(keep))


def test_top_n_keeps_exactly_n_even_on_ties():
    gen = torch.Generator().manual_seed(0)
    agg = torch.randn(2, 3, 5, 30, generator=gen)
    n = torch.tensor([[0, 1, 7, 30, 12], [3, 3, 0, 29, 1]])
    ref = torch.zeros_like(agg, dtype=torch.bool)
    for (b, h, r), row in zip(itertools.product(range(2), range(3), range(5)), agg.view(-1, 30)):
        ref[b, h, r, row.argsort(descending=True)[: n[b, r]]] = True
    assert torch.equal(top_n(agg, n, 30), ref)
    tied = torch.tensor([5.0, 3.0, 3.0, 3.0, 1.0]).view(1, 1, 1, 5)  # the 2nd best is a three-way tie
    keep = top_n(tied, torch.tensor([[2]]), 5)
    assert keep.sum() == 2 and keep[0, 0, 0, 0] and not keep[0, 0, 0, 4]


def test_dynamic_count_follows_alpha():
    # one head, one row: scores 10, 9, 7, 2 -> within alpha=2.5 of the max: two tokens
    scores = torch.tensor([10.0, 9.0, 7.0, 2.0]).view(1, 1, 1, 1, 4)
    keep, n = select(scores, torch.ones(1, 1, 1, 4, dtype=torch.bool), torch.tensor([4]), 2.5, "logit_max", 4)
    assert n.item() == 2 and keep[0, 0, 0].tolist() == [True, True, False, False]


def test_eviction_policies_pick_the_right_victim():
    positions = torch.arange(6).view(1, 1, 6)
    counts = torch.tensor([[[5, 0, 2, 0, 9, 0]]])  # tokens 1, 3, 5 never fetched
    last = torch.tensor([[[7, 1, 2, 8, 6, 5]]])
    valid = torch.ones(1, 1, 6, dtype=torch.bool)
    assert victim(positions, counts, last, valid, "fifo").item() == 0
    assert victim(positions, counts, last, valid, "lru").item() == 1
    # counter: least fetched among the older half (tokens 0..2) -> token 1 (not 3 or 5: they are in the newer half)
    assert victim(positions, counts, last, valid, "counter").item() == 1
    valid[0, 0, 1] = False  # token 1 already gone: older half of {0,2,3,4,5} is {0,2,3} -> token 3 (count 0)
    assert victim(positions, counts, last, valid, "counter").item() == 3


def test_pool_capacity_is_never_exceeded_in_decode():
    model, _ = load_model("tiny-llama-gqa")
    ids = sample_ids("tiny-llama-gqa", 80)
    method = method_from_conf("infinigen", capacity=0.5, cache_dir=None)
    modes.decode_logits(model, method, ids, dense_rows=48)
    limit = pool_limit(0.5, 80)
    for i, store in enumerate(method.last_cache.layers):
        assert store.stored == (80 if i < method.skip_layers else limit)
    assert pool_limit(1, 100) == 100 and pool_limit(0.8, 100) == 80 and pool_limit(30, 100) == 30


def test_calibration_is_cached_on_disk(tmp_path):
    model = fresh("tiny-llama")
    ids = sample_ids("tiny-llama", 48)
    calls = []

    def source():
        calls.append(1)
        return ids

    a = calibrate(model, source, skew=True, partial_ratio=0.25, partial_select="qk", cache_dir=str(tmp_path), settings="s")
    other = fresh("tiny-llama")  # same weights, new object: must come from disk, not recompute
    b = calibrate(other, source, skew=True, partial_ratio=0.25, partial_select="qk", cache_dir=str(tmp_path), settings="s")
    assert len(calls) == 1 and len(list(tmp_path.glob("skew-*.pt"))) == 1
    for x, y in zip(a.columns, b.columns):
        assert torch.equal(x, y)
    assert (a.columns[0].sum(-1) >= 8).all()  # qk: union of the top-8 |Q| and top-8 |K| columns


def test_bad_hyperparameters_are_rejected():
    for bad in [{"alpha": 0}, {"budget": 1.5}, {"partial_ratio": 0}, {"eviction": "random"}, {"gqa_reduce": "x"},
                {"skip_layers": 0}, {"capacity": -1}, {"speculate_from": "next"},
                {"speculate_from": "block_input", "skip_layers": 0}]:
        with pytest.raises(InstantiationException, match="ValueError"):
            method_from_conf("infinigen", **bad)
