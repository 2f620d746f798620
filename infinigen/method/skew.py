"""Offline skewing + partial-weight selection (InfiniGen, Lee et al. OSDI'24, Sec. 4.2).

Per layer and KV head, the SVD of the calibration queries gives an orthogonal A with (QA)(KA)^T = QK^T: the
attention is unchanged, but Q's and K's energy concentrates in a few columns, which the partial query weight
and partial key cache keep. For OPT, A is folded into W_q, W_k and their biases once; for RoPE models it
cannot be (the rotation sits between projection and attention), so A is applied to post-RoPE q and k where
speculation needs them.

GQA: the g query heads sharing a KV head share one A (SVD of their stacked queries) and one column set, so
the partial key cache is per KV head, the unit that is stored and moved.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from infinigen import adapter
from infinigen.attention import score_dtype, widen
from infinigen.contract import KVMethod
from infinigen.modes import sim_hidden


@dataclass
class Skew:
    # per layer (h_kv, d, d) orthogonal A in float32 at least (`score_dtype`); None = folded or skew off
    rotations: list[torch.Tensor | None]
    columns: list[torch.Tensor]  # per layer (h_kv, d) float 0/1: the partial columns kept in skewed space

    def partial(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x (b, h_kv, ..., d) -> skewed, partial columns only (others zeroed); same shape, in `score_dtype` (what
        selection scores are computed in). A half-precision A is no longer orthogonal (skewed scores would drift
        from q.k by ~1e-3), and a half-precision sum would round sim mode's whole-sequence product and a decode
        step's single row differently."""
        A, cols = self.rotations[layer], self.columns[layer]
        shape = (1, cols.shape[0]) + (1,) * (x.dim() - 3) + (cols.shape[1],)
        x = widen(x)
        if A is not None:
            x = torch.einsum("bh...d,hde->bh...e", x, A)
        return x * cols.view(shape).to(x.dtype)

    def __post_init__(self):
        # per layer (h_kv, r): each KV head's kept columns first (r = the most any head keeps); a head that keeps
        # fewer (partial_select=qk) pads with columns `partial` zeroes
        self.kept = []
        for cols in self.columns:
            r = int(cols.sum(-1).max())
            self.kept.append(torch.argsort(cols, dim=-1, descending=True, stable=True)[:, :r])

    def compact(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x (b, h_kv, ..., d) -> skewed, only the kept columns: (b, h_kv, ..., r) in `score_dtype`. Dot products
        between compact vectors equal those between `partial` ones; the partial key cache keeps r of d columns."""
        idx = self.kept[layer]
        shape = (1, idx.shape[0]) + (1,) * (x.dim() - 3) + (idx.shape[1],)
        return self.partial(x, layer).gather(-1, idx.view(shape).expand(*x.shape[:-1], idx.shape[1]))

    def num_columns(self, layer: int) -> torch.Tensor:
        return self.columns[layer].sum(-1)  # (h_kv,)


@torch.inference_mode()
def capture_qk(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (q (h, t, d), k (h_kv, t, d)) exactly as the attention sees them, from a dense forward."""
    captured = {}

    class Capture(KVMethod):
        def forward_attention(self, session, layer, q, k, v, allowed):
            captured[layer.index] = (q[0].float(), k[0].float())
            return super().forward_attention(session, layer, q, k, v, allowed)

    sim_hidden(model, Capture(), input_ids)  # the captures are all it needs: no LM head
    return [captured[i] for i in sorted(captured)]


def rotation(q: torch.Tensor, groups: int) -> torch.Tensor:
    """q (h, t, d) -> per KV head A (h_kv, d, d): right singular vectors of the group's stacked queries."""
    h, t, d = q.shape
    stacked = q.reshape(h // groups, groups * t, d).double()
    _, _, vh = torch.linalg.svd(stacked, full_matrices=False)  # (h_kv, d, d)
    return vh.transpose(-1, -2).float()


def top_columns(magnitude: torch.Tensor, r: int) -> torch.Tensor:
    """magnitude (h_kv, d) -> 0/1 mask of the r largest columns per KV head."""
    mask = torch.zeros_like(magnitude)
    return mask.scatter_(-1, magnitude.topk(r, dim=-1).indices, 1.0)


def fold_opt(layer: adapter.AttentionLayer, A: torch.Tensor) -> None:
    """W_q, W_k (and biases) of an OPT layer <- per-head A^T W, so projections come out skewed (MHA: h == h_kv).
    Folded in float32 at least and rounded once into the weights' dtype: A rounded to half precision first
    would no longer be orthogonal, and W_q W_k^T (the attention itself) would change, not only its rounding."""
    d = layer.head_dim
    for proj in (layer.q_proj, layer.k_proj):
        w = proj.weight.data.view(-1, d, proj.weight.shape[1])  # (h, d, in)
        w.copy_(torch.einsum("hde,hdi->hei", A.to(score_dtype(w.dtype)), widen(w)))
        if proj.bias is not None:
            b = proj.bias.data.view(-1, d)
            b.copy_(torch.einsum("hde,hd->he", A.to(score_dtype(b.dtype)), widen(b)))


def _fingerprint(model) -> str:
    weights = [layer.q_proj.weight for layer in adapter.attention_layers(model)]
    probe = torch.stack([w.double().abs().sum() for w in weights] + [w.double().sum() for w in weights])
    blob = model.config.to_json_string() + repr(probe.tolist())
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_DONE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {settings: Skew} (folds happen once)


COLUMN_COUNTS = {"round": round, "floor": int}  # partial columns per head from partial_ratio x head_dim


def calibrate(model, input_ids: Callable[[], torch.Tensor], *, skew: bool, partial_ratio: float, partial_select: str,
              cache_dir: str | None, settings: str, column_count: str = "round", column_tokens: int | None = None,
              column_ids: Callable[[], torch.Tensor] | None = None) -> Skew:
    """Skew + partial columns for every layer of `model`, cached in memory per model and on disk by weights.

    The skew comes from the calibration ids; the partial columns from the same forward, or (column_tokens) from a
    forward over their first column_tokens only, or (column_ids) from a forward over other ids, a text of their own
    (the InfiniGen artifact calibrates its skew on 2,048 tokens of PG-19 and its columns on a ~100-token prompt:
    setup/gen_llama_skewing_matrix.py, setup/gen_partial_weight.py). `settings` must key whatever they came from.
    column_count: how partial_ratio x head_dim becomes a count, "round" or "floor" (the artifact's int())."""
    per_model = _DONE.setdefault(model, {})
    if settings in per_model:
        return per_model[settings]
    layers = adapter.attention_layers(model)
    path = Path(cache_dir) / f"skew-{_fingerprint(model)}-{hashlib.sha256(settings.encode()).hexdigest()[:12]}.pt" if cache_dir else None
    if path is not None and path.exists():
        saved = torch.load(path)
        rotations, columns = saved["rotations"], saved["columns"]
    else:
        rotations, columns = [], []
        ids = input_ids()
        captured = capture_qk(model, ids)
        if column_ids is not None:
            shorter = capture_qk(model, column_ids())
        else:
            shorter = capture_qk(model, ids[:, :column_tokens]) if column_tokens else captured
        for layer, (q, k), (qc, kc) in zip(layers, captured, shorter):
            A = rotation(q, layer.groups) if skew else torch.eye(layer.head_dim).expand(layer.num_kv_heads, -1, -1)
            hk, g, d = layer.num_kv_heads, layer.groups, layer.head_dim
            qs = torch.einsum("hgtd,hde->hgte", qc.reshape(hk, g, -1, d), A)
            ks = torch.einsum("htd,hde->hte", kc, A)
            r = max(1, COLUMN_COUNTS[column_count](partial_ratio * d))
            cols = top_columns(qs.abs().sum(dim=(1, 2)), r)
            if partial_select == "qk":
                cols = torch.maximum(cols, top_columns(ks.abs().sum(dim=1), r))
            rotations.append(A.contiguous())
            columns.append(cols)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"rotations": rotations, "columns": columns}, path)
    # speculation runs on the model's device and in its dtype (fp16 on GPU, fp64 in tests), except the rotations:
    # float32 at least (`Skew.partial`)
    weight = layers[0].q_proj.weight
    folded = []
    for layer, A in zip(layers, rotations):
        if skew and layer.family == "opt":
            fold_opt(layer, A)
            folded.append(None)
        else:
            folded.append(A.to(weight.device, score_dtype(weight.dtype)) if skew else None)
    result = Skew(rotations=folded, columns=[c.to(weight.device, weight.dtype) for c in columns])
    per_model[settings] = result
    return result
