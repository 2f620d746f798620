"""Text corpora (perplexity, InfiniGen's calibration, latency prompts): where a corpus comes from, the checks run
on it before any model loads, and what identifies it in the results store.

A corpus is named by one string, `task.dataset` (or `method.calibration`):

* a named corpus, read from its file under `data_dir` (with `data_dir=null`: the copy the package ships in
  infinigen/data/, else the HF hub), tokenised the way the InfiniGen artifact does (see ../shared/data/SOURCES.md):
  `wikitext2` (WikiText-2 raw, test split), `ptb` (Penn Treebank, **validation** split, as InfiniGen),
  `ptb_test` (Penn Treebank, test split: needs `ptb/ptb.test.txt`), `pg19` (PG-19's first book, the text
  InfiniGen calibrates on; public domain, shipped with the package: infinigen/data/README.md), `infinigen_prompt`
  (the InfiniGen artifact's partial-weight prompt, read verbatim: what `method.column_calibration` can name);
* `file:PATH`: a UTF-8 text file, read verbatim (newlines normalised to "\\n"; a relative PATH is taken from
  the current directory);
* `hf:PATH/CONFIG/SPLIT/COLUMN[@REVISION]`: a hub dataset's column, rows joined by a blank line ("\\n\\n", as
  InfiniGen joins WikiText-2); PATH may hold one `/` (`org/name`), CONFIG may be empty (`hf:pg19//test/text`).
  Needs the hub (online); imported only here, when such a corpus is read.

Only the standard library is imported at module level: everything here runs while a config is validated.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

FILE, HUB = "file:", "hf:"

# name -> (file under data_dir, hub (path, config, split, column) or None)
CORPORA = {
    "wikitext2": ("wikitext-2/wiki.test.raw", ("wikitext", "wikitext-2-raw-v1", "test", "text")),
    "ptb": ("ptb/ptb.valid.txt", ("ptb_text_only", "penn_treebank", "validation", "sentence")),
    "ptb_test": ("ptb/ptb.test.txt", ("ptb_text_only", "penn_treebank", "test", "sentence")),
    "pg19": ("pg19/pg19_firstbook.txt", None),
    # the InfiniGen artifact's partial-weight prompt (six COPA-style sentences, setup/gen_partial_weight.py; provenance:
    # the data folder's SOURCES.md): what its partial columns are calibrated on. Only in a data_dir
    "infinigen_prompt": ("infinigen_artifact/partial_weight_prompt.txt", None),
}
# the files a pip install ships, laid out as in a data_dir: read when no data_dir is set (a method's default text
# runs without a data folder), byte-identical to the data_dir copies, so either gives the same identity
BUNDLED = Path(__file__).resolve().parent / "data"
# tokenizers whose every token covers >= 1 UTF-8 byte give at most bytes + this many tokens (BOS, SentencePiece's
# dummy prefix): a text with fewer bytes than a window minus this cannot fill one, whatever the tokenizer
SPECIAL_TOKENS = 2


@dataclass(frozen=True)
class Corpus:
    """A resolved corpus spec: a file to read (`path`) or a hub column (`hub`), and how its rows are joined."""

    spec: str
    path: Path | None = None
    hub: tuple[str, str | None, str, str] | None = None  # (path, config, split, column)
    revision: str | None = None
    style: str = "plain"  # wikitext2 | ptb | plain (file: verbatim, hf: rows joined by "\n\n")


def _forms() -> str:
    return f"one of {sorted(CORPORA)}, '{FILE}PATH' (a UTF-8 text file) or '{HUB}PATH/CONFIG/SPLIT/COLUMN' (the hub)"


def _hub_spec(spec: str) -> Corpus:
    body, _, revision = spec[len(HUB):].partition("@")
    parts = body.split("/")
    if len(parts) not in (4, 5) or not all(p for i, p in enumerate(parts) if i != len(parts) - 3):
        raise ValueError(f"hub corpus {spec!r} must read '{HUB}PATH/CONFIG/SPLIT/COLUMN[@REVISION]' (PATH may be "
                         "org/name, CONFIG may be empty)")
    path, config, split, column = "/".join(parts[:-3]), parts[-3] or None, parts[-2], parts[-1]
    return Corpus(spec, hub=(path, config, split, column), revision=revision or None)


def resolve(spec: str, data_dir: str | None) -> Corpus:
    """Parse a corpus spec; a file that should exist but does not raises FileNotFoundError. A named corpus is read
    from data_dir when one is set; without one, from the package's own copy where it ships one (BUNDLED: pg19), else
    from the hub."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"dataset must be {_forms()}; got {spec!r}")
    if spec.startswith(HUB):
        return _hub_spec(spec)
    if spec.startswith(FILE):
        path = Path(spec[len(FILE):]).expanduser()
        if not spec[len(FILE):].strip():
            raise ValueError(f"corpus {spec!r} names no file: write '{FILE}/path/to/text.txt'")
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path.resolve()} (dataset {spec!r}) not found"
                                    + (" (it is a directory)" if path.is_dir() else ""))
        return Corpus(spec, path=path.resolve())
    if spec not in CORPORA:
        hint = f"; did you mean '{FILE}{spec}'?" if Path(spec).expanduser().is_file() else ""
        raise ValueError(f"unknown dataset {spec!r}; choose {_forms()}{hint}")
    rel, hub = CORPORA[spec]
    style = {"wikitext2": "wikitext2", "ptb": "ptb", "ptb_test": "ptb"}.get(spec, "plain")
    if data_dir:
        path = Path(data_dir).expanduser() / rel
        if not path.is_file():
            raise FileNotFoundError(f"dataset {spec!r} needs {path} (data_dir={data_dir!r}); file not found")
        return Corpus(spec, path=path.resolve(), style=style)
    if (BUNDLED / rel).is_file():
        return Corpus(spec, path=BUNDLED / rel, style=style)
    if hub is None:
        raise ValueError(f"dataset {spec!r} has no hub source: set data_dir to a folder holding {rel}")
    return Corpus(spec, hub=hub, style=style)


