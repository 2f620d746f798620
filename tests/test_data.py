"""Users' own data: a text file or hub column as a perplexity / calibration corpus, a directory of lm-eval task
YAMLs (task.include_path), the checks that run before any model loads, and the data identity in the config hash
and in every row.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import DATA_DIR, ROOT, load_model, method_from_conf
from experiments import ppl, runner
from experiments.cli_errors import UserError
from experiments.identity import config_hash, data_identity
from experiments.validation import validate
from infinigen import corpora as data
from infinigen import adapter

SEQ_LEN = 64
needs_data = pytest.mark.skipif(not (Path(DATA_DIR) / "wikitext-2").is_dir(),
                                reason=f"evaluation data not found at {DATA_DIR} (set DATA_DIR)")


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield


def cfg_of(overrides: list[str], tmp_path: Path, data_dir: str | Path | None = DATA_DIR):
    """run.py's config for tiny-llama; ppl (the default task) over two windows of SEQ_LEN."""
    task = [] if any(o.startswith("task=") for o in overrides) else [f"task.seq_len={SEQ_LEN}", "task.max_windows=2"]
    return compose("config", overrides=["model=tiny-llama", f"results_dir={tmp_path / 'results'}",
                                        f"data_dir={data_dir if data_dir else 'null'}", *task, *overrides])


def ppl_task(dataset: str, **overrides):
    return OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "task" / "ppl.yaml"),
                           {"dataset": dataset, "seq_len": SEQ_LEN, "max_windows": 2, **overrides})


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("adapter.load was called: this input must fail before the model loads")

    monkeypatch.setattr(adapter, "load", refuse)


# ----------------------------------------------------------------------------------------------- perplexity


@needs_data
@pytest.mark.parametrize("name", ["wikitext2", "ptb", "pg19"])
def test_file_corpus_scores_like_the_named_corpus(name, tmp_path):
    """The named corpus's text written to a file and read back as file:PATH: the same windows, the same ppl."""
    model, _ = load_model("tiny-llama")
    path = write(tmp_path / "corpus.txt", data.corpus_text(name, DATA_DIR))
    named = ppl.run(model, None, method_from_conf("full"), ppl_task(name), DATA_DIR)
    mine = ppl.run(model, None, method_from_conf("full"), ppl_task(f"file:{path}"), None)
    assert named["windows"] == mine["windows"] == 2 and named["tokens"] == mine["tokens"] == 2 * (SEQ_LEN - 1)
    assert mine["ppl"] == named["ppl"]
    if name == "pg19":  # read verbatim: the book's own file is the same corpus
        again = ppl.run(model, None, method_from_conf("full"), ppl_task(f"file:{data.resolve(name, DATA_DIR).path}"),
                        None)
        assert again["ppl"] == named["ppl"]


def test_full_on_a_file_is_plain_transformers(tmp_path):
    """`full` through the adapter (sim mode) = a plain HF forward of the same windows (a float64 model: the two
    attention paths agree to ~1e-15; a wrong window or target shift would move the ppl by far more than 1e-6)."""
    model, _ = load_model("tiny-llama", "float64")
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * i}.\n" for i in range(40))
    path = write(tmp_path / "fox.txt", text)
    got = ppl.run(model, None, method_from_conf("full"), ppl_task(f"file:{path}"), None)
    ids = torch.tensor(list(text.encode()), dtype=torch.long) % model.config.vocab_size  # the byte "tokenizer"
    nll = []
    with torch.no_grad():
        for start in (0, SEQ_LEN):
            window = ids[start:start + SEQ_LEN][None]
            logits = model(window).logits.float()  # (1, t, vocab); fp32 logits, as sim_logits returns them
            nll.append(torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:], reduction="none"))
    want = math.exp(float(torch.cat(nll).mean()))
    assert got["tokens"] == 2 * (SEQ_LEN - 1)
    assert got["ppl"] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("content,message", [
    (b"", r"is empty"),
    (b"  \n\n \t\n", r"is empty \(7 bytes of whitespace\)"),
    (b"some text\x00\x01\x02 more", r"binary, not text: NUL byte at byte offset 9"),
    ("caf\u00e9 ".encode("latin-1") + b"x" * 100, r"not UTF-8 text: byte 0xe9 at byte offset 3"),
    (b"too short for a window", r"has 22 bytes of text, too short for one window of 64 tokens"),
])
def test_bad_corpus_files_fail_before_the_model_loads(content, message, tmp_path, no_model_load):
    path = write(tmp_path / "bad.txt", content)
    with pytest.raises(ValueError, match=message) as err:
        runner.run(cfg_of([f"task.dataset=file:{path}"], tmp_path))
    assert str(path) in str(err.value)


