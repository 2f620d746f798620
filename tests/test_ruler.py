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


PLACES = ["Arlen", "Bexley", "Corvin", "Dunmore", "Elsby", "Farrow", "Galton", "Hollis"]
COLOURS = ["amber", "teal", "crimson", "ivory", "olive", "slate", "coral", "umber"]


def write_qa_files(folder) -> dict:
    """A tiny SQuAD v2.0 file (an unanswerable question, a paragraph repeated in an article, an article with no
    answerable question: its paragraph is still a document) and a tiny HotpotQA distractor file, in their
    published layouts; made-up facts."""
    import json

    def para(i):
        return (f"The lighthouse of {PLACES[i]} was painted {COLOURS[i]} in {1900 + 7 * i}. Its keeper kept "
                f"{i + 2} goats on the cliff.")

    def qas(i, impossible=False):
        out = [{"id": f"q{i}", "question": f"What colour was the lighthouse of {PLACES[i]} painted?",
                "answers": [{"text": COLOURS[i], "answer_start": 0}, {"text": COLOURS[i], "answer_start": 0}],
                "is_impossible": False}]
        if impossible:
            out.append({"id": f"x{i}", "question": "Who painted the moon?", "answers": [],
                        "plausible_answers": [{"text": "Arlen", "answer_start": 0}], "is_impossible": True})
        return out

    squad = {"version": "v2.0", "data": [
        {"title": "North", "paragraphs": [{"context": para(i), "qas": qas(i, impossible=i == 1)} for i in range(4)]
         + [{"context": para(0), "qas": []}]},
        {"title": "South", "paragraphs": [{"context": para(i), "qas": qas(i)} for i in range(4, 8)]},
        {"title": "West", "paragraphs": [{"context": "The moon over Ilford is pale.", "qas": qas(1, True)[1:]}]},
        # more documents than lm-eval's first probe (10): at or below it, it shuffles the document list in place
        {"title": "East", "paragraphs": [{"context": f"The harbour of {p} holds {n} boats.", "qas": []}
                                         for n, p in enumerate(PLACES, 3)]},
    ]}
    hotpot = [{"_id": f"h{i}", "type": "bridge", "level": "easy", "answer": str(1900 + 7 * i),
               "question": f"In which year was the lighthouse kept by the owner of {i + 2} goats painted?",
               "supporting_facts": [[PLACES[i], 0]],
               "context": [[PLACES[i], [f"The lighthouse of {PLACES[i]} was painted in {1900 + 7 * i}. ",
                                        f"Its keeper kept {i + 2} goats."]],
                           [PLACES[(i + 1) % 8], [f"{PLACES[(i + 1) % 8]} has no lighthouse."]]]}
              for i in range(6)]
    paths = {"squad": folder / "dev-v2.0.json", "hotpotqa": folder / "hotpot_dev_distractor_v1.json"}
    paths["squad"].write_text(json.dumps(squad))
    paths["hotpotqa"].write_text(json.dumps(hotpot))
    return paths


