"""InfiniGen (Lee et al., "InfiniGen: Efficient Generative Inference of Large Language Models with Dynamic KV
Cache Management", OSDI'24).

While layer i-1 runs, its attention input x is pushed through layer i's *partial* query weight (skewed, only
`partial_ratio` of the columns) and scored against layer i's partial key cache. (`speculate_from` chooses x:
the paper's choice is the default, the others are this project's ablation, see `SPECULATE_FROM`.) Per head the
tokens within `alpha` of the best score are counted; the mean count over heads, capped at `budget` x sequence
length, is how many tokens each KV head fetches (its top scorers). The full KV lives in a host-side pool of `capacity`
that evicts one token per step (`counter`, `lru` or `fifo`) when full.

QK-norm (Gemma 3: each query and key head RMS-normalised, then rotated): the partial key cache holds keys as the
attention sees them (after their norm), so it is unaffected; the speculated query goes through layer i's q norm
with the true RMS of the whole speculated head vector (`qk_norm="rms"`). With RoPE between the projection and the
skew the whole query is computed anyway, so the true RMS costs one reduction over head_dim. Scaling a head's query
leaves that head's ranking of the keys unchanged but moves the alpha threshold (score > max - alpha) and the GQA
reduction over the heads sharing a KV head: `qk_norm="weight"` (the norm's per-channel weight alone, what a partial
query weight could fold into its rows) on gemma3-270m (WikiText-2, 2 x 1024 tokens, budget 0.2, alpha 4) fetched
fewer tokens (kv_fraction 0.12 against 0.19) with a recall of the true attention mass of 0.49 against 0.78 (the
oracle's at budget 0.2: 0.93); at alpha = inf (the same count as the oracle) the two rank almost alike (0.846
against 0.854).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

from infinigen.adapter import AttentionLayer, Session, encode, norm_weight_only, reads_bytes, tokenizer_of
from infinigen.attention import score_dtype
from infinigen.corpora import check_dataset, corpus_text, identity, without_paths
from infinigen.method.skew import COLUMN_COUNTS, Skew, calibrate
from infinigen.shared.selective_attention import SelectiveAttention
from infinigen.shared.step import CapturedSelection, select_step, speculated_query

# The speculation input x for layer i (pushed through layer i's partial query weight):
#   previous        layer i-1's normalised attention input, norm_{i-1}(h_{i-1}) (the paper, Sec. 4.3)
#   block_input     layer i's input norm on the residual stream entering block i-1, norm_i(h_{i-1}): the same
#                   vector, but normalised with the weights (and, for OPT, bias) layer i's queries see
#   after_attention layer i's input norm on the residual after block i-1's attention, norm_i(h_{i-1} + attn_{i-1}):
#                   one MLP closer to layer i's true input
#   current         layer i's own input (ablation: an upper bound with no prefetch window)
SPECULATE_FROM = ("previous", "block_input", "after_attention", "current")
# When, during layer i-1, layer i's selection is known (what a prefetch can hide: "attention_start" leaves layer
# i-1's attention and MLP to overlap the fetch, "attention_end" only its MLP; None: no prefetch possible).
SPECULATION_POINT = {"previous": "attention_start", "block_input": "attention_start",
                     "after_attention": "attention_end", "current": "query"}
# Residual-stream tensors the adapter must capture for each option (the attention inputs are always captured).
CAPTURES = {"block_input": ("block_inputs",), "after_attention": ("attn_residuals",)}
PARTIAL_SELECT = ("q", "qk")
# How the speculated query goes through a QK-norm layer's per-head RMS norm (Gemma 3; other layers have none):
#   rms     the norm as the attention applies it: the whole head vector's RMS, then the norm's weight (default)
#   weight  the norm's weight alone, no division by the RMS (a partial query weight could fold the weight into its
#           rows and skip the whole-vector reduction): each head's speculated scores are scaled by its query's RMS,
#           so the alpha threshold and the GQA reduction across the heads sharing a KV head move
QK_NORM = ("rms", "weight")
# How a decode step's speculation and selection (`step.speculated_query` + `step.select_step`) run on a CUDA device:
#   none     eagerly, op by op (every device; the only choice off CUDA, where the others fall back to it)
#   graph    as one CUDA graph per layer, captured at the first step and replayed (the host copies the speculation
#            input in and launches one graph instead of ~20 kernels)
#   compile  the same graph of the function compiled with torch.compile first (its kernels fused)
CAPTURE = ("none", "graph", "compile")
RANDOM_CALIBRATION = "random ids (a random-weight stand-in: infinigen/offload/census.py)"


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
    speculate_from: str = "previous"  # see SPECULATE_FROM: previous | block_input | after_attention | current
    qk_norm: str = "rms"  # see QK_NORM: rms | weight
    capture: str = "none"  # see CAPTURE: none | graph | compile (CUDA; how a decode step's selection is launched)
    calibration: str = "pg19"  # a corpus spec (infinigen/corpora.py): a name, file:PATH or hf:PATH/CONFIG/SPLIT/COLUMN
    calib_tokens: int = 2048
    column_count: str = "round"  # round | floor: partial_ratio x head_dim as a column count (the artifact: floor)
    column_tokens: int | None = None  # partial columns from the first N calibration tokens (None: all calib_tokens)
    # the partial columns' own text, a corpus spec as `calibration` takes (None: `calibration`'s tokens); the skew
    # stays on `calibration`. Tokenised whole (the tokenizer's default special tokens), up to column_tokens and the
    # model's positions: the artifact calibrates its columns on a prompt of its own (setup/gen_partial_weight.py)
    column_calibration: str | None = None
    calib_data_dir: str | None = None
    cache_dir: str | None = ".cache/infinigen"

    test_variants: ClassVar[tuple[dict, ...]] = (
        {"capacity": 0.8}, {"speculate_from": "block_input"}, {"speculate_from": "after_attention"},
        {"speculate_from": "current"})

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.partial_ratio <= 1:
            raise ValueError(f"partial_ratio must be in (0, 1], got {self.partial_ratio}")
        if self.partial_select not in PARTIAL_SELECT:
            raise ValueError(f"partial_select must be one of {PARTIAL_SELECT}, got {self.partial_select!r}")
        if self.qk_norm not in QK_NORM:
            raise ValueError(f"qk_norm must be one of {QK_NORM}, got {self.qk_norm!r}")
        if self.speculate_from not in SPECULATE_FROM:
            raise ValueError(f"speculate_from must be one of {SPECULATE_FROM}, got {self.speculate_from!r}")
        if self.speculate_from != "current" and self.skip_layers < 1:
            raise ValueError("skip_layers must be >= 1: layer 0 has no previous layer to speculate from")
        if self.calib_tokens < 16:
            raise ValueError(f"calib_tokens must be >= 16, got {self.calib_tokens}")
        if self.column_count not in COLUMN_COUNTS:
            raise ValueError(f"column_count must be one of {tuple(COLUMN_COUNTS)}, got {self.column_count!r}")
        if self.column_calibration is not None:
            if not isinstance(self.column_calibration, str) or not self.column_calibration.strip():
                raise ValueError("column_calibration must be null or a corpus spec (as calibration takes), got "
                                 f"{self.column_calibration!r}")
            if self.column_tokens is not None and self.column_tokens < 1:
                raise ValueError(f"column_tokens must be null or >= 1, got {self.column_tokens!r}")
        elif self.column_tokens is not None and not 1 <= self.column_tokens <= self.calib_tokens:
            raise ValueError(f"column_tokens must be null or in 1..calib_tokens ({self.calib_tokens}), got "
                             f"{self.column_tokens!r}")
        if self.capture not in CAPTURE:
            raise ValueError(f"capture must be one of {CAPTURE}, got {self.capture!r}")
        self.skewing: Skew | None = None
        self._random_calibration = False  # stand_in(): calibrate on random ids
        self._projections: list[torch.Tensor] = []  # per layer (h_kv, d, r): skew and column choice in one matrix
        self._repeated: dict = {}  # (layer, batch) -> the projection repeated per batch row
        self._partial_q: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []  # per layer (weight, bias)
        self._step: dict = {}  # (layer, batch) -> a static decode step's weights (`step_weights`)
        self._rope: dict = {}  # layer type -> (the forward's cos table, its rotary factors): made once per forward
        self._captured: dict = {}  # layer -> (key, CapturedSelection)
        self.capture_used = False  # whether a captured selection ran (False off CUDA: the eager one did)

    def check_data(self) -> None:
        check_dataset(self.calibration, self.calib_data_dir)
        if self.column_calibration is not None:
            try:
                check_dataset(self.column_calibration, self.calib_data_dir)
            except (OSError, ValueError) as err:
                raise type(err)(f"column_calibration (the partial columns' text): {err}") from None

    @property
    def captures(self) -> tuple[str, ...]:
        """What `adapter.install` records beyond the attention inputs (only what the speculation reads)."""
        return CAPTURES.get(self.speculate_from, ())

    @property
    def speculation_point(self) -> str:
        """When during layer i-1 layer i's speculated query can be computed: "attention_start" (from layer i-1's
        attention input / its block input, before its attention), "attention_end" (after its attention and
        residual add, before its MLP), "query" (speculate_from=current: only at layer i itself, a synchronous
        gather)."""
        return SPECULATION_POINT[self.speculate_from]

    # ------------------------------------------------------------------ calibration
    def bind(self, session: Session) -> None:
        super().bind(session)
        model = session.model
        keys = ("skew", "partial_ratio", "partial_select", "calibration", "calib_tokens", "column_count", "column_tokens")
        settings = {k: asdict(self)[k] for k in keys}
        # the calibration text's content (not its folder) keys the skew cache: other text, other rotations
        settings["calibration_data"] = (RANDOM_CALIBRATION if self._random_calibration
                                        else without_paths(identity(self.calibration, self.calib_data_dir)))
        columns = self.column_calibration if not self._random_calibration else None
        if columns is not None:  # keys only where set: the caches written before the option keep their names
            settings["column_calibration"] = columns
            settings["column_calibration_data"] = without_paths(identity(columns, self.calib_data_dir))
        settings = json.dumps(settings, sort_keys=True)
        self.skewing = calibrate(
            model, lambda: self._calibration_ids(model), skew=self.skew, partial_ratio=self.partial_ratio,
            partial_select=self.partial_select, cache_dir=self.cache_dir, settings=settings,
            column_count=self.column_count, column_tokens=self.column_tokens,
            column_ids=None if columns is None else lambda: self._column_ids(model),
        )
        self._projections = [partial_projection(self.skewing, i, layer.head_dim) for i, layer in enumerate(session.layers)]
        self._repeated = {}
        self._partial_q = [partial_query_weight(layer, p) for layer, p in zip(session.layers, self._projections)]
        self._step, self._rope, self._captured = {}, {}, {}

    def _calibration_ids(self, model) -> torch.Tensor:
        limit = min(self.calib_tokens, getattr(model.config, "max_position_embeddings", self.calib_tokens))
        if self._random_calibration:
            gen = torch.Generator().manual_seed(0)
            return torch.randint(0, model.config.vocab_size, (1, limit), generator=gen).to(model.device)
        return self._text_ids(model, self.calibration, limit)

    def _column_ids(self, model) -> torch.Tensor:
        """(1, n): the column_calibration text's ids, tokenised whole as the artifact tokenises its prompt (the
        tokenizer's default special tokens: a BOS where the tokenizer adds one), up to column_tokens and the
        model's positions."""
        limits = [n for n in (self.column_tokens, getattr(model.config, "max_position_embeddings", None)) if n]
        limit = min(limits) if limits else None
        return self._text_ids(model, self.column_calibration, limit)

    def _text_ids(self, model, spec: str, limit: int | None) -> torch.Tensor:
        """(1, n): the first `limit` ids (None: all) of the corpus `spec` through the model's tokenizer."""
        tokenizer = tokenizer_of(model)
        if tokenizer is None and not reads_bytes(model):
            raise ValueError(f"InfiniGen calibrates on text ({spec}): this model was not loaded by "
                             "infinigen.load_model, so pass its tokenizer (infinigen.apply / generate(..., tokenizer=))")
        ids = encode(tokenizer, corpus_text(spec, self.calib_data_dir), model.config.vocab_size)
        return ids[:limit][None].to(model.device)

    def stand_in(self) -> "InfiniGen":
        copy = replace(self)
        # a stand-in's random weights make any text as good as random ids: the census needs no data folder
        copy._random_calibration = True
        return copy

    # ------------------------------------------------------------------ speculation
    def speculation_input(self, session: Session, layer: AttentionLayer) -> torch.Tensor:
        """(b, t, hidden): what layer i's partial query weight is applied to, per `speculate_from`."""
        i = layer.index
        if self.speculate_from == "previous":
            return session.attn_inputs[i - 1]
        if self.speculate_from == "block_input":
            return layer.input_norm(session.block_inputs[i - 1])
        if self.speculate_from == "after_attention":
            return layer.input_norm(session.attn_residuals[i - 1])
        return session.attn_inputs[i]

    def speculation_queries(self, session: Session, layer: AttentionLayer) -> torch.Tensor:
        """Layer i's speculated partial query from what the session captured: (b, h_kv, g, t, r) in the score dtype,
        skewed, only the partial columns (unkept ones of a head keeping fewer are zero). The same skew and columns
        as the partial key cache (calibrated on the true queries)."""
        x = self.speculation_input(session, layer)  # (b, t, hidden)
        b, t, _ = x.shape
        hk, g = layer.num_kv_heads, layer.groups
        partial = self._partial_q[layer.index]
        if partial is not None:  # no rotary embedding: the partial columns are rows of W_q, projected alone
            weight, bias = partial
            y = F.linear(x, weight, bias) * layer.query_scale  # (b, t, h * r)
            return y.view(b, t, hk, g, -1).permute(0, 2, 3, 1, 4).to(score_dtype(y.dtype))  # (b, hk, g, t, r)
        # RoPE sits between the projection and the skew, mixing each column with its pair: the whole query first
        # (at layer i's own RoPE base: speculation may run during layer i-1, of the other type). With QK-norm the
        # whole head vector is there too, so its true RMS costs one reduction over head_dim (`qk_norm`).
        spec = layer.queries(x, session.rope_of(layer), rms=self.qk_norm == "rms")  # (b, h, t, d), rotated
        return self.project(spec.view(b, hk, g, t, layer.head_dim), layer.index)

    def project(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x (b, h_kv, ..., d) as attention sees it -> its skewed partial columns (b, h_kv, ..., r), score dtype.
        One batched product over (b * h_kv) with the projection repeated per batch row (kept per batch size): a
        decode step's ops do not depend on the batch (einsum, or matmul broadcasting the projection over b, copy
        it when b > 1)."""
        b, hk, d = x.shape[0], x.shape[1], x.shape[-1]
        key = (layer, b)
        if key not in self._repeated:
            self._repeated[key] = self._projections[layer].repeat(b, 1, 1)  # (b * h_kv, d, r)
        p = self._repeated[key]
        return torch.bmm(x.to(p.dtype).reshape(b * hk, -1, d), p).view(*x.shape[:-1], p.shape[-1])

    # ------------------------------------------------------------------ the static decode step
    def step_query(self, session, layer, q):
        """The speculated query of `speculation_queries` in one projection (`step.speculated_query`): (b*h_kv, g,
        c + 1), the logit scale and the constant channel folded into the weights, RoPE into the projection."""
        x = self.speculation_input(session, layer)  # (b, 1, hidden)
        b = x.shape[0]
        w = self.step_weights(layer, b)
        return speculated_query(x.view(b, -1), w["weight"], w["bias"], self.rotary_factors(session, layer),
                                w["proj"], w["one"], layer.num_kv_heads, layer.groups, w["norm"])

    def step_keys(self, layer, k, out):
        """The partial key cache's rows of k (b, h_kv, n, d), written into out (b*h_kv, n, c + 1) by one batched
        product (the liveness channel's projection column is zero)."""
        b, hk, n, d = k.shape
        torch.bmm(k.reshape(b * hk, n, d).to(out.dtype), self.step_weights(layer, b)["keys"], out=out)

    def step_weights(self, layer, b: int) -> dict:
        """What `speculated_query` and `step_keys` multiply by, made once per layer and batch size: the query weight
        (OPT: the partial rows with the query scale and the constant channel; RoPE: the layer's own, transposed, not
        copied), its bias, the projection [P; J^T P] x the logit scale (RoPE) and [P | 0] (keys), per batch row."""
        key = (layer.index, b)
        if key in self._step:
            return self._step[key]
        P = self._projections[layer.index]  # (hk, d, r) in the score dtype
        hk, d, r = P.shape
        zero = P.new_zeros(hk, d, 1)
        w = {"keys": torch.cat([P, zero], -1).repeat(b, 1, 1), "norm": None, "proj": None, "one": None}
        partial = self._partial_q[layer.index]
        if partial is not None:  # OPT: the partial rows + a zero row per head whose bias is 1, times the query scale
            weight, bias = partial
            h, hidden = layer.num_heads, weight.shape[-1]
            rows = torch.cat([weight.view(h, r, hidden).to(P.dtype), P.new_zeros(h, 1, hidden)], 1)
            shift = (torch.zeros(h, r, dtype=P.dtype, device=P.device) if bias is None
                     else bias.view(h, r).to(P.dtype))
            shift = torch.cat([shift * layer.query_scale, P.new_ones(h, 1)], 1)
            w["weight"] = (rows * layer.query_scale).view(-1, hidden).t().contiguous().to(weight.dtype)
            w["bias"] = shift.view(-1).to(weight.dtype)
        else:  # RoPE: rope(y) . P = (y * cos) . P + (y * sin') . J^T P, J = rotate_half, J^T P = [P_2; -P_1]
            half = d // 2
            rotated = torch.cat([P[:, half:], -P[:, :half]], 1)
            proj = torch.cat([P, rotated], 1) * (layer.logit_scale * layer.query_scale)  # (hk, 2d, r)
            w["proj"] = torch.cat([proj, P.new_zeros(hk, 2 * d, 1)], -1).repeat(b, 1, 1)  # (b*hk, 2d, r + 1)
            w["one"] = torch.cat([P.new_zeros(r), P.new_ones(1)]).view(1, 1, r + 1)
            w["weight"], w["bias"] = layer.q_proj.weight.t(), layer.q_proj.bias
            if layer._q_norm is not None:
                w["norm"] = layer._q_norm if self.qk_norm == "rms" else partial_norm(layer._q_norm)
        self._step[key] = w
        return w

    def rotary_factors(self, session, layer) -> torch.Tensor | None:
        """(b, 1, 1, 2, d) in the score dtype: [cos | sin with its halves swapped] of the current forward's position
        (what `speculated_query` multiplies the query by), made once per forward; None without RoPE."""
        tables = session.rope_of(layer) if layer.family != "opt" else None
        if tables is None:
            return None
        cos, sin = tables  # (b, 1, d)
        held = self._rope.get(layer.layer_type)
        if held is None or held[0] is not cos:
            half = cos.shape[-1] // 2
            factors = torch.cat([cos, sin[..., half:], sin[..., :half]], -1).to(score_dtype(cos.dtype))
            held = self._rope[layer.layer_type] = (cos, factors.view(cos.shape[0], 1, 1, 2, -1))
        return held[1]

    def step_select(self, session, layer, q, buf, thr, width):
        """capture=graph|compile on a CUDA device: the speculation and the selection as one captured graph of this
        layer (re-captured when its buffers or batch change), fed the speculation input; else eagerly."""
        if self.capture == "none" or buf.keys.device.type != "cuda":
            return super().step_select(session, layer, q, buf, thr, width)
        x = self.speculation_input(session, layer)
        b = x.shape[0]
        rope = self.rotary_factors(session, layer)
        key = (buf.keys.data_ptr(), thr.data_ptr(), b)
        held = self._captured.get(layer.index)
        if held is None or held[0] != key:
            w = self.step_weights(layer, b)
            rope_in = None if rope is None else rope.clone()  # the graph's own copy, refreshed before each replay
            hk, g, alpha, reduce = layer.num_kv_heads, layer.groups, self.alpha, self.gqa_reduce

            def fn(x2d):
                query = speculated_query(x2d, w["weight"], w["bias"], rope_in, w["proj"], w["one"], hk, g, w["norm"])
                return select_step(query, buf.keys_t, buf.live, thr, alpha=alpha, width=width, batch=b, reduce=reduce)

            held = self._captured[layer.index] = (key, CapturedSelection(fn, x.view(b, -1), self.capture), rope_in)
        if rope is not None:
            held[2].copy_(rope)
        self.capture_used = True
        return held[1](x.view(b, -1))

    def score_queries(self, session, layer, q):
        """`q` (the true query) is deliberately unused: even speculate_from=current recomputes it from the
        layer's input, through the partial weight."""
        return self.speculation_queries(session, layer)

    def score_keys(self, layer, k):
        return self.project(k, layer.index)  # (b, h_kv, s, r): the partial key cache

    def score_channels(self, layer) -> float:
        """The partial key cache's columns (calibrated; before calibration, partial_ratio of head_dim)."""
        if self.skewing is not None:
            return int(self.skewing.columns[layer.index].sum(-1).max())
        return max(1, COLUMN_COUNTS[self.column_count](self.partial_ratio * layer.head_dim))

    def selection_flops(self, layer, past):
        """Scoring the partial key cache, plus the speculated query itself: without rotary embeddings (OPT) the
        partial query weight (r of d columns per head); with them the whole query weight, then each query head's
        skewed partial columns (d x r)."""
        r = self.score_channels(layer)
        rope = getattr(layer, "family", "llama") != "opt"
        q_weight = layer.hidden_size * layer.num_heads * (layer.head_dim if rope else r)
        return super().selection_flops(layer, past) + 2.0 * (q_weight + rope * layer.num_heads * layer.head_dim * r)

    def partial_columns(self) -> list[int]:
        """Columns kept per KV head, per layer (for byte accounting)."""
        return [int(c.sum(-1).max()) for c in self.skewing.columns]


def partial_projection(skewing: Skew, layer: int, head_dim: int) -> torch.Tensor:
    """(h_kv, d, r) in the score dtype: x @ it = the skewed x's kept columns (zero where a head keeps fewer). The
    rotation, where it is not folded into the weights, is applied in float32 at least, whatever the model's dtype."""
    rotation, kept, cols = skewing.rotations[layer], skewing.kept[layer], skewing.columns[layer]  # (hk, d, d), (hk, r)
    dtype = score_dtype(cols.dtype)
    hk = kept.shape[0]
    basis = torch.eye(head_dim, dtype=dtype, device=cols.device).expand(hk, -1, -1) if rotation is None else rotation
    chosen = basis.to(dtype).gather(-1, kept[:, None, :].expand(hk, head_dim, -1))  # (hk, d, r)
    return chosen * cols.to(dtype).gather(-1, kept)[:, None, :]


def partial_norm(norm):
    """qk_norm="weight": the norm's per-channel weight without the RMS (`norm_weight_only`), as a callable."""
    return lambda y: norm_weight_only(norm, y)


def partial_query_weight(layer: AttentionLayer, projection: torch.Tensor):
    """(weight (h * r, hidden), bias (h * r,) or None): the query weight's rows that make the partial columns of a
    layer without rotary embeddings, so the speculated query costs r/d of the projection. None with RoPE."""
    if layer.family != "opt":
        return None
    h, d = layer.num_heads, layer.head_dim
    proj = projection.repeat_interleave(layer.groups, dim=0)  # (h, d, r): each query head its KV head's columns
    w = layer.q_proj.weight.view(h, d, -1)
    weight = torch.einsum("hdr,hdi->hri", proj.to(w.dtype), w).reshape(-1, w.shape[-1])
    bias = layer.q_proj.bias
    if bias is not None:
        bias = torch.einsum("hdr,hd->hr", proj.to(bias.dtype), bias.view(h, d)).reshape(-1)
    return weight, bias
