"""RULER through the lm_eval task (experiments/lm_eval_tasks/ruler.py): generated offline with the model's tokenizer
and a local haystack, `limit` samples per length, one row per (task, length), scored through decode mode; bad
options refused before a model loads.

tiny-llama reads bytes (the byte tokenizer), so its samples are short in text; its answers are noise, so the
scores are compared, not judged, and the generated text is compared with lm-eval's own HF model token for token.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from baselines.full import Full
from conftest import ROOT, load_model, method_from_conf
from experiments import lm_eval as le
from experiments.lm_eval_tasks import ruler
from infinigen import adapter


def task_cfg(**overrides):
    return OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "task" / "lm_eval.yaml"), overrides)


def run_cfg(tmp_path, data_dir, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=[f"data_dir={data_dir}", f"results_dir={tmp_path}", *overrides])


# ----------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "overrides,option",
    [
        (["task.tasks=[ruler_qa_squad]", "task.max_seq_lengths=[512]"], "task.tasks"),
        (["task.tasks=[niah_single_1]", "task.max_seq_lengths=[512,2048]"], r"max\(task.max_seq_lengths\) = 2048"),
        (["task.tasks=[niah_single_1]", "task.max_seq_lengths=[100]"], "task.max_seq_lengths must be"),
        (["task.tasks=[niah_single_2]", "task.max_seq_lengths=[512]", "task.haystack=file:{short}"],
         r"task.haystack 'file:.*' \(.*\) has 9 words"),
        (["task.tasks=[ruler_fwe]", "task.max_seq_lengths=[512]", "task.limit=0"], "task.limit"),
        # the byte tokenizer (tiny-llama has none): lm-eval's generators would loop forever on these
        (["task.tasks=[ruler_vt]", "task.max_seq_lengths=[1024]"], "task.tasks: ruler_vt cannot be generated with "
                                                                    "the byte tokenizer of tiny-llama"),
        (["task.tasks=[niah_single_1,ruler_fwe]", "task.max_seq_lengths=[300,512]"],
         r"task.max_seq_lengths \[300\]: the shortest ruler_fwe sample takes 364 tokens"),
    ],
)
def test_refused_before_model_load(overrides, option, tmp_path, data_dir, monkeypatch):
    from conftest import refuse_model_load
    from experiments import runner

    refuse_model_load(monkeypatch)

    short = tmp_path / "short.txt"
    short.write_text("Nine words are far too few for a haystack.")
    cfg = run_cfg(tmp_path, data_dir, "model=tiny-llama", "method=full", "task=lm_eval",
                  *[o.format(short=short) for o in overrides])
    with pytest.raises(runner.UserError, match=option):
        runner.run(cfg)


def test_haystack_long_enough_for_smollm2_lengths(data_dir):
    le.validate(task_cfg(tasks=["niah_single_2", "ruler_cwe"]), data_dir)  # WikiText-2 test, 1k..8k


# ----------------------------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-llama")
    assert tok is None
    return model, adapter.byte_tokenizer()


def test_samples_fit_their_length_and_limit_is_per_length(tiny):
    _, tok = tiny
    data = ruler.dataset(ruler_task="ruler_fwe", max_seq_lengths=[400, 512], num_samples=2, tokenizer=tok,
                         haystack="wikitext2")["test"]
    assert [row["max_length"] for row in data] == [400, 400, 512, 512]
    first = ruler.dataset(ruler_task="ruler_fwe", max_seq_lengths=[512], num_samples=1, tokenizer=tok,
                          haystack="wikitext2")["test"]
    assert first[0]["input"] == data[2]["input"]  # a length's samples do not depend on other lengths or the limit


def test_generation_refuses_a_length_its_generator_cannot_fill(tiny):
    """At the shortest fwe prompt's length lm-eval's generator ends; one token less and it would loop forever
    (its fit loop retries a prompt that cannot shrink): refused first, naming the option."""
    _, tok = tiny
    (template, reserved, _), = ruler.shortest_texts("ruler_fwe")
    floor = ruler.byte_count(template) + reserved
    assert len(ruler.samples("ruler_fwe", floor, 1, tok, "")) == 1
    with pytest.raises(ValueError, match=rf"task.max_seq_lengths \[{floor - 1}\]"):
        ruler.samples("ruler_fwe", floor - 1, 1, tok, "")


def test_full_matches_lm_eval_hflm(tiny, data_dir):
    """The same generated samples through lm-eval's HFLM (model.generate) and through decode mode under full
    attention: the same answers, so the same per-length scores."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny
    outs = {}
    for name, lm in [("ours", le.KVMethodLM(model, tok, Full())),
                     ("hf", HFLM(pretrained=model, tokenizer=tok, backend="causal", batch_size=1))]:
        tm = ruler.task_manager("ruler_fwe", [400], 2, tok, "wikitext2", data_dir)
        res = lm_eval.simple_evaluate(model=lm, tasks=["ruler_fwe"], task_manager=tm, log_samples=True,
                                      bootstrap_iters=0)
        outs[name] = (res["results"]["ruler_fwe"]["400,none"], [s["resps"] for s in res["samples"]["ruler_fwe"]])
    assert outs["ours"] == outs["hf"]
    assert len(outs["ours"][1]) == 2


