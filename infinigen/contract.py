"""The KV-method contract every method implements, in two modes.

* sim: one teacher-forced forward over a whole sequence, attended in chunks of query rows so that memory stays
  O(heads x chunk x t), never O(heads x t^2). Per layer the method computes a compact state once (`sim_state`,
  e.g. H2O's last attending row per entry) and from it, per chunk, which KV entries each row may attend
  (`sim_keep`, a (b, h_kv, rows, s) bool mask); rows below `dense_rows` attend densely. The chunk is attended
  by torch's fused SDPA kernel (`attention="fused"`, the default) or by the eager math transformers' own
  eager attention uses (`attention="exact"`, what the sim == decode contract is checked with).
* decode: a real prefill (dense), then one token per step through a `KVStore` cache layer that holds exactly
  what the method keeps (`decode_attention`).

Both modes record the same statistics (`KVStats`), above all `kv_fraction`: the mean fraction of the causal
KV entries a decoded query row actually attended.

Local layers (a sliding window of W positions, Gemma 3's sliding_attention): every method keeps the model's own
semantics. A decoded row never attends a position the model's attention would not (sim: transformers' sliding mask
is the `allowed` every keep set is combined with; decode: `in_window` masks what the base decode steps attend and
what a gathering method selects), and kv_fraction counts against what full attention attends on that layer
(`full_past`: the W - 1 positions before the row, not the whole prefix).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch
import torch.nn.functional as F

from infinigen.adapter import AttentionLayer, KVStore, Session

# Query rows attended at once in sim mode and in the decode-mode prefill: a sequence is split into SIM_CHUNKS equal
# chunks of rows, each at most SIM_CHUNK rows (longer sequences: more chunks of SIM_CHUNK rows) and at least
# SIM_CHUNK / SIM_CHUNKS (shorter sequences: fewer chunks). So a chunk holds at most SIM_CHUNK x t (row, key)
# pairs (memory linear in t, never t^2); the ops a forward dispatches per chunk are the same at every length from
# SIM_CHUNK to SIM_CHUNK x SIM_CHUNKS tokens and grow by whole chunks of SIM_CHUNK rows beyond; and each chunk's
# rows see only the keys up to its last row (with 8 chunks, 9/16 of the (t, t) pairs are computed).
SIM_CHUNK = 1024
SIM_CHUNKS = 8


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
    # transformers' eager math (one batched matmul, scaled after, a float32 softmax; no fused kernel), so `full`
    # reproduces the model's own logits, with one difference: eager repeats every KV head for its g query heads,
    # a copy of the whole cache per layer and step (at batch 8 x 2048 tokens that copy was most of a decode
    # step). Here each KV head's g query heads are folded into its rows and the KV is read in place.
    scores = grouped_matmul(q.reshape(b, hk, g, t, d), k) * scale  # (b, hk, g, t, s)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend` through torch's fused SDPA kernel: q (b, h, t, d); k, v (b, h_kv, s, d); keep (b|1, h_kv|1, t, s)
    bool or None (every entry, or with `causal` the causal prefix of t == s rows). KV heads are never repeated:
    a per-KV-head mask is applied with the g query heads of each KV head folded into one batch entry.
    Returns out (b, h, t, d) and each row's log-sum-exp of its attended logits (b, h, t), where the device's
    kernel gives it (CPU), else None."""
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    g = h // hk
    bias, fold = None, False
    if keep is not None:
        # 0 where kept, the dtype's finite minimum elsewhere (as eager's masked_fill): a row with nothing to
        # attend is then uniform over every entry, as in eager, instead of NaN
        zero, low = (torch.tensor(x, dtype=q.dtype, device=q.device) for x in (0.0, torch.finfo(q.dtype).min))
        bias = torch.where(keep, zero, low)  # one pass
        fold = keep.shape[1] > 1 and g > 1
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


