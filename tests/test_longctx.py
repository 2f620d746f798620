"""Long-context sim mode (issue 11): chunked fused attention == the exact eager math for every method, memory
linear in t (no (heads, t, t) tensor), `full` == plain transformers through the ppl task's path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import METHODS, load_model, method_from_conf, random_ids, variants
from infinigen import adapter, modes
from infinigen import rows as method_module

# Every method's defaults run with dense_rows 0 and 40; the variants its class declares (eviction on, other
# windows and pages: where chunked state could go wrong) with a prompt (40), whose chunks stop at row 40 and
# restart there (row_chunks), as a ppl run with dense_rows does.
CHUNK = 16  # rows per sim chunk in these tests: the sequences below span several chunks
# float64 model; exact's softmax runs in fp32 (as transformers' eager), fused in fp64: differences of a few 1e-6
# were seen (3.4e-6 for quant on 80 tokens), so the tolerance leaves ~5x margin for other CPUs' rounding
LOGPROB_TOL = 2e-5


def cases():
    for name in METHODS:
        for dense_rows in (0, 40):
            yield pytest.param(name, {}, dense_rows, id=f"{name}-default-{dense_rows}")
        for overrides in variants(name)[1:]:
            yield pytest.param(name, overrides, 40, id=f"{name}-{overrides}-40")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(method_module, "SIM_CHUNK", CHUNK)


@pytest.fixture
def small_logit_blocks(monkeypatch):
    monkeypatch.setattr(modes, "LOGIT_BLOCK", 64 * 512)  # 64 rows of the tiny models' 512-token vocab


@pytest.mark.parametrize("method_name,overrides,dense_rows", list(cases()))
def test_fused_equals_exact(method_name, overrides, dense_rows, small_chunks):
    model, _ = load_model("tiny-llama-gqa", "float64")
    ids = random_ids(100, model.config.vocab_size, batch=2)
    out = {}
    if dense_rows == 0 and method_from_conf(method_name, **overrides).needs_prompt:
        pytest.skip(f"{method_name} compresses a prompt: dense_rows=0 is refused (tested in test_comparators)")
    for kernel in adapter.ATTENTION_KERNELS:
        method = method_from_conf(method_name, **overrides)
        logp = modes.sim_logits(model, method, ids, dense_rows=dense_rows, attention=kernel)
        summary = method.stats.summary()
        out[kernel] = (logp.double().log_softmax(-1), summary.get("kv_fraction"), summary.get("recall"))
    torch.testing.assert_close(out["fused"][0], out["exact"][0], atol=LOGPROB_TOL, rtol=0)
    assert out["fused"][1] == pytest.approx(out["exact"][1], abs=1e-12)  # the same keep decisions
    # recall: eager masked softmax (exact) vs the fused kernel's log-sum-exp
    assert (out["fused"][2] is None) == (out["exact"][2] is None)
    if out["exact"][2] is not None:
        assert out["fused"][2] == pytest.approx(out["exact"][2], abs=1e-5)


@pytest.mark.parametrize("method_name", METHODS)
def test_chunked_sim_equals_one_chunk(method_name, monkeypatch):
    """The chunk size is not a hyperparameter: many chunks == one chunk (exact kernel, float64; its softmax is
    float32 as transformers' eager attention's, so rows agree to that rounding: 1.8e-7 at 12-row chunks)."""
    model, _ = load_model("tiny-llama-gqa", "float64")
    ids = random_ids(90, model.config.vocab_size)
    runs = []
    for chunk in (CHUNK, 1024):
        monkeypatch.setattr(method_module, "SIM_CHUNK", chunk)
        method = method_from_conf(method_name)
        runs.append(modes.sim_logits(model, method, ids, dense_rows=30, attention="exact").double())
    torch.testing.assert_close(runs[0], runs[1], atol=1e-6, rtol=0)


class LargestFloat(TorchDispatchMode):
    """Records the largest floating-point tensor any op produces (attention scores/probs are the O(t^2) risk).
    Views allocate nothing (an as_strided view of overlapping windows may span many times its buffer): skipped."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("method_name", METHODS)
@pytest.mark.parametrize("mode", ["sim", "decode-prefill"])
def test_no_quadratic_float_tensor(method_name, mode, small_chunks):
    """At t = 1000 one (heads, t, t) score tensor has 6M elements; chunked attention never builds more than
    (heads, chunk, t) = 96k. The bound, heads * t^2 / 8, still admits the model's own (t, vocab) logits (and
    InfiniGen's calibration forward over 1024 tokens)."""
    model, _ = load_model("tiny-llama-gqa")
    t, heads = 1000, model.config.num_attention_heads
    ids = random_ids(t, model.config.vocab_size)
    method = method_from_conf(method_name)
    with LargestFloat() as spy:
        if mode == "sim":
            modes.sim_logits(model, method, ids, dense_rows=100)
        else:
            modes.decode_logits(model, method, ids, dense_rows=t - 1)
    assert spy.numel < heads * t * t // 8, f"{method_name}: a {spy.numel}-element float tensor at t={t}"
    assert spy.numel >= (t - 1) * model.config.hidden_size  # the spy saw the forward (its hidden states)


