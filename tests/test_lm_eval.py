"""experiments/lm_eval.py: lm-eval requests scored through a KV method, in the paper and serving protocols.

tiny-llama has no tokenizer: it is tested at the token-id level (`_loglikelihood_tokens`, lm-eval's own entry
point below `loglikelihood`) and, end to end, with the byte tokenizer the task module gives tokenizer-less models.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from baselines.full import Full
from conftest import METHODS, ROOT, load_model, method_from_conf
from experiments import lm_eval as le
from experiments.lm_eval_protocols import PROTOCOLS
from infinigen import adapter
from infinigen.contract import KVMethod
from infinigen.modes import sim_logits


@dataclass
class RecentOnly(KVMethod):
    """Test-only sparse method: each decoded row attends only its `window` most recent tokens."""

    window: int = 4

    def sim_keep(self, session, layer, state, rows, s):
        cols = torch.arange(s, device=rows.device)[None, :]
        return (rows[:, None] - cols < self.window)[None, None]  # (1, 1, r, s)


@dataclass
class CountingFull(Full):
    """Full attention that counts the attention calls it serves."""

    def __post_init__(self):
        super().__post_init__()
        self.calls = {"forward": 0, "decode": 0}

    def forward_attention(self, session, layer, q, k, v, allowed):
        self.calls["forward"] += 1
        return super().forward_attention(session, layer, q, k, v, allowed)

    def decode_attention(self, session, layer, q, store):
        self.calls["decode"] += 1
        return super().decode_attention(session, layer, q, store)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def token_requests(max_length: int) -> list:
    """(strings, context ids, continuation ids) as lm-eval builds them: multiple choice (shared contexts, 1- to
    6-token continuations), two different contexts of equal length, a context+continuation key shared by two
    one-token continuations (lm-eval's logits cache), and one request left-truncated to max_length."""
    reqs = []
    for doc, ctx_len in enumerate([40, 57, 57, 23]):
        ctx = _ids(ctx_len, seed=doc)
        for j, cont_len in enumerate([1, 3, 6]):
            reqs.append((None, ctx, _ids(cont_len, seed=100 * doc + j)))
    ctx = _ids(30, seed=7)
    reqs += [(None, ctx, [5]), (None, ctx, [9])]
    reqs.append((None, _ids(max_length + 6, seed=8), _ids(4, seed=9)))
    return reqs


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-llama")
    assert tok is None
    return model, adapter.byte_tokenizer()


MAX_LENGTH = 128  # small, to exercise lm-eval's left truncation cheaply


def make_lm(tiny, method, protocol, batch_size=1, dense_rows=0, max_length=MAX_LENGTH):
    model, tok = tiny
    return le.KVMethodLM(model, tok, method, protocol=protocol, dense_rows=dense_rows, batch_size=batch_size,
                         max_length=max_length)


def lls(lm, reqs) -> torch.Tensor:
    return torch.tensor([ll for ll, _ in lm._loglikelihood_tokens(reqs, disable_tqdm=True)], dtype=torch.float64)


def manual_ll(model, method, ctx, cont, max_length, protocol, dense_rows=0) -> float:
    """The protocols' definition, independent of lm-eval: input (ctx + cont)[-(L+1):][:-1]; paper: rows >=
    dense_rows decoded; serving: every context row dense."""
    inp = (ctx + cont)[-(max_length + 1):][:-1]
    rows = len(inp) - (len(cont) - 1) if protocol == "serving" else dense_rows
    logits = sim_logits(model, method, torch.tensor([inp]), dense_rows=rows)
    logp = torch.log_softmax(logits[0, -len(cont):].double(), -1)
    return float(logp.gather(-1, torch.tensor(cont)[:, None]).sum())


# ----------------------------------------------------------------------------------------------- scores


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_full_matches_lm_eval_hflm(tiny, protocol):
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny
    ref_lm = HFLM(pretrained=model, tokenizer=tok, backend="causal", batch_size=1, max_length=MAX_LENGTH)
    ours = make_lm(tiny, CountingFull(), protocol)
    reqs = token_requests(ours.max_length)
    ref = ref_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    got = ours._loglikelihood_tokens(reqs, disable_tqdm=True)
    torch.testing.assert_close(torch.tensor([g[0] for g in got]), torch.tensor([r[0] for r in ref]),
                               atol=1e-4, rtol=0)
    assert [g[1] for g in got] == [r[1] for r in ref]  # is_greedy
    # every forward went through the method, one call per layer
    assert ours.method.calls["forward"] == ours.counts["forwards"] * model.config.num_hidden_layers > 0
    assert ours.counts["requests"] == len(reqs)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_float64_scores_equal_lm_eval_whole_logits(protocol, monkeypatch):
    """Scores from the continuation rows' hidden states, in blocks = lm-eval's HFLM from the whole (batch, t,
    vocab) log-softmax of the model's own SDPA forward, in float64 to rounding; is_greedy identical."""
    from lm_eval.models.huggingface import HFLM

    from infinigen import modes

    model, _ = load_model("tiny-llama", "float64")
    tiny64 = (model, adapter.byte_tokenizer())
    ref_lm = HFLM(pretrained=model, tokenizer=tiny64[1], backend="causal", batch_size=1, max_length=MAX_LENGTH)
    reqs = token_requests(MAX_LENGTH)
    with adapter.attn_implementation(model, "sdpa"):
        ref = ref_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    monkeypatch.setattr(modes, "LOGIT_BLOCK", 2 * model.config.vocab_size)  # several blocks per continuation
    got = make_lm(tiny64, Full(), protocol, batch_size=4)._loglikelihood_tokens(reqs, disable_tqdm=True)
    torch.testing.assert_close(torch.tensor([g[0] for g in got], dtype=torch.float64),
                               torch.tensor([r[0] for r in ref], dtype=torch.float64), atol=1e-9, rtol=0)
    assert [g[1] for g in got] == [r[1] for r in ref]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_sparse_method_changes_scores(tiny, protocol):
    full = lls(make_lm(tiny, Full(), protocol), token_requests(MAX_LENGTH))
    sparse_lm = make_lm(tiny, RecentOnly(window=4), protocol)
    reqs = token_requests(sparse_lm.max_length)
    sparse = lls(sparse_lm, reqs)
    multi = torch.tensor([len(cont) > 1 for _, _, cont in reqs])
    assert (sparse - full)[multi].abs().min() > 1e-3  # every multi-token continuation is affected
    if protocol == "serving":  # a single continuation token is predicted by the dense prefill
        torch.testing.assert_close(sparse[~multi], full[~multi], atol=1e-4, rtol=0)
    else:
        assert (sparse - full)[~multi].abs().min() > 1e-3
    kv = sparse_lm.method.stats.summary()["kv_fraction"]
    assert 0 < kv < 0.5


@pytest.mark.parametrize("protocol,dense_rows", [("paper", 0), ("paper", 20), ("serving", 0)])
def test_protocol_definition(tiny, protocol, dense_rows):
    model, _ = tiny
    method = RecentOnly(window=6)
    lm = make_lm(tiny, method, protocol, dense_rows=dense_rows)
    reqs = token_requests(lm.max_length)
    got = lls(lm, reqs)
    want = torch.tensor([manual_ll(model, method, ctx, cont, lm.max_length, protocol, dense_rows)
                         for _, ctx, cont in reqs], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_protocols_differ(tiny):
    paper = lls(make_lm(tiny, RecentOnly(window=4), "paper"), token_requests(MAX_LENGTH))
    serving = lls(make_lm(tiny, RecentOnly(window=4), "serving"), token_requests(MAX_LENGTH))
    assert (paper - serving).abs().max() > 1e-2


BATCH_METHODS = {
    "recent": lambda: RecentOnly(window=4),
    **{name: (lambda name=name: method_from_conf(name)) for name in METHODS},
    # sizes its KV pool from the sequence length: padding would change its scores
    "infinigen-capacity": lambda: method_from_conf("infinigen", capacity=0.5),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", sorted(BATCH_METHODS))
def test_batch_size_does_not_change_scores(tiny, protocol, name):
    if protocol == "paper" and BATCH_METHODS[name]().needs_prompt:
        pytest.skip(f"{name} compresses a prompt: the paper protocol (dense_rows=0) is refused before a model loads")
    reqs = token_requests(MAX_LENGTH)
    one = make_lm(tiny, BATCH_METHODS[name](), protocol, batch_size=1)
    four = make_lm(tiny, BATCH_METHODS[name](), protocol, batch_size=4)
    torch.testing.assert_close(lls(four, reqs), lls(one, reqs), atol=1e-5, rtol=0)
    assert four.counts["forwards"] < one.counts["forwards"]  # equal-length requests did share forwards


def test_auto_batch_size_fills_a_token_budget(tiny):
    """task.batch_size=auto (the default): a forward takes as many equal-length inputs as fill AUTO_TOKENS tokens,
    with the scores of batch 1."""
    from experiments.lm_eval_protocols import AUTO_TOKENS, requests_per_forward

    assert requests_per_forward("auto", 64) == AUTO_TOKENS // 64 and requests_per_forward("auto", 10 ** 6) == 1
    assert requests_per_forward(3, 64) == 3
    reqs = token_requests(MAX_LENGTH)
    one, auto = make_lm(tiny, Full(), "paper", batch_size=1), make_lm(tiny, Full(), "paper", batch_size="auto")
    torch.testing.assert_close(lls(auto, reqs), lls(one, reqs), atol=1e-5, rtol=0)
    assert auto.counts["forwards"] < one.counts["forwards"] and auto.batch_option == "auto"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_batch_size_does_not_change_stats(tiny, protocol):
    reqs = token_requests(MAX_LENGTH)
    kv = []
    for batch_size in (1, 4):
        lm = make_lm(tiny, RecentOnly(window=4), protocol, batch_size=batch_size)
        lls(lm, reqs)
        kv.append(lm.method.stats.summary()["kv_fraction"])
    assert kv[1] == pytest.approx(kv[0], rel=1e-9)


# ----------------------------------------------------------------------------------------------- generation


def test_generation_is_hf_greedy_through_the_method(tiny):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny
    reqs = [
        Instance(request_type="generate_until", doc={}, idx=0,
                 arguments=(ctx, {"until": until, "max_gen_toks": 12, "do_sample": False}))
        for ctx, until in [("Question: what is it?\nAnswer:", ["\n\n"]), ("The cat sat on the", ["zz"])]
    ]
    ref = HFLM(pretrained=model, tokenizer=tok, backend="causal", batch_size=1,
               max_length=MAX_LENGTH).generate_until(reqs)
    lm = make_lm(tiny, CountingFull(), "paper")
    got = lm.generate_until(reqs)
    assert got == ref
    steps = lm.counts["generated"] - len(reqs)  # the first token of each comes out of the prefill
    assert steps > 0 and lm.method.calls["decode"] == steps * model.config.num_hidden_layers
    sampled = {"until": ["\n"], "max_gen_toks": 4, "do_sample": True, "temperature": 1.0}
    with pytest.raises(NotImplementedError, match="greedily"):
        lm.generate_until([Instance(request_type="generate_until", doc={}, idx=0, arguments=("x", sampled))])


# ----------------------------------------------------------------------------------------------- task module


def task_cfg(**overrides):
    cfg = OmegaConf.load(ROOT / "conf" / "task" / "lm_eval.yaml")
    return OmegaConf.merge(cfg, overrides)


def test_default_config_validates(data_dir):
    le.validate(task_cfg(), data_dir)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"protocol": "decode"}, "task.protocol must be one of"),
        ({"limit": -3}, "task.limit must be null"),
        ({"limit": 0}, "task.limit must be null"),
        ({"tasks": []}, "non-empty list"),
        ({"tasks": ["copa", ""]}, "non-empty strings"),
        ({"num_fewshot": -1}, "task.num_fewshot"),
        ({"batch_size": 0}, "task.batch_size"),
        ({"batch_size": "fast"}, r"task.batch_size must be an integer >= 1 or 'auto', got 'fast'"),
        ({"dense_rows": -1}, "task.dense_rows must be"),
        ({"protocol": "serving", "dense_rows": 8}, "applies to protocol=paper only"),
        ({"fewshot_seed": None}, "task.fewshot_seed"),
        ({"tasks": ["copa", "copaa"]}, r"unknown lm-eval task 'copaa'; close matches: \['copa"),
    ],
)
def test_validate_rejects(overrides, message, data_dir):
    with pytest.raises(ValueError, match=message):
        le.validate(task_cfg(**overrides), data_dir)


