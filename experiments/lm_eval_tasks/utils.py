"""Document helpers for the offline lm-eval tasks in this folder.

The prompt / target / result functions are lm-eval's own (imported, not copied), so the local tasks render
exactly what the built-in ``copa`` / ``winogrande`` / ``wikitext`` tasks render. The rest only turns the
local files into the HF schema that the built-in task configs expect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

# lm-eval 0.4.13 built-in prompt functions, re-exported for the YAMLs (`!function utils.<name>`).
from lm_eval.tasks.super_glue.copa.utils import (  # noqa: F401
    doc_to_choice as copa_doc_to_choice,
    doc_to_target as copa_doc_to_target,
    doc_to_text as copa_doc_to_text,
)
from lm_eval.tasks.wikitext.preprocess_wikitext import (  # noqa: F401
    process_results as wikitext_process_results,
    wikitext_detokenizer,
)
from lm_eval.tasks.winogrande.preprocess_winogrande import (  # noqa: F401
    doc_to_choice as winogrande_doc_to_choice,
    doc_to_target as winogrande_doc_to_target,
    doc_to_text as winogrande_doc_to_text,
)


def openbookqa_doc_to_hf(doc: dict[str, Any]) -> dict[str, Any]:
    """One original AllenAI OpenBookQA record -> the HF ``allenai/openbookqa`` ``main`` schema.

    Original: {"id", "question": {"stem", "choices": [{"text", "label"}, ...]}, "answerKey"}
    HF:       {"id", "question_stem", "choices": {"text": [...], "label": [...]}, "answerKey"}
    """
    question = doc["question"]
    return {
        "id": doc["id"],
        "question_stem": question["stem"],
        "choices": {
            "text": [c["text"] for c in question["choices"]],
            "label": [c["label"] for c in question["choices"]],
        },
        "answerKey": doc["answerKey"],
    }


def openbookqa_process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """process_docs for openbookqa_local: flatten the original jsonl into the HF schema.

    In memory and never from the datasets cache: that cache is keyed on the function's name, not its
    code, so an edit here would otherwise be silently ignored.
    """
    return dataset.map(
        openbookqa_doc_to_hf,
        remove_columns=dataset.column_names,
        keep_in_memory=True,
        load_from_cache_file=False,
    )


def read_piqa_labels(labels_file: str | Path) -> list[int]:
    """PIQA ``*-labels.lst``: one integer label (0 -> sol1, 1 -> sol2) per line."""
    return [int(line) for line in Path(labels_file).read_text().split()]


def load_piqa(
    data_files: dict[str, str] | None = None,
    labels_file: str | None = None,
    **_metadata: Any,
) -> datasets.DatasetDict:
    """custom_dataset for piqa_local: official PIQA jsonl + labels file -> HF ``piqa`` schema.

    lm-eval calls this as ``custom_dataset(**metadata, **dataset_kwargs)``; the task's metadata
    (version, config_source, ...) lands in ``_metadata`` and is ignored.
    """
    if not data_files or labels_file is None:
        raise ValueError("piqa_local needs dataset_kwargs.data_files and dataset_kwargs.labels_file")
    if len(data_files) != 1:
        raise ValueError(f"piqa_local expects exactly one data split, got {sorted(data_files)}")
    (split, path), = data_files.items()
    ds = datasets.load_dataset("json", data_files={split: path})[split]
    labels = read_piqa_labels(labels_file)
    if len(labels) != len(ds):
        raise ValueError(
            f"piqa_local: {labels_file} has {len(labels)} labels but {path} has {len(ds)} questions"
        )
    return datasets.DatasetDict({split: ds.add_column("label", labels)})


def is_article_heading(line: str) -> bool:
    """A level-1 WikiText heading (`` = Title = ``), where a new article starts; ``= = Section = =`` and
    deeper headings are not."""
    stripped = line.replace("= = =", "===").replace("= =", "==").strip()
    return stripped.startswith("= ") and stripped.endswith(" =")


def wikitext_pages(text: str) -> list[str]:
    """A raw WikiText file -> its articles, split as HF ``EleutherAI/wikitext_document_level`` does: a page
    starts at each level-1 heading line and is its raw lines joined by newlines, so the pages joined by
    newlines give back the file; blank-only pages (the file's leading blank line) are dropped."""
    pages: list[str] = []
    lines: list[str] = []
    for line in text.split("\n"):
        if is_article_heading(line) and lines:
            pages.append("\n".join(lines))
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return [page for page in pages if page.strip()]


def load_wikitext(data_files: dict[str, str] | None = None, **_metadata: Any) -> datasets.DatasetDict:
    """custom_dataset for wikitext_local: raw WikiText file(s) -> the HF ``EleutherAI/wikitext_document_level``
    schema, one {"page": str} document per article. Kept in memory (nothing in the datasets cache)."""
    if not data_files:
        raise ValueError("wikitext_local needs dataset_kwargs.data_files ({split: path to wiki.*.raw})")
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict({"page": wikitext_pages(Path(path).read_text(encoding="utf-8"))})
        for split, path in data_files.items()
    })


def boolq_process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """process_docs for boolq_local: super_glue's ``label`` (0 no, 1 yes) from the file's bool ``answer``.

    In memory and never from the datasets cache (openbookqa_process_docs says why).
    """
    return dataset.map(lambda doc: {"label": int(doc["answer"])}, keep_in_memory=True, load_from_cache_file=False)
