"""The one place that touches transformers internals.

It loads a model + tokenizer (from what infinigen/models.py checks and locates without importing torch), exposes the per-layer pieces KV methods need (`AttentionLayer`), registers this
project's attention function through the public `AttentionInterface` / `AttentionMaskInterface`, and installs a
KV method into a model for the duration of a `with install(...)` block (hooks removed on exit).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

# Only the cache classes at import time: the model classes, tokenizers and attention registries cost seconds
# to import and are imported where they are used, so a bad config is refused before any of that.
from transformers.cache_utils import Cache, DynamicLayer

from infinigen.models import (  # noqa: F401 (re-exported)
    ATTENTION_KERNELS, ModelUnavailable, check_attention, check_supported, source, validate_model,
)

ATTN_NAME = "kv_method"


# ----------------------------------------------------------------------------------------------- loading


def resolve_device(device: str | None) -> str:
    """The device to run on (None: cuda if available else cpu); refuses one this machine does not have."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = str(device).partition(":")
    if kind == "cpu" and not index:
        return "cpu"
    if kind == "cuda" and (not index or index.isdigit()):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index or 0) >= count:
            raise ValueError(f"device={device!r} is not available: this machine has {count} CUDA device(s)"
                             f"{'' if count else ' (or torch has no CUDA)'}; use device=cpu"
                             + (f" or cuda:0..cuda:{count - 1}" if count else ""))
        return str(device)
    if kind == "mps" and not index:
        if not torch.backends.mps.is_available():
            raise ValueError("device='mps' is not available on this machine; use device=cpu")
        return "mps"
    raise ValueError(f"device must be null (auto), cpu, cuda, cuda:N or mps, got {device!r}")


def model_config(cfg):
    """The transformers config a model cfg describes (no weights touched)."""
    from transformers import AutoConfig

    if cfg.get("random_init"):
        from omegaconf import OmegaConf

        # plain lists and dicts: transformers' configs type-check theirs (Gemma 3's layer_types)
        arch = OmegaConf.to_container(cfg.arch, resolve=True) if OmegaConf.is_config(cfg.arch) else dict(cfg.arch)
        model_type = arch.pop("model_type")
        check_supported(model_type)
        return AutoConfig.for_model(model_type, **arch)
    src, extra = source(cfg)
    try:
        path, kwargs = _converted_source(src, extra, convert=False)
        config = AutoConfig.from_pretrained(path, **kwargs)
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        src, extra = source(cfg)
        try:
            path, kwargs = _converted_source(src, extra, convert=True)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, device_map=cfg.get("device_map"), attn_implementation="eager", **kwargs
            )
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
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


@lru_cache(maxsize=None)
def converted_dir(gguf: Path) -> Path:
    """Where a GGUF file's one-time conversion to a transformers folder lives: keyed by the file's sha256 and the
    transformers version that converted it, under $XDG_CACHE_HOME (default ~/.cache)/infinigen/checkpoints."""
    import transformers

    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infinigen" / "checkpoints"
    return root / f"{gguf.stem}-{digest.hexdigest()[:16]}-transformers{transformers.__version__}"


def _converted_gguf(gguf: Path, convert: bool) -> Path | None:
    # transformers parses a GGUF's metadata in Python once for the config and again for the tokenizer and the
    # weights: ~40 s per load of SmolLM2's 98 MB file on a 2-core machine, against ~1 s for the float32
    # safetensors it dequantises to. The conversion is exact (the same float32 tensors), and done once.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_dir(gguf)
    if (folder / "config.json").is_file():
        return folder
    if not convert:
        return None
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # marks the GGUF origin; the tensors are plain float32 now
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        del loaded
        model.save_pretrained(staging)
        del model
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users of a shared cache
        try:
            staging.rename(folder)  # atomic: a concurrent process sees no folder or a whole one
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _converted_source(src: str, extra: dict, convert: bool) -> tuple[str, dict]:
    """(src, extra) of `models.source`, with a GGUF file replaced by its converted folder: once it exists, or
    (convert=True) after converting it."""
    if "gguf_file" not in extra:
        return src, extra
    folder = _converted_gguf(Path(src, extra["gguf_file"]).resolve(), convert)
    return (str(folder), {k: v for k, v in extra.items() if k != "gguf_file"}) if folder else (src, extra)


def tokenizer_of(model):
    """The tokenizer `load` returned with this model (None for random-init models: they read bytes)."""
    return _TOKENIZERS.get(model)


def remember_tokenizer(model, tokenizer) -> None:
    """`tokenizer_of(model)` is `tokenizer` from now on (a model loaded by its owner, not by `load`)."""
    _TOKENIZERS[model] = tokenizer


def reads_bytes(model) -> bool:
    """Whether text reaches `model` as UTF-8 bytes: a random-init model `load` built (it has no tokenizer)."""
    return model in _TOKENIZERS and _TOKENIZERS[model] is None


