"""Every KV method from a transformers user's own code: build one by its conf/method name, apply it to a model,
generate.

    model, tokenizer = load_model("smollm2-135m")                  # or any supported model you loaded yourself
    method = load_method("infinigen", model=model, budget=0.1)     # conf/method/infinigen.yaml + your options
    with apply(model, method) as cache:                            # decode mode for the block
        ids = model.generate(input_ids, cache=cache, max_new_tokens=32)   # (cache=... may be left out)
    out = generate(model, method, input_ids, 32)                   # the same, + batches of any lengths + stats

`load_method` composes conf/method/<name>.yaml as `python run.py method=<name>` does (the model's family picks
InfiniGen's speculation setting: infinigen/selected.py; `${data_dir}` is `data_dir=`, else $DATA_DIR) and refuses
bad input with the CLI's checks, before any model is touched. `apply` installs the method in decode mode (a dense
prefill of the prompt, then one token per row and step through a cache holding what the method keeps) and makes
`model.generate` run through it: a call is checked first (modes a KV method's cache cannot run are refused in one
line: adapter.check_generation), then runs on a fresh cache, or on the one `apply` yields when passed. `generate`
runs a batch whose prompts differ in length as groups of equal-length prompts (left padding, as transformers pads
for decoder-only generation), so each row's tokens are those of its prompt run alone.

The runtime layer: it resolves method configs by their `_target_` and names no method class.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from infinigen import adapter, modes
from infinigen.models import check_available, conf_dir


def method_names() -> list[str]:
    """The methods `load_method` builds: conf/method/*.yaml."""
    return sorted(p.stem for p in (conf_dir() / "method").glob("*.yaml"))


def model_names() -> list[str]:
    """The models `load_model` loads: conf/model/*.yaml."""
    return sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))


def _named(kind: str, name: str, names: list[str]) -> Path:
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"unknown {kind} {name!r}; one of: {', '.join(names)}")
    return conf_dir() / kind / f"{name}.yaml"


# ----------------------------------------------------------------------------------------------- models


def load_model(name: str, device: str | None = None, **options):
    """(model, tokenizer) of conf/model/<name>.yaml with `options` overriding its keys (dtype="bfloat16",
    local_path=..., random_init=True, ...), checked as the CLI checks them, on `device` (None: cuda if available).
    Random-init models (the tiny test models) have no tokenizer of their own: they get one that reads UTF-8 bytes."""
    path = _named("model", name, model_names())
    cfg = OmegaConf.load(path)
    unknown = [k for k in options if k not in cfg]
    if unknown:
        raise ValueError(f"model.{unknown[0]}: model {name!r} has no such option; its options: {', '.join(cfg)}")
    cfg = OmegaConf.merge(cfg, options)
    adapter.validate_model(cfg)
    check_available(cfg)
    model, tokenizer = adapter.load(cfg, device=adapter.resolve_device(device))
    if tokenizer is None and model.config.vocab_size > 256:
        tokenizer = adapter.byte_tokenizer()  # for text in and out; the model still reads the bytes it was built on
    return model, tokenizer


# ----------------------------------------------------------------------------------------------- methods


def load_method(name: str, model=None, *, data_dir: str | None = None, **options):
    """The KV method conf/method/<name>.yaml describes, with `options` overriding its hyperparameters, as
    `python run.py method=<name> method.<key>=<value>` builds it: composed with `model`'s family where a default
    depends on it (InfiniGen's speculation setting, infinigen/selected.py; without a model, the paper's), `${data_dir}`
    resolved to `data_dir` (None: $DATA_DIR, else null), then the CLI's checks: each value's type and range
    (ValueError naming the option), the data the method reads (InfiniGen's calibration text) and, with `model`,
    its attention shape. Nothing is loaded or computed here; InfiniGen calibrates when first applied (cached in
    memory per model and settings, and on disk in `method.cache_dir` as the CLI caches it)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    cfg = OmegaConf.load(_named("method", name, method_names()))
    unknown = [k for k in options if k not in cfg or k == "_target_"]
    if unknown:
        allowed = ", ".join(k for k in cfg if k != "_target_") or "none"
        raise ValueError(f"method.{unknown[0]}: {name} has no such option; its options: {allowed}")
    try:
        cfg = OmegaConf.merge(cfg, options)
    except Exception as err:  # noqa: BLE001 -- OmegaConf's own errors for values it cannot hold (a tensor, ...)
        raise ValueError(f"method options of {name}: {err}".splitlines()[0]) from err
    root = OmegaConf.create({
        "data_dir": data_dir if data_dir is not None else os.environ.get("DATA_DIR"),
        "model": {} if model is None else {"arch": {"model_type": model.config.model_type}},
    })
    root.method = cfg
    try:
        method = instantiate(root.method)
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ValueError(str(cause).splitlines()[0] if str(cause) else repr(cause)) from err
    method.check_data()
    if model is not None:
        layer = adapter.attention_layers(model)[0]
        method.check_shape(layer.num_kv_heads, layer.head_dim)
    return method


# ----------------------------------------------------------------------------------------------- applying


def _prompt_ids(args: tuple, kwargs: dict) -> torch.Tensor:
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds: pass the prompt as input_ids (b, t) to generate through a KV method")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, tokens) tensor of token ids, got {type(ids).__name__}"
                         + (f" of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else ""))
    return ids


@contextmanager
def apply(model, method, *, tokenizer=None, max_len: int | None = None, attention: str = "fused"):
    """`method` runs inside every attention layer of `model` until the block exits (decode mode: a dense prefill of
    the prompt, then one token per row and step), and `model.generate` goes through it. Yields the cache (a
    transformers `Cache` whose layers hold what the method keeps): pass it as `cache=` to read it afterwards, or
    pass none (kvpress-style) and each call runs on a fresh one.

    A `model.generate` call is checked before anything runs: assisted / prompt-lookup decoding, prefill chunking,
    another cache implementation, a padded batch, a cache that already holds tokens (a second turn) and the modes
    transformers runs from the Hub are refused with a ValueError naming what is not supported (greedy decoding,
    sampling, beam search and num_return_sequences run). The method's statistics accumulate in `method.stats`.

    tokenizer: the model's, for a method that reads text when applied (InfiniGen's calibration) on a model not
    loaded by `load_model`. max_len: the longest sequence of forwards you make yourself (model.generate sets it):
    what a budget over the whole sequence (InfiniGen's capacity < 1, RocketKV's split) is a fraction of."""
    if tokenizer is not None:
        adapter.remember_tokenizer(model, tokenizer)
    cache = modes.new_cache(model, method)
    with adapter.install(model, method, mode="decode", cache=cache, max_len=max_len or 0,
                         attention=attention) as session:

        def around(original, args, kwargs):
            kwargs = dict(kwargs)
            if "past_key_values" in kwargs:  # the name transformers 5 deprecates for `cache`
                kwargs["cache"] = kwargs.pop("past_key_values")
            config = adapter.generation_config(model, kwargs)
            adapter.check_generation(config, kwargs)
            ids = _prompt_ids(args, kwargs)
            given = kwargs.get("cache")
            if given is not None and given is not cache:
                raise ValueError("cache: inside infinigen.apply, pass the cache it yields (or none: a fresh one)")
            use = cache if given is not None else modes.new_cache(model, method)
            held = use.get_seq_length()
            if held:
                raise ValueError(f"cache: it already holds {held} tokens; a second turn on a reused cache is not "
                                 "supported with a KV method (generate the whole conversation again; cache.reset() "
                                 "empties it)")
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
                raise ValueError(adapter.PADDED)
            saved = session.cache, session.max_len, session.dense_rows
            session.cache, session.dense_rows = use, ids.shape[1]
            session.max_len = max_len or adapter.max_length(config, ids.shape[1])
            kwargs["cache"] = use
            try:
                return original(*args, **kwargs)
            finally:
                session.cache, session.max_len, session.dense_rows = saved

        with adapter.generate_hook(model, around):
            yield cache


# ----------------------------------------------------------------------------------------------- generating


@dataclass
class Generation:
    """What `generate` returns."""

    # (b x num_return_sequences, t + n) ids, transformers' layout: each input row as given (left padding kept), then
    # its new tokens, right-padded with pad_token_id after a row stops (eos) or where other rows generated more
    sequences: torch.Tensor
    # the method's statistics over every decoded step (KVStats.summary: kv_fraction, recall where tracked,
    # selected, density and retain (the kept fraction on the InfiniGen artifact's axes), per_layer)
    stats: dict
    prompt_lengths: list[int]  # each input row's unpadded length
    new_tokens: list[int]  # each output row's generated tokens (its eos included), before right padding

    def generated(self, row: int) -> torch.Tensor:
        """Output row `row`'s new tokens, without padding."""
        start = self.sequences.shape[1] - max(self.new_tokens, default=0)
        return self.sequences[row, start : start + self.new_tokens[row]]


def prompt_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Each row's prompt length: the whole row without a mask; with one, its ones, which must come last in the row
    (left padding)."""
    b, t = input_ids.shape
    if attention_mask is None:
        return [t] * b
    mask = torch.as_tensor(attention_mask).bool().cpu()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(mask.shape)}")
    lengths = mask.sum(-1).tolist()
    left = torch.arange(t)[None, :] >= (t - mask.sum(-1))[:, None]  # each row's ones, at its end
    if not torch.equal(mask, left) or min(lengths) < 1:
        raise ValueError("attention_mask: each row must be left-padded (its zeros first, then at least one 1), as "
                         "transformers pads for decoder-only generation (tokenizer.padding_side='left')")
    return lengths


@torch.inference_mode()
def generate(model, method, input_ids, max_new_tokens: int, *, attention_mask=None, tokenizer=None,
             reset_stats: bool = True, **kwargs):
    """`model.generate(input_ids, max_new_tokens=...)` through `method`, for a batch whose prompts may differ in
    length: rows are left-padded (`attention_mask`), and run as groups of equal-length prompts, each group one
    batched `model.generate` on its unpadded rows, so every row's tokens are those of its prompt run alone (a
    method's store, budgets and statistics never see a pad). `kwargs` are `model.generate`'s, checked before
    anything runs (see `apply`): greedy by default (the model's generation config), `do_sample`, `temperature`,
    `top_k`, `top_p`, `num_beams`, `num_return_sequences`, `eos_token_id`, ... Returns a `Generation`: the ids and
    the method's statistics over this call (`method.stats` is reset first; reset_stats=False: added to what it
    held). tokenizer: see `apply` (also passed on to model.generate, which reads it for `stop_strings`)."""
    ids = torch.as_tensor(input_ids)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype not in (torch.long, torch.int, torch.int32):
        raise ValueError(f"input_ids must be a (batch, tokens) tensor of token ids, got shape {tuple(ids.shape)} "
                         f"and dtype {ids.dtype}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            raise ValueError(f"{key}: infinigen.generate makes the method's caches itself (use infinigen.apply to "
                             "hold one)")
    config = adapter.generation_config(model, {**kwargs, "max_new_tokens": max_new_tokens})
    adapter.check_generation(config, kwargs)
    lengths = prompt_lengths(ids, attention_mask)
    copies = config.num_return_sequences or 1
    pad = config.pad_token_id
    if pad is None:
        eos = config.eos_token_id
        pad = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) if eos is not None else 0
    groups: dict[int, list[int]] = {}
    for row, n in enumerate(lengths):
        groups.setdefault(n, []).append(row)
    if reset_stats:
        method.reset_stats()
    new: list[torch.Tensor | None] = [None] * (ids.shape[0] * copies)
    with apply(model, method, tokenizer=tokenizer) as _:
        for n, rows in groups.items():
            prompts = ids[rows][:, ids.shape[1] - n :].to(model.device)
            extra = {} if tokenizer is None else {"tokenizer": tokenizer}  # transformers reads it for stop_strings
            # an explicit all-ones mask: transformers would read a prompt token equal to pad_token_id as padding
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=max_new_tokens,
                                 **extra, **kwargs)
            seq = out if isinstance(out, torch.Tensor) else out.sequences
            for j, row in enumerate(rows):
                for c in range(copies):
                    new[row * copies + c] = seq[j * copies + c, n:]
    counts = [_length(t, config) for t in new]
    width = max(counts)
    tail = torch.full((len(new), width), int(pad), dtype=ids.dtype, device=ids.device)
    for i, (t, c) in enumerate(zip(new, counts)):
        tail[i, :c] = t[:c].to(ids.device)
    sequences = torch.cat([ids.repeat_interleave(copies, dim=0), tail], dim=1)
    return Generation(sequences=sequences, stats=method.stats.summary(), prompt_lengths=lengths, new_tokens=counts)


def _length(tokens: torch.Tensor, config) -> int:
    """Generated tokens up to and including the first end-of-sequence token (all of them without one)."""
    eos = config.eos_token_id
    if eos is None:
        return tokens.shape[0]
    stops = torch.isin(tokens, torch.as_tensor(eos if isinstance(eos, (list, tuple)) else [eos], device=tokens.device))
    hits = stops.nonzero()
    return int(hits[0, 0]) + 1 if hits.numel() else tokens.shape[0]
