"""ShadowKV: a low-rank key cache on the device, values on the host (Sun et al., "ShadowKV: KV Cache in Shadows
for High-Throughput Long-Context LLM Inference", 2024; reference code: bytedance/ShadowKV)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from infinigen.attention import attend, selection_logits, widen
from infinigen.budget import budget_at, check_budget
from infinigen.contract import GatheringMethod
from infinigen.rows import full_past
from infinigen.shared.ranking import NEG, gather_seq, record_recall, stable_top


class ValuesCodec:
    """A host row is the entry's value only, (..., d): keys never cross, ShadowKV rebuilds them on the device.
    decode gives (None, values)."""

    def __init__(self, head_dim: int, dtype):
        self.width, self.dtype = head_dim, dtype

    def encode(self, k, v):
        return v

    def decode(self, rows):
        return None, rows


def packed(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep (b, h_kv, past) -> the kept entries' indices per head, kept first in position order, (b, h_kv, k), and
    which of them are real, (b, h_kv, k) (k = the most any head keeps): the order the offloading runtime's
    gathered rows arrive in (infinigen/offload/executors.py GatherExecutor.gather)."""
    n = keep.sum(-1)
    k = int(n.max()) if n.numel() else 0
    order = torch.argsort(keep.to(torch.uint8), dim=-1, descending=True, stable=True)[..., :k]
    return order, torch.arange(k, device=keep.device) < n[..., None]