@pytest.mark.slow  # importing lm-eval's prepare_niah builds a 6M-word list (~15 s of CPU)
def test_niah_single_1_offline_through_a_method_writes_rows(tmp_path, data_dir):
    from experiments import runner
    from analysis import store

    cfg = run_cfg(tmp_path, data_dir, "model=tiny-llama", "method=h2o", "task=lm_eval",
                  "task.tasks=[niah_single_1]", "task.limit=2", "task.max_seq_lengths=[768,1024]")
    runner.run(cfg)
    rows = store.load(tmp_path)
    assert rows["metrics.length"].tolist() == [768, 1024]
    assert (rows["metrics.task"] == "niah_single_1").all() and (rows["metrics.n"] == 2).all()
    assert rows["metrics.score"].between(0, 1).all()
    assert rows["metrics.kv_fraction"].between(0, 0.9).all()  # the method's own cache served the generated tokens
    recorded = rows["data.ruler"].tolist()  # niah_single_1's haystack is RULER's own: no essay text recorded
    assert all(d["seed"] == ruler.SEED and d["essay_tasks"] == [] and "essay_haystack" not in d for d in recorded)


def test_rows_record_the_essay_haystack(tmp_path, data_dir):
    from experiments import runner

    cfg = run_cfg(tmp_path, data_dir, "model=tiny-llama", "method=full", "task=lm_eval",
                  "task.tasks=[niah_single_2,ruler_cwe]", "task.max_seq_lengths=[512]")
    data = runner.data_identity(cfg)["ruler"]
    assert data["essay_tasks"] == ["niah_single_2"] and data["essay_haystack"]["dataset"] == "wikitext2"
    assert data["essay_haystack"]["sha256"].startswith("173c87a5")  # WikiText-2 raw test (SOURCES.md)


def test_ruler_options_are_part_of_what_ruler_runs_compute_only():
    """A COPA run computes the same whatever the RULER options say: its config hash (and the report's matching of
    stored rows) leaves them out; a RULER run's keeps them."""
    from experiments.runner import semantic_config

    def config(tasks, lengths):
        return {"model": {"name": "m"}, "method": {"_target_": "baselines.full.Full"}, "data_dir": "/d",
                "task": {"name": "lm_eval", "tasks": tasks, "max_seq_lengths": lengths, "haystack": "wikitext2"}}

    assert semantic_config(config(["copa"], [1024])) == semantic_config(config(["copa"], [2048]))
    assert "max_seq_lengths" not in semantic_config(config("copa", [1024]))["task"]
    assert semantic_config(config(["niah_single_1"], [1024])) != semantic_config(config(["niah_single_1"], [2048]))