@pytest.mark.parametrize("dataset,error,message", [
    ("file:/no/such/corpus.txt", UserError, r"corpus file /no/such/corpus.txt .* not found"),
    ("ptb_test", UserError, r"dataset 'ptb_test' needs .*ptb/ptb.test.txt"),
    ("ptbb", ValueError, r"unknown dataset 'ptbb'; choose one of \['infinigen_prompt', 'pg19', 'ptb', 'ptb_test', 'wikitext2'\]"),
    ("hf:wikitext/test/text", ValueError, r"must read 'hf:PATH/CONFIG/SPLIT/COLUMN"),
    ("file:", ValueError, r"names no file"),
])
def test_bad_corpus_specs_fail_before_the_model_loads(dataset, error, message, tmp_path, no_model_load):
    with pytest.raises(error, match=message):
        runner.run(cfg_of([f"task.dataset={dataset}"], tmp_path, data_dir=tmp_path))


def test_a_directory_or_a_bare_path_is_refused_with_a_hint(tmp_path):
    with pytest.raises(FileNotFoundError, match="it is a directory"):
        data.check_dataset(f"file:{tmp_path}", None)
    path = write(tmp_path / "mine.txt", "text " * 50)
    with pytest.raises(ValueError, match=f"did you mean 'file:{path}'"):
        data.check_dataset(str(path), None)


def test_corpus_shorter_than_a_window_after_tokenisation_fails_before_any_forward(tmp_path, monkeypatch):
    """Within the byte bound (62 bytes + 2 >= 64) validation passes; the exact count after tokenisation refuses."""
    path = write(tmp_path / "short.txt", "x" * (SEQ_LEN - 2))
    task = ppl_task(f"file:{path}")
    ppl.validate(task, None)

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran on a corpus shorter than one window")

    from infinigen import modes

    monkeypatch.setattr(modes, "sim_hidden", no_forward)  # ppl imports it when it runs
    model, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match=r"has 62 tokens after tokenisation, fewer than 1 window\(s\) "
                                         r"\(seq_len=64, skip_windows=0\)"):
        ppl.run(model, None, method_from_conf("full"), task, None)


def test_hub_specs_parse_and_identify_without_the_network():
    corpus = data.resolve("hf:Salesforce/wikitext/wikitext-103-raw-v1/test/text@b08601e", None)
    assert corpus.hub == ("Salesforce/wikitext", "wikitext-103-raw-v1", "test", "text") and corpus.revision == "b08601e"
    assert data.resolve("hf:pg19//validation/text", None).hub == ("pg19", None, "validation", "text")
    assert data.identity("ptb", None) == {"dataset": "ptb", "hub": "ptb_text_only", "config": "penn_treebank",
                                          "split": "validation", "column": "sentence", "revision": None,
                                          "sha256": None}
    assert data.identity("ptb_test", None)["split"] == "test"