# ----------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "overrides,option",
    [
        (["task.tasks=[ruler_qa_squad]", "task.max_seq_lengths=[512]"], r"task.qa_data.squad: ruler_qa_squad needs"),
        (["task.tasks=[ruler_qa_hotpot]", "task.max_seq_lengths=[512]", "task.qa_data.hotpotqa=nowhere.json"],
         r"task.qa_data.hotpotqa: .*nowhere.json not found"),
        (["task.tasks=[ruler_qa_squad]", "task.max_seq_lengths=[512]", "task.qa_data.squad={hotpotqa}"],
         r"task.qa_data.squad: .* is not the SQuAD v2.0 dev JSON"),
        (["task.tasks=[ruler_qa_hotpot]", "task.max_seq_lengths=[512]", "task.qa_data.hotpotqa={hotpotqa}",
          "task.limit=7"],
         r"task.qa_data.hotpotqa: .* has 6 answerable questions, fewer than the 7"),
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
    from experiments import cli_errors, runner

    refuse_model_load(monkeypatch)

    short = tmp_path / "short.txt"
    short.write_text("Nine words are far too few for a haystack.")
    files = write_qa_files(tmp_path)
    cfg = run_cfg(tmp_path, data_dir, "model=tiny-llama", "method=full", "task=lm_eval",
                  *[o.format(short=short, **files) for o in overrides])
    with pytest.raises(cli_errors.UserError, match=option):
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


@pytest.mark.parametrize("task,length", [("ruler_fwe", 400), ("ruler_qa_squad", 1024)])
def test_full_matches_lm_eval_hflm(task, length, tiny, data_dir, tmp_path):
    """The same generated samples through lm-eval's HFLM (model.generate) and through decode mode under full
    attention: the same answers, so the same per-length scores."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny
    qa_data = {kind: str(path) for kind, path in write_qa_files(tmp_path).items()}
    outs = {}
    for name, lm in [("ours", le.KVMethodLM(model, tok, Full())),
                     ("hf", HFLM(pretrained=model, tokenizer=tok, backend="causal", batch_size=1))]:
        tm = ruler.task_manager(task, [length], 2, tok, "wikitext2", data_dir, qa_data)
        res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, log_samples=True,
                                      bootstrap_iters=0)
        outs[name] = (res["results"][task][f"{length},none"], [s["resps"] for s in res["samples"][task]])
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
    from experiments import identity

    cfg = run_cfg(tmp_path, data_dir, "model=tiny-llama", "method=full", "task=lm_eval",
                  "task.tasks=[niah_single_2,ruler_cwe]", "task.max_seq_lengths=[512]")
    data = identity.data_identity(cfg)["ruler"]
    assert data["essay_tasks"] == ["niah_single_2"] and data["essay_haystack"]["dataset"] == "wikitext2"
    assert data["essay_haystack"]["sha256"].startswith("173c87a5")  # WikiText-2 raw test (SOURCES.md)


def test_ruler_options_are_part_of_what_ruler_runs_compute_only():
    """A COPA run computes the same whatever the RULER options say: its config hash (and the report's matching of
    stored rows) leaves them out; a RULER run's keeps them."""
    from infinigen.semantic import semantic_config

    def config(tasks, lengths):
        return {"model": {"name": "m"}, "method": {"_target_": "baselines.full.Full"}, "data_dir": "/d",
                "task": {"name": "lm_eval", "tasks": tasks, "max_seq_lengths": lengths, "haystack": "wikitext2"}}

    assert semantic_config(config(["copa"], [1024])) == semantic_config(config(["copa"], [2048]))
    assert "max_seq_lengths" not in semantic_config(config("copa", [1024]))["task"]
    assert semantic_config(config(["niah_single_1"], [1024])) != semantic_config(config(["niah_single_1"], [2048]))


# ----------------------------------------------------------------------------------------------- QA, local files


@pytest.mark.parametrize("kind", ["squad", "hotpotqa"])
def test_qa_files_read_as_lm_eval_reads_the_downloaded_ones(kind, tmp_path, monkeypatch):
    """The same questions, answers, gold and article documents (by index into the same sorted documents) as
    lm-eval's read_squad / read_hotpotqa give for the same JSON from the web."""
    import json

    from lm_eval.tasks.ruler import qa_utils

    path = write_qa_files(tmp_path)[kind]
    monkeypatch.setattr(qa_utils, "download_json", lambda url: json.loads(path.read_text()))
    theirs = (qa_utils.read_squad if kind == "squad" else qa_utils.read_hotpotqa)(url=str(path))
    ours = ruler.read_qa(kind, path)
    assert ours == theirs
    assert len(ours[0]) == (8 if kind == "squad" else 6)  # squad: the unanswerable question left out


@pytest.fixture()
def qa_files(tmp_path):
    return write_qa_files(tmp_path)


def test_qa_samples_hold_their_gold_document_and_answer(tiny, qa_files):
    _, tok = tiny
    data = ruler.dataset(ruler_task="ruler_qa_squad", max_seq_lengths=[1024], num_samples=3, tokenizer=tok,
                         haystack="wikitext2", qa_file=str(qa_files["squad"]))["test"]
    assert len(data) == 3 and all(row["match"] == "part" and row["length"] <= 1024 for row in data)
    for i, row in enumerate(data):
        assert f"lighthouse of {PLACES[i]} painted?" in row["input"] and row["outputs"] == [COLOURS[i]] * 2
        assert f"{PLACES[i]} was painted {COLOURS[i]}" in row["input"]  # its gold paragraph among the documents
    assert ruler.process_results(data[0], [f" It was {COLOURS[0]}."]) == {"1024": 1.0}
    assert ruler.process_results(data[0], [" It was green."]) == {"1024": 0.0}


def test_qa_offline_through_a_method_writes_rows(tmp_path, data_dir, qa_files):
    from analysis import store
    from experiments import runner
    from infinigen import corpora

    cfg = run_cfg(tmp_path, data_dir, "model=tiny-llama", "method=h2o", "task=lm_eval",
                  "task.tasks=[ruler_qa_squad,ruler_qa_hotpot]", "task.limit=2", "task.max_seq_lengths=[1024]",
                  f"task.qa_data.squad={qa_files['squad']}", f"task.qa_data.hotpotqa={qa_files['hotpotqa']}")
    runner.run(cfg)
    rows = store.load(tmp_path)
    assert sorted(rows["metrics.task"]) == ["ruler_qa_hotpot", "ruler_qa_squad"] and (rows["metrics.n"] == 2).all()
    assert rows["metrics.score"].between(0, 1).all() and rows["metrics.kv_fraction"].between(0, 0.9).all()
    recorded = rows["data.ruler"].tolist()[0]["qa"]
    assert set(recorded) == {"squad", "hotpotqa"}
    assert recorded["squad"]["sha256"] == corpora.file_sha256(qa_files["squad"])


def test_qa_files_are_part_of_what_qa_runs_compute_only():
    """The QA files enter the config hash of a run with a QA task only: the RULER rows without QA (and every
    other lm_eval row) keep their hashes whatever task.qa_data says."""
    from infinigen.semantic import semantic_config

    def config(tasks, squad):
        return {"model": {"name": "m"}, "method": {"_target_": "baselines.full.Full"}, "data_dir": "/d",
                "task": {"name": "lm_eval", "tasks": tasks, "max_seq_lengths": [1024], "haystack": "wikitext2",
                         "qa_data": {"squad": squad, "hotpotqa": None}}}

    for tasks in (["copa"], ["niah_single_1"]):
        assert semantic_config(config(tasks, None)) == semantic_config(config(tasks, "dev.json"))
        assert "qa_data" not in semantic_config(config(tasks, None))["task"]
    assert semantic_config(config(["ruler_qa_squad"], "a.json")) != semantic_config(
        config(["ruler_qa_squad"], "b.json"))
