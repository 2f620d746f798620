"""Oracle top-k: the best any token selection can do at a given budget."""

from dataclasses import dataclass
from typing import ClassVar

from infinigen.shared.selective_attention import SelectiveAttention


@dataclass
class Oracle(SelectiveAttention):
    """Per decoded row and KV head, attends to the ceil(budget x t) past tokens with the highest TRUE attention
    scores of that step (query heads sharing a KV head aggregated by `gqa_reduce`), plus the row itself.

    With alpha = inf the count is the cap itself, so kv_fraction tracks `budget`; InfiniGen and H2O are read
    against it at matched kv_fraction (cf. the "ideal" selection of InfiniGen, OSDI'24, Fig. 6).
    """

    alpha: float = float("inf")

    test_variants: ClassVar[tuple[dict, ...]] = ({"capacity": 0.7, "eviction": "lru"},)

    def score_queries(self, session, layer, q):
        b, h, t, d = q.shape
        return q.view(b, layer.num_kv_heads, layer.groups, t, d)  # the true queries

    def score_keys(self, layer, k):
        return k
