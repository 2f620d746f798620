"""The KV-method contract every method implements, in two modes.

* sim: one teacher-forced forward over a whole sequence. Per layer the method returns which KV entries each
  query row may attend (`sim_keep`, a (b, h_kv, t, s) bool mask); rows below `dense_rows` attend densely.
* decode: a real prefill (dense), then one token per step through a `KVStore` cache layer that holds exactly
  what the method keeps (`decode_attention`).

Both modes record the same statistics (`KVStats`), above all `kv_fraction`: the mean fraction of the causal
KV entries a decoded query row actually attended.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from infinigen.adapter import AttentionLayer, KVStore, Session


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scale: float,
    need_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked softmax attention without materialising repeated KV heads.

    q (b, h, t, d); k, v (b, h_kv, s, d); keep (b|1, h_kv|1, t, s) bool or None (= every entry).
    Returns out (b, h, t, d) and, if need_probs, probs (b, h_kv, g, t, s) in float32.
    """
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    g = h // hk
    # Exactly transformers' eager attention (KV heads repeated, then one batched matmul; no fused kernel), so
    # `full` reproduces the model's own logits to 1e-5 in fp32 over 30 layers.
    kr = k[:, :, None].expand(b, hk, g, s, d).reshape(b, h, s, d)
    vr = v[:, :, None].expand(b, hk, g, s, d).reshape(b, h, s, d)
    scores = torch.matmul(q, kr.transpose(2, 3)) * scale  # (b, h, t, s)
    if keep is not None:
        mask = keep.unsqueeze(2).expand(b, keep.shape[1], g, t, s) if keep.shape[1] > 1 else keep
        scores = scores.masked_fill(~mask.reshape(b, -1, t, s) if keep.shape[1] > 1 else ~keep, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(v.dtype), vr)  # (b, h, t, d)
    probs = probs.view(b, hk, g, t, s)
    return out.view(b, h, t, d), (probs if need_probs else None)


def logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention logits q·k·scale, (b, h_kv, g, t, s)."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    return torch.matmul(q.view(b, hk, h // hk, t, d), k.unsqueeze(2).transpose(-1, -2)) * scale


@dataclass
class KVStats:
    """Per-layer running means of named per-row quantities (kv_fraction, recall, selected, ...)."""

    sums: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    counts: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, layer: int, name: str, values: torch.Tensor) -> None:
        self.sums[name][layer] += float(values.double().sum())
        self.counts[name][layer] += values.numel()

    def per_layer(self, name: str) -> dict[int, float]:
        return {i: self.sums[name][i] / self.counts[name][i] for i in sorted(self.sums[name]) if self.counts[name][i]}

    def mean(self, name: str) -> float:
        n = sum(self.counts[name].values())
        return sum(self.sums[name].values()) / n if n else float("nan")

    def summary(self) -> dict:
        out = {name: self.mean(name) for name in self.sums}
        if "kv_fraction" in out:
            density = min(max(out["kv_fraction"], 0.0), 1.0)
            out["retain_ratio"] = (1 - math.sqrt(1 - density)) * 100  # the paper's x-axis (InfiniGen Fig. 11)
        out["per_layer"] = {name: self.per_layer(name) for name in self.sums}
        return out


def check_field_types(method) -> None:
    """Each hyperparameter (dataclass field) against its annotation, so `method.budget=abc` is refused by name
    before a method's own range checks compare it with numbers. float accepts int (the numeric tower); bool is
    never a number; annotations other than int/float/str/bool/None are left to the method."""
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    hints = typing.get_type_hints(type(method))
    for f in dataclasses.fields(method):
        kinds = typing.get_args(hints[f.name]) if isinstance(hints[f.name], types.UnionType) else (hints[f.name],)
        if not f.init or not all(k in names for k in kinds):
            continue
        value = getattr(method, f.name)
        accepted = set(kinds) | ({int} if float in kinds else set())
        if not any(type(value) is k for k in accepted):
            allowed = " or ".join(dict.fromkeys(names[k] for k in kinds if not (k is int and float in kinds)))
            raise ValueError(f"method.{f.name} must be {allowed}, got {value!r}")