def test_validate_names_missing_data_file(tmp_path):
    with pytest.raises(ValueError, match=r"'rte_local'.*rte/validation\.jsonl"):
        le.validate(task_cfg(tasks=["rte"]), str(tmp_path))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_run_rows(tiny, protocol, data_dir):
    model, _ = tiny
    cfg = task_cfg(tasks=["copa"], num_fewshot=1, limit=3, protocol=protocol)
    rows = {}
    for name, method in [("full", Full()), ("recent", RecentOnly(window=4))]:
        (row,) = le.run(model, None, method, cfg, data_dir)  # None: the byte tokenizer
        rows[name] = row
        assert row["task"] == "copa" and row["lm_eval_task"] == "copa_local"
        assert row["protocol"] == protocol and row["num_fewshot"] == 1 and row["limit"] == 3
        assert row["n"] == 3 and row["n_docs"] == 100
        assert row["acc"] in (0, 1 / 3, 2 / 3, 1) and row["acc_stderr"] >= 0
        assert row["requests"] == 6 and row["seconds"] > 0
        assert row["stats"]["kv_fraction"] == row["kv_fraction"]
    assert rows["full"]["kv_fraction"] == 1.0
    assert rows["recent"]["kv_fraction"] < 0.5


# ----------------------------------------------------------------------------------------------- smollm2


