"""InfiniGen (Lee et al., "InfiniGen: Efficient Generative Inference of Large Language Models with Dynamic KV
Cache Management", OSDI'24).

While layer i-1 runs, its attention input x is pushed through layer i's *partial* query weight (skewed, only
`partial_ratio` of the columns) and scored against layer i's partial key cache. Per head the tokens within
`alpha` of the best score are counted; the mean count over heads, capped at `budget` x sequence length, is
how many tokens each KV head fetches (its top scorers). The full KV lives in a host-side pool of `capacity`
that evicts one token per step (`counter`, `lru` or `fifo`) when full.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from infinigen.corpora import check_dataset, corpus_text, identity, without_paths
from infinigen.adapter import Session, encode, tokenizer_of
from infinigen.infinigen_method.selective_attention import SelectiveAttention
from infinigen.infinigen_method.skew import Skew, calibrate

SPECULATE_FROM = ("previous", "current")
PARTIAL_SELECT = ("q", "qk")


@dataclass
class InfiniGen(SelectiveAttention):
    """Keeps the whole KV (up to `capacity`) in a pool; each decoded row attends to the tokens speculated
    important for it (at most `budget` of the sequence) plus itself. Layers below `skip_layers` are dense.

    GQA: the g query heads sharing a KV head are scored together (`gqa_reduce`, default `prob_sum`: the sum of
    their speculated softmax probabilities), and the fetch count is the mean over all query heads.
    """

    alpha: float = 4.0
    partial_ratio: float = 0.2
    skew: bool = True
    partial_select: str = "q"  # "q": top columns of |Q|; "qk": union of top columns of |Q| and |K|
    speculate_from: str = "previous"  # "current" = ablation: speculate with the layer's own input
    calibration: str = "pg19"  # a corpus spec (experiments/data.py): a name, file:PATH or hf:PATH/CONFIG/SPLIT/COLUMN
    calib_tokens: int = 2048
    calib_data_dir: str | None = None
    cache_dir: str | None = ".cache/infinigen"

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.partial_ratio <= 1:
            raise ValueError(f"partial_ratio must be in (0, 1], got {self.partial_ratio}")
        if self.partial_select not in PARTIAL_SELECT:
            raise ValueError(f"partial_select must be one of {PARTIAL_SELECT}, got {self.partial_select!r}")
        if self.speculate_from not in SPECULATE_FROM:
            raise ValueError(f"speculate_from must be one of {SPECULATE_FROM}, got {self.speculate_from!r}")
        if self.speculate_from == "previous" and self.skip_layers < 1:
            raise ValueError("skip_layers must be >= 1: layer 0 has no previous layer to speculate from")
        if self.calib_tokens < 16:
            raise ValueError(f"calib_tokens must be >= 16, got {self.calib_tokens}")
        check_dataset(self.calibration, self.calib_data_dir)
        self.skewing: Skew | None = None

    @property
    def speculation_point(self) -> str:
        """The selection for layer i is known once layer i-1's attention starts (its input is the speculation's);
        speculating from the layer's own input needs that layer's turn (a synchronous gather)."""
        return "attention_start" if self.speculate_from == "previous" else "query"

    # ------------------------------------------------------------------ calibration
    def bind(self, session: Session) -> None:
        model = session.model
        keys = ("skew", "partial_ratio", "partial_select", "calibration", "calib_tokens")
        settings = {k: asdict(self)[k] for k in keys}
        # the calibration text's content (not its folder) keys the skew cache: other text, other rotations
        settings["calibration_data"] = without_paths(identity(self.calibration, self.calib_data_dir))
        settings = json.dumps(settings, sort_keys=True)
        self.skewing = calibrate(
            model, lambda: self._calibration_ids(model), skew=self.skew, partial_ratio=self.partial_ratio,
            partial_select=self.partial_select, cache_dir=self.cache_dir, settings=settings,
        )

    def _calibration_ids(self, model) -> torch.Tensor:
        ids = encode(tokenizer_of(model), corpus_text(self.calibration, self.calib_data_dir), model.config.vocab_size)
        limit = min(self.calib_tokens, getattr(model.config, "max_position_embeddings", self.calib_tokens))
        return ids[:limit][None].to(model.device)

    # ------------------------------------------------------------------ speculation
    def score_queries(self, session, layer, q):
        """Layer i's partial query, computed from layer i-1's attention input: (b, h_kv, g, t, r), the kept
        columns only. `q` (the true query) is deliberately unused unless speculate_from == "current"."""
        source = layer.index - 1 if self.speculate_from == "previous" else layer.index
        x = session.attn_inputs[source]  # (b, t, hidden)
        spec = layer.queries(x, session.position_embeddings)  # (b, h, t, d): rotated at the current positions
        b, h, t, d = spec.shape
        return self.skewing.compact(spec.view(b, layer.num_kv_heads, layer.groups, t, d), layer.index)

    def score_keys(self, layer, k):
        return self.skewing.compact(k, layer.index)  # (b, h_kv, s, r): the partial key cache

    def partial_columns(self) -> list[int]:
        """Columns kept per KV head, per layer (for byte accounting)."""
        return [int(c.sum(-1).max()) for c in self.skewing.columns]
