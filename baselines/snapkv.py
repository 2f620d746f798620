"""SnapKV: prefill-time KV compression by an observation window (Li et al., "SnapKV: LLM Knows What You are
Looking for Before Generation", 2024)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from infinigen.attention import selection_logits
from infinigen.budget import check_budget, token_count
from infinigen.contract import KVMethod

POOLING = {"max": F.max_pool1d, "avg": F.avg_pool1d}


@dataclass
class SnapKV(KVMethod):
    """At the end of the prefill, the last `window` prompt queries (the observation window) vote for the prefix
    tokens to keep; decoding then runs on the compressed prompt plus every generated token (SnapKV never
    evicts generated tokens).

    Vote, per KV head: the window rows' attention probabilities (softmax over everything each row can see)
    on the prefix (the prompt before the window), summed over the window rows and over the query heads sharing
    the KV head (GQA), then pooled along positions with a 1-D `pooling` ("max" or "avg") of odd size `kernel`
    (stride 1, same length), so a voted token brings its neighbours. Kept: the window plus the top
    token_count(budget, prompt) - window prefix tokens by pooled vote (ties: the earlier position), i.e.
    `budget` is the whole compressed prompt, window included, as the paper's max_capacity_prompt (int =
    tokens, float in (0, 1] = fraction of the prompt, ceil). A budget at or below the window keeps only the
    window; a prompt that fits the budget (or the window) is not compressed.

    There must be a prompt: sim mode with dense_rows = 0 (every row decoded) has nothing to compress and is
    refused (run the perplexity task with task.dense_rows = prompt length, lm-eval with protocol=serving).
    """

    offload: ClassVar[str] = "resident"  # a compressed cache that stays on the device: nothing crosses a link
    needs_prompt: ClassVar[bool] = True  # sim mode needs dense_rows > 0: the prompt it compresses
    size_params: ClassVar[tuple[str, ...]] = ("budget", "window")
    # the default window (32) barely acts on the tests' short prompts
    test_variants: ClassVar[tuple[dict, ...]] = (
        {"window": 8, "budget": 0.5, "kernel": 3}, {"window": 8, "budget": 20, "pooling": "avg"})

    budget: int | float = 0.2
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        check_budget("budget", self.budget)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1 (observation window: last prompt queries), got {self.window!r}")
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd int >= 1 (pooling size along positions), got {self.kernel!r}")
        if self.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {sorted(POOLING)}, got {self.pooling!r}")

    # ------------------------------------------------------------------ the vote (both modes)
    def votes(self, q_window: torch.Tensor, k_prompt: torch.Tensor, scale: float) -> torch.Tensor:
        """q_window (b, h, w, d): the last w prompt rows; k_prompt (b, h_kv, n, d) -> pooled votes on the prefix,
        (b, h_kv, n - w)."""
        w, n = q_window.shape[2], k_prompt.shape[2]
        scores = selection_logits(q_window, k_prompt, scale)  # (b, hk, g, w, n), float32 at least
        rows = torch.arange(n - w, n, device=scores.device)
        causal = torch.arange(n, device=scores.device)[None, :] <= rows[:, None]  # (w, n)
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, -1)
        votes = probs[..., : n - w].sum((2, 3))  # (b, hk, n - w)
        b, hk, m = votes.shape
        pooled = POOLING[self.pooling](votes.view(b * hk, 1, m), self.kernel, stride=1, padding=self.kernel // 2)
        return pooled.view(b, hk, m)

    def prompt_kept(self, q_window: torch.Tensor, k_prompt: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Ascending indices (b, h_kv, kept) of the prompt entries kept after the prefill; None = all of them."""
        b, hk, n, _ = k_prompt.shape
        count = token_count(self.budget, n)
        if count >= n or n <= self.window:
            return None
        w = self.window
        voted = max(count - w, 0)
        pooled = self.votes(q_window[:, :, -w:], k_prompt, scale)  # (b, hk, n - w)
        top = pooled.sort(dim=-1, descending=True, stable=True).indices[..., :voted].sort(-1).values
        window = torch.arange(n - w, n, device=k_prompt.device).expand(b, hk, w)
        return torch.cat([top, window], -1)

    # ------------------------------------------------------------------ sim mode
    def sim_state(self, session, layer, q, k, v, allowed):
        """The kept prompt entries per KV head (ascending indices, (b, h_kv, kept)) and the prompt length."""
        t, n = self.sim_rows(session, q, k)
        kept = self.prompt_kept(q[:, :, :n], k[:, :, :n], layer.logit_scale)
        return None if kept is None else (kept, n)

    def sim_keep(self, session, layer, state, rows, s):
        """The kept prompt entries and everything after the prompt (causality and the dense prompt rows are the
        caller's), the same for every row: (b, h_kv, 1, s)."""
        if state is None or s <= state[1]:  # chunks never straddle dense_rows: these rows are the dense prompt
            return None
        kept, prompt = state
        b, hk, _ = kept.shape
        held = (torch.arange(s, device=kept.device) >= prompt).expand(b, hk, s).clone()
        held.scatter_(-1, kept, True)
        return held[:, :, None]

    # ------------------------------------------------------------------ decode mode
    def after_prefill(self, session, layer, store, q, mass) -> None:
        kept = self.prompt_kept(q, store.kv()[0], layer.logit_scale)
        if kept is not None:
            store.keep(kept)  # the compressed resident cache; generated tokens are appended and never evicted