@needs_data
def test_calibration_reads_the_same_corpus_forms(tmp_path):
    """InfiniGen's calibration text: file:PATH of PG-19's book = the named pg19; the skew cache is keyed by the text's
    content (same spec, edited file: recalibrated); a bad file fails the method's check_data, which the runner calls
    before a model loads."""
    from infinigen import modes

    model, _ = load_model("tiny-llama")
    book = data.resolve("pg19", DATA_DIR).path
    named = method_from_conf("infinigen", cache_dir=str(tmp_path / "skew"))
    assert torch.equal(named._calibration_ids(model),
                       method_from_conf("infinigen", calibration=f"file:{book}")._calibration_ids(model))
    text = write(tmp_path / "calib.txt", "a calibration text of my own. " * 40)
    ids = torch.arange(32)[None]
    mine = {"calibration": f"file:{text}", "cache_dir": str(tmp_path / "skew")}
    modes.sim_logits(model, method_from_conf("infinigen", **mine), ids)
    write(text, "another calibration text, edited. " * 40)
    modes.sim_logits(model, method_from_conf("infinigen", **mine), ids)
    assert len(list((tmp_path / "skew").glob("skew-*.pt"))) == 2
    write(text, b"\xff\xfe binary")
    with pytest.raises(ValueError, match=r"not UTF-8 text: byte 0xff at byte offset 0"):
        method_from_conf("infinigen", calibration=f"file:{text}").check_data()


@needs_data
def test_the_package_ships_pg19_as_the_data_dirs_copy(tmp_path):
    """PG-19's first book ships with the package (infinigen/data/, public domain): with no data_dir it is what `pg19`
    reads, byte for byte the data_dir's copy, so InfiniGen calibrates on the same text under the same identity (its
    config hash and skew cache key) from either. A data_dir still wins; a corpus the package does not ship still
    comes from the hub."""
    shipped = data.resolve("pg19", None).path
    assert shipped == data.BUNDLED / "pg19" / "pg19_firstbook.txt" and shipped != data.resolve("pg19", DATA_DIR).path
    assert shipped.read_bytes() == data.resolve("pg19", DATA_DIR).path.read_bytes()
    assert data.without_paths(data.identity("pg19", None)) == data.without_paths(data.identity("pg19", DATA_DIR))
    text = f"file:{data.resolve('wikitext2', DATA_DIR).path}"
    hashes = {config_hash(cfg_of(["method=infinigen", f"task.dataset={text}"], tmp_path, data_dir=d))
              for d in (None, DATA_DIR)}
    assert len(hashes) == 1
    assert "public domain" in (data.BUNDLED / "README.md").read_text()
    assert data.resolve("wikitext2", None).hub is not None


# ----------------------------------------------------------------------------------------------- identity


def ptb_folder(root: Path, text: str) -> Path:
    write(root / "ptb" / "ptb.valid.txt", text)
    return root


def test_data_folders_hash_by_content(tmp_path, no_model_load):
    lines = [f" sentence number {i} with some words in it \n" for i in range(200)]
    a = ptb_folder(tmp_path / "a", "".join(lines))
    moved = ptb_folder(tmp_path / "elsewhere" / "a", "".join(lines))
    b = ptb_folder(tmp_path / "b", "".join(reversed(lines)))
    digest = {}
    for name, folder in [("a", a), ("moved", moved), ("b", b)]:
        cfg = cfg_of(["task.dataset=ptb"], tmp_path, data_dir=folder)
        validate(cfg)
        digest[name] = config_hash(cfg)
    assert digest["a"] == digest["moved"] != digest["b"]
    # the same holds for InfiniGen's calibration text, whose folder (calib_data_dir) is data_dir
    calib = {}
    for name, folder in [("a", a), ("moved", moved), ("b", b)]:
        write(folder / "pg19" / "pg19_firstbook.txt", "calibration text " * (20 if name != "b" else 21))
        calib[name] = config_hash(cfg_of(["task.dataset=file:" + str(a / "ptb" / "ptb.valid.txt"),
                                                 "method=infinigen"], tmp_path, data_dir=folder))
    assert calib["a"] == calib["moved"] != calib["b"]