def test_full_ppl_equals_plain_transformers(small_chunks, small_logit_blocks, data_dir):
    """The ppl task through `full` (fused kernel, several chunks per window, log-probs in blocks of 64 rows) scores
    exactly what the model's own SDPA forward predicts on the same windows, from its whole logits (float64 model;
    its eager forward runs the softmax in fp32). sim_logits hands logits out in float32, so they are compared at
    that resolution (1 ulp of a logit near 1 is 6e-8); the task's nll is float64 throughout."""
    from omegaconf import OmegaConf

    from experiments import ppl
    from infinigen.corpora import corpus_text

    model, _ = load_model("tiny-llama", "float64")
    task = OmegaConf.create({"dataset": "wikitext2", "seq_len": 80, "stride": None, "max_windows": 2,
                             "dense_rows": 0})
    ids = adapter.encode(None, corpus_text(task.dataset, data_dir), model.config.vocab_size)
    nll = []
    for start, _ in ppl.windows(ids, task.seq_len, task.seq_len, task.max_windows):
        window = ids[start : start + task.seq_len][None]
        with torch.inference_mode(), adapter.attn_implementation(model, "sdpa"):
            plain = model(window, use_cache=False).logits.double()
        ours = modes.sim_logits(model, method_from_conf("full"), window)
        torch.testing.assert_close(ours, plain.float(), atol=1e-7, rtol=0)
        nll.append(torch.nn.functional.cross_entropy(plain[0, :-1], window[0, 1:], reduction="none"))
    result = ppl.run(model, None, method_from_conf("full"), task, data_dir)
    assert result["nll"] == pytest.approx(float(torch.cat(nll).mean()), abs=1e-9)


# ----------------------------------------------------------------------------------------------- log-probs in blocks


def _ppl_task(seq_len: int, max_windows: int = 1):
    from omegaconf import OmegaConf

    return OmegaConf.create({"dataset": "wikitext2", "seq_len": seq_len, "stride": None, "max_windows": max_windows,
                             "dense_rows": 0})


def _scoring_entry(entry, model, data_dir, t):
    """A callable running one of the evaluation entry points on a t-token sequence of the tiny model."""
    from experiments import needle, ppl
    from experiments.lm_eval_lm import KVMethodLM

    method = method_from_conf("full")
    ids = random_ids(t, 256)[0].tolist()  # byte ids: the byte tokenizer's range
    if entry == "ppl":
        return lambda: ppl.run(model, None, method, _ppl_task(t), data_dir)
    lm = KVMethodLM(model, adapter.byte_tokenizer(), method, max_length=t)
    if entry == "lm_eval":
        return lambda: lm._loglikelihood_tokens([(None, ids[:-8], ids[-8:])], disable_tqdm=True)
    if entry == "generate":
        return lambda: lm.greedy(torch.tensor([ids]), new_tokens=3, stop=[])
    prompt = needle.Prompt(torch.tensor(ids[:-5]), torch.tensor(ids[-5:]), "", 10, 20)
    return lambda: needle.score(model, method, prompt, "cpu")


@pytest.mark.parametrize("entry", ["ppl", "lm_eval", "generate", "needle"])
def test_no_vocab_wide_float_tensor(entry, small_chunks, small_logit_blocks, data_dir):
    """Scoring a t-token sequence never forms its (t, vocab) logits (nor their log-softmax): log-probs come from
    blocks of 64 rows, greedy tokens and needle answers from the one row each step needs. At t = 1000 the largest
    float tensor left is the model's own MLP activation, (t, intermediate) = half of (t, vocab)."""
    model, _ = load_model("tiny-llama")
    t, vocab, inner = 1000, model.config.vocab_size, model.config.intermediate_size
    run = _scoring_entry(entry, model, data_dir, t)
    with LargestFloat() as spy:
        run()
    assert spy.numel <= t * inner < t * vocab, f"{entry}: a {spy.numel}-element float tensor at t={t}, vocab={vocab}"
    assert spy.numel >= (t - 8) * inner  # the spy saw the forward


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("block_rows", [1, 7, 64, 10_000])
def test_token_logprobs_equal_the_whole_log_softmax(model_name, block_rows, monkeypatch):
    """Blocks of any size (one row, a size that does not divide the rows, more than all of them) give the
    log-probs and argmax of the whole (b, t, vocab) log-softmax (float64 model: to rounding)."""
    model, _ = load_model(model_name, "float64")
    monkeypatch.setattr(modes, "LOGIT_BLOCK", block_rows * model.config.vocab_size)
    ids = random_ids(90, model.config.vocab_size, batch=2)
    hidden = modes.sim_hidden(model, method_from_conf("full"), ids)  # (2, 90, hidden)
    targets = ids.roll(-1, dims=1)
    scores = modes.token_logprobs(model, hidden, targets)
    whole = adapter.lm_head(model)(hidden).log_softmax(-1)  # (2, 90, vocab)
    assert scores.logprob.dtype == torch.float64 and scores.logprob.shape == targets.shape and scores.finite
    torch.testing.assert_close(scores.logprob, whole.gather(-1, targets[..., None])[..., 0], atol=1e-12, rtol=0)
    assert torch.equal(scores.greedy, whole.argmax(-1) == targets)
    greedy_targets = whole.argmax(-1)
    assert modes.token_logprobs(model, hidden, greedy_targets).greedy.all()
