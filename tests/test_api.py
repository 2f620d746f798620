"""The Python API (infinigen/api.py, README "Use it from Python") and task=generate: `model.generate` through a method
gives the method's own decode loop's tokens; a 1-token prompt, a left-padded batch and beam search work; what a
method's cache cannot run is refused before anything runs, in one line."""

import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import DATA_DIR, METHODS, ROOT, load_model, method_from_conf, random_ids, readme_example
from baselines.full import Full
from infinigen import adapter, apply, generate, load_method, modes, selected
from infinigen import load_model as load_model_by_name

# every method on the three families; the other two in the slow tier (still run by `make test`) to keep the fast one
# under a minute
GEN_MODELS = ["tiny-llama", pytest.param("tiny-opt", marks=pytest.mark.slow),
              pytest.param("tiny-gemma3", marks=pytest.mark.slow)]
NEW = 6  # generated tokens per check


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def until_stop(tokens: list[int], eos: set[int]) -> list[int]:
    """A greedy decode loop's tokens as model.generate returns them: up to and including the first eos."""
    out = []
    for t in tokens:
        out.append(t)
        if t in eos:
            break
    return out


# ----------------------------------------------------------------------------------------------- the README


def test_readme_example_runs_on_tiny_llama(monkeypatch, capsys, data_dir):
    monkeypatch.setenv("DATA_DIR", data_dir)
    code = readme_example()
    assert '"smollm2-135m"' in code
    scope = {}
    exec(compile(code.replace('"smollm2-135m"', '"tiny-llama"'), "README.md", "exec"), scope)
    printed = capsys.readouterr().out
    assert re.search(r"^full: .+ kv_fraction 1\.00$", printed, re.M), printed
    assert re.search(r"^infinigen: .+ kv_fraction 0\.\d\d$", printed, re.M), printed
    assert torch.equal(scope["ids"], scope["out"].sequences)  # model.generate in `apply` == infinigen.generate


@pytest.mark.slow
def test_readme_example_runs_on_smollm2(monkeypatch, capsys, data_dir):
    """Verbatim: InfiniGen at budget 0.1 and full attention on one prompt; full's text is transformers' own."""
    monkeypatch.setenv("DATA_DIR", data_dir)
    scope = {}
    exec(compile(readme_example(), "README.md", "exec"), scope)
    printed = capsys.readouterr().out
    assert re.search(r"^full: .+ kv_fraction 1\.00$", printed, re.M), printed
    assert re.search(r"^infinigen: .+ kv_fraction 0\.\d\d$", printed, re.M), printed
    model, prompt = scope["model"], scope["prompt"]
    with torch.inference_mode():
        plain = model.generate(prompt, max_new_tokens=24, do_sample=False)
    full = generate(model, load_method("full"), prompt, 24, do_sample=False)
    assert torch.equal(full.sequences, plain)