def test_two_data_folders_run_twice_into_distinguishable_rows(tmp_path):
    """The same command on two data folders (same dataset name, other text): two runs, two rows that tell their data
    apart; the first folder again is a skip."""
    lines = [f" sentence number {i} with some words in it \n" for i in range(60)]
    folders = [ptb_folder(tmp_path / "a", "".join(lines)), ptb_folder(tmp_path / "b", "".join(reversed(lines)))]
    rows = [runner.run(cfg_of(["task.dataset=ptb"], tmp_path, data_dir=f)) for f in folders]
    assert all(rows) and rows[0]["config_hash"] != rows[1]["config_hash"]
    for row, folder in zip(rows, folders):
        assert row["data"]["dataset"] == "ptb" and row["data"]["path"] == str(folder / "ptb" / "ptb.valid.txt")
        assert row["data"]["sha256"] == data.file_sha256(folder / "ptb" / "ptb.valid.txt")
    assert rows[0]["metrics"]["ppl"] != rows[1]["metrics"]["ppl"]
    assert runner.run(cfg_of(["task.dataset=ptb"], tmp_path, data_dir=folders[0])) is None
    from analysis import store

    stored = store.load(tmp_path / "results")
    assert len(stored) == 2 and stored["data.sha256"].nunique() == 2


# ----------------------------------------------------------------------------------------------- lm-eval tasks

