"""Loading: the device to run on, a model's transformers config, the model and its tokenizer.

`load` builds what infinigen/models.py checks and locates without importing torch: a random-init model of a config's
shape, or a checkpoint (a GGUF file through its one-time float32 conversion to a transformers folder,
`converted_dir`); `model.multihead=true` repeats each KV head for its query heads (infinigen/adapter/multihead.py). It
remembers which tokenizer came with each model (`tokenizer_of`); random-init models have none and read UTF-8 bytes
(`encode`, `byte_tokenizer`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from infinigen.models import ModelUnavailable, check_supported, source, validate_model


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
        # float64 weights are the float32 draw widened: a float64 run computes the float32 model exactly (as the
        # reference checks run the authors' code on it: docs/reference.md), not another random model
        widen = dtype == torch.float64
        with torch.device(device):  # built where it runs: a 13B model is never materialised in host memory
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if widen else dtype)
        if widen:  # only then: `.to` would also cast the buffers a half-precision model keeps in float32
            model = model.to(dtype)
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
    if cfg.get("multihead"):  # one KV head per query head: the same logits (infinigen/multihead.py)
        from infinigen.adapter.multihead import repeat_kv_heads

        model = repeat_kv_heads(model)
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
