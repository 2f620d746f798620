"""InfiniGen's static decode step (infinigen/shared/step.py, issue 56): the speculation and the selection of
a decode step in as few ops as the math needs, in shapes that do not change from step to step, so that a CUDA device
can run them as one captured graph (`capture=graph|compile`).

* the static step selects exactly what the general path selects (`_rank_step`: the ranking sim mode shares), in
  decode mode and through the offloading runtime, for InfiniGen (RoPE and OPT, each GQA reduction, alpha = inf) and
  the oracle, and keeps its buffers and shapes across steps;
* the speculation + selection function compiles whole (`torch.compile(fullgraph=True)`: a graph break raises) and
  gives what it gives eagerly;
* the census (experiments/bench_ops.py): InfiniGen's steady decode step dispatches at most full attention's ops + 25
  per layer-step (the issue's target; docs/results.md had + 71) and synchronises the host nowhere;
* `capture` off CUDA runs the eager step (the same run), and an unknown value is refused.
"""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch
from hydra.errors import InstantiationException

from conftest import load_model, method_from_conf, random_ids
from experiments import bench_ops as B
from infinigen import modes
from infinigen.offload.runtime import OffloadRuntime, teacher_forced_logits
from infinigen.shared.step import CapturedSelection, StepBuffers, select_step, speculated_query, thresholds

PROMPT, DECODED = 48, 16
CASES = [("infinigen", {}), ("infinigen", {"gqa_reduce": "logit_max"}), ("infinigen", {"gqa_reduce": "logit_mean"}),
         ("infinigen", {"alpha": math.inf, "budget": 0.3}), ("infinigen", {"speculate_from": "current"}),
         ("oracle", {})]
OPS_MARGIN = 25  # the target: InfiniGen <= full + 25 ops per layer-step


def case_id(case) -> str:
    name, overrides = case
    return "-".join([name] + [f"{k}={v}" for k, v in overrides.items()])


def recorded(method, general: bool) -> list:
    """Runs `method`'s selections through the general path (`general`) or the static one, recording each one's keep
    mask (decode mode) or (index, valid) (the runtime)."""
    log = []
    if general:
        method.static_step = lambda session, layer: False
    select, select_indices = method.select, method.select_indices

    def keep(*args, **kwargs):
        out = select(*args, **kwargs)
        log.append(out.clone())
        return out

    def indices(session, layer, q, store, past, position):
        index, valid = select_indices(session, layer, q, store, past, position)
        log.append((index.clone(), valid.clone(), past))
        return index, valid

    method.select, method.select_indices = keep, indices
    return log


def as_mask(index, valid, past) -> torch.Tensor:
    """(b, h_kv, past) bool of what (index, valid) selects (the order of the ranks aside)."""
    keep = torch.zeros(*index.shape[:2], past + 1, dtype=torch.bool)
    return keep.scatter_(-1, torch.where(valid.expand_as(index), index, past), True)[..., :past]


@pytest.mark.parametrize("model_name", ["tiny-llama-gqa", "tiny-opt"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_static_step_selects_what_the_general_path_selects(case, model_name):
    """float64, batch 2: decode mode's keep masks equal, step by step and layer by layer; through the runtime, the
    same rows cross and every selection is (b, h_kv, max_selected) whatever the step."""
    name, overrides = case
    model, _ = load_model(model_name, "float64")
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=2, seed=3)
    runs = {}
    for general in (False, True):
        method = method_from_conf(name, **overrides)
        log = recorded(method, general)
        logits = modes.decode_logits(model, method, ids, dense_rows=PROMPT)
        runs[general] = (log, logits, method.stats.summary()["kv_fraction"])
    (static, a, fa), (general, b, fb) = runs[False], runs[True]
    assert len(static) == len(general) > 0
    assert all(torch.equal(x, y) for x, y in zip(static, general))
    assert torch.equal(a, b) and fa == fb
    gathered = {}
    for general in (False, True):
        method = method_from_conf(name, **overrides)
        log = recorded(method, general)
        logits, report = teacher_forced_logits(model, method, ids, PROMPT)
        gathered[general] = (log, logits, report.fetch_log, method.stats.summary()["kv_fraction"])
    (static, a, moved_a, fa), (general, b, moved_b, fb) = gathered[False], gathered[True]
    assert moved_a == moved_b and fa == pytest.approx(fb, abs=1e-12)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # the same rows attended (attend_rows); logits kept in fp32
    width = method.max_selected(PROMPT + DECODED)
    assert {tuple(index.shape) for index, _, _ in static} == {(2, model.config.num_key_value_heads
                                                               if model_name != "tiny-opt"
                                                               else model.config.num_attention_heads, width)}
    assert all(torch.equal(as_mask(*x), as_mask(*y)) for x, y in zip(static, general))


def test_the_static_buffers_are_allocated_once():
    """Every decode step of a layer ranks the same partial key cache (one allocation per store) and the same
    thresholds buffer, rewritten in place only when the budget cap grows."""
    model, _ = load_model("tiny-llama-gqa")
    method = method_from_conf("infinigen")
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=2)
    pointers = set()
    step_buffers = method.step_buffers

    def watched(session, layer, store):
        views = step_buffers(session, layer, store)
        pointers.add((layer.index, views.keys.data_ptr()))
        return views

    method.step_buffers = watched
    modes.decode_logits(model, method, ids, dense_rows=PROMPT)
    assert len(pointers) == 3 - method.skip_layers  # one cache per gathering layer, for the whole sequence
    assert len(method._thresholds) == 1