def encode(tokenizer, text: str, vocab_size: int) -> torch.Tensor:
    """Token ids (n,); random-init models have no tokenizer and read the UTF-8 bytes (mod vocab) instead."""
    if tokenizer is None:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % vocab_size
    return tokenizer(text, return_tensors="pt").input_ids[0]


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


def byte_tokenizer(eos_token: str = "<|endoftext|>") -> "PreTrainedTokenizerFast":
    """A tokenizer for models without one: one token per UTF-8 byte (id = byte value), eos = id 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

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
    (what positions/masks are derived from); `stored` is what is physically kept. `reserve(n)` preallocates room
    for n entries, so appending a token writes into a buffer instead of re-allocating the cache.
    """

    def __init__(self):
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.seen = 0
        self.entries: dict[str, torch.Tensor] = {}  # per stored entry, (b, h_kv, s, ...)
        self.state: dict[str, Any] = {}
        self._room = 0
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: dict[str, torch.Tensor] = {}  # per-entry tensors' preallocated (b, h_kv, room, ...) buffers

    def reserve(self, entries: int) -> None:
        self._room = entries

    def _appended(self, name: str, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """old (b, h_kv, n, ...) with new (b, h_kv, t, ...) after it. Written into a buffer reserved for `room`
        entries while old is still that buffer's prefix (a decode step then allocates nothing and its op count
        does not grow); concatenated once something replaced it (an eviction's gather)."""
        n = 0 if old is None else old.shape[2]
        t = new.shape[2]
        buf = self._rows.get(name)
        chained = old is None or (buf is not None and old.data_ptr() == buf.data_ptr() and old.shape[3:] == buf.shape[3:]
                                  and old.dtype == buf.dtype and old.shape[:2] == buf.shape[:2])
        if not self._room or n + t > self._room or not chained:
            self._rows.pop(name, None)
            return new if old is None else torch.cat([old, new], dim=2)
        if old is None:
            buf = new.new_empty(*new.shape[:2], self._room, *new.shape[3:])
            self._rows[name] = buf
        buf[:, :, n : n + t] = new
        return buf[:, :, : n + t]

    def append_entries(self, **new: torch.Tensor) -> None:
        """Per-entry state (b, h_kv, t, ...) for the t newest entries, after what `entries` holds."""
        for name, value in new.items():
            self.entries[name] = self._appended(name, self.entries.get(name), value)

    def append_positions(self, b: int, hk: int, t: int, device) -> None:
        pos = torch.arange(self.seen, self.seen + t, device=device).expand(b, hk, t)
        self.positions = self._appended(" positions", self.positions, pos)
        self.seen += t

    def update(self, key_states, value_states, *args, **kwargs):
        b, hk, t, _ = key_states.shape
        self.append_positions(b, hk, t, key_states.device)
        n = self.stored
        if self._room and self._buffers is None and n == 0:
            self._buffers = tuple(x.new_empty(b, hk, self._room, x.shape[-1]) for x in (key_states, value_states))
        if self._buffers is None or n + t > self._room:
            self._buffers = None
            return super().update(key_states, value_states)
        kb, vb = self._buffers
        kb[:, :, n : n + t] = key_states
        vb[:, :, n : n + t] = value_states
        self.keys, self.values = kb[:, :, : n + t], vb[:, :, : n + t]
        self.device, self.is_initialized = key_states.device, True
        return self.keys, self.values

    @property
    def stored(self) -> int:
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as attention sees them, (b, h_kv, s, d)."""
        return self.keys, self.values

    def recent_keys(self, n: int) -> torch.Tensor:
        """Keys of the last n stored entries as attention sees them, (b, h_kv, n, d)."""
        return self.kv()[0][:, :, -n:]

    def selected(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a query attends when it selected `keep` (b, h_kv, past) of the entries before the current (last)
        one: (keys, values, mask (b, h_kv, 1, s) or None). Here every entry is resident, so the selection is a
        mask over them all; the offloading runtime's store returns just the gathered rows."""
        keys, values = self.kv()
        current = keep.new_ones(*keep.shape[:2], 1)
        return keys, values, torch.cat([keep, current], dim=-1)[:, :, None]

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the entries at `index` (b, h_kv, n) along the sequence axis (per head); per-entry method
        state in `entries` ((b, h_kv, s, ...) tensors) is gathered alongside."""
        self._buffers = None
        self._rows.clear()
        if self.keys is not None:
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

    def entry_bytes(self) -> int:
        """Bytes of the per-entry bookkeeping (positions, method state) kept beside the KV."""
        tensors = list(self.entries.values()) + ([self.positions] if self.positions is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ transformers' cache operations
    # What `model.generate` may ask of a cache layer besides `update`. Beam search reorders the batch rows every
    # step (`reorder_cache`); the batch is repeated or narrowed by `batch_repeat_interleave` / `batch_select_indices`.
    # A method's per-row state must follow its keys, so every batch-indexed tensor of the store moves with them:
    # keys, values, positions, `entries`, whatever `state` holds (nested in dicts, lists, tuples) and the tensors a
    # subclass keeps as attributes, i.e. every such tensor whose first dimension is the batch. `crop` (assisted
    # decoding's rollback, a DeferredStopCheck's undo) is refused: an evicting or compressing store cannot give
    # back what it dropped.
    is_croppable = False

    def _each_row_tensor(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.positions is None:
            return
        batch = self.positions.shape[0]

        def walk(x):
            if isinstance(x, torch.Tensor):
                return fn(x) if x.dim() and x.shape[0] == batch else x
            if isinstance(x, dict):
                return {k: walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(walk(v) for v in x)
            return x

        self._buffers = None  # preallocated rows belong to the old batch order: the next append concatenates
        self._rows.clear()
        for name, value in list(vars(self).items()):
            if name not in ("_buffers", "_rows"):
                setattr(self, name, walk(value))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._each_row_tensor(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._each_row_tensor(lambda x: x[indices.to(x.device) if isinstance(indices, torch.Tensor) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each_row_tensor(lambda x: x.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(f"a KV method's cache cannot be cropped (asked to drop {abs(tokens_to_remove)} tokens): "
                             "what it evicted or compressed cannot be given back (assisted / prompt-lookup decoding "
                             "is not supported)")

    def reset(self) -> None:
        """Empty, as new: a reset cache starts another sequence."""
        self.keys = self.values = None
        self.is_initialized = False
        self.positions, self.seen = None, 0
        self.entries, self.state = {}, {}
        self._buffers = None
        self._rows = {}


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


# ----------------------------------------------------------------------------------------------- model.generate

# `model.generate` modes a KV method's cache runs (transformers' GenerationMode values): every one feeds the prompt
# once, then one token per row and step; beam search reorders the rows (KVStore.reorder_cache)
GENERATION_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")
ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def generation_config(model, kwargs: dict):
    """The GenerationConfig a `model.generate(**kwargs)` call runs with: `kwargs["generation_config"]` or the model's
    own, updated with the kwargs that name its fields (transformers' public GenerationConfig API; a copy)."""
    import copy

    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def check_generation(config, kwargs: dict | None = None) -> None:
    """Refuses, in one line (ValueError), a generation a KV method's cache cannot run: assisted / prompt-lookup
    decoding (a verify step of several tokens, then a rollback), prefill chunking (a prefill in pieces), another
    cache (`cache_implementation`), no cache, a custom decoding loop and the modes transformers runs from the Hub
    (contrastive search, DoLa, group / constrained beam search)."""
    kwargs = kwargs or {}
    assisted = [k for k in ASSISTED
                if kwargs.get(k) not in (None, False) or getattr(config, k, None) not in (None, False)]
    if assisted:
        raise ValueError(f"{assisted[0]}: assisted / prompt-lookup decoding is not supported with a KV method (its "
                         "verify step feeds several draft tokens at once and rolls back the rejected ones, which a "
                         "cache that evicted or compressed its past cannot do)")
    if kwargs.get("custom_generate") is not None:
        raise ValueError("custom_generate: a custom decoding loop is not supported with a KV method")
    if getattr(config, "prefill_chunk_size", None):
        raise ValueError(f"prefill_chunk_size={config.prefill_chunk_size}: prefill chunking is not supported with a "
                         "KV method (its prefill is one dense forward over the prompt, after which it compresses or "
                         "indexes what it keeps)")
    if config.cache_implementation is not None:
        raise ValueError(f"cache_implementation={config.cache_implementation!r}: the KV method's cache is the cache")
    if config.use_cache is False:
        raise ValueError("use_cache=False: a KV method runs through its cache")
    mode = getattr(config.get_generation_mode(), "value", None)
    if mode not in GENERATION_MODES:
        key = {"contrastive_search": "penalty_alpha", "dola_generation": "dola_layers", "group_beam_search":
               "num_beam_groups", "constrained_beam_search": "force_words_ids"}.get(mode, "generation_config")
        raise ValueError(f"{key}: {str(mode).replace('_', ' ')} is not supported with a KV method (supported: greedy "
                         "decoding, sampling, beam search with or without sampling, num_return_sequences)")


def max_length(config, prompt: int) -> int:
    """The longest sequence a generation of a `prompt`-token input reaches (transformers' own rule: max_new_tokens
    wins over max_length; neither set: 20 new tokens)."""
    if config.max_new_tokens is not None:
        return prompt + config.max_new_tokens
    if config.max_length is not None:
        return max(config.max_length, prompt + 1)
    return prompt + 20


@contextmanager
def generate_hook(model, around: Callable[[Callable, tuple, dict], Any]):
    """For the block, `model.generate(*args, **kwargs)` is `around(generate, args, kwargs)`, which checks the call
    and runs transformers' own `generate`: an attribute of this model instance, removed on exit (transformers itself
    is untouched)."""
    own = model.__dict__.get("generate")
    original = model.generate

    def generate(*args, **kwargs):
        return around(original, args, kwargs)

    generate.__doc__ = original.__doc__
    model.__dict__["generate"] = generate
    try:
        yield
    finally:
        if own is None:
            model.__dict__.pop("generate", None)
        else:
            model.__dict__["generate"] = own


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