@dataclass
class KVMethod:
    """Dense attention over every cached entry: the reference every method is compared with."""

    def __post_init__(self):
        check_field_types(self)
        self.stats = KVStats()

    # ------------------------------------------------------------------ life cycle
    def bind(self, session: Session) -> None:
        """Called when installed into a model (e.g. to calibrate on its weights)."""

    def reset_stats(self) -> None:
        self.stats = KVStats()

    def new_store(self, layer: AttentionLayer) -> KVStore:
        return KVStore()

    def store_bytes(self, stores: list[KVStore]) -> int:
        """Bytes the decode-mode cache holds for its KV."""
        return sum(s.nbytes() for s in stores)

    # ------------------------------------------------------------------ sim mode (and decode prefill)
    def sim_keep(self, session: Session, layer: AttentionLayer, q, k, allowed) -> torch.Tensor | None:
        """(b, h_kv, t, s) bool: which entries each row may attend (combined with causality by the caller);
        None = all of them."""
        return None

    def forward_attention(self, session: Session, layer: AttentionLayer, q, k, v, allowed) -> torch.Tensor:
        """A multi-token forward: the whole sequence in sim mode, the dense prefill in decode mode."""
        if session.mode == "decode":
            out, probs = attend(q, k, v, allowed, layer.logit_scale, need_probs=self.needs_prefill_probs)
            self.after_prefill(session, layer, session.cache.layers[layer.index], q, probs)
            return out
        keep = self.sim_keep(session, layer, q, k, allowed)
        keep = allowed if keep is None else allowed & (keep | dense_row_mask(q.shape[2], k.shape[2], session.dense_rows, q.device))
        out, _ = attend(q, k, v, keep, layer.logit_scale)
        self.record_sim(session, layer, keep, allowed)
        return out

    needs_prefill_probs = False  # set True if after_prefill reads the prefill attention probabilities

    def after_prefill(self, session: Session, layer: AttentionLayer, store: KVStore, q, probs) -> None:
        """Decode mode: called once the dense prefill has filled `store` (probs: (b, h_kv, g, t, s))."""

    def record_sim(self, session: Session, layer: AttentionLayer, keep, allowed, dense_rows: int | None = None) -> None:
        rows = slice(session.dense_rows if dense_rows is None else dense_rows, None)
        attended = keep[:, :, rows].sum(-1).float()  # (b, h_kv|1, rows)
        causal = allowed[:, :, rows].sum(-1).float()
        batch = session.attn_inputs[layer.index].shape[0]  # keep/allowed may be broadcast over the batch
        attended = attended.expand(batch, layer.num_kv_heads if keep.shape[1] == 1 else keep.shape[1], -1)
        self.stats.add(layer.index, "kv_fraction", attended / causal.clamp(min=1))

    # ------------------------------------------------------------------ decode mode
    def decode_attention(self, session: Session, layer: AttentionLayer, q, store: KVStore) -> torch.Tensor:
        """One decoded token: q (b, h, 1, d); `store` already holds this token's KV."""
        out, _ = attend(q, store.keys, store.values, None, layer.logit_scale)
        self.record_decode(layer, store, store.stored)
        return out

    def record_decode(self, layer: AttentionLayer, store: KVStore, attended) -> None:
        b = store.keys.shape[0]
        attended = torch.as_tensor(attended, dtype=torch.float32).expand(b, layer.num_kv_heads)
        self.stats.add(layer.index, "kv_fraction", attended / store.seen)


def dense_row_mask(t: int, s: int, dense_rows: int, device) -> torch.Tensor:
    """(1, 1, t, 1) True for query rows that attend densely (the prefill part of a sim-mode sequence)."""
    rows = torch.arange(s - t, s, device=device)
    return (rows < dense_rows).view(1, 1, t, 1)


def causal_keep(t: int, device) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()
