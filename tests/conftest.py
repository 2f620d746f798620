import os
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
# Extra settings a method is also checked under (e.g. eviction on); {} = its conf/method defaults.
VARIANTS = {
    "infinigen": [{}, {"capacity": 0.8}, {"speculate_from": "block_input"}, {"speculate_from": "after_attention"},
                  {"speculate_from": "current"}],
    "h2o": [{}, {"gqa_reduce": "max"}, {"heavy": 8, "recent": 8}],
    "quant": [{}, {"bits": 2}],
    "streaming": [{}, {"recent": 32}],
    # the defaults (pages of 16, 2 dense layers; window 32; residual 128) barely act on 72 tokens and 3 layers
    "quest": [{}, {"page_size": 4, "skip_layers": 0},
              {"page_size": 8, "budget": 0.4, "gqa_reduce": "sum", "skip_layers": 1}],
    "snapkv": [{}, {"window": 8, "budget": 0.5, "kernel": 3}, {"window": 8, "budget": 20, "pooling": "avg"}],
    "kivi": [{}, {"residual": 32, "group_size": 16}, {"bits": 4, "residual": 16, "group_size": 8}],
    # ShadowKV's 4 local + 2 outlier chunks cover a 48-token prompt: shrink them so chunks get selected and rebuilt
    "shadowkv": [{}, {"local": 1, "outliers": 1, "budget": 0.25}, {"chunk": 4, "rank": 8, "local": 2, "outliers": 0}],
    "rocketkv": [{}, {"budget": 0.5, "split": 0.6, "window": 8, "kernel": 3}, {"chunk": 4, "channels": 8}],
}

torch.set_num_threads(max(1, torch.get_num_threads()))


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
