"""Installing a KV method: `install` routes every attention layer of a model through the method for the duration of a
`with install(...)` block (hooks removed on exit), and yields the `Session` it reads.

The routing goes through transformers' public `AttentionInterface` / `AttentionMaskInterface`: this project's
attention function (`_attention`, registered once by `register_attention`) finds the session and layer bound to the
attention module it is called for, and hands the forward to the method (sim mode, a decode prefill) or the decode
step to the method's `decode_attention`. Forward hooks capture the attention inputs and the residual-stream tensors a
method asks for; in decode mode a padded batch or a foreign cache is refused before the forward runs.
`attn_implementation` switches to the model's own attention instead (the reference forwards benchmarks time).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache

from infinigen.adapter.layers import AttentionLayer, attention_layers, decoder_layers, post_attention_norm, pre_norm
from infinigen.models import check_attention

ATTN_NAME = "kv_method"


@dataclass
class Session:
    """A KV method installed into one model for one `with install(...)` block."""

    method: Any
    mode: str  # "sim" | "decode"
    layers: list[AttentionLayer]
    dense_rows: int = 0
    max_len: int = 0  # the longest sequence this session will see (sim: t; decode: prompt + generated)
    attention: str = "fused"  # kernel of multi-token forwards (sim mode, decode prefill): ATTENTION_KERNELS
    cache: Cache | None = None
    # The captures hold the current and the previous layer only (what speculation reads): memory stays O(t), not
    # O(layers x t). attn_inputs: layer -> its normalised input x
    attn_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # captured only for a method whose `captures` names them (each is a (b, t, hidden) tensor per layer):
    block_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> residual stream entering its block
    attn_residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> residual after its attention
    position_embeddings: Any = None  # the (cos, sin) tables of the layer attending now
    rope_tables: dict = field(default_factory=dict)  # the current forward's (cos, sin) per layer_type (Gemma 3's two)
    model: Any = None
    plain_causal: bool = True  # the current forward's mask is plain causal (no padding): set per attention call
    causal_masks: dict = field(default_factory=dict)  # the last causal mask built, by (q_len, kv_len, device)
    # sim mode: sequence positions [first, last + 1) of the chunk of rows being attended, host ints (what a method
    # branches or slices on without reading its `rows` tensor back from the device)
    chunk: tuple[int, int] = (0, 0)
    # sim mode resuming after a prefix (infinigen/modes.py sim_prefix, sim_resume): what a method keeps beyond the KV
    # for the rows that continue (layer -> batch-first tensors and host values), left by the prefix's forward
    # (`carry`) and handed to the resumed one, its batch rows picked (`carried`)
    carry: dict = field(default_factory=dict)
    carried: dict = field(default_factory=dict)

    def longest(self, what: str) -> int:
        """max_len, for an option (`what`) defined as a fraction of the longest sequence; refused while unknown."""
        if not self.max_len:
            raise ValueError(f"{what} is a fraction of the longest sequence, which this session was not told "
                             "(model.generate inside infinigen.apply tells it; direct forwards: apply(..., max_len=N))")
        return self.max_len

    def rope_of(self, layer: AttentionLayer):
        """The (cos, sin) tables of `layer` in the current forward, also while another layer attends (speculation
        for layer i runs during layer i-1, whose tables may be the other RoPE base); None without RoPE."""
        return self.rope_tables.get(layer.layer_type, self.position_embeddings)


_BOUND: dict[int, tuple[Session, AttentionLayer]] = {}


def _as_allowed(mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor:
    """transformers' mask (bool, additive float, or None = plain causal) -> bool (b|1, 1, q, s)."""
    if mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]
    if mask.dtype != torch.bool:
        mask = mask == 0
    return mask[..., -kv_len:]