# ----------------------------------------------------------------------------------------------- compile


def synthetic(rope: bool, dtype=torch.float64):
    """Inputs of `speculated_query` + `select_step` in the shapes a decode step has them (b 2, h_kv 2, g 3, head_dim 8,
    3 channels, 40 positions of which 30 written, the top 9, a cap of 7): RoPE's projection or OPT's partial rows."""
    gen = torch.Generator().manual_seed(0)
    b, hk, g, d, c, L, W, hidden = 2, 2, 3, 8, 3, 40, 9, 24

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    buf = StepBuffers(StepBuffers.new(b, hk, L, c, dtype, "cpu"))
    buf.rows[:, :30, :c] = randn(b * hk, 30, c)
    buf.rows[:, :30, c] = 0
    one = torch.zeros(1, 1, c + 1, dtype=dtype)
    one[..., -1] = 1
    if rope:
        weight, bias = randn(hidden, hk * g * d), randn(hk * g * d)
        factors, proj = randn(b, 1, 1, 2, d), randn(b * hk, 2 * d, c + 1)
        proj[..., -1] = 0
    else:
        weight, bias, factors, proj, one = randn(hidden, hk * g * (c + 1)), randn(hk * g * (c + 1)), None, None, None
    thr = thresholds(7, W, hk * g, True, "cpu").expand(b, hk, W + 1)

    def fn(x, reduce="prob_sum"):
        query = speculated_query(x, weight, bias, factors, proj, one, hk, g)
        return select_step(query, buf.keys_t, buf.live, thr, alpha=4.0, width=W, batch=b, reduce=reduce)

    return fn, randn(b, hidden)


@pytest.mark.slow  # an inductor compilation on the CPU: ~30 s each here
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "opt"])
def test_the_speculation_and_selection_compile_whole_and_equal_eager(rope):
    """torch.compile(fullgraph=True) raises on any graph break; the compiled function's selection is eager's."""
    fn, x = synthetic(rope)
    index, keep = fn(x)
    assert keep[..., :-1].any() and not keep[..., :-1].all() and keep[..., -1].all()  # a selection, not all or none
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        got_index, got_keep = compiled(x)
    assert torch.equal(got_index, index) and torch.equal(got_keep, keep)


def test_a_captured_selection_reads_its_static_input():
    """CapturedSelection without a graph (any device): each call copies its input into the static buffer the
    function was built on, and gives what the function gives on that input."""
    fn, x = synthetic(rope=True)
    captured = CapturedSelection(fn, x, graph=False)
    for scale in (1.0, -2.0):
        index, keep = captured(x * scale)
        want_index, want_keep = fn(x * scale)
        assert torch.equal(index, want_index) and torch.equal(keep, want_keep)


def test_capture_off_cuda_runs_the_eager_step_and_bad_values_are_refused():
    model, _ = load_model("tiny-llama-gqa")
    ids = random_ids(PROMPT + DECODED, model.config.vocab_size, batch=2)
    runs = {}
    for capture in ("none", "graph", "compile"):
        method = method_from_conf("infinigen", capture=capture)
        runs[capture] = teacher_forced_logits(model, method, ids, PROMPT)[0]
        assert method.capture_used is False
    assert torch.equal(runs["none"], runs["graph"]) and torch.equal(runs["none"], runs["compile"])
    with pytest.raises(InstantiationException, match="capture must be one of"):
        method_from_conf("infinigen", capture="cuda")


# ----------------------------------------------------------------------------------------------- the census


@lru_cache(maxsize=None)
def census(model_name: str, name: str, batch: int) -> dict:
    model, _ = B.adapter.load(B.model_config(model_name, positions=128))
    return B.decode_point(model, B.build_method(name, [], B.parse_args([]).data_dir), "auto", batch, 64, 12, 2)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("model_name", B.DECODE_MODELS)
def test_infinigen_dispatches_at_most_full_attention_plus_25_ops_per_layer_step(model_name, batch):
    """The op count is a property of the code path (the same at every prompt and batch: tests/test_bench_ops.py's
    gate), so a short prompt shows it."""
    full, ig = census(model_name, "full", batch), census(model_name, "infinigen", batch)
    extra = ig["ops_per_layer_step"] - full["ops_per_layer_step"]
    assert extra <= OPS_MARGIN, f"InfiniGen on {model_name}: {ig['ops_per_layer_step']:.1f} ops per layer-step, " \
                                f"full attention {full['ops_per_layer_step']:.1f} (+{extra:.1f} > +{OPS_MARGIN})"
    assert ig["syncs_max_step"] == 0, ig["sync_sites"]
