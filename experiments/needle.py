"""Needle / passkey retrieval at long context, generated locally (no hub).

A prompt of exactly `length` tokens: an instruction, filler text (a fixed passage repeated, or WikiText-2 test
from data_dir), a needle sentence carrying a random `key_digits`-digit pass key inserted at `depth` (0 = right
after the instruction, 1 = right before the question), and the question at the end. Several seeds (different
keys) per (length, depth) cell.

The answer goes through decode mode, as a server would run it: a dense prefill of the prompt, then the key's
tokens fed one step at a time through the method's own cache (`modes.decode_logits`). Greedy decoding
reproduces the key exactly iff every key token is the argmax given the prompt and the key tokens before it, so
the teacher-forced steps give both scores at once: `exact` (the greedy answer is the key) and `loglik` (the
key's log-likelihood). The first key token is predicted by the dense prefill, the rest by the method's cache.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from infinigen.corpora import check_dataset, corpus_text

# torch, tqdm and the runtime are imported in the functions that use them: `validate` must stay cheap to import

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
               "memorise it: I will ask you about it.\n\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is"
FILLERS = ("repeat", "wikitext2")


@dataclass
class Prompt:
    ids: torch.Tensor  # (length,) prompt tokens
    key_ids: torch.Tensor  # (k,) the answer: the key's tokens
    key: str
    needle_start: int  # token index where the needle sentence begins
    needle_end: int


def validate(task, data_dir) -> None:
    if task.filler not in FILLERS:
        raise ValueError(f"task.filler must be one of {FILLERS}, got {task.filler!r}")
    if task.filler == "wikitext2":
        check_dataset("wikitext2", data_dir)
    lengths, depths = list(task.lengths), list(task.depths)
    if not lengths or any(not isinstance(n, int) or n < 64 for n in lengths):
        raise ValueError(f"task.lengths must be a non-empty list of integers >= 64 (prompt tokens), got {lengths}")
    if not depths or any(not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in depths):
        raise ValueError(f"task.depths must be a non-empty list of fractions in [0, 1], got {depths}")
    if not isinstance(task.seeds, int) or task.seeds < 1:
        raise ValueError(f"task.seeds must be an integer >= 1 (keys per length x depth cell), got {task.seeds!r}")
    if not isinstance(task.key_digits, int) or not 1 <= task.key_digits <= 12:
        raise ValueError(f"task.key_digits must be an integer in 1..12, got {task.key_digits!r}")


def positions_needed(task) -> tuple[str, int]:
    """The option that sets the longest sequence this task feeds the model (prompt + answer), and its value."""
    return "max(task.lengths) + task.key_digits", max(task.lengths) + task.key_digits


def make_key(seed: int, digits: int) -> str:
    rng = random.Random(seed)
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def filler_ids(tokenize, filler: str, data_dir: str | None, n: int, seed: int) -> torch.Tensor:
    """At least n filler tokens: the fixed passage repeated, or WikiText-2 test from a seed-dependent offset."""
    if filler == "repeat":
        unit = tokenize(FILLER)
        return unit.repeat(math.ceil(n / unit.numel()) + 1)
    text = corpus_text("wikitext2", data_dir)
    start = random.Random(seed).randrange(0, len(text) // 2)
    ids = tokenize(text[start : start + 8 * n])
    if ids.numel() < n:
        raise ValueError(f"WikiText-2 from offset {start} has fewer than {n} tokens")
    return ids


def question_and_answer(tokenize, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The question's tokens and the key's. Tokenizers that write " 60494" as a space token + digits get the
    space token at the end of the question, so that only the key's digits are scored (at the end of a prompt the
    model may well continue "The pass key is" with another word, and then give the right digits)."""
    import torch

    question, answer, space = tokenize(QUESTION), tokenize(" " + key), tokenize(" ")
    if space.numel() == 1 and answer.numel() > 1 and answer[0] == space[0]:
        return torch.cat([question, space]), answer[1:]
    return question, answer


