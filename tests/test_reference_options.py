"""The options that make InfiniGen and H2O compute what the authors' code computes (infinigen_reference, h2o_reference:
docs/methods.md), each on a case small enough to work out by hand. tests/test_reference.py pins the presets to the
artifact's own outputs."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import load_model, method_from_conf, model_cfg, sample_ids
from infinigen import adapter, modes
from infinigen.offload.runtime import run_kind
from infinigen.shared.select_evict import select, sequence_cap


def test_first_head_threshold_counts_every_head_against_head_zeros_best():
    # two heads (one KV head each), one row, alpha 2.5: head 0's best is 10 (threshold 7.5), head 1's 3 (0.5)
    scores = torch.tensor([[10.0, 9.0, 7.0, 2.0], [3.0, 2.5, 1.0, 0.0]]).view(1, 2, 1, 1, 4)
    every = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    cap = torch.tensor([4])
    _, own = select(scores.clone(), every, cap, 2.5, "logit_max", 4)  # counts 2 and 3: floor(5 / 2) = 2
    _, first = select(scores.clone(), every, cap, 2.5, "logit_max", 4, threshold_head="first")  # 2 and 0: 1
    assert own.item() == 2 and first.item() == 1


def test_sequence_cap_truncates_as_the_artifact():
    assert sequence_cap(0.2, 2048) == 409 and sequence_cap(0.2, 256) == 51 and sequence_cap(0.1, 256) == 25
    assert sequence_cap(0.2, 2048, max_num_kv=100) == 100


def kept_rows(method, model, ids):
    """Per decoded layer, the (b, h_kv, r, s) attended masks of one sim forward (record_sim's keep)."""
    seen = {}
    record = method.record_sim

    def spy(session, layer, keep, allowed, rows, start=None, kept=None):
        seen.setdefault(layer.index, []).append((keep.clone(), None if kept is None else kept.clone()))
        return record(session, layer, keep, allowed, rows, start, kept)

    method.record_sim = spy
    modes.sim_hidden(model, method, ids, attention="exact")
    return seen


def test_budget_of_sequence_leaves_the_first_rows_dense_and_caps_the_rest():
    model, _ = load_model("tiny-llama", "float64")
    ids = sample_ids("tiny-llama", 60)
    method = method_from_conf("infinigen_reference", alpha=math.inf, current_token="kept", cache_dir=None)
    cap = sequence_cap(method.budget, 60)  # 12
    keep = torch.cat([k for k, _ in kept_rows(method, model, ids)[2]], dim=2)[0, 0]  # (t, t), layer 2
    counts = keep.sum(-1)
    assert torch.equal(counts[:cap], torch.arange(1, cap + 1))  # rows before the cap attend everything
    assert (counts[cap:] == cap + 1).all()  # then exactly the cap (alpha = inf) and the row itself


def test_ranked_current_token_can_be_left_out_and_an_empty_selection_attends_everything():
    model, _ = load_model("tiny-llama", "float64")
    ids = sample_ids("tiny-llama", 64)
    method = method_from_conf("infinigen_reference", alpha=1e-6, cache_dir=None)  # about one entry per head counts
    seen = kept_rows(method, model, ids)[2]
    keep = torch.cat([k for k, _ in seen], dim=2)[0]  # (h_kv, t, t)
    kept = torch.cat([c for _, c in seen], dim=2)[0]  # (h_kv, t): what each row selected (0: nothing)
    rows = torch.arange(64)
    cap = sequence_cap(method.budget, 64)
    decoded = rows >= cap
    empty = (kept == 0) & decoded
    assert empty.any(), "alpha 1e-6 should leave some rows with nothing within alpha of the first head's best"
    assert torch.equal(keep.sum(-1)[empty], rows.expand_as(kept)[empty] + 1)  # an empty row attends its whole prefix
    selected = ~empty & decoded
    diag = keep.diagonal(dim1=-2, dim2=-1)  # (h_kv, t): did the row attend itself
    assert not diag[selected].all(), "with the current token ranked, some selections leave it out"
    summary = method.stats.summary()
    assert summary["density"] < summary["kv_fraction"]  # empty rows count nothing kept, everything attended


def test_ranked_current_token_moves_every_entry_in_the_offloading_runtime():
    layers = [SimpleNamespace(index=i) for i in range(3)]
    ranked = method_from_conf("infinigen_reference", cache_dir=None)
    assert [ranked.offload_kind(layer) for layer in layers] == ["resident", "resident", "held"]
    kept = method_from_conf("infinigen_reference", current_token="kept", cache_dir=None)
    assert [kept.offload_kind(layer) for layer in layers] == ["resident", "resident", "gather"]
    assert run_kind(ranked, "auto") == "gather" and run_kind(ranked, "ideal") == "resident"


def test_mask_heavy_hitters_keep_a_fixed_heavy_set_that_never_takes_an_entry_back():
    model, _ = load_model("tiny-llama", "float64")
    t = 80
    ids = sample_ids("tiny-llama", t)
    method = method_from_conf("h2o_reference", recent=2)  # heavy int(0.1 x 80) = 8 (the row among them), 2 before
    keep = torch.cat([k for k, _ in kept_rows(method, model, ids)[2]], dim=2)[0]  # (h_kv, t, t)
    heavy = int(0.1 * t)
    rows = torch.arange(t)
    assert torch.equal(keep[:, :heavy].sum(-1), (rows[:heavy] + 1).expand(keep.shape[0], -1))  # dense first rows
    window = (rows[:, None] - rows[None, :] <= 2) & (rows[:, None] >= rows[None, :])
    outside = keep & ~window  # the heavy set's entries older than the window
    assert (outside[:, heavy:].sum(-1) <= heavy - 1).all()
    # once an entry leaves the heavy set it is never attended again outside the window
    for h in range(keep.shape[0]):
        for j in range(t):
            attended = outside[h, :, j].nonzero().flatten()
            if attended.numel():
                last = attended.max()
                later = outside[h, last + 1 :, j]
                assert not later.any()
                assert torch.equal(outside[h, j + 3 : last + 1, j], torch.ones_like(outside[h, j + 3 : last + 1, j]))


def test_h2o_dense_layers_attend_everything_and_are_not_counted_in_density():
    model, _ = load_model("tiny-llama", "float64")
    ids = sample_ids("tiny-llama", 64)
    method = method_from_conf("h2o_reference")
    modes.sim_hidden(model, method, ids, attention="exact")
    summary = method.stats.summary()
    assert summary["per_layer"]["kv_fraction"][0] == pytest.approx(1.0)
    assert summary["per_layer"]["kv_fraction"][1] == pytest.approx(1.0)
    assert set(summary["per_layer"]["density"]) == {2}  # only the layer H2O selects on
    assert summary["density"] == pytest.approx(summary["per_layer"]["density"][2])
    assert summary["retain"] == pytest.approx(1 - math.sqrt(1 - summary["density"]))


def test_full_attention_keeps_everything_on_both_axes():
    model, _ = load_model("tiny-llama")
    method = method_from_conf("full")
    modes.sim_hidden(model, method, sample_ids("tiny-llama", 40), dense_rows=8)
    summary = method.stats.summary()
    assert summary["kv_fraction"] == pytest.approx(1.0) and summary["density"] == pytest.approx(1.0)
    assert summary["retain"] == pytest.approx(1.0)


def test_column_calibration_calibrates_the_columns_on_its_own_text_and_keys_the_skew_cache(tmp_path):
    """column_calibration (issue 72): the skew still from `calibration`, the partial columns from a forward over the
    other text's ids (tokenised whole, up to column_tokens), and the text's content keys the skew cache."""
    from infinigen.method import skew
    from infinigen.method.skew import capture_qk, top_columns

    model, _ = load_model("tiny-llama", "float64")
    skew._DONE.pop(model, None)  # both skews from this model as it is now (an earlier test may have cast it)
    texts = [tmp_path / f"columns_{i}.txt" for i in range(2)]
    texts[0].write_text("The bartender refused to serve the patron because the patron was drunk. " * 3)
    texts[1].write_text("I tossed the ball upwards therefore the ball hit the ceiling, twice. " * 3)
    cache = str(tmp_path / "skew")
    plain = method_from_conf("infinigen_reference", cache_dir=cache)
    modes.sim_hidden(model, plain, sample_ids("tiny-llama", 16))
    before = set((tmp_path / "skew").glob("skew-*.pt"))
    for text in texts:
        method = method_from_conf("infinigen_reference", column_calibration=f"file:{text}", column_tokens=None,
                                  cache_dir=cache)
        method.check_data()
        ids = method._column_ids(model)
        assert torch.equal(ids[0], adapter.encode(None, text.read_text(), model.config.vocab_size))
        modes.sim_hidden(model, method, sample_ids("tiny-llama", 16))
        for i, (q, k) in enumerate(capture_qk(model, ids)):  # every layer (the columns of all are calibrated)
            A = method.skewing.rotations[i].to(q.dtype)
            assert torch.equal(A, plain.skewing.rotations[i].to(q.dtype))  # the skew: calibration's, unchanged
            r = int(method.partial_ratio * q.shape[-1])  # floor
            qs, ks = torch.einsum("htd,hde->hte", q, A), torch.einsum("htd,hde->hte", k, A)
            want = torch.maximum(top_columns(qs.abs().sum(1), r), top_columns(ks.abs().sum(1), r))
            assert torch.equal(method.skewing.columns[i].to(want.dtype), want)
    assert len(set((tmp_path / "skew").glob("skew-*.pt")) - before) == 2  # one cache file per column text
    capped = method_from_conf("infinigen_reference", column_calibration=f"file:{texts[0]}", column_tokens=40)
    assert capped._column_ids(model).shape == (1, 40)
    missing = method_from_conf("infinigen_reference", column_calibration=f"file:{tmp_path / 'absent.txt'}")
    with pytest.raises(FileNotFoundError, match="column_calibration.*absent.txt"):
        missing.check_data()


@pytest.mark.parametrize("bad", [{"budget_of": "window"}, {"threshold_head": "last"}, {"current_token": "maybe"},
                                 {"column_count": "ceil"}, {"column_tokens": 0}, {"column_calibration": ""}])
def test_bad_reference_options_are_refused(bad):
    with pytest.raises(Exception, match=next(iter(bad))):
        method_from_conf("infinigen", **bad)


@pytest.mark.parametrize("bad", [{"heavy_hitters": "sticky"}, {"budget_of": "window"}, {"dense_layers": -1}])
def test_bad_h2o_options_are_refused(bad):
    with pytest.raises(Exception, match=next(iter(bad))):
        method_from_conf("h2o", **bad)


def test_a_gqa_model_with_its_kv_heads_repeated_gives_the_same_logits(tmp_path):
    from infinigen.adapter.multihead import repeat_kv_heads, save

    model, _ = load_model("tiny-llama-gqa")
    mha = repeat_kv_heads(model)
    assert mha.config.num_key_value_heads == mha.config.num_attention_heads != model.config.num_key_value_heads
    ids = sample_ids("tiny-llama-gqa", 40)
    with torch.inference_mode():
        torch.testing.assert_close(mha(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    save(mha, adapter.byte_tokenizer(), tmp_path, for_transformers_4=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_key_value_heads"] == config["num_attention_heads"] and "rope_theta" in config
    tokenizer = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "PreTrainedTokenizerFast"
    reloaded, _ = adapter.load(model_cfg("tiny-llama-gqa", random_init=False, local_path=str(tmp_path)))
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_a_fraction_of_the_sequence_needs_the_sequence_length():
    """budget_of="sequence" in decode mode is a fraction of max_len: direct forwards without one are refused by name;
    model.generate inside apply sets it."""
    import infinigen

    model, tok = load_model("tiny-llama")
    ids = sample_ids("tiny-llama", 24)
    for name in ("infinigen_reference", "h2o_reference"):
        method = method_from_conf(name, **({"cache_dir": None} if name.startswith("infinigen") else {}))
        with infinigen.apply(model, method, tokenizer=tok) as cache, torch.inference_mode():
            with pytest.raises(ValueError, match="budget_of='sequence' is a fraction of the longest sequence"):
                model(ids[:, :20], cache=cache, use_cache=True)  # the prefill, then one decoded token
                model(ids[:, 20:21], cache=cache, use_cache=True, position_ids=torch.tensor([[20]]))
        with infinigen.apply(model, method, tokenizer=tok), torch.inference_mode():
            out = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert out.shape[1] == 28
