"""Generation task: text generated through the method (decode mode, `model.generate` via infinigen.api) beside full
attention's on the same prompts, with their token agreement and the first position where they differ.

Prompts: `task.prompt` (a text, `file:PATH` whose text is one prompt, or `file:PATH.jsonl`: one prompt per line, a
JSON string or an object with a "prompt" key); null: `task.num_prompts` windows of `task.prompt_tokens` tokens
spread evenly over `task.dataset` (a corpus spec, as task=ppl's). Greedy by default; sampling and beam search with
transformers' own option names (`do_sample`, `temperature`, `top_k`, `top_p`, `num_beams`, any other
GenerationConfig option under `task.generation`), seeded the same for the method and full attention. Generation
stops at the model's end-of-sequence token or after `max_new_tokens`. Prompts of different lengths run as groups of
equal-length prompts (infinigen.api.generate): each text is that of its prompt run alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from infinigen.corpora import FILE, check_dataset, corpus_text, read_file

# torch, transformers and the runtime are imported in the functions that use them: `validate` must stay cheap

OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "num_beams")  # task keys passed to model.generate as named
SHOWN = 400  # characters of a prompt's end printed before its two texts


def _int(task, key: str, low: int = 1) -> None:
    value = task.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"task.{key} must be an integer >= {low}, got {value!r}")


def generation_kwargs(task) -> dict:
    """What `model.generate` gets besides the prompt and max_new_tokens: the task's transformers-named options that
    are set (null: the model's generation config decides), then `task.generation`."""
    from omegaconf import OmegaConf

    out = {k: task.get(k) for k in OPTIONS if task.get(k) is not None}
    extra = task.get("generation") or {}
    extra = OmegaConf.to_container(extra, resolve=True) if OmegaConf.is_config(extra) else dict(extra)
    return out | extra


def check_generation(task) -> None:
    """The generation options through transformers' GenerationConfig and the KV-method check the API applies
    (infinigen.adapter.check_generation): a mode a method's cache cannot run is refused before the model loads."""
    from transformers import GenerationConfig

    from infinigen import adapter

    extra = task.get("generation") or {}
    kwargs = generation_kwargs(task)
    for key in ("do_sample",):
        if not isinstance(kwargs.get(key, False), bool):
            raise ValueError(f"task.{key} must be true or false, got {kwargs[key]!r}")
    if not isinstance(kwargs.get("num_beams", 1), int) or isinstance(kwargs.get("num_beams"), bool) \
            or kwargs.get("num_beams", 1) < 1:
        raise ValueError(f"task.num_beams must be an integer >= 1, got {kwargs.get('num_beams')!r}")
    for key in ("max_new_tokens", "max_length", "num_return_sequences", "input_ids", "attention_mask"):
        if key in extra:
            raise ValueError(f"task.generation.{key} must be unset: "
                             + ("one text per prompt is compared" if key == "num_return_sequences"
                                else "the task sets it (task.max_new_tokens, the prompts)"))
    config = GenerationConfig()
    unknown = config.update(**kwargs)
    if unknown:
        raise ValueError(f"task.generation.{next(iter(unknown))} must be a GenerationConfig option (transformers' "
                         "name), got an unknown key")
    try:
        adapter.check_generation(config, kwargs)
    except ValueError as err:
        key, _, reason = str(err).partition(": ")
        key = key.split("=")[0]
        option = f"task.generation.{key}" if key in extra else f"task.{key}" if key in task else "task.generation"
        raise ValueError(f"{option} must be unset: {reason or err}") from err


def validate(task, data_dir) -> None:
    prompt = task.get("prompt")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"task.prompt must be a text, file:PATH or file:PATH.jsonl (or null: windows of "
                             f"task.dataset), got {prompt!r}")
        if prompt.startswith(FILE):
            try:
                check_dataset(prompt, None)
                prompts_of(prompt)
            except (OSError, ValueError) as err:
                raise ValueError(f"task.prompt must name a UTF-8 text or JSONL file: {err}") from err
    else:
        _int(task, "prompt_tokens")
        check_dataset(task.dataset, data_dir, min_tokens=task.prompt_tokens)
    for key in ("num_prompts", "max_new_tokens", "batch_size"):
        _int(task, key)
    _int(task, "seed", 0)
    check_generation(task)


def positions_needed(task) -> tuple[str, int] | None:
    """The longest sequence, where it is known before tokenising (corpus windows)."""
    if task.get("prompt") is not None:
        return None
    return "task.prompt_tokens + task.max_new_tokens", task.prompt_tokens + task.max_new_tokens


def prompts_of(spec: str) -> list[str]:
    """The prompt texts of `task.prompt`: itself, a file's text, or a JSONL file's prompts."""
    if not spec.startswith(FILE):
        return [spec]
    path = Path(spec[len(FILE):]).expanduser()
    text = read_file(path.resolve())
    if path.suffix != ".jsonl":
        return [text]
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number} is not JSON ({err.msg})") from None
        item = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"{path} line {number} must be a JSON string or an object with a non-empty \"prompt\" "
                             "string")
        prompts.append(item)
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts


def prompt_ids(model, tokenizer, task, data_dir) -> list:
    """One (n,) id tensor per prompt."""
    from infinigen.adapter import encode

    vocab = model.config.vocab_size
    if task.get("prompt") is not None:
        return [encode(tokenizer, text, vocab) for text in prompts_of(task.prompt)]
    ids = encode(tokenizer, corpus_text(task.dataset, data_dir), vocab)
    room = ids.numel() - task.prompt_tokens
    if room < 0:
        raise ValueError(f"corpus {task.dataset!r} has {ids.numel()} tokens, fewer than task.prompt_tokens "
                         f"({task.prompt_tokens})")
    starts = [room * i // task.num_prompts for i in range(task.num_prompts)]
    return [ids[s : s + task.prompt_tokens] for s in starts]


def compare(ours: list[int], full: list[int]) -> tuple[float, int | None]:
    """(token agreement, first divergence): the share of positions where both texts have the same token, over the
    longer of the two; the first position where they differ (one ending first counts), None where they are equal."""
    same = sum(a == b for a, b in zip(ours, full))
    longest = max(len(ours), len(full))
    first = next((i for i, (a, b) in enumerate(zip(ours, full)) if a != b), None)
    if first is None and len(ours) != len(full):
        first = min(len(ours), len(full))
    return (same / longest if longest else 1.0), first


def _generate(model, method, prompts: list, task, device) -> tuple[list[list[int]], dict, float]:
    """Every prompt's generated ids through `method`, batch_size prompts (left-padded) per infinigen.generate call,
    the method's statistics over all of them, and the seconds spent."""
    import torch

    from infinigen.api import generate

    kwargs = generation_kwargs(task)
    out: list[list[int]] = []
    method.reset_stats()
    t0 = time.perf_counter()
    for start in range(0, len(prompts), task.batch_size):
        batch = prompts[start : start + task.batch_size]
        width = max(p.numel() for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
        torch.manual_seed(task.seed + start)  # the same draws for the method and for full attention
        result = generate(model, method, ids.to(device), task.max_new_tokens, attention_mask=mask.to(device),
                          reset_stats=False, **kwargs)
        out += [result.generated(i).tolist() for i in range(len(batch))]
    return out, method.stats.summary(), time.perf_counter() - t0


def run(model, tokenizer, method, task, data_dir, device="cpu") -> dict:
    from baselines.full import Full
    from infinigen.adapter import byte_tokenizer

    prompts = prompt_ids(model, tokenizer, task, data_dir)
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(p.numel() for p in prompts) + task.max_new_tokens
    if limit is not None and longest > limit:
        raise ValueError(f"task.prompt: the longest prompt + task.max_new_tokens is {longest} tokens, beyond the "
                         f"model's max_position_embeddings ({limit})")
    text = tokenizer if tokenizer is not None else byte_tokenizer()  # random-init models read bytes
    ours, stats, seconds = _generate(model, method, prompts, task, device)
    reference = Full()
    full = ours if type(method) is type(reference) else _generate(model, reference, prompts, task, device)[0]
    name = type(method).__name__
    units = {"id": [], "agreement": [], "first_divergence": [], "exact": [], "new_tokens": []}
    texts = {"prompt": [], "full": [], "method": []}
    per_prompt = []
    for i, (p, a, f) in enumerate(zip(prompts, ours, full)):
        agreement, first = compare(a, f)
        prompt_text, ours_text, full_text = (text.decode(x, skip_special_tokens=True) for x in (p.tolist(), a, f))
        units["id"].append(i)
        units["agreement"].append(agreement)
        units["first_divergence"].append(first)
        units["exact"].append(first is None)
        units["new_tokens"].append(len(a))
        texts["prompt"].append(prompt_text)
        texts["full"].append(full_text)
        texts["method"].append(ours_text)
        per_prompt.append({"prompt_tokens": p.numel(), "prompt_ids": p.tolist(), "full_ids": f, "method_ids": a,
                           "agreement": agreement, "first_divergence": first})
        shown = prompt_text if len(prompt_text) <= SHOWN else "..." + prompt_text[-SHOWN:]
        print(f"\n--- prompt {i + 1}/{len(prompts)} ({p.numel()} tokens): {shown!r}")
        print(f"  full      : {full_text!r}")
        print(f"  {name:<10}: {ours_text!r}")
        where = "identical" if first is None else f"first divergence at generated token {first}"
        print(f"  token agreement {agreement:.3f} ({sum(x == y for x, y in zip(a, f))}/{max(len(a), len(f))}), {where}")
    diverged = [d for d in units["first_divergence"] if d is not None]
    return {
        "agreement": sum(units["agreement"]) / len(prompts),
        "exact": sum(units["exact"]) / len(prompts),
        # the mean first divergence of the prompts whose texts differ (null: every text equals full attention's)
        "first_divergence": sum(diverged) / len(diverged) if diverged else None,
        "prompts": len(prompts),
        "new_tokens": sum(units["new_tokens"]) / len(prompts),
        "seconds_per_prompt": seconds / len(prompts),
        "kv_fraction": stats.get("kv_fraction"),
        "recall": stats.get("recall"),
        "stats": stats,
        "units": units,  # per prompt: paired comparisons over the same prompts (analysis/paired.py)
        "texts": texts,  # per prompt: the prompt and both generated texts, for side-by-side tables
        "per_prompt": per_prompt,  # per prompt: the token ids (dropped by `make export`)
    }