@pytest.mark.slow
def test_smollm2_copa_matches_lm_eval_hflm(data_dir):
    from lm_eval.models.huggingface import HFLM

    model, tok = load_model("smollm2-135m")
    (name,), tm = le.lm_eval_setup(["copa"], data_dir)
    task = tm.load([name])["tasks"][name]
    task.set_config("num_fewshot", 5)
    task.set_fewshot_seed(1234)
    task.build_all_requests(limit=2)
    reqs = task.instances
    ref = [ll for ll, _ in HFLM(pretrained=model, tokenizer=tok, batch_size=2).loglikelihood(reqs)]
    for protocol in PROTOCOLS:
        lm = make_lm((model, tok), Full(), protocol, batch_size=2, max_length=None)  # None: the model's 8192
        got = [ll for ll, _ in lm.loglikelihood(reqs)]
        # fp32 sums over a continuation: our LM head runs on the scored rows only, HFLM's on every row
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=5e-4, rtol=0)
    lm = make_lm((model, tok), RecentOnly(window=16), "paper", max_length=None)
    sparse = [ll for ll, _ in lm.loglikelihood(reqs)]
    assert max(abs(a - b) for a, b in zip(sparse, ref)) > 1e-2


def test_registered():
    from lm_eval.api.registry import get_model

    assert le.KVMethodLM is get_model("kv_method")  # the attribute imports the module that registers it
