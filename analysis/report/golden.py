"""The InfiniGen artifact's side of the section "The authors' code": its golden values (tests/data/reference,
docs/reference.md) read as the artifact reports them, perplexity and kept fraction on its own axes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from omegaconf import OmegaConf

from analysis.report.compose import ROOT


def heads(model: str) -> int:
    """Query heads per layer (a multi-head model has as many KV heads): the artifact's kept entries are summed over
    them."""
    return int(OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml").arch.num_attention_heads)


def golden(reference: Path, name: str) -> dict:
    """One golden file of the reference folder (smollm2_mha_2048.json, ...)."""
    return json.loads((Path(reference) / name).read_text())


def retain(density: float) -> float:
    """The paper's "retain ratio" axis: 1 - sqrt(1 - density) (the artifact's perplexity/llama.py)."""
    return 1 - math.sqrt(1 - min(max(density, 0.0), 1.0)) if not math.isnan(density) else math.nan


def artifact(run: dict, n_heads: int, nll: list[float] | None = None) -> tuple[float, float]:
    """(perplexity, density) the artifact computed: each window scores seq_len - 1 tokens; density is its kept
    entries over the causal area of its recorded layers, every head and window (1 for full attention)."""
    t, windows = run["seq_len"], run["windows"]
    ppl = math.exp(sum(nll if nll is not None else run["window_nll"]) / (windows * (t - 1)))
    kept = run.get("kept") or {}
    if not kept:
        return ppl, 1.0
    area = len(kept) * n_heads * windows * t * (t + 1) / 2
    return ppl, sum(sum(per_window) for per_window in kept.values()) / area
