"""`model.generate` with a KV method: the generation modes a method's cache can run and the one-line refusal of the
others (`check_generation`: assisted decoding, prefill chunking, another cache, ...), the config and length a call
runs with, and `generate_hook`, which puts a check around one model instance's `generate` for a block.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable


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
