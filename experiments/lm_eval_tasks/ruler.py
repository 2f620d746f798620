"""RULER (Hsieh et al., 2024) offline: lm-eval 0.4.13's own RULER sample generators, fed locally.

lm-eval ships RULER (`lm_eval/tasks/ruler/`) as tasks whose `custom_dataset` synthesises samples at load time, for
the `max_seq_lengths` in the task metadata. As shipped it needs the network: the tokenizer is looked up by a hub
name, the essay haystack (Paul Graham's essays) is downloaded, QA reads SQuAD / HotpotQA from the web, nltk
downloads its Punkt sentence splitter, and 500 samples are generated per length whatever `--limit` says.

Here the same generators (`prepare_niah.generate_samples`, `vt_utils.sys_vartrack_w_noise_random`,
`cwe_utils.sys_word_pair_random`, `fwe_utils.sys_kwext`) are called by :func:`dataset`, the `custom_dataset` of
`ruler_local.yaml`, with

* the loaded model's own tokenizer (GGUF included; the byte tokenizer for the random-init test models), handed
  over as a Python object through the TaskManager's metadata (`tokenizer`);
* the essay haystack from a local text (`task.haystack`, a corpus spec as in "Your own data"; default WikiText-2
  test), split into words as lm-eval splits the essays;
* nltk's sentence splitter: a Punkt model with no trained parameters (`nltk_data/` next to this file, put first
  on `nltk.data.path`: nltk's trained English model is a download), so essay sentences split at ". " etc.;
* the QA tasks' documents and questions from local files (`task.qa_data`: SQuAD v2.0 dev and HotpotQA dev
  distractor JSON, as their authors publish them), read by :func:`read_qa` as lm-eval's `read_squad` /
  `read_hotpotqa` read the downloaded ones;
* `num_samples` per length (`task.limit`), so only the samples a run scores are generated;
* a fixed seed per (task, length): the samples of a length do not depend on the other lengths, and the first k
  samples are the same for any limit >= k.

Scoring is lm-eval's (`common_utils.postprocess_pred` + `string_match_all`, QA `string_match_part`), one metric
per length named by the length, as lm-eval's RULER reports it.

Only the standard library and infinigen.corpora (itself standard library only) are imported at module level:
`check_options` runs while a config is validated.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from infinigen.corpora import check_dataset, corpus_text, file_sha256, identity

TEMPLATE_YAML = Path(__file__).resolve().parent / "ruler_local.yaml"
NLTK_DATA = Path(__file__).resolve().parent / "nltk_data"
SEED = 42  # RULER's RANDOM_SEED
DEFAULT_SAMPLES = 500  # RULER's samples per length (task.limit=null)
MIN_LENGTH = 256  # below this a sample leaves no room for the template, the needles and the answer

# lm-eval task name -> prepare_niah.generate_samples arguments (as lm-eval's niah_utils sets them)
NIAH = {
    "niah_single_1": {"type_haystack": "repeat", "type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_single_2": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_single_3": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "uuids"},
    "niah_multikey_1": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                        "num_needle_k": 4},
    "niah_multikey_2": {"type_haystack": "needle", "type_needle_k": "words", "type_needle_v": "numbers"},
    "niah_multikey_3": {"type_haystack": "needle", "type_needle_k": "uuids", "type_needle_v": "uuids"},
    "niah_multivalue": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                        "num_needle_v": 4},
    "niah_multiquery": {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
                        "num_needle_q": 4},
}
QA = {"ruler_qa_squad": "squad", "ruler_qa_hotpot": "hotpotqa"}  # lm-eval task name -> its task.qa_data key
QA_FORMATS = {"squad": "SQuAD v2.0 dev JSON (dev-v2.0.json)",
              "hotpotqa": "HotpotQA dev distractor JSON (hotpot_dev_distractor_v1.json)"}
#: every RULER task lm-eval 0.4.13 ships -> max_gen_toks (its YAMLs' generation_kwargs)
RULER_TASKS = {**dict.fromkeys(NIAH, 128), "ruler_vt": 30, "ruler_cwe": 120, "ruler_fwe": 50,
               **dict.fromkeys(QA, 32)}
ESSAY_TASKS = tuple(name for name, spec in NIAH.items() if spec["type_haystack"] == "essay")


def ruler_names(names) -> list[str]:
    return [name for name in names if name in RULER_TASKS]


def essay_words(text: str) -> list[str]:
    """A text as the essay haystack: its words, whitespace runs collapsed (as lm-eval's get_haystack('essay'))."""
    return re.sub(r"\s+", " ", text).strip().split(" ")


def qa_path(qa_data, kind: str, data_dir: str | None) -> Path | None:
    """task.qa_data[kind] as a path: absolute, or relative to data_dir; None when not given."""
    given = (qa_data or {}).get(kind)
    if given is None:
        return None
    path = Path(str(given)).expanduser()
    return path if path.is_absolute() or not data_dir else Path(data_dir).expanduser() / path


def check_options(names: list[str], lengths, haystack: str, data_dir: str | None, qa_data=None,
                  limit: int | None = None) -> None:
    """What RULER tasks need, checked without lm-eval or a tokenizer; ValueError naming the option.

    The essay haystack must hold at least max(task.max_seq_lengths) words: every word is at least one token, so
    that is enough for any tokenizer (lm-eval's generator silently stops at the end of a shorter text and gives
    samples shorter than the length they are reported under). A QA task needs its file in task.qa_data, readable
    as its format, with at least the questions a run samples (lm-eval's generator takes the first ones)."""
    if qa_data is not None and not isinstance(qa_data, dict):
        raise ValueError(f"task.qa_data must map {sorted(QA_FORMATS)} to files, got {qa_data!r}")
    for name in (name for name in names if name in QA):
        kind = QA[name]
        path = qa_path(qa_data, kind, data_dir)
        if path is None:
            raise ValueError(f"task.qa_data.{kind}: {name} needs the {QA_FORMATS[kind]} (RULER downloads it; "
                             f"offline it is read from a local file): set task.qa_data.{kind}=PATH (absolute, or "
                             "relative to data_dir), or remove the task from task.tasks")
        try:
            qas, _ = read_qa(kind, path)
        except (OSError, ValueError) as err:
            raise ValueError(f"task.qa_data.{kind}: {err}") from err
        wanted = limit if limit is not None else DEFAULT_SAMPLES
        if len(qas) < wanted:
            raise ValueError(f"task.qa_data.{kind}: {path} has {len(qas)} answerable questions, fewer than the "
                             f"{wanted} samples per length {name} generates (task.limit={limit}); lower task.limit")
    if (not isinstance(lengths, (list, tuple)) or not lengths
            or any(not isinstance(n, int) or isinstance(n, bool) or n < MIN_LENGTH for n in lengths)):
        raise ValueError(f"task.max_seq_lengths must be a non-empty list of integers >= {MIN_LENGTH} (tokens per "
                         f"RULER sample, prompt + answer), got {lengths!r}")
    essay = [name for name in names if name in ESSAY_TASKS]
    if essay:
        try:
            corpus = check_dataset(haystack, data_dir)
        except (ValueError, OSError) as err:
            raise ValueError(f"task.haystack (the essay haystack of {essay}): {err}") from err
        words = len(essay_words(corpus_text(haystack, data_dir)))
        if words < max(lengths):
            raise ValueError(f"task.haystack {haystack!r} ({corpus.path or corpus.hub}) has {words} words, too "
                             f"short for the essay haystack of {essay} at max(task.max_seq_lengths) = "
                             f"{max(lengths)} tokens (a word is at least one token, so that many words fill any "
                             "length); give a longer text or shorter lengths")


def read_qa(kind: str, path: Path) -> tuple[list[dict], list[str]]:
    """(questions, documents) of a local QA file, as lm-eval's RULER reads the downloaded one: the documents are
    every distinct paragraph (SQuAD) or "title\\nsentences" (HotpotQA), sorted; each question keeps its answers
    ("outputs"), the indices of its gold documents ("context") and, for SQuAD, of the other paragraphs of its
    article ("more_context"), which RULER adds before random distractors. Unanswerable SQuAD questions are left
    out. ValueError when the file is not that format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found" + (" (it is a directory)" if path.is_dir() else ""))
    stat = path.stat()
    return _read_qa(kind, path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_qa(kind: str, path: Path, size: int, mtime_ns: int) -> tuple[list[dict], list[str]]:
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err}); expected the {QA_FORMATS[kind]}") from None
    try:
        questions, texts = _squad(data) if kind == "squad" else _hotpotqa(data)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path} is not the {QA_FORMATS[kind]}: missing or misshapen {err}") from None
    if not questions:
        raise ValueError(f"{path} holds no answerable question")
    docs = sorted(set(texts))
    index = {doc: i for i, doc in enumerate(docs)}
    for q in questions:
        q["context"] = [index[doc] for doc in q["context"]]
        if "more_context" in q:
            q["more_context"] = [index[doc] for doc in q["more_context"]]
    return questions, docs


def _squad(data: dict) -> tuple[list[dict], list[str]]:
    """{"data": [article: {"paragraphs": [{"context", "qas": [{"question", "answers": [{"text"}],
    "is_impossible"}]}]}]}: per answerable question, its paragraph and its article's other paragraphs (by text);
    every paragraph is a document, answerable or not."""
    questions, texts = [], []
    for article in data["data"]:
        paragraphs = [p["context"] for p in article["paragraphs"]]
        texts += paragraphs
        for p in article["paragraphs"]:
            others = [c for c in paragraphs if c != p["context"]]
            questions += [{"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                           "context": [p["context"]], "more_context": others}
                          for qa in p["qas"] if not qa["is_impossible"]]
    return questions, texts


def _hotpotqa(data: list) -> tuple[list[dict], list[str]]:
    """[{"question", "answer", "context": [[title, [sentence, ...]], ...]}]: every listed paragraph is gold."""
    if not isinstance(data, list):
        raise TypeError("top level: a list of questions")
    questions, texts = [], []
    for item in data:
        paragraphs = [f"{title}\n{''.join(sentences)}" for title, sentences in item["context"]]
        texts += paragraphs
        questions.append({"query": item["question"], "outputs": [item["answer"]], "context": paragraphs})
    return questions, texts


def haystack_identity(names: list[str], haystack: str, data_dir: str | None, qa_data=None) -> dict:
    """What RULER's samples are made from, for each row's `data`: the seed, the text that replaces RULER's essay
    haystack for the essay tasks among `names` (none: every other task uses RULER's built-in haystacks), and the
    QA files of the QA tasks among them."""
    essay = [name for name in names if name in ESSAY_TASKS]
    out = {"seed": SEED, "essay_tasks": essay}
    if essay:
        out |= {"essay_haystack": identity(haystack, data_dir),
                "replaces": "Paul Graham essays (RULER's essay haystack, a download)",
                "sentence_splitter": "nltk Punkt, untrained parameters (experiments/lm_eval_tasks/nltk_data)"}
    paths = {QA[name]: qa_path(qa_data, QA[name], data_dir).resolve() for name in names if name in QA}
    if paths:
        out["qa"] = {kind: {"format": QA_FORMATS[kind], "path": str(path), "sha256": file_sha256(path)}
                     for kind, path in sorted(paths.items())}
    return out


# ----------------------------------------------------------------------------------------------- lm-eval side


def _use_local_punkt() -> None:
    import nltk

    if str(NLTK_DATA) not in nltk.data.path:
        nltk.data.path.insert(0, str(NLTK_DATA))  # before prepare_niah is imported: it downloads punkt_tab if absent


def _seed(name: str, length: int) -> None:
    import random
    import zlib

    import numpy as np

    seed = SEED + zlib.crc32(f"{name}:{length}".encode())  # RULER's generators draw from the global RNGs
    random.seed(seed)
    np.random.seed(seed % 2**32)


def shortest_texts(name: str) -> list[tuple[str, int, int | None]]:
    """(text, reserved, within) for the shortest samples lm-eval's vt, cwe and fwe generators fall back to:
    each generator shrinks a sample until it fits and loops forever (a bare `except:` retrying) when even this
    one does not fit `within` tokens (None: each of task.max_seq_lengths) with `reserved` tokens for the answer, as
    the generator counts it. vt's in-context example is generated
    at 500 tokens whatever the lengths. niah's generator gives up instead (lm-eval #2963): none."""
    import random

    import numpy as np

    if name == "ruler_fwe":
        from lm_eval.tasks.ruler.fwe_utils import TEMPLATE

        return [(TEMPLATE.format(context=""), 0, None)]  # fwe's fit loop reserves no room for the answer
    if name == "ruler_cwe":
        from lm_eval.tasks.ruler.cwe_utils import TEMPLATE

        return [(TEMPLATE.format(context="", query=""), RULER_TASKS[name], None)]
    if name != "ruler_vt":
        return []
    from lm_eval.tasks.ruler.vt_utils import generate_input_output

    state = random.getstate(), np.random.get_state()  # the chains' names and values are random, their sizes not
    try:
        icl, icl_answer = generate_input_output(5, 1, 4, is_icl=True)  # samples(): the ICL's first try, 5 noises
        text, answer = generate_input_output(10, 1, 4)  # the sample's first try: 10 noises (vt's increment)
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    return [(f"{icl} {icl_answer}", RULER_TASKS[name], 500),
            (f"{icl} {' '.join(icl_answer)}\n\n{text} {answer}", RULER_TASKS[name], None)]


def check_fits(names: list[str], lengths, count, tokenizer_name: str) -> None:
    """ValueError naming the option when a sample of a task in `names` cannot fit its length with this tokenizer
    (`count`: text -> tokens), before lm-eval's generator would loop forever on it."""
    for name in names:
        for text, reserved, within in shortest_texts(name):
            need = count(text) + reserved
            if within is not None and need > within:
                raise ValueError(
                    f"task.tasks: {name} cannot be generated with {tokenizer_name}: lm-eval builds its in-context "
                    f"example within {within} tokens and its shortest one takes {need}; its "
                    "generator would loop forever. Remove it from task.tasks or use a model with a real tokenizer")
            short = [n for n in lengths if within is None and need > n]
            if short:
                raise ValueError(
                    f"task.max_seq_lengths {short}: the shortest {name} sample takes {need} tokens with "
                    f"{tokenizer_name}, more than that length; lm-eval's generator would loop "
                    f"forever. Use lengths >= {need}")


def byte_count(text: str) -> int:
    """Tokens of `text` for the byte tokenizer of models without one (adapter.byte_tokenizer): its UTF-8 bytes."""
    return len(text.encode("utf-8"))


def samples(name: str, length: int, num_samples: int, tokenizer, haystack_text: str,
            qa: tuple[list[dict], list[str]] | None = None) -> list[dict]:
    """`num_samples` RULER samples of task `name` at `length` tokens, from lm-eval's generator for that task
    (`qa`: a QA task's (questions, documents), `read_qa`). A QA sample whose gold documents cannot fit is
    skipped by lm-eval's generator (the row's `n` says how many were scored)."""
    check_fits([name], [length], lambda text: len(tokenizer(text).input_ids), "this model's tokenizer")
    _seed(name, length)
    if name in NIAH:
        _use_local_punkt()
        from lm_eval.tasks.ruler.niah_utils import TEMPLATE
        from lm_eval.tasks.ruler.prepare_niah import generate_samples, get_haystack

        spec = NIAH[name]
        kind = spec["type_haystack"]
        haystack = essay_words(haystack_text) if kind == "essay" else get_haystack(type_haystack=kind)
        return generate_samples(haystack, TOKENIZER=tokenizer, max_seq_length=length, template=TEMPLATE,
                                num_samples=num_samples, **spec)
    if name == "ruler_vt":
        from lm_eval.tasks.ruler.vt_utils import sys_vartrack_w_noise_random

        icl = sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=500, incremental=5)[0]
        return sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=num_samples, max_seq_length=length,
                                           icl_example=icl)
    if name == "ruler_cwe":
        from lm_eval.tasks.ruler.cwe_utils import sys_word_pair_random

        return sys_word_pair_random(num_samples=num_samples, max_seq_length=length, tokenizer=tokenizer)
    if name == "ruler_fwe":
        from lm_eval.tasks.ruler.fwe_utils import sys_kwext

        return sys_kwext(tokenizer=tokenizer, max_seq_length=length, num_samples=num_samples)
    if name in QA:
        from lm_eval.tasks.ruler.qa_utils import generate_samples as qa_samples

        qas, docs = qa
        return qa_samples(tokenizer=tokenizer, docs=list(docs), qas=[dict(q) for q in qas], max_seq_length=length,
                          num_samples=num_samples, tokens_to_generate=RULER_TASKS[name])
    raise ValueError(f"no local RULER generator for {name!r}; known: {sorted(RULER_TASKS)}")