# A forward that brings several tokens to a store already holding a past: what transformers' prefill chunking,
# assisted / prompt-lookup decoding's verify step and a second turn on a reused cache do. A method's decode step
# attends one new token against what it kept of the past, so these are refused (check_generation refuses them
# before a `model.generate` call runs; this is the check of a forward made some other way).
MULTI_TOKEN = ("a forward of {q} tokens after {past} cached ones: a KV method's decode mode takes one new token per "
               "forward once its cache holds a past (prefill chunking, assisted / prompt-lookup decoding and a second "
               "turn on a reused cache are not supported)")


def _attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    # query (b, h, q, d); key/value (b, h_kv, s, d) as returned by the cache (or this forward's only)
    session, layer = _BOUND[id(module)]
    q_len, kv_len = query.shape[2], key.shape[2]
    if session.mode == "decode":
        # the cache has appended this forward's keys already: a decode step is a forward whose store held a past
        # before it (not one of a single query: a 1-token prompt is a prefill)
        store = session.cache.layers[layer.index] if session.cache is not None else None
        past = -1 if store is None else store.seen - q_len
        if past < 0:
            raise ValueError("decode mode: this forward does not go through the method's cache (pass the cache the "
                             "session holds, e.g. the one `infinigen.apply` yields, or none to model.generate)")
        if past > 0:
            if q_len != 1:
                raise ValueError(MULTI_TOKEN.format(q=q_len, past=past))
            out = session.method.decode_attention(session, layer, query, store)
            return out.transpose(1, 2).contiguous(), None  # (b, q, h, d)
    session.plain_causal = attention_mask is None
    if attention_mask is None:  # one causal mask per forward, shared by its layers
        shape = (q_len, kv_len, query.device)
        if shape not in session.causal_masks:
            session.causal_masks = {shape: _as_allowed(None, q_len, kv_len, query.device)}
        allowed = session.causal_masks[shape]
    else:
        allowed = _as_allowed(attention_mask, q_len, kv_len, query.device)
    out = session.method.forward_attention(session, layer, query, key, value, allowed)
    return out.transpose(1, 2).contiguous(), None  # (b, q, h, d)


def _mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("dtype", None)
    kwargs.pop("config", None)
    return sdpa_mask(*args, **kwargs)


@lru_cache(maxsize=None)
def register_attention() -> None:
    """Registers this project's attention and mask functions with transformers (once, on first install)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask)


CAPTURES = ("block_inputs", "attn_residuals")

PADDED = ("a padded batch (an attention_mask with zeros): a KV method's store, budgets and statistics count every "
          "position of its rows, so decode mode takes unpadded rows of one length; infinigen.generate runs a padded "
          "batch as groups of equal-length prompts")


def _decode_inputs(session: Session) -> Callable:
    """A forward pre-hook of the whole model in decode mode: refuses, before anything runs, a forward whose rows are
    padded or whose cache is not the session's (either would be computed silently wrong)."""

    def hook(module, args, kwargs):
        cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")
        if cache is not session.cache and len(args) < 2:  # (a cache passed by position: transformers' own order)
            raise ValueError("decode mode: this forward does not go through the method's cache (pass the cache the "
                             "session holds, e.g. the one `infinigen.apply` yields, or none to model.generate)")
        mask = kwargs.get("attention_mask")
        # checked at the prefill only (a decode step only appends ones to it): reading it back syncs the host
        prefill = session.cache is None or not session.cache.layers or session.cache.layers[0].seen == 0
        if prefill and isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all()):
            raise ValueError(PADDED)

    return hook