def chunk_rows(t: int) -> int:
    """Rows per sim chunk of a t-row sequence: t / SIM_CHUNKS rounded up, within [SIM_CHUNK / SIM_CHUNKS, SIM_CHUNK]."""
    return min(SIM_CHUNK, max(-(-t // SIM_CHUNKS), -(-SIM_CHUNK // SIM_CHUNKS), 1))


def row_chunks(t: int, split_at: int = 0) -> Iterator[tuple[int, int]]:
    """(r0, r1) query-row chunks of `chunk_rows(t)` rows covering 0..t; none straddles row `split_at` (so a chunk
    is either all dense prefill rows or all decoded rows). SIM_CHUNK is read at call time: tests shrink it to cross
    chunk boundaries on short sequences."""
    size = chunk_rows(t)
    for lo, hi in ((0, min(max(split_at, 0), t)), (min(max(split_at, 0), t), t)):
        for r0 in range(lo, hi, size):
            yield r0, min(hi, r0 + size)


def full_past(layer: AttentionLayer, position):
    """Earlier positions the model's own attention lets the row at `position` (an int, or a tensor of them) see on
    `layer`: all of them on a global layer, the W - 1 before it on a local layer of window W."""
    window = layer.sliding_window
    if window is None:
        return position
    return min(position, window - 1) if isinstance(position, int) else position.clamp(max=window - 1)


def in_window(layer: AttentionLayer, store: KVStore, position: int, past: int | None = None) -> torch.Tensor | None:
    """(b, h_kv, n) bool: which of the store's first `past` entries (all of them: None) the row at `position` may
    attend on a local layer, by each entry's position; None where the layer lets it see every one (a global layer,
    or a row whose window still reaches position 0). Host ints in, nothing read back."""
    start = position - full_past(layer, position)
    if start == 0:
        return None
    return (store.positions if past is None else store.positions[..., :past]) >= start


def chunk_allowed(allowed: torch.Tensor, r0: int, r1: int, offset: int, causal: bool = False) -> torch.Tensor:
    """Rows r0..r1-1 of the (b|1, 1, t, s) mask, cut after the last key any of them may see: with a causal mask
    that is key offset + r1 - 1, so a chunk costs what it attends, and the later columns are never built.
    causal: the mask is known to be plain causal (no device value is read to find out)."""
    rows = allowed[..., r0:r1, :]  # (b|1, 1, r, s)
    end = offset + r1
    if not causal and end < rows.shape[-1] and bool(rows[..., end:].any()):
        end = rows.shape[-1]  # not causal (never the case for the models here): keep every key
    return rows[..., :end]


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


def keep_mask(idx: torch.Tensor, valid: torch.Tensor, past: int) -> torch.Tensor:
    """(..., k) selected entries -> (..., past) bool: a column past collects the unkept ones, so duplicates
    among them never race a kept entry's write."""
    keep = torch.zeros(*idx.shape[:-1], past + 1, dtype=torch.bool, device=idx.device)
    return keep.scatter_(-1, torch.where(valid, idx, past), True)[..., :past]


class KVStats:
    """Per-layer running means of named per-row quantities (kv_fraction, recall, selected, ...). `add` keeps each
    batch's sum as a tensor and reads them only when asked, so recording never waits for the device."""

    PENDING = 4096  # recordings kept unread at most (each holds its tensor): memory stays bounded over long runs

    def __init__(self):
        self._sums: dict = defaultdict(lambda: defaultdict(float))
        self._counts: dict = defaultdict(lambda: defaultdict(int))
        self._pending: list = []
        self._folded: dict = {}  # (name, layer, device) -> a running sum, where the recordings are

    def add(self, layer: int, name: str, values: torch.Tensor, offset: float = 0.0, scale: float = 1.0) -> None:
        """Records (values + offset) * scale per element. Dispatches nothing and reads nothing back: a decode step
        on a GPU neither launches a kernel nor waits to record (every PENDING recordings are summed into running
        sums on their own device; a mean read brings them to the host)."""
        self._pending.append((layer, name, values, offset, scale))
        if len(self._pending) >= self.PENDING:
            self._fold()

    def _fold(self) -> None:
        for layer, name, values, offset, scale in self._pending:
            n = values.numel()
            total = (values.detach().double().sum() + offset * n) * scale
            key = (name, layer, total.device)
            self._folded[key] = total if key not in self._folded else self._folded[key] + total
            self._counts[name][layer] += n
        self._pending.clear()

    def _settle(self) -> None:
        self._fold()
        for (name, layer, _), total in self._folded.items():
            self._sums[name][layer] += float(total)
        self._folded.clear()

    @property
    def sums(self) -> dict:
        self._settle()
        return self._sums

    @property
    def counts(self) -> dict:
        self._settle()
        return self._counts

    def per_layer(self, name: str) -> dict[int, float]:
        sums, counts = self.sums[name], self.counts[name]
        return {i: sums[i] / counts[i] for i in sorted(sums) if counts[i]}

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


def check_budget(budget, budget_tokens, of: str) -> None:
    """A token budget given one of two ways, as papers give it: `budget`, a fraction in (0, 1] of `of` (the
    sequence, the prompt), or `budget_tokens`, a count >= 1; exactly one of them, the other null."""
    if (budget is None) == (budget_tokens is None):
        got = "neither" if budget is None else f"both ({budget!r} and {budget_tokens!r})"
        raise ValueError(f"exactly one of method.budget (a fraction of the {of}) and method.budget_tokens (a token "
                         f"count) is given, got {got}: the other null, e.g. method.budget=null method.budget_tokens=256")
    if budget is not None and not 0 < budget <= 1:
        raise ValueError(f"method.budget must be a fraction in (0, 1] of the {of}, got {budget!r}")
    if budget_tokens is not None and budget_tokens < 1:
        raise ValueError(f"method.budget_tokens must be a token count >= 1, got {budget_tokens!r}")


def budget_at(budget, budget_tokens, length: int) -> float:
    """The token budget over `length` tokens (checked by `check_budget`): the count, at most `length`, or the
    fraction of `length` (callers round it as their reference does)."""
    return float(min(budget_tokens, length)) if budget_tokens is not None else budget * length


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


# How an offloading runtime (infinigen/offload/) holds a method's KV, declared per layer by `KVMethod.offload_kind`:
#   resident  on the compute device; the method's own decode step runs there (nothing crosses the link)
#   held      every entry the method holds lives in a host pool and crosses before the layer's attention
#             (`codec` says how a row is stored, `max_held` how many entries it ever holds at once)
#   gather    past entries live in a host pool; `GatheringMethod.select` says which rows cross, at the method's
#             `speculation_point`; per-entry state (`store.entries`) stays on the device
OFFLOAD_KINDS = ("resident", "held", "gather")
# When a gathering method's selection for layer i is known: at the start of layer i-1's attention, at its end
# (after its residual add, before its MLP), or only from layer i's own query (the gather is synchronous).
SPECULATION_POINTS = ("attention_start", "attention_end", "query")


@dataclass
class KVMethod:
    """Dense attention over every cached entry: the reference every method is compared with."""

    offload: ClassVar[str] = "held"  # what an offloading runtime does with this method's KV (OFFLOAD_KINDS)
    # hyperparameters that set how much KV the method keeps or attends: figures place points along them
    size_params: ClassVar[tuple[str, ...]] = ()
    # a method that compresses a prompt (SnapKV) has nothing to do without one: sim mode needs dense_rows > 0
    needs_prompt: ClassVar[bool] = False
    # settings worth testing beside the defaults (overrides of conf/method/<name>.yaml, e.g. eviction on): every
    # method-wide test (tests/conftest.py `variants`) runs them too, so a new method's own settings need no test edit
    test_variants: ClassVar[tuple[dict, ...]] = ()

    def __post_init__(self):
        check_field_types(self)
        self.stats = KVStats()

    # ------------------------------------------------------------------ life cycle
    def check_shape(self, num_kv_heads: int, head_dim: int) -> None:
        """Refuse hyperparameters a model of this attention shape cannot take (ValueError naming the option); run
        before the model loads where its config declares the shape (experiments/runner.py validate)."""

    def check_data(self) -> None:
        """Refuse missing or unreadable files `bind` will read (a calibration text): run before a model loads, by
        runs that load one (a modelled latency run binds nothing, so it needs no data)."""

    def bind(self, session: Session) -> None:
        """Called when installed into a model (e.g. to calibrate on its weights)."""

    def stand_in(self) -> "KVMethod":
        """A fresh copy to run on a random-weight stand-in of the model (infinigen/offload/census.py counts the
        code path it runs, not its choices): it binds without reading data files."""
        return dataclasses.replace(self)

    def reset_stats(self) -> None:
        self.stats = KVStats()

    def sim_rows(self, session: Session, q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
        """(t, prompt rows) of sim mode's one forward over the whole sequence; anything else is refused, and so is
        a method that compresses a prompt (needs_prompt) given none."""
        t, s = q.shape[2], k.shape[2]
        name = type(self).__name__
        if s != t:
            raise ValueError(f"{name} sim mode expects one forward over the whole sequence (t == s), got t={t}, s={s}")
        if self.needs_prompt and session.dense_rows == 0:
            raise ValueError(f"{name} compresses a prompt: with dense_rows=0 there is none (set task.dense_rows to "
                             "the prompt length, or use lm-eval's protocol=serving)")
        return t, min(session.dense_rows, t)

    def new_store(self, layer: AttentionLayer) -> KVStore:
        return KVStore()

    def store_bytes(self, stores: list[KVStore]) -> int:
        """Bytes the decode-mode cache holds for its KV."""
        return sum(s.nbytes() for s in stores)

    # ------------------------------------------------------------------ what an offloading runtime needs
    def offload_kind(self, layer: AttentionLayer) -> str:
        return self.offload

    def codec(self, layer: AttentionLayer, dtype) -> Any:
        """How a held entry is stored on the host: an object with encode(k, v) -> rows (..., W), decode(rows) ->
        (k, v), `width` and `dtype` (of the rows); None = K|V in the model's dtype."""
        return None

    def max_held(self, max_len: int) -> int:
        """Most entries one layer holds at once (the current token included) in a sequence of max_len tokens."""
        return max_len

    def attention_end(self, session: Session, layer: AttentionLayer) -> None:
        """Called when `layer`'s attention output has been added to the residual stream, before its MLP."""

    # ------------------------------------------------------------------ sim mode (and decode prefill)
    def sim_state(self, session: Session, layer: AttentionLayer, q, k, v, allowed) -> Any:
        """Computed once per layer and sim forward, before any chunk: whatever `sim_keep` / `sim_kv` need
        (kept compact: O(t) or O(h_kv x t), never per (row, entry) pair). q (b, h, t, d); k, v (b, h_kv, s, d)."""
        return None

    def sim_keep(self, session: Session, layer: AttentionLayer, state, rows: torch.Tensor, s: int) -> torch.Tensor | None:
        """(b|1, h_kv|1, r, s) bool: which of the first s entries the query rows at sequence positions `rows`
        (r,) may attend (combined with causality by the caller); None = all of them. `session.chunk` holds the
        same positions as host ints: branch and slice on those (reading `rows` would wait for the device)."""
        return None

    def sim_kv(self, session: Session, layer: AttentionLayer, state, k, v, rows: torch.Tensor):
        """The keys/values the rows at `rows` attend ((b, h_kv, s, d) each): the real ones unless the method
        changes what attention sees (quantisation)."""
        return k, v

    def forward_attention(self, session: Session, layer: AttentionLayer, q, k, v, allowed) -> torch.Tensor:
        """A multi-token forward: the whole sequence in sim mode, the dense prefill in decode mode."""
        if session.mode == "decode":
            return self.prefill_attention(session, layer, q, k, v, allowed)
        t, s = q.shape[2], k.shape[2]
        offset = s - t  # sequence position of query row 0
        if offset == 0 and session.plain_causal and session.attention == "fused" and self.sim_dense(layer):
            return self.sim_causal(session, layer, q, k, v)
        state = self.sim_state(session, layer, q, k, v, allowed)
        outs = []
        for r0, r1 in row_chunks(t, session.dense_rows - offset):
            allowed_c = chunk_allowed(allowed, r0, r1, offset, session.plain_causal)  # (b|1, 1, r, e)
            rows = torch.arange(offset + r0, offset + r1, device=q.device)
            session.chunk = (offset + r0, offset + r1)
            e = allowed_c.shape[-1]
            keep = self.sim_keep(session, layer, state, rows, e)
            dense = (rows < session.dense_rows).view(1, 1, -1, 1)
            keep = allowed_c if keep is None else allowed_c & (keep | dense)
            kc, vc = self.sim_kv(session, layer, state, k[:, :, :e], v[:, :, :e], rows)
            outs.append(sim_attend(session, q[:, :, r0:r1], kc, vc, keep, layer.logit_scale))
            self.record_sim(session, layer, keep, allowed_c, rows, start=offset + r0)
        return torch.cat(outs, dim=2)  # (b, h, t, d)

    def sim_dense(self, layer: AttentionLayer) -> bool:
        """Whether every sim-mode row of `layer` attends its whole causal prefix of the real KV: true unless the
        method defines which entries rows keep (`sim_keep`) or what they see (`sim_kv`)."""
        return type(self).sim_keep is KVMethod.sim_keep and type(self).sim_kv is KVMethod.sim_kv

    def sim_causal(self, session: Session, layer: AttentionLayer, q, k, v) -> torch.Tensor:
        """A dense layer over a plain causal sequence: one fused causal call, no mask, no chunks."""
        out, _ = attend_fused(q, k, v, None, layer.logit_scale, causal=True)
        decoded = q.shape[2] - min(session.dense_rows, q.shape[2])
        if decoded:
            self.stats.add(layer.index, "kv_fraction", q.new_ones(q.shape[0], layer.num_kv_heads, decoded))
        return out

    needs_prefill_probs = False  # set True if after_prefill reads the prefill attention probabilities

    def prefill_mass(self, probs: torch.Tensor) -> torch.Tensor:
        """Decode mode, needs_prefill_probs: one chunk's probabilities (b, h_kv, g, r, e) -> what after_prefill
        receives summed over every prefill row, (b, h_kv, e)."""
        return probs.sum(dim=(2, 3))

    def prefill_attention(self, session: Session, layer: AttentionLayer, q, k, v, allowed) -> torch.Tensor:
        """The dense decode-mode prefill, chunked like sim mode; a method that reads the prefill attention gets
        it accumulated chunk by chunk (`prefill_mass`), never as a (t, s) tensor."""
        t, s = q.shape[2], k.shape[2]
        mass, outs = None, []
        for r0, r1 in row_chunks(t):
            allowed_c = chunk_allowed(allowed, r0, r1, s - t, session.plain_causal)
            e = allowed_c.shape[-1]
            if self.needs_prefill_probs:
                out, probs = attend(q[:, :, r0:r1], k[:, :, :e], v[:, :, :e], allowed_c, layer.logit_scale, need_probs=True)
                part = self.prefill_mass(probs)  # (b, h_kv, e)
                mass = part.new_zeros(*part.shape[:2], s) if mass is None else mass
                mass[..., :e] += part
            else:
                out = sim_attend(session, q[:, :, r0:r1], k[:, :, :e], v[:, :, :e], allowed_c, layer.logit_scale)
            outs.append(out)
        self.after_prefill(session, layer, session.cache.layers[layer.index], q, mass)
        return torch.cat(outs, dim=2)

    def after_prefill(self, session: Session, layer: AttentionLayer, store: KVStore, q, mass) -> None:
        """Decode mode: called once the dense prefill has filled `store` (mass: the `prefill_mass` of every
        prefill row, (b, h_kv, s), if needs_prefill_probs, else None)."""

    def record_sim(self, session: Session, layer: AttentionLayer, keep, allowed, rows: torch.Tensor,
                   start: int | None = None) -> None:
        """kv_fraction of the chunk's rows at sequence positions `rows` that are decoded (>= dense_rows). start:
        rows[0] (ascending, consecutive), when the caller knows it: nothing is then read back from the device."""
        if start is None:
            first = int((rows < session.dense_rows).sum())  # rows are ascending: the decoded ones come last
        else:
            first = min(max(session.dense_rows - start, 0), rows.numel())
        if first == rows.numel():
            return
        attended = keep[:, :, first:].sum(-1, dtype=torch.int32).float()  # (b|1, h_kv|1, rows)
        causal = allowed[:, :, first:].sum(-1, dtype=torch.int32).float()
        batch = session.attn_inputs[layer.index].shape[0]  # keep/allowed may be broadcast over the batch
        attended = attended.expand(batch, layer.num_kv_heads if keep.shape[1] == 1 else keep.shape[1], -1)
        self.stats.add(layer.index, "kv_fraction", attended / causal.clamp(min=1))

    # ------------------------------------------------------------------ decode mode
    def decode_attention(self, session: Session, layer: AttentionLayer, q, store: KVStore) -> torch.Tensor:
        """One decoded token: q (b, h, 1, d); `store` already holds this token's KV (a local layer attends those in
        its window)."""
        keys, values = store.kv()
        window = in_window(layer, store, store.seen - 1)  # (b, h_kv, s) or None
        out, _ = attend(q, keys, values, None if window is None else window[:, :, None], layer.logit_scale)
        self.record_decode(layer, store, store.stored if window is None else window.sum(-1))
        return out

    def record_decode(self, layer: AttentionLayer, store: KVStore, attended) -> None:
        """kv_fraction of the current row: `attended` entries (its own included) of what full attention attends."""
        b = store.positions.shape[0]
        attended = torch.as_tensor(attended, dtype=torch.float32).expand(b, layer.num_kv_heads)
        self.stats.add(layer.index, "kv_fraction", attended / (full_past(layer, store.seen - 1) + 1))


@dataclass
class GatheringMethod(KVMethod):
    """A method whose decoded rows attend a selection of the past plus themselves. Its decode step is three
    parts, run back to back in decode mode and split by the offloading runtime (which gathers exactly the
    selected rows from host memory between `select` and `attend_selected`):

    select(...)           which past entries the current token attends, (b, h_kv, past) bool
    attend_selected(...)  attention over them + the current token, statistics, then `after_step`
    after_step(...)       per-entry bookkeeping (counters, eviction) once the step has attended
    """

    offload: ClassVar[str] = "gather"
    speculation_point: ClassVar[str] = "query"  # SPECULATION_POINTS: when `select` can run

    def select(self, session: Session, layer: AttentionLayer, q, store: KVStore, past: int, position: int):
        """keep (b, h_kv, past) bool over the store's first `past` entries (those before the current token) for
        the token at `position`. q (b, h, 1, d) is the true query, or None when the runtime calls this ahead of
        the layer (speculation_point != "query"): then only what `session` captured so far may be used."""
        raise NotImplementedError

    def select_indices(self, session: Session, layer: AttentionLayer, q, store: KVStore, past: int,
                       position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`select` as the offloading runtime gathers it: (index (b, h_kv, k) long, valid (b, h_kv, k) bool), the
        selected entries first in position order, then entries that are not fetched; k =
        `selection_width(...)`, known on the host, so nothing here waits for the device. The default sorts
        `select`'s mask (less what a local layer's window hides); a method that ranks with top-k returns its indices
        directly, and then selects within the window itself."""
        keep = self.windowed(layer, store, self.select(session, layer, q, store, past, position), position)
        k = self.selection_width(session, past, position)
        index = torch.argsort(keep.to(torch.uint8), dim=-1, descending=True, stable=True)[..., :k]  # kept first
        return index, torch.arange(k, device=keep.device) < keep.sum(-1, keepdim=True)

    def selection_width(self, session: Session, past: int, position: int) -> int:
        """A host bound on how many of the `past` entries the row at `position` selects (per row and KV head)."""
        return min(past, self.max_selected(session.max_len))

    def max_selected(self, max_len: int) -> int:
        """Most past entries one row and KV head selects in a sequence of max_len tokens (sizes landing buffers)."""
        return max_len

    def score_channels(self, layer: AttentionLayer) -> float:
        """Channels of the per-entry vector `select` ranks one past entry of one KV head by (its keys: head_dim)."""
        return layer.head_dim

    def selection_flops(self, layer: AttentionLayer, past: int) -> float:
        """FLOPs one batch row's `select` spends ranking `past` entries, for the performance model
        (infinigen/offload/perf.py; the bytes it moves are counted by running it): each query head dotted with
        `past` stored vectors of `score_channels` elements."""
        return 2.0 * layer.num_heads * past * self.score_channels(layer)

    @staticmethod
    def windowed(layer: AttentionLayer, store: KVStore, keep: torch.Tensor, position: int) -> torch.Tensor:
        """A selection keep (b, h_kv, past) less what a local layer's window hides from the row at `position`."""
        window = in_window(layer, store, position, keep.shape[-1])
        return keep if window is None else keep & window

    def decode_attention(self, session, layer, q, store):
        if self.offload_kind(layer) != "gather":
            return super().decode_attention(session, layer, q, store)
        past, position = store.stored - 1, store.seen - 1
        keep = self.windowed(layer, store, self.select(session, layer, q, store, past, position), position)
        return self.attend_selected(session, layer, q, store, keep)

    def attend_selected(self, session, layer, q, store: KVStore, keep: torch.Tensor) -> torch.Tensor:
        """q (b, h, 1, d) attends the `keep`-selected past entries (b, h_kv, past) and itself."""
        self.before_step(session, layer, store)
        keys, values, mask = store.selected(keep)
        out, _ = attend(q, keys, values, mask, layer.logit_scale)
        full = full_past(layer, store.seen - 1) + 1  # what the model's own attention attends at this row
        self.stats.add(layer.index, "kv_fraction", keep.sum(-1), offset=1, scale=1 / full)
        self.after_step(session, layer, q, store, keep)
        return out

    def attend_gathered(self, session, layer, q, store: KVStore, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The offloading runtime's second half of a gathering step: the rows `select_indices` returned (index,
        valid: (b, h_kv, k)) are in `store.gathered` (the runtime's rows (b, h_kv, k + 1, W), the current token's
        last, with `valid` and the per-(row, KV head) `counts`). By default the selection as a mask over the past,
        then `attend_selected`, as decode mode runs it; a method whose selection has static buffers may attend the
        rows directly."""
        return self.attend_selected(session, layer, q, store, keep_mask(index, valid, store.stored - 1))

    def before_step(self, session, layer, store: KVStore) -> None:
        """Per-entry state for the current token (already appended to `store`), before it attends."""

    def after_step(self, session, layer, q, store: KVStore, keep: torch.Tensor) -> None:
        """Bookkeeping once the current token attended `keep`."""