@lru_cache(maxsize=16)
def _read(path: Path, size: int, mtime_ns: int) -> str:
    """The text of a corpus file; size and mtime key the cache, so an edited file is re-read.
    Raises ValueError for an empty file, a NUL byte or bytes that are not UTF-8, naming the byte offset."""
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"corpus file {path} is empty" + (f" ({len(raw)} bytes of whitespace)" if raw else ""))
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ValueError(f"corpus file {path} is binary, not text: NUL byte at byte offset {nul}")
    try:
        text = raw.decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError as err:
        raise ValueError(f"corpus file {path} is not UTF-8 text: byte 0x{raw[err.start]:02x} at byte offset "
                         f"{err.start} cannot be decoded ({err.reason})") from None
    # universal newlines, as Python's text mode reads (what the named corpora were always read with)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_file(path: Path) -> str:
    stat = path.stat()
    return _read(path, stat.st_size, stat.st_mtime_ns)


def _hub_rows(corpus: Corpus) -> list[str]:
    import datasets

    path, config, split, column = corpus.hub
    rows = datasets.load_dataset(path, config, split=split, revision=corpus.revision)
    if column not in rows.column_names:
        raise ValueError(f"hub corpus {corpus.spec!r}: split {split!r} has no column {column!r}; "
                         f"columns: {rows.column_names}")
    return list(rows[column])


def _rows(corpus: Corpus) -> list[str]:
    if corpus.path is None:
        return _hub_rows(corpus)
    lines = read_file(corpus.path).splitlines(keepends=True)
    if corpus.style == "wikitext2":
        # HF rows: blank lines (a single space in the raw file) are "", others keep their "\n"
        return ["" if line.strip() == "" else line for line in lines]
    return lines


def _text(corpus: Corpus) -> str:
    if corpus.style == "plain" and corpus.path is not None:
        return read_file(corpus.path)  # verbatim
    rows = _rows(corpus)
    if corpus.style == "ptb":
        return "\n\n".join(row.strip() for row in rows)
    return "\n\n".join(rows)  # wikitext2 (its HF rows) and any hub column


def corpus_text(spec: str, data_dir: str | None) -> str:
    return _text(resolve(spec, data_dir))


def check_dataset(spec: str, data_dir: str | None, min_tokens: int | None = None) -> Corpus:
    """Everything checkable without a model or a tokenizer: the spec parses, a file exists and is non-empty UTF-8
    text, and (min_tokens) it has enough bytes to fill one window (the exact token count is checked right after
    tokenisation, before any forward). A hub corpus is only parsed: reading it needs the network."""
    corpus = resolve(spec, data_dir)
    if corpus.path is None:
        return corpus
    read_file(corpus.path)
    if min_tokens is not None:
        n_bytes = len(_text(corpus).encode("utf-8"))
        if n_bytes + SPECIAL_TOKENS < min_tokens:
            raise ValueError(f"corpus {spec!r} ({corpus.path}) has {n_bytes} bytes of text, too short for one "
                             f"window of {min_tokens} tokens (a token covers at least one byte)")
    return corpus


def identity(spec: str, data_dir: str | None) -> dict:
    """What identifies a corpus in a row: the file read and its sha256, or the hub column and revision."""
    corpus = resolve(spec, data_dir)
    if corpus.path is not None:
        return {"dataset": spec, "path": str(corpus.path), "sha256": file_sha256(corpus.path)}
    path, config, split, column = corpus.hub
    return {"dataset": spec, "hub": path, "config": config, "split": split, "column": column,
            "revision": corpus.revision, "sha256": None}


def without_paths(value):
    """A data identity with every file location dropped: moving the same data elsewhere keeps the config hash."""
    if isinstance(value, dict):
        return {k: without_paths(v) for k, v in value.items() if k != "path"}
    if isinstance(value, list):
        return [without_paths(v) for v in value]
    return value


@lru_cache(maxsize=256)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 of any file's bytes (cached while its size and mtime stay the same)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _sha256(path, stat.st_size, stat.st_mtime_ns)