def _residual_hooks(model, session: Session, captures) -> list[tuple[torch.nn.Module, Callable]]:
    """(module, forward pre-hook) pairs filling the residual-stream captures a method asks for."""
    unknown = set(captures) - set(CAPTURES)
    if unknown:
        raise ValueError(f"unknown captures {sorted(unknown)}; known: {CAPTURES}")
    if captures and not pre_norm(model):
        raise ValueError(f"{session.method!r} reads the residual stream ({', '.join(captures)}) through the next "
                         "layer's input norm; this OPT model normalises after attention and the MLP "
                         "(do_layer_norm_before=False), so it has no input norm")

    def block_input(i):
        def hook(module, args, kwargs):
            session.block_inputs[i] = args[0] if args else kwargs["hidden_states"]  # (b, t, hidden)
            session.block_inputs.pop(i - 2, None)

        return hook

    def attn_residual(i):
        def hook(module, args, kwargs):
            # OPT flattens to (b*t, hidden) before this norm; the attention input has the (b, t, hidden) shape
            session.attn_residuals[i] = args[0].view(session.attn_inputs[i].shape)
            session.attn_residuals.pop(i - 2, None)

        return hook

    hooks = []
    for i, block in enumerate(decoder_layers(model)):
        if "block_inputs" in captures:
            hooks.append((block, block_input(i)))
        if "attn_residuals" in captures:
            hooks.append((post_attention_norm(block), attn_residual(i)))
    return hooks


@contextmanager
def attn_implementation(model, name: str):
    """The model's own attention ("eager", "sdpa", ...) for the block: the reference forwards benchmarks time."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def install(model, method, mode: str = "sim", dense_rows: int = 0, cache: Cache | None = None, max_len: int = 0,
            attention: str = "fused"):
    """Route every attention layer of `model` through `method` until the block exits. Besides each layer's
    attention input, the residual-stream tensors named in `method.captures` are recorded on the session, and
    `method.attention_end(session, layer)` is called once a layer's attention output joined the residual stream."""
    if mode not in ("sim", "decode"):
        raise ValueError(f"mode must be 'sim' or 'decode', got {mode!r}")
    check_attention(attention)
    register_attention()
    layers = attention_layers(model)
    session = Session(method=method, mode=mode, layers=layers, dense_rows=dense_rows, cache=cache, max_len=max_len,
                      attention=attention)
    residual_hooks = _residual_hooks(model, session, getattr(method, "captures", ()))
    previous = model.config._attn_implementation
    handles = []

    def capture(attn_layer):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            session.attn_inputs[attn_layer.index] = x
            session.attn_inputs.pop(attn_layer.index - 2, None)
            session.position_embeddings = kwargs.get("position_embeddings")

        return hook

    def attention_end(attn_layer):
        def hook(module, args):
            session.method.attention_end(session, attn_layer)

        return hook

    def rope_tables(module, args, kwargs, output):
        # Gemma 3 computes one (cos, sin) pair per layer type before its first layer: rotary_emb(x, ids, type)
        layer_type = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
        session.rope_tables[layer_type] = output

    outer = {id(layer.module): _BOUND.get(id(layer.module)) for layer in layers}  # installs may nest
    for layer in layers:
        _BOUND[id(layer.module)] = (session, layer)
        handles.append(layer.module.register_forward_pre_hook(capture(layer), with_kwargs=True))
    for module, hook in residual_hooks:  # before the attention_end hooks, which may read what they capture
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    for layer, block in zip(layers, decoder_layers(model)):
        handles.append(post_attention_norm(block).register_forward_pre_hook(attention_end(layer)))
    rotary = getattr(model.model, "rotary_emb", None)
    if any(layer.layer_type is not None for layer in layers) and rotary is not None:
        handles.append(rotary.register_forward_hook(rope_tables, with_kwargs=True))
    if mode == "decode":
        handles.append(model.register_forward_pre_hook(_decode_inputs(session), with_kwargs=True))
    session.model = model
    model.set_attn_implementation(ATTN_NAME)
    try:
        method.bind(session)  # inside the try: a failing calibration must not leave the model patched
        yield session
    finally:
        for h in handles:
            h.remove()
        for key, bound in outer.items():
            if bound is None:
                _BOUND.pop(key, None)
            else:
                _BOUND[key] = bound
        model.set_attn_implementation(previous)