def rope_at(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (b, h_kv, n, d) rotated to the positions `index` (b, h_kv, n) of the tables cos/sin (b, P, d)."""
    b, hk, n, d = x.shape
    pick = lambda table: table[:, None].expand(b, hk, *table.shape[1:]).gather(2, index[..., None].expand(b, hk, n, d))
    rotated = layer.rope(x.reshape(b * hk, 1, n, d), (pick(cos).reshape(b * hk, n, d), pick(sin).reshape(b * hk, n, d)))
    return rotated.view(b, hk, n, d)


@dataclass
class ShadowKV(GatheringMethod):
    """At the end of the prefill, per layer: the pre-RoPE prompt keys (b, P, h_kv*d) are factored by SVD and only
    rank `rank` factors are kept (U S (b, P, r), V^T (b, r, h_kv*d)); the prompt before the local window is cut in
    chunks of `chunk` tokens, each with a landmark (the mean of its post-RoPE keys). Per KV head, the `outliers`
    chunks whose keys are least similar to their landmark (lowest min cosine) are kept exact on the device, with
    the local window (the last `local` chunks and the remainder of the prompt) and every generated token. Each
    decoded query scores the other chunks by softmax(q . landmark) per query head, max over the group sharing the
    KV head, and attends the top ceil(budget x P / chunk) of them: their keys rebuilt from the factors (+RoPE)
    on the device, their values fetched from the host: only values cross the link (`ValuesCodec`).

    Choices the harness's protocol forces (reference: bytedance/ShadowKV, ShadowKVCache):
    * the prompt is the dense prefill (sim mode: rows < dense_rows), so sim mode needs dense_rows > 0;
    * `budget` is a fraction of the prompt (the paper's sparse budget, 1.56% at 128K, in chunks, rounded up), or
      `budget_tokens` a token count (the reference's sparse_budget, 2048), at most the prompt;
    * the landmark softmax divides q . landmark by sqrt(d), the model's own attention scale (`logit_scale`), where
      the reference divides by sqrt(128) whatever the head size (Llama-3-8B's d is 128: the two agree there). With
      SmolLM2's d = 64 the scores here are sqrt(2) sharper. Within one query head the softmax is monotone, so the
      temperature changes no head's ranking of the chunks; it changes only the max over the query heads sharing a
      KV head (a sharper softmax lets the head with the most peaked scores decide more of the group's chunks);
    * the pre-RoPE keys are the post-RoPE keys rotated back (the adapter's `rope` with -sin): the adapter exposes
      keys as the attention sees them, and this keeps it unchanged;
    * every decoded row attends itself (harness-wide), which ShadowKV also does (its generated tokens stay exact);
    * the singular values are kept with U (the reference keeps U and S V^T): the same product, but each factor
      then stays within the keys' own range, which S V^T exceeds in fp16 on long prompts with outlier channels.
    """

    needs_prompt: ClassVar[bool] = True
    size_params: ClassVar[tuple[str, ...]] = ("budget", "budget_tokens", "rank")
    speculation_point: ClassVar[str] = "query"  # chunks are scored with the layer's own query
    # the 4 local + 2 outlier chunks cover a 48-token test prompt: shrink them so chunks get selected and rebuilt
    test_variants: ClassVar[tuple[dict, ...]] = ({"local": 1, "outliers": 1, "budget": 0.25},
                                                 {"chunk": 4, "rank": 8, "local": 2, "outliers": 0},
                                                 {"local": 1, "budget": None, "budget_tokens": 12})

    budget: float | None = 0.05
    budget_tokens: int | None = None
    chunk: int = 8
    rank: int = 32
    outliers: int = 1
    local: int = 4
    track_recall: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_budget("budget", self.budget, tokens=self.budget_tokens, of="prompt")
        for name, low in (("chunk", 1), ("rank", 1), ("outliers", 0), ("local", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"method.{name} must be an integer >= {low}, got {getattr(self, name)!r}")

    def check_shape(self, num_kv_heads: int, head_dim: int) -> None:
        if self.rank > num_kv_heads * head_dim:
            raise ValueError(f"method.rank={self.rank} exceeds head_dim x KV heads = {head_dim} x {num_kv_heads} = "
                             f"{num_kv_heads * head_dim}, the width of the key matrix it factors")

    def bind(self, session) -> None:
        layer = session.layers[0]
        self.check_shape(layer.num_kv_heads, layer.head_dim)

    def codec(self, layer, dtype) -> ValuesCodec:
        return ValuesCodec(layer.head_dim, dtype)

    def max_selected(self, max_len: int) -> int:
        return min(max_len, math.ceil(self.sparse_tokens(max_len) / self.chunk - 1e-9) * self.chunk)

    def sparse_tokens(self, prompt: int) -> float:
        """The sparse budget over a prompt of `prompt` tokens, before it is rounded up to whole chunks."""
        return budget_at(self.budget, self.budget_tokens, prompt)

    # ------------------------------------------------------------------ the prefill's analysis (both modes)
    def layout(self, prompt: int) -> tuple[int, int, int]:
        """(context chunks, outlier chunks, selected chunks) of a prompt of `prompt` tokens."""
        chunks = max(prompt // self.chunk - self.local, 0)
        outliers = min(self.outliers, chunks)
        selected = min(math.ceil(self.sparse_tokens(prompt) / self.chunk - 1e-9), chunks - outliers)
        return chunks, outliers, selected

    def analyse(self, layer, k: torch.Tensor, cos, sin) -> dict:
        """k (b, h_kv, P, d): the prompt's post-RoPE keys -> low-rank factors, landmarks and outlier chunks."""
        b, hk, P, d = k.shape
        chunks, n_out, _ = self.layout(P)
        pre = k if cos is None else layer.rope(k, (cos, -sin))  # RoPE undone: (b, hk, P, d)
        flat = pre.transpose(1, 2).reshape(b, P, hk * d)
        u, s, vh = torch.linalg.svd(widen(flat), full_matrices=False)
        r = min(self.rank, s.shape[-1])
        # the singular values go with U (rows of U S are the keys' coordinates, as large as the keys themselves),
        # not with V^T: along an outlier channel S V^T grows with sqrt(prompt length) and overflows fp16 on long
        # prompts (300 x sqrt(65,536) = 76,800 > 65,504)
        state = {"us": (u[..., :r] * s[:, None, :r]).to(k.dtype),  # (b, P, r)
                 "vh": vh[:, :r].to(k.dtype).view(b, r, hk, d).transpose(1, 2),  # (b, hk, r, d)
                 "cos": cos, "sin": sin}
        # landmarks and the outlier test in float32 at least: a half-precision cosine squares the keys' norms
        ctx = widen(k[:, :, : chunks * self.chunk]).unflatten(2, (chunks, self.chunk))  # (b, hk, C, c, d)
        marks = ctx.mean(3)  # (b, hk, C, d)
        similarity = torch.nn.functional.cosine_similarity(marks.unsqueeze(3), ctx, dim=-1).amin(-1)  # (b, hk, C)
        outlier = torch.zeros(b, hk, chunks, dtype=torch.bool, device=k.device)
        outlier.scatter_(-1, stable_top(-similarity, n_out), True)
        state.update(marks=marks.to(k.dtype), outlier=outlier)  # stored as keys are
        return state

    def rebuilt_keys(self, layer, state, index: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys of prompt positions `index` (b, h_kv, n) from the low-rank factors."""
        us, vh = state["us"], state["vh"]
        b, hk, n = index.shape
        rows = us[:, None].expand(b, hk, *us.shape[1:]).gather(2, index[..., None].expand(b, hk, n, us.shape[-1]))
        # summed in float32 at least, then stored as keys are: sim rebuilds every position at once, decode only the
        # selected ones, and a half-precision sum would round differently in the two
        pre = torch.matmul(widen(rows), widen(vh)).to(vh.dtype)  # (b, hk, n, d)
        return pre if state["cos"] is None else rope_at(layer, pre, state["cos"], state["sin"], index)

    def chunks_kept(self, layer, state, q: torch.Tensor, prompt: int) -> torch.Tensor:
        """Which context chunks rows with queries q (b, h, r, d) attend besides the exact ones: (b, h_kv, r, C)."""
        marks, outlier = state["marks"], state["outlier"]
        _, _, n = self.layout(prompt)
        scores = selection_logits(q, marks, layer.logit_scale)  # (b, hk, g, r, C), float32 at least
        scores = scores.masked_fill(outlier[:, :, None, None], NEG)
        probs = torch.softmax(scores, -1).amax(2)  # (b, hk, r, C)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        return keep.scatter_(-1, stable_top(probs, n), True) & ~outlier[:, :, None]

    def candidates(self, state, prompt: int) -> torch.Tensor:
        """(b, h_kv, P) bool: the prompt positions whose keys are rebuilt (context chunks that are not outliers)."""
        chunks = state["outlier"].shape[-1]
        b, hk = state["outlier"].shape[:2]
        cand = torch.zeros(b, hk, prompt, dtype=torch.bool, device=state["outlier"].device)
        cand[..., : chunks * self.chunk] = (~state["outlier"]).repeat_interleave(self.chunk, -1)
        return cand

    # ------------------------------------------------------------------ sim mode
    def sim_state(self, session, layer, q, k, v, allowed):
        t, P = self.sim_rows(session, q, k)
        pe = session.position_embeddings
        cos, sin = (None, None) if pe is None else (pe[0][:, :P], pe[1][:, :P])  # OPT: no RoPE, no tables
        state = self.analyse(layer, k[:, :, :P], cos, sin)
        cand = self.candidates(state, P)
        b, hk = cand.shape[:2]
        positions = torch.arange(P, device=k.device).expand(b, hk, P)
        mixed = torch.where(cand[..., None], self.rebuilt_keys(layer, state, positions), k[:, :, :P])
        state.update(q=q, k=k, prompt=P, cand=cand, keys=torch.cat([mixed, k[:, :, P:]], 2))
        return state

    def sim_kv(self, session, layer, state, k, v, rows):
        if state is None or session.chunk[0] < state["prompt"]:
            return k, v  # the dense prompt rows see the real keys
        return state["keys"][:, :, : k.shape[2]], v

    def sim_keep(self, session, layer, state, rows, s):
        P = state["prompt"]
        first, stop = session.chunk
        if first < P:
            return None
        q = state["q"][:, :, first:stop]  # (b, h, r, d)
        chunks = self.chunks_kept(layer, state, q, P)  # (b, hk, r, C)
        b, hk, r, C = chunks.shape
        keep = torch.ones(b, hk, r, s, dtype=torch.bool, device=q.device)  # outliers, local window, generated
        keep[..., :P] = ~state["cand"][:, :, None]
        keep[..., : C * self.chunk] |= chunks.repeat_interleave(self.chunk, -1)
        if self.track_recall:
            record_recall(self.stats, layer, q, state["k"][:, :, :s], keep, rows)
        return keep

    # ------------------------------------------------------------------ decode mode
    def after_prefill(self, session, layer, store, q, mass) -> None:
        keys, values = store.kv()  # (b, hk, P, d): still on the device
        P = keys.shape[2]
        pe = session.position_embeddings
        cos, sin = (None, None) if pe is None else pe
        state = self.analyse(layer, keys, cos, sin)
        exact = ~self.candidates(state, P)  # (b, hk, P): outliers + local window, the same count per head
        index = packed(exact)[0]
        state.update(prompt=P, k=gather_seq(keys, index), v=gather_seq(values, index), exact_positions=index)
        store.state["shadowkv"] = state

    def select(self, session, layer, q, store, past, position):
        state = store.state["shadowkv"]
        P = state["prompt"]
        chunks = self.chunks_kept(layer, state, q, P)[:, :, 0]  # (b, hk, C)
        keep = torch.zeros(*chunks.shape[:2], past, dtype=torch.bool, device=chunks.device)
        keep[..., : chunks.shape[-1] * self.chunk] = chunks.repeat_interleave(self.chunk, -1)
        return keep

    def attend_selected(self, session, layer, q, store, keep):
        state = store.state["shadowkv"]
        index, valid = packed(keep)  # (b, hk, k)
        _, values, _ = store.selected(keep)  # every entry (resident) or the k gathered rows + the current one
        k = index.shape[-1]
        # the runtime gathered the kept rows first, in position order (GatheringMethod.select_indices), then its
        # other selected slots and the current token: the first k are these
        gathered = getattr(store, "gathered", None) is not None
        chosen = values[:, :, :k] if gathered else gather_seq(values, index)
        key, value = store.recent_keys(1), values[:, :, -1:]  # the current token, exact
        keys = torch.cat([self.rebuilt_keys(layer, state, index), state["k"], key], 2)
        vals = torch.cat([chosen, state["v"], value], 2)
        exact = state["k"].shape[2] + 1
        position = store.seen - 1
        start = position - full_past(layer, position)  # a local layer's window hides the exact entries before it
        if start == 0:
            mask = torch.cat([valid, valid.new_ones(*valid.shape[:2], exact)], -1)
        else:  # the exact entries: the prompt's outliers and local chunks, then every generated token, in order
            generated = torch.arange(state["prompt"], position + 1, device=valid.device).expand(*valid.shape[:2], -1)
            mask = torch.cat([valid, state["exact_positions"] >= start, generated >= start], -1)
            exact = mask[..., valid.shape[-1]:].sum(-1)
        out, _ = attend(q, keys, vals, mask[:, :, None], layer.logit_scale)
        attended = (keep.sum(-1) + exact).double()
        self.stats.add(layer.index, "kv_fraction", attended / (full_past(layer, position) + 1))
        self.record_kept(layer, attended, full_past(layer, position) + 1)
        state["k"], state["v"] = torch.cat([state["k"], key], 2), torch.cat([state["v"], value], 2)
        return out

    def store_bytes(self, stores) -> int:
        """The device's share: low-rank factors, landmarks, the exact entries (outliers, local window, generated
        tokens). Not the values of the rebuilt chunks: they live on the host (decode mode's resident store holds them
        too, as a stand-in for the host). The RoPE tables are the model's, not the cache's."""
        total = 0
        for s in stores:
            state = s.state.get("shadowkv", {})
            total += sum(state[n].numel() * state[n].element_size()
                         for n in ("us", "vh", "marks", "k", "v") if n in state)
        return total
