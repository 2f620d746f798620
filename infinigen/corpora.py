"""Perplexity corpora, tokenised the way the InfiniGen artifact does (see ../shared/data/SOURCES.md)."""

from __future__ import annotations

from pathlib import Path

# dataset -> (file under data_dir, hub (path, name, split, column))
CORPORA = {
    "wikitext2": ("wikitext-2/wiki.test.raw", ("wikitext", "wikitext-2-raw-v1", "test", "text")),
    "ptb": ("ptb/ptb.valid.txt", ("ptb_text_only", "penn_treebank", "validation", "sentence")),
    "pg19": ("pg19/pg19_firstbook.txt", None),
}


def check_dataset(name: str, data_dir: str | None) -> None:
    if name not in CORPORA:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(CORPORA)}")
    rel, hub = CORPORA[name]
    if data_dir:
        path = Path(data_dir) / rel
        if not path.is_file():
            raise FileNotFoundError(f"dataset {name!r} needs {path} (data_dir={data_dir!r}); file not found")
    elif hub is None:
        raise ValueError(f"dataset {name!r} has no hub source: set data_dir to a folder holding {rel}")


def _rows(name: str, data_dir: str | None) -> list[str]:
    rel, hub = CORPORA[name]
    if data_dir:
        lines = (Path(data_dir) / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        if name == "wikitext2":
            # HF rows: blank lines (a single space in the raw file) are "", others keep their "\n"
            return ["" if line.strip() == "" else line for line in lines]
        return lines
    import datasets

    path, config, split, column = hub
    return list(datasets.load_dataset(path, config, split=split)[column])


def corpus_text(name: str, data_dir: str | None) -> str:
    rows = _rows(name, data_dir)
    if name == "wikitext2":
        return "\n\n".join(rows)
    if name == "ptb":
        return "\n\n".join(row.strip() for row in rows)
    return "".join(rows)