# ----------------------------------------------------------------------------------------------- every method


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", GEN_MODELS)
def test_model_generate_equals_the_methods_decode_loop(name, method):
    """transformers' own generate inside `apply` gives the tokens of the method's decode loop (modes.greedy_generate,
    which never stops at eos); a 1-token prompt runs (its forward is the prefill: the store held no past)."""
    model, _ = load_model(name)
    eos = eos_ids(model)
    ids = random_ids(36, model.config.vocab_size, seed=3)
    ref = modes.greedy_generate(model, method_from_conf(method), ids, NEW)[0, 36:].tolist()
    m = method_from_conf(method)
    with apply(model, m) as cache:
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False)
    assert out[0, 36:].tolist() == until_stop(ref, eos)
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token is generated, never fed
    one = torch.tensor([[7]])
    ref = modes.greedy_generate(model, method_from_conf(method), one, 3)[0, 1:].tolist()
    got = generate(model, method_from_conf(method), one, 3, do_sample=False)
    assert got.generated(0).tolist() == until_stop(ref, eos)


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_batch_rows_equal_each_prompt_alone(method):
    """Three prompts of different lengths, left-padded: each row's tokens are those of its prompt run alone (the
    batch runs as groups of equal-length prompts; alone, they are the method's decode loop's: the test above)."""
    model, _ = load_model("tiny-llama")
    lengths = [40, 23, 32]
    prompts = [random_ids(n, model.config.vocab_size, seed=20 + i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(3, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, -p.numel():], mask[i, -p.numel():] = p, 1
    batch = generate(model, method_from_conf(method), ids, NEW, attention_mask=mask, do_sample=False)
    assert batch.prompt_lengths == lengths and batch.sequences.shape[0] == 3
    assert torch.equal(batch.sequences[:, : ids.shape[1]], ids)  # the padded prompts as given, transformers' layout
    for i, p in enumerate(prompts):
        alone = generate(model, method_from_conf(method), p[None], NEW, do_sample=False)
        assert batch.generated(i).tolist() == alone.generated(0).tolist()


# ----------------------------------------------------------------------------------------------- beam search


@pytest.mark.parametrize("method", METHODS)
def test_reorder_cache_moves_each_rows_state_with_its_keys(method):
    """Beam search reorders the cache's rows every step: prefill [A, B], 3 steps, reorder to [B, A, B], 3 more steps
    gives the logits of [B, A, B] run from the start (float64), for every method's per-entry and per-layer state."""
    model, _ = load_model("tiny-llama", "float64")
    V = model.config.vocab_size
    a, b = random_ids(30, V, seed=5)[0], random_ids(30, V, seed=6)[0]
    steps = random_ids(6, V, batch=2, seed=7)  # the tokens fed to rows A and B

    def run(prompts, fed, reorder=None):
        m = method_from_conf(method)
        cache = modes.new_cache(model, m)
        out = []
        with torch.inference_mode(), adapter.install(model, m, mode="decode", dense_rows=30, cache=cache, max_len=36):
            modes.prefill(model, torch.stack(prompts), cache)
            for s in range(6):
                if s == 3 and reorder is not None:
                    cache.reorder_cache(reorder)
                    fed = fed[reorder]
                out.append(modes.decode_step(model, fed[:, s : s + 1], cache, 30 + s))
        return torch.stack(out[3:], 1)

    moved = run([a, b], steps, reorder=torch.tensor([1, 0, 1]))
    fresh = run([b, a, b], steps[[1, 0, 1]])
    torch.testing.assert_close(moved, fresh, rtol=0, atol=1e-9)


def test_beam_search_through_full_equals_transformers():
    model, _ = load_model("tiny-llama")
    ids = random_ids(24, model.config.vocab_size, seed=8)
    with torch.inference_mode():
        plain = model.generate(ids, num_beams=3, num_return_sequences=2, max_new_tokens=NEW, do_sample=False)
    with apply(model, Full()):
        ours = model.generate(ids, num_beams=3, num_return_sequences=2, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(ours, plain)


@pytest.mark.parametrize("method", ["h2o", "infinigen"])
def test_beam_search_and_sampling_run_through_evicting_methods(method):
    model, _ = load_model("tiny-llama")
    ids = random_ids(24, model.config.vocab_size, seed=9)
    m = method_from_conf(method)
    out = generate(model, m, ids, NEW, num_beams=3, num_return_sequences=2, do_sample=False)
    assert out.sequences.shape[0] == 2 and out.stats["kv_fraction"] < 1
    torch.manual_seed(0)
    first = generate(model, m, ids, NEW, do_sample=True, top_k=20, num_return_sequences=2)
    torch.manual_seed(0)
    again = generate(model, m, ids, NEW, do_sample=True, top_k=20, num_return_sequences=2)
    assert torch.equal(first.sequences, again.sequences) and first.sequences.shape[0] == 2


# ----------------------------------------------------------------------------------------------- refused


REFUSED = [({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens: assisted / prompt-lookup decoding"),
           ({"assistant_model": "model"}, "assistant_model: assisted / prompt-lookup decoding"),
           ({"prefill_chunk_size": 8}, "prefill_chunk_size=8: prefill chunking is not supported"),
           ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha: contrastive search is not supported"),
           ({"cache_implementation": "static"}, "cache_implementation='static': the KV method's cache is the cache"),
           ({"attention_mask": "padded"}, "a padded batch")]


@pytest.mark.parametrize("kwargs,message", REFUSED, ids=[next(iter(k)) for k, _ in REFUSED])
def test_unsupported_generation_is_refused_before_anything_runs(kwargs, message):
    model, _ = load_model("tiny-llama")
    ids = random_ids(2 * 12, model.config.vocab_size, seed=1).view(2, 12)
    kwargs = {k: model if v == "model" else v for k, v in kwargs.items()}
    if kwargs.get("attention_mask") == "padded":
        kwargs["attention_mask"] = torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with apply(model, method_from_conf("h2o")) as cache:
            with pytest.raises(ValueError, match=re.escape(message)):
                model.generate(ids, cache=cache, max_new_tokens=4, **kwargs)
            assert cache.get_seq_length() == 0
        if "attention_mask" not in kwargs:  # the API refuses the same, in one line
            with pytest.raises(ValueError, match=re.escape(message)) as err:
                generate(model, method_from_conf("h2o"), ids, 4, **kwargs)
            assert "\n" not in str(err.value)
    finally:
        hook.remove()
    assert forwards == []


def test_a_reused_cache_is_refused_and_a_reset_one_starts_again():
    model, _ = load_model("tiny-llama")
    ids = random_ids(16, model.config.vocab_size, seed=2)
    with apply(model, method_from_conf("h2o")) as cache:
        first = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        turn = torch.cat([first, random_ids(3, model.config.vocab_size, seed=4)], 1)
        with pytest.raises(ValueError, match="already holds 19 tokens; a second turn on a reused cache"):
            model.generate(turn, cache=cache, max_new_tokens=4, do_sample=False)
        cache.reset()
        assert torch.equal(model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False), first)
        # forwards of your own: several tokens after a past is not a decode step; another cache is not the method's
        with pytest.raises(ValueError, match="a forward of 3 tokens after 19 cached ones"):
            model(turn[:, -3:], cache=cache)
        with pytest.raises(ValueError, match="does not go through the method's cache"):
            model(ids, cache=modes.new_cache(model, Full()))


def test_generate_checks_its_input():
    model, _ = load_model("tiny-llama")
    m = method_from_conf("full")
    ids = random_ids(8, model.config.vocab_size).repeat(2, 1)
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match="must be left-padded"):
        generate(model, m, ids, 4, attention_mask=right)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate(model, m, ids, 0)
    with pytest.raises(ValueError, match="cache: infinigen.generate makes the method's caches itself"):
        generate(model, m, ids, 4, cache=modes.new_cache(model, m))
    with pytest.raises(ValueError, match="unknown model 'nosuch'; one of: gemma3-270m"):
        load_model_by_name("nosuch")


def test_a_prompt_token_equal_to_pad_is_not_padding():
    """tiny-gemma3's pad_token_id is 0: transformers would read a 0 in an unmasked prompt as padding."""
    model, _ = load_model("tiny-gemma3")
    ids = random_ids(20, model.config.vocab_size, seed=1)
    ids[0, 5] = model.generation_config.pad_token_id
    ref = modes.greedy_generate(model, Full(), ids, 4)[0, 20:].tolist()
    assert generate(model, Full(), ids, 4).generated(0).tolist() == until_stop(ref, eos_ids(model))


# ----------------------------------------------------------------------------------------------- load_method


def test_load_method_validates_as_the_cli_and_uses_the_models_family(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'nosuch'; one of: full, h2o"):
        load_method("nosuch")
    with pytest.raises(ValueError, match="method.bugdet: infinigen has no such option; its options: alpha"):
        load_method("infinigen", bugdet=0.1)
    with pytest.raises(ValueError, match=r"budget must be a fraction in \(0, 1\], got 2"):
        load_method("oracle", budget=2)
    # no calibration text where data_dir points: named before any model is touched
    with pytest.raises(FileNotFoundError, match="pg19"):
        load_method("infinigen", data_dir=str(tmp_path))
    # the speculation setting of the model's family (infinigen/selected.py), as `run.py method=infinigen model=...`
    paper = load_method("infinigen", data_dir=DATA_DIR)
    llama = load_method("infinigen", model=load_model("tiny-llama")[0], data_dir=DATA_DIR, budget=0.1)
    assert {k: getattr(paper, k) for k in selected.KEYS} == selected.setting(None)
    assert {k: getattr(llama, k) for k in selected.KEYS} == selected.setting("llama") != selected.setting(None)
    assert llama.budget == 0.1 and llama.calib_data_dir == DATA_DIR
    with pytest.raises(ValueError, match="method.rank=999 exceeds head_dim x KV heads"):
        load_method("shadowkv", model=load_model("tiny-llama")[0], rank=999)


def test_infinigen_on_a_model_loaded_elsewhere_needs_its_tokenizer(data_dir, tmp_path):
    """Calibration reads text: a model not loaded by load_model must come with its tokenizer (not bytes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(load_model("tiny-llama")[0].config)
    method = load_method("infinigen", data_dir=data_dir, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="pass its tokenizer"):
        with apply(model, method):
            pass
    with apply(model, method, tokenizer=adapter.byte_tokenizer()):
        assert method.skewing is not None


# ----------------------------------------------------------------------------------------------- task=generate


def run_py(*args, tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args, f"data_dir={DATA_DIR}",
                           f"results_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_task_generate_prints_both_texts_and_writes_a_row(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("The capital of France is") + "\n" + json.dumps({"prompt": "Once upon a"}) + "\n")
    done = run_py("task=generate", "method=h2o", "model=tiny-llama", f"task.prompt=file:{prompts}",
                  "task.max_new_tokens=6", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("  full      : ") == 2 and out.count("  H2O       : ") == 2
    assert re.search(r"token agreement \d\.\d{3} \(\d+/\d+\), (identical|first divergence at generated token \d+)",
                     out)
    (rows,) = (tmp_path / "rows").glob("*.jsonl")
    row = json.loads(rows.read_text().splitlines()[0])
    metrics = row["metrics"]
    assert row["task"] == "generate" and metrics["prompts"] == 2
    assert len(metrics["texts"]["full"]) == len(metrics["texts"]["method"]) == len(metrics["units"]["id"]) == 2
    assert 0 <= metrics["agreement"] <= 1 and metrics["kv_fraction"] < 1
    assert row["data"]["sha256"]  # the prompts' file is part of the run's identity


def test_task_generate_refuses_assisted_decoding_in_one_line_exit_2(tmp_path):
    done = run_py("task=generate", "method=infinigen", "model=tiny-llama", "task.prompt=Hello",
                  "+task.generation.prompt_lookup_num_tokens=3", tmp_path=tmp_path)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert lines == ["error: task.generation.prompt_lookup_num_tokens: must be unset: assisted / prompt-lookup "
                     "decoding is not supported with a KV method (its verify step feeds several draft tokens at once "
                     "and rolls back the rejected ones, which a cache that evicted or compressed its past cannot do)"]