def dataset(*, ruler_task: str, max_seq_lengths, num_samples: int, tokenizer, haystack: str, data_dir=None,
            qa_file: str | None = None, **_metadata):
    """custom_dataset of ruler_local.yaml: the samples of every length, with the columns lm-eval's RULER uses and
    how each is scored (`match`: "part" for QA, lm-eval's string_match_part, "all" for the others)."""
    import datasets

    text = corpus_text(haystack, data_dir) if ruler_task in ESSAY_TASKS else ""
    qa = read_qa(QA[ruler_task], Path(qa_file)) if ruler_task in QA else None
    match = "part" if ruler_task in QA else "all"
    rows = [{**{key: row[key] for key in ("index", "input", "outputs", "length", "max_length", "gen_prefix")},
             "match": match}
            for length in max_seq_lengths for row in samples(ruler_task, int(length), num_samples, tokenizer, text, qa)]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's RULER score of one sample under its length: every expected string found in the answer
    (`string_match_all`), or for QA the share of its reference answers found in it (`string_match_part`)."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all, string_match_part

    score = string_match_part if doc.get("match") == "part" else string_match_all
    return {str(doc["max_length"]): score(postprocess_pred(results), [doc["outputs"]])}


def task_manager(name: str, lengths: list[int], num_samples: int, tokenizer, haystack: str, data_dir=None,
                 qa_data=None):
    """A TaskManager that knows one task, `name` (lm-eval's RULER task name), generated locally at `lengths`
    (a QA task from its file in `qa_data`, task.qa_data).

    Only our YAML is indexed (include_defaults=False: lm-eval's own `niah_single_1` would download). The
    tokenizer goes in the metadata as an object; lm-eval passes metadata to custom_dataset as keyword arguments."""
    import tempfile

    import yaml
    from lm_eval.tasks import TaskManager

    if name not in RULER_TASKS:
        raise ValueError(f"no local RULER task {name!r}")
    qa_file = str(qa_path(qa_data, QA[name], data_dir)) if name in QA else None
    tmp = tempfile.TemporaryDirectory(prefix="ruler_local_")
    wrapper = {
        "include": str(TEMPLATE_YAML),  # keeps `!function ruler.*` resolving to this folder
        "task": name,
        "generation_kwargs": {"do_sample": False, "temperature": 0.0, "max_gen_toks": RULER_TASKS[name],
                              "until": []},
        "metric_list": [{"metric": str(n), "aggregation": "mean", "higher_is_better": True} for n in lengths],
        "metadata": {"version": 1.0, "ruler_task": name, "max_seq_lengths": [int(n) for n in lengths],
                     "num_samples": int(num_samples), "haystack": haystack, "data_dir": data_dir,
                     "qa_file": qa_file},
    }
    (Path(tmp.name) / f"{name}.yaml").write_text(yaml.safe_dump(wrapper, sort_keys=False))
    tm = TaskManager(include_path=[tmp.name], include_defaults=False, metadata={"tokenizer": tokenizer})
    tm._ruler_tmpdir = tmp  # the wrapper lives as long as the manager
    return tm