# lm-eval's own YAML for a user's COPA-style JSONL (Jinja prompts, no Python)
TASK_YAML = """\
task: my_copa
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{premise[:-1]}}}} {{{{'because' if question == 'cause' else 'therefore'}}}}"
doc_to_choice: "{{{{[' ' + choice1[0]|lower + choice1[1:], ' ' + choice2[0]|lower + choice2[1:]]}}}}"
doc_to_target: label
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""
DOCS = [
    {"premise": "The man turned on the faucet.", "choice1": "The toilet filled with water.",
     "choice2": "Water flowed from the spout.", "question": "effect", "label": 1},
    {"premise": "The girl found a bug in her cereal.", "choice1": "She poured milk in the bowl.",
     "choice2": "She lost her appetite.", "question": "effect", "label": 1},
    {"premise": "My body cast a shadow over the grass.", "choice1": "The sun was rising.",
     "choice2": "The grass was cut.", "question": "cause", "label": 0},
    {"premise": "The woman tolerated her friend's difficult behavior.", "choice1": "The woman knew her friend was "
     "going through a hard time.", "choice2": "The woman felt that her friend took advantage of her kindness.",
     "question": "cause", "label": 0},
]


def task_dir(root: Path, docs=DOCS, data_name: str | None = None) -> Path:
    jsonl = write(root / "data" / "docs.jsonl", "".join(json.dumps(d) + "\n" for d in docs))
    write(root / "tasks" / "my_copa.yaml", TASK_YAML.format(data=data_name or jsonl))
    return root / "tasks"


def lm_eval_task(include_path, **overrides):
    return OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "task" / "lm_eval.yaml"),
                           {"tasks": ["my_copa"], "include_path": str(include_path), "num_fewshot": 0, "limit": 3,
                            **overrides})


def test_include_path_task_is_scored_through_the_method(tmp_path):
    from experiments import lm_eval as le

    tasks = task_dir(tmp_path)
    model, _ = load_model("tiny-llama")
    rows = {}
    for name, method in [("full", method_from_conf("full")), ("streaming", method_from_conf("streaming", sinks=1,
                                                                                                   recent=4))]:
        (row,) = le.run(model, None, method, lm_eval_task(tasks), None)  # no data_dir: offline all the same
        rows[name] = row
        assert row["task"] == row["lm_eval_task"] == "my_copa" and row["n"] == 3 and row["n_docs"] == len(DOCS)
        assert row["acc"] in (0, 1 / 3, 2 / 3, 1) and row["requests"] == 6  # 3 docs x 2 choices
    assert rows["full"]["kv_fraction"] == 1.0 and rows["streaming"]["kv_fraction"] < 0.7  # the method saw them


@pytest.mark.parametrize("setup,tasks,message", [
    ("missing", ["my_copa"], r"include_path: .*nowhere is not a directory"),
    ("yml", ["my_copa"], r"holds no \*.yaml task config \(lm-eval reads .yaml only; found \['my_copa.yml'\]\)"),
    ("relative", ["my_copa"], r"'my_copa' .* reads the data file .*docs.jsonl, which does not exist; .*absolute"),
])
def test_bad_include_paths_fail_before_the_model_loads(setup, tasks, message, tmp_path, no_model_load):
    include = tmp_path / "nowhere"
    if setup == "yml":
        include = task_dir(tmp_path)
        (include / "my_copa.yaml").rename(include / "my_copa.yml")
    if setup == "relative":
        include = task_dir(tmp_path, data_name="docs.jsonl")  # relative: datasets reads it from the cwd
    with pytest.raises(ValueError, match=message):
        runner.run(cfg_of(["task=lm_eval", f"task.include_path={include}", f"task.tasks={tasks}"], tmp_path))


def test_misspelled_include_path_task_gets_a_did_you_mean(tmp_path, no_model_load):
    include = task_dir(tmp_path)
    write(include / "broken.yaml", "task: [unclosed\n")
    with pytest.raises(ValueError, match=r"unknown lm-eval task 'my_copaa'; close matches: \['my_copa'.*"
                                         r"include_path defines \['my_copa'\].*could not be read: .*broken.yaml"):
        runner.run(cfg_of(["task=lm_eval", f"task.include_path=[{include}]", "task.tasks=[my_copaa]"], tmp_path,
                          data_dir=None))


def test_include_path_data_is_in_the_hash_and_the_row(tmp_path, no_model_load):
    one = task_dir(tmp_path / "one")
    two = task_dir(tmp_path / "two", docs=DOCS[::-1])
    same = task_dir(tmp_path / "same")
    digests = []
    for include in (one, two, same):
        cfg = cfg_of(["task=lm_eval", f"task.include_path={include}", "task.tasks=[my_copa]"], tmp_path,
                     data_dir=None)
        identity = data_identity(cfg)
        names = sorted(Path(f["path"]).name for f in identity["files"])
        assert names == ["docs.jsonl", "my_copa.yaml"]
        digests.append(identity["sha256"])
    # same data in another folder: the YAML names another absolute path, so its bytes (and the digest) differ
    assert len(set(digests)) == 3
    # the named local tasks hash their data files under data_dir
    cfg = cfg_of(["task=lm_eval", "task.tasks=[copa]"], tmp_path)
    (entry,) = data_identity(cfg)["files"]
    assert entry["path"].endswith("copa/validation.jsonl") and entry["sha256"].startswith("fa61467c")


@needs_data
def test_include_path_task_renders_the_requests_of_the_twin_it_copies(tmp_path):
    """TASK_YAML over the shared COPA file is lm-eval's copa prompt in Jinja: one TaskManager (ours + include_path)
    builds both, and their loglikelihood requests are identical (0 and 2 shots)."""
    from experiments import lm_eval as le

    include = task_dir(tmp_path, data_name=str(Path(DATA_DIR) / "copa" / "validation.jsonl"))
    (mine, twin), tm = le.lm_eval_setup(["my_copa", "copa"], DATA_DIR, str(include))
    assert twin == "copa_local"
    tasks = tm.load([mine, twin])["tasks"]
    requests = {}
    for name in (mine, twin):
        task = tasks[name]
        for shots in (0, 2):
            task.set_config("num_fewshot", shots)
            task.set_fewshot_seed(1234)
            task.build_all_requests(limit=5)
            requests[name, shots] = [inst.arguments for inst in task.instances]
    for shots in (0, 2):
        assert len(requests[mine, shots]) == 10 and requests[mine, shots] == requests[twin, shots]
