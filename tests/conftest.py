import os
import re
from functools import lru_cache
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = os.environ.get("DATA_DIR") or str(ROOT.parent / "shared" / "data")
TINY = ["tiny-opt", "tiny-llama", "tiny-llama-gqa"]
METHODS = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))


def readme_example() -> str:
    """The README's "Use it from Python" example as a user copies it: the section's first python block."""
    section = (ROOT / "README.md").read_text().split("## Use it from Python", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def method_class(name: str):
    """The class conf/method/<name>.yaml names (imported, not instantiated)."""
    from hydra.utils import get_class

    return get_class(OmegaConf.load(ROOT / "conf" / "method" / f"{name}.yaml")._target_)


def variants(name: str) -> list[dict]:
    """The settings every method-wide test checks a method under: {} (its conf/method defaults) and the
    `test_variants` its class declares (eviction on, other bits, ...). A reference preset (conf/method/*_reference:
    another conf of a class whose variants its own conf runs) adds only the first."""
    declared = method_class(name).test_variants
    return [{}, *(declared[:1] if name.endswith("_reference") else declared)]


# under pytest-xdist (`make test` runs one worker per core) each worker computes on one thread: two workers
# with two threads each would oversubscribe the cores
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, torch.get_num_threads()))


def model_cfg(name: str, **overrides):
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    return OmegaConf.merge(cfg, overrides)


@lru_cache(maxsize=None)
def load_model(name: str, dtype: str | None = None):
    from infinigen import adapter

    return adapter.load(model_cfg(name, **({"dtype": dtype} if dtype else {})))


def method_from_conf(name: str, **overrides):
    from hydra.utils import instantiate

    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "method" / f"{name}.yaml"), overrides)
    root = OmegaConf.create({"data_dir": DATA_DIR, "method": cfg})  # resolves ${data_dir} as run.py would
    return instantiate(root.method)


def random_ids(n: int, vocab: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def text_ids(tokenizer, n: int) -> torch.Tensor:
    from infinigen.corpora import corpus_text

    text = corpus_text("wikitext2", DATA_DIR)[:20000]
    return tokenizer(text, return_tensors="pt").input_ids[:, :n]


def sample_ids(name: str, n: int) -> torch.Tensor:
    """Real text for smollm2, random ids for the tiny random-init models."""
    model, tok = load_model(name)
    return text_ids(tok, n) if tok is not None else random_ids(n, model.config.vocab_size)


@pytest.fixture
def data_dir():
    if not Path(DATA_DIR, "wikitext-2").is_dir():
        pytest.skip(f"evaluation data not found at {DATA_DIR} (set DATA_DIR)")
    return DATA_DIR


class ModelLoaded(AssertionError):
    """adapter.load was called where the input should have been refused (or validated) without the model."""


def refuse_model_load(monkeypatch) -> None:
    """Replace adapter.load by a function that fails the test with ModelLoaded."""
    from infinigen import adapter

    def refuse(*args, **kwargs):
        raise ModelLoaded("adapter.load was called: the input should have been refused or validated without the model")

    monkeypatch.setattr(adapter, "load", refuse)