def build_prompt(tokenize, length: int, depth: float, key: str, filler: torch.Tensor) -> Prompt:
    """Instruction + filler with the needle at `depth` of the filler + question: exactly `length` tokens."""
    import torch

    head, (question, key_ids) = tokenize(INSTRUCTION), question_and_answer(tokenize, key)
    needle = tokenize(NEEDLE.format(key=key))
    room = length - head.numel() - question.numel() - needle.numel()  # filler tokens in the prompt
    if room < 0:
        raise ValueError(f"length {length} is shorter than the instruction, needle and question")
    if filler.numel() < room:
        raise ValueError(f"{filler.numel()} filler tokens, {room} needed")
    before = round(depth * room)
    ids = torch.cat([head, filler[:before], needle, filler[before:room], question])
    start = head.numel() + before
    return Prompt(ids=ids, key_ids=key_ids, key=key, needle_start=start, needle_end=start + needle.numel())


def score(model, method, prompt: Prompt, device) -> tuple[bool, float]:
    """(greedy answer == key, log-likelihood of the key): dense prefill of the prompt, key tokens decoded."""
    import torch

    from infinigen.modes import decode_logits

    ids = torch.cat([prompt.ids, prompt.key_ids])[None].to(device)
    logits = decode_logits(model, method, ids, dense_rows=prompt.ids.numel())  # (1, k, V)
    target = prompt.key_ids.to(device)
    logp = logits[0].double().log_softmax(-1)
    return bool((logits[0].argmax(-1) == target).all()), float(logp.gather(-1, target[:, None]).sum())


def cells(task) -> list[tuple[int, float]]:
    return [(int(n), float(d)) for n in task.lengths for d in task.depths]


def run(model, tokenizer, method, task, data_dir, device="cpu") -> dict:
    import torch
    from tqdm import tqdm

    from infinigen.adapter import encode

    def tokenize(text: str) -> torch.Tensor:
        if tokenizer is None:
            return encode(None, text, model.config.vocab_size)
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)

    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(task.lengths) + tokenize(" " + "9" * task.key_digits).numel()
    if limit is not None and longest > limit:
        raise ValueError(f"task.lengths up to {max(task.lengths)} + the key exceed max_position_embeddings={limit}")
    method.reset_stats()
    results, seconds = [], []
    jobs = [(n, d, s) for n, d in cells(task) for s in range(task.seeds)]
    for length, depth, seed in tqdm(jobs, desc="needle", unit="prompt"):
        key = make_key(seed, task.key_digits)
        filler = filler_ids(tokenize, task.filler, data_dir, length, seed)
        prompt = build_prompt(tokenize, length, depth, key, filler)
        t0 = time.perf_counter()
        exact, loglik = score(model, method, prompt, device)
        seconds.append(time.perf_counter() - t0)
        results.append({"length": length, "depth": depth, "seed": seed, "exact": exact, "loglik": loglik})
    by_cell = []
    for length, depth in cells(task):
        mine = [r for r in results if r["length"] == length and r["depth"] == depth]
        by_cell.append({"length": length, "depth": depth, "n": len(mine),
                        "accuracy": sum(r["exact"] for r in mine) / len(mine),
                        "loglik": sum(r["loglik"] for r in mine) / len(mine)})
    stats = method.stats.summary()
    method.reset_stats()
    return {
        "accuracy": sum(r["exact"] for r in results) / len(results),
        "loglik": sum(r["loglik"] for r in results) / len(results),
        "prompts": len(results),
        "cells": by_cell,
        "per_prompt": results,
        # each prompt's outcome, kept by `make export` (per_prompt is not): paired comparisons over the same prompts
        "units": {"id": [f"{r['length']}/{r['depth']:g}/{r['seed']}" for r in results],
                  "exact": [r["exact"] for r in results], "loglik": [r["loglik"] for r in results]},
        "seconds_per_prompt": {str(n): sum(s for s, (m, _, _) in zip(seconds, jobs) if m == n) / (len(task.depths) * task.seeds)
                               for n in task.lengths},
        "kv_fraction": stats.get("kv_fraction"),
        "stats": stats,
    }
