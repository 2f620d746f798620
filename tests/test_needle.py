"""experiments/needle.py: prompt construction (exact length, needle at its depth, question last) and scoring
through decode mode, end to end on a tiny model."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import METHODS, load_model, method_from_conf
from experiments import needle
from infinigen.adapter import encode

VOCAB = 512


def tokenize(text: str) -> torch.Tensor:
    return encode(None, text, VOCAB)  # tokenizer-less models read bytes


def task(**overrides):
    base = {"name": "needle", "lengths": [300, 400], "depths": [0.0, 0.5, 1.0], "seeds": 2, "key_digits": 5,
            "filler": "repeat"}
    return OmegaConf.create(base | overrides)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("length", [300, 777])
def test_prompt_has_exact_length_and_needle_at_depth(length, depth):
    key = needle.make_key(3, 5)
    filler = needle.filler_ids(tokenize, "repeat", None, length, seed=3)
    p = needle.build_prompt(tokenize, length, depth, key, filler)
    assert p.ids.numel() == length
    head, question = tokenize(needle.INSTRUCTION), tokenize(needle.QUESTION + " ")  # the key's space ends it
    assert torch.equal(p.ids[: head.numel()], head)
    assert torch.equal(p.ids[-question.numel():], question)  # the question ends the prompt
    assert torch.equal(p.ids[p.needle_start : p.needle_end], tokenize(needle.NEEDLE.format(key=key)))
    room = length - head.numel() - question.numel() - (p.needle_end - p.needle_start)
    assert p.needle_start - head.numel() == round(depth * room)  # the needle's share of the filler before it
    assert torch.equal(p.key_ids, tokenize(key))  # only the digits are scored
    assert key in bytes(p.ids.tolist()).decode()


def test_keys_differ_by_seed_and_have_their_digits():
    keys = {needle.make_key(s, 5) for s in range(20)}
    assert len(keys) > 15 and all(len(k) == 5 and k.isdigit() for k in keys)


def test_wikitext_filler_comes_from_the_corpus(data_dir):
    ids = needle.filler_ids(tokenize, "wikitext2", data_dir, 500, seed=1)
    p = needle.build_prompt(tokenize, 500, 0.5, "12345", ids)
    assert p.ids.numel() == 500 and not torch.equal(ids[:50], needle.filler_ids(tokenize, "repeat", None, 50, 1)[:50])


def test_bad_settings_are_refused():
    for bad in ({"filler": "lorem"}, {"depths": [1.5]}, {"lengths": [10]}, {"seeds": 0}, {"key_digits": 0}):
        with pytest.raises(ValueError):
            needle.validate(task(**bad), None)


def test_score_is_teacher_forced_greedy_exact_match():
    """`exact` says whether greedy generation reproduces the key; checked against modes.greedy_generate."""
    from infinigen import modes

    model, _ = load_model("tiny-llama")
    filler = needle.filler_ids(tokenize, "repeat", None, 400, seed=0)
    prompt = needle.build_prompt(tokenize, 400, 0.5, needle.make_key(0, 5), filler)
    greedy = modes.greedy_generate(model, method_from_conf("full"), prompt.ids[None], prompt.key_ids.numel())
    answer = greedy[0, prompt.ids.numel():]
    # a prompt whose key is what the model answers anyway: exact must be True there, and False for the real key
    own = needle.Prompt(prompt.ids, answer, "", prompt.needle_start, prompt.needle_end)
    assert needle.score(model, method_from_conf("full"), own, "cpu")[0]
    exact, loglik = needle.score(model, method_from_conf("full"), prompt, "cpu")
    assert exact == torch.equal(answer, prompt.key_ids) and loglik < 0


def test_run_end_to_end():
    model, _ = load_model("tiny-llama")
    out = needle.run(model, None, method_from_conf("h2o"), task(depths=[0.0, 1.0], seeds=2), None)
    assert out["prompts"] == 2 * 2 * 2
    assert [(c["length"], c["depth"]) for c in out["cells"]] == [(n, d) for n in (300, 400) for d in (0.0, 1.0)]
    assert all(c["n"] == 2 and 0 <= c["accuracy"] <= 1 and c["loglik"] < 0 for c in out["cells"])
    assert 0 < out["kv_fraction"] <= 1


@pytest.mark.parametrize("method_name", METHODS)
def test_every_method_end_to_end(method_name):
    """The needle task through each method's decode mode: a prompt at each end of the filler, one key each."""
    model, _ = load_model("tiny-llama")
    out = needle.run(model, None, method_from_conf(method_name), task(lengths=[300], depths=[0.0, 1.0], seeds=1),
                     None)
    assert out["prompts"] == 2 and [c["depth"] for c in out["cells"]] == [0.0, 1.0]
    assert all(c["n"] == 1 and c["accuracy"] in (0.0, 1.0) and c["loglik"] < 0 for c in out["cells"])
    assert 0 < out["kv_fraction"] <= 1


def test_lengths_beyond_the_model_are_refused():
    model, _ = load_model("tiny-llama")  # max_position_embeddings 1024
    with pytest.raises(ValueError, match="max_position_embeddings"):
        needle.run(model, None, method_from_conf("full"), task(lengths=[1020]), None)
