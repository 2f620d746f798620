"""Attention kernels every method and runtime shares: masked attention that never repeats a KV head for its query
heads (`attend`, `attend_rows`, `attend_fused`), the chunk kernel sim mode picks by the session (`sim_attend`), and the
logits a method ranks entries by, widened to `score_dtype` (`selection_logits`).

Shapes: q (b, h, t, d); k, v (b, h_kv, s, d); g = h / h_kv query heads per KV head; keep (b|1, h_kv|1, t, s) bool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infinigen.adapter import Session

def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scale: float,
    need_probs: bool = False, shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked softmax attention without materialising repeated KV heads.

    q (b, h, t, d); k, v (b, h_kv, s, d); keep (b|1, h_kv|1, t, s) bool or None (= every entry); shift
    (b|1, h_kv|1, t) added to every logit of a row before the softmax (a constant per row changes the result only by
    how the sum rounds: the InfiniGen artifact's -10000 on a row that selected nothing, `SelectiveAttention`).
    Returns out (b, h, t, d) and, if need_probs, probs (b, h_kv, g, t, s) in float32.
    """
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    g = h // hk
    # transformers' eager math (one batched matmul, scaled after, a float32 softmax; no fused kernel), so `full`
    # reproduces the model's own logits, with one difference: eager repeats every KV head for its g query heads,
    # a copy of the whole cache per layer and step (at batch 8 x 2048 tokens that copy was most of a decode
    # step). Here each KV head's g query heads are folded into its rows and the KV is read in place.
    scores = grouped_matmul(q.reshape(b, hk, g, t, d), k) * scale  # (b, hk, g, t, s)
    if shift is not None:
        scores = scores + shift[:, :, None, :, None].to(scores.dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep.unsqueeze(2), torch.finfo(scores.dtype).min)  # broadcast over g
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # (b, hk, g, t, s)
    out = torch.matmul(probs.to(v.dtype).view(b, hk, g * t, s), v)  # (b, hk, g * t, d)
    return out.view(b, h, t, d), (probs if need_probs else None)


_LOWEST: dict = {}  # (dtype, device) -> a 0-dim tensor of the dtype's minimum, made once (not an op per call)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend`'s arithmetic (the same product, scale, masked minimum, float32 softmax, product) for one decoded
    token over rows gathered per KV head, with no view it does not need: q (b, h, 1, d); keys, values
    (b, h_kv, s, d) (views of the gathered rows are fine); keep (b, h_kv, s) bool. Returns (b, h, 1, d). What an
    offloading runtime's gathering step attends (`GatheringMethod.attend_gathered`): half the ops of `attend`."""
    b, h, _, d = q.shape
    hk, s = keys.shape[1], keys.shape[2]
    scores = torch.bmm(q.view(b * hk, h // hk, d), keys.view(b * hk, s, d).transpose(1, 2)) * scale  # (b*hk, g, s)
    key = (scores.dtype, scores.device)
    if key not in _LOWEST:
        _LOWEST[key] = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
    scores = torch.where(keep.view(b * hk, 1, s), scores, _LOWEST[key])
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.bmm(probs.to(values.dtype), values.view(b * hk, s, d)).view(b, h, 1, d)


def _flash_kernel(device: torch.device):
    """torch's fused CPU kernel called directly: it returns each row's log-sum-exp beside the output (what recall
    is computed from) and takes a float mask as is (SDPA converts a bool mask per call). None off CPU."""
    if device.type != "cpu":
        return None
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scale: float, causal: bool = False,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend` through torch's fused SDPA kernel: q (b, h, t, d); k, v (b, h_kv, s, d); keep (b|1, h_kv|1, t, s)
    bool or None (every entry, or with `causal` the causal prefix of t == s rows); shift (b|1, h_kv|1, t) added to
    every kept logit of a row, as `attend`'s (needs keep). KV heads are never repeated: a per-KV-head mask is
    applied with the g query heads of each KV head folded into one batch entry.
    Returns out (b, h, t, d) and each row's log-sum-exp of its attended logits (shift included) (b, h, t), where
    the device's kernel gives it (CPU), else None."""
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    g = h // hk
    bias, fold = None, False
    if keep is not None:
        # 0 where kept, the dtype's finite minimum elsewhere (as eager's masked_fill): a row with nothing to
        # attend is then uniform over every entry, as in eager, instead of NaN
        zero, low = (torch.tensor(x, dtype=q.dtype, device=q.device) for x in (0.0, torch.finfo(q.dtype).min))
        kept = zero if shift is None else shift.to(q.dtype)[..., None]  # (b|1, h_kv|1, t, 1)
        bias = torch.where(keep, kept, low)  # one pass
        fold = bias.shape[1] > 1 and g > 1
    if fold:  # (b*hk, g, t, d) queries against (b*hk, 1, s, d): the mask broadcasts over the g heads
        q, k, v = q.reshape(b * hk, g, t, d), k.reshape(b * hk, 1, s, d), v.reshape(b * hk, 1, s, d)
        bias = bias.expand(b, hk, t, s).reshape(b * hk, 1, t, s)
    kernel = _flash_kernel(q.device)
    if kernel is not None:
        out, lse = kernel(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out.reshape(b, h, t, d), lse.reshape(b, h, t)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.reshape(b, h, t, d), None


def sim_attend(session: Session, q, k, v, keep, scale: float) -> torch.Tensor:
    """One chunk of rows attended by the session's kernel ("fused" SDPA or the "exact" eager math)."""
    if session.attention == "exact":
        return attend(q, k, v, keep, scale)[0]
    return attend_fused(q, k, v, keep, scale)[0]


def grouped_matmul(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (b, h_kv, g, t, c) dotted with k (b, h_kv, s, c) -> (b, h_kv, g, t, s). The g rows of a KV head are folded
    into one product: torch.matmul would broadcast k over g by copying it g times (the whole cache, per call)."""
    b, hk, g, t, c = q.shape
    return torch.matmul(q.reshape(b, hk, g * t, c), k.transpose(-1, -2)).view(b, hk, g, t, k.shape[-2])


def logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention logits q·k·scale, (b, h_kv, g, t, s)."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    return grouped_matmul(q.view(b, hk, h // hk, t, d), k) * scale


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a method's decisions (which entries to keep, evict, fetch) are computed in: at least float32.
    Half-precision scores carry 11 (fp16) or 8 (bf16) significant bits: entries a few per mille apart round to
    one value, so which of them is kept would depend on a kernel's rounding (sim mode's chunked product vs a
    decode step's single row) instead of on the model; float32 and float64 are kept as they are."""
    return torch.promote_types(dtype, torch.float32)


def widen(x: torch.Tensor) -> torch.Tensor:
    """x in `score_dtype` (the same tensor when it already is: float32 and float64 compute exactly as before)."""
    return x.to(score_dtype(x.dtype))


def selection_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """`logits` for ranking entries, in `score_dtype`: (b, h_kv, g, t, s). Attention itself stays in the model's
    dtype (as transformers' eager math); only what a method decides from is widened."""
    return logits(widen(q), widen(k), scale)

