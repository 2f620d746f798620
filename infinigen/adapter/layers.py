"""The per-layer view of a decoder: its blocks, their norms and feed-forward span, the LM head, and
`AttentionLayer`, what a KV method may know about one attention layer (projections, heads, RoPE, QK-norm, sliding
window), read off the blocks of every supported family alike (Llama, Mistral, Qwen2, OPT, Gemma 3: models.FAMILIES).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from infinigen.models import check_supported


def decoder_layers(model) -> list[torch.nn.Module]:
    inner = model.model
    return list(inner.decoder.layers if hasattr(inner, "decoder") else inner.layers)


def _input_norm(block) -> torch.nn.Module:
    return block.self_attn_layer_norm if hasattr(block, "self_attn_layer_norm") else block.input_layernorm


def post_attention_norm(block) -> torch.nn.Module:
    """The norm whose input is the residual stream right after the block's attention was added (Llama's
    post_attention_layernorm; Gemma's pre_feedforward_layernorm, its post_attention_layernorm normalising the
    attention output before the add; OPT's final_layer_norm, or its self_attn_layer_norm in post-norm models)."""
    if hasattr(block, "pre_feedforward_layernorm"):
        return block.pre_feedforward_layernorm
    if hasattr(block, "post_attention_layernorm"):
        return block.post_attention_layernorm
    return block.final_layer_norm if block.do_layer_norm_before else block.self_attn_layer_norm


def pre_norm(model) -> bool:
    """Whether each block normalises its attention input (Llama, OPT >= 1.3B / 125M) rather than its output
    (OPT-350M, `do_layer_norm_before=False`): only then is the residual stream an un-normalised input."""
    return bool(getattr(model.config, "do_layer_norm_before", True))


def final_hidden(model, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The forward up to the LM head's input (final norm applied): (b, t) -> (b, t, hidden). Scoring from these in
    blocks of rows never forms the (b, t, vocab) logits the model's own forward returns."""
    return model.get_decoder()(input_ids, **kwargs).last_hidden_state


def lm_head(model) -> torch.nn.Module:
    """hidden -> logits. For every supported family (FAMILIES) the logits are exactly lm_head(final_hidden):
    no softcapping or logit scale after it (a Gemma config that sets one is refused)."""
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        raise ValueError("final_logit_softcapping is set in the model's config: logits scored from "
                         "lm_head(final_hidden) would not be the model's (Gemma 3 leaves it unset)")
    return model.get_output_embeddings()


def ffn_span(block) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(first, last) module of a decoder block's feed-forward part, for timing hooks: Llama's `mlp`, OPT's fc1..fc2."""
    if hasattr(block, "mlp"):
        return block.mlp, block.mlp
    return block.fc1, block.fc2


@dataclass
class AttentionLayer:
    """What a KV method may know about one attention layer. Queries/keys come out exactly as the attention
    function sees them (post-RoPE for Llama; per-head RMS-normalised, then rotated for Gemma 3; projected, biased
    and, for OPT, pre-scaled queries)."""

    index: int
    family: str
    module: torch.nn.Module
    input_norm: torch.nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    logit_scale: float  # the `scaling` the attention applies to q·k (1.0 for OPT: folded into q)
    query_scale: float  # factor applied to q_proj's output before attention (OPT) or 1.0
    # a local layer attends the `sliding_window` most recent positions, its own included (Gemma 3's
    # sliding_attention layers); None: every earlier position (a global layer)
    sliding_window: int | None = None
    layer_type: str | None = None  # which of the model's RoPE tables the layer's positions use (Session.rope_of)
    _rope: Callable | None = field(default=None, repr=False)
    _q_norm: Callable | None = field(default=None, repr=False)  # per-head RMS norm of q / k before RoPE (QK-norm)
    _k_norm: Callable | None = field(default=None, repr=False)

    @property
    def q_proj(self) -> torch.nn.Linear:
        return self.module.q_proj

    @property
    def k_proj(self) -> torch.nn.Linear:
        return self.module.k_proj

    @property
    def v_proj(self) -> torch.nn.Linear:
        return self.module.v_proj

    @property
    def hidden_size(self) -> int:
        return self.q_proj.in_features

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        b, t, _ = y.shape
        return y.view(b, t, -1, self.head_dim).transpose(1, 2)  # (b, heads, t, d)

    def rope(self, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Rotate (b, heads, t, d) by the layer's RoPE; identity for OPT."""
        if self._rope is None:
            return x
        cos, sin = position_embeddings
        rotated, _ = self._rope(x, x[:, :1], cos, sin)
        return rotated

    def queries(self, x: torch.Tensor, position_embeddings=None, rms: bool = True) -> torch.Tensor:
        """(b, t, hidden) normalised attention input -> (b, h, t, d) as the attention sees them. rms=False (QK-norm
        layers): the norm's per-channel weight without the division by each head vector's RMS, i.e. each query
        head as the attention sees it times its RMS (a positive factor per head and row)."""
        y = self._heads(self.q_proj(x) * self.query_scale)
        if self._q_norm is not None:
            y = self._q_norm(y) if rms else norm_weight_only(self._q_norm, y)
        return self.rope(y, position_embeddings)

    def keys(self, x: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        y = self._heads(self.k_proj(x))
        if self._k_norm is not None:
            y = self._k_norm(y)
        return self.rope(y, position_embeddings)  # (b, h_kv, t, d)


def norm_weight_only(norm: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm without its normalisation: y * (1 + weight), computed in float32 and cast back as the norm
    computes (Gemma3RMSNorm.forward)."""
    return (y.float() * (1.0 + norm.weight.float())).type_as(y)


def _sliding_window(config, attn) -> int | None:
    """The window of a local layer (as transformers' mask for it is built), None for a global one: Gemma 3 and
    Qwen2 mark it per layer; Mistral applies config.sliding_window to every layer."""
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    return getattr(attn, "sliding_window", None)


def attention_layers(model) -> list[AttentionLayer]:
    family = check_supported(model.config.model_type)
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attn_logit_softcapping is set in the model's config: the attention here computes plain "
                         "softmax(q·k · scaling) (Gemma 3 leaves it unset)")
    layer_types = getattr(model.config, "layer_types", None)
    out = []
    for i, block in enumerate(decoder_layers(model)):
        attn = block.self_attn
        heads = model.config.num_attention_heads
        kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
        head_dim = getattr(attn, "head_dim", None) or model.config.hidden_size // heads
        rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        out.append(
            AttentionLayer(
                index=i,
                family=family,
                module=attn,
                input_norm=_input_norm(block),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                logit_scale=1.0 if family == "opt" else attn.scaling,
                query_scale=attn.scaling if family == "opt" else 1.0,
                sliding_window=_sliding_window(model.config, attn),
                layer_type=layer_types[i] if family == "gemma3" else None,
                _rope=None if family == "opt" else rope,
                _q_norm=attn.q_norm if family == "gemma3" else None,
                _k_norm=attn.k_norm if family == "gemma3" else None,
            )
        )
    return out
