"""Perplexity task: teacher-forced sim mode over fixed windows of a corpus."""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from experiments.data import check_dataset, corpus_text
from infinigen.adapter import check_attention
from infinigen.runtime import cache_bytes, sim_logits

CHUNK = 256  # positions per bucket of the NLL-vs-position curve (InfiniGen Fig. 12)


def validate(task, data_dir) -> None:
    check_dataset(task.dataset, data_dir)
    if not isinstance(task.seq_len, int) or task.seq_len <= 1:
        raise ValueError(f"task.seq_len must be an integer > 1, got {task.seq_len!r}")
    stride = task.stride if task.stride is not None else task.seq_len
    if not isinstance(stride, int) or not 0 < stride <= task.seq_len:
        raise ValueError(f"task.stride must be an integer in 1..seq_len ({task.seq_len}), got {task.stride!r}")
    if task.max_windows is not None and (not isinstance(task.max_windows, int) or task.max_windows < 1):
        raise ValueError(f"task.max_windows must be null or an integer >= 1, got {task.max_windows!r}")
    if not isinstance(task.dense_rows, int) or not 0 <= task.dense_rows < task.seq_len:
        raise ValueError(f"task.dense_rows must be an integer in 0..seq_len-1, got {task.dense_rows!r}")
    check_attention(task.get("attention", "fused"))  # +task.attention=exact: transformers' eager math


def windows(ids: torch.Tensor, seq_len: int, stride: int, max_windows: int | None) -> list[tuple[int, int]]:
    """(start, first scored position) of each window; overlapping windows score only their new tokens."""
    starts = list(range(0, ids.numel() - seq_len + 1, stride))[: max_windows or None]
    return [(s, 0 if i == 0 else seq_len - stride) for i, s in enumerate(starts)]


def encode(tokenizer, text: str, vocab_size: int) -> torch.Tensor:
    """Token ids; random-init models have no tokenizer and read the UTF-8 bytes (mod vocab) instead."""
    if tokenizer is None:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % vocab_size
    return tokenizer(text, return_tensors="pt").input_ids[0]


def run(model, tokenizer, method, task, data_dir, device="cpu") -> dict:
    text = corpus_text(task.dataset, data_dir)
    ids = encode(tokenizer, text, model.config.vocab_size)
    stride = task.stride or task.seq_len
    spans = windows(ids, task.seq_len, stride, task.max_windows)
    if not spans:
        raise ValueError(f"{task.dataset} has {ids.numel()} tokens, fewer than seq_len={task.seq_len}")
    nll_sum, n_tok = 0.0, 0
    chunk_sum = torch.zeros(math.ceil(task.seq_len / CHUNK), dtype=torch.float64)
    chunk_n = torch.zeros_like(chunk_sum)
    seconds = []
    method.reset_stats()
    for start, first in tqdm(spans, desc=f"ppl {task.dataset}", unit="window"):
        window = ids[start : start + task.seq_len][None].to(device)
        t0 = time.perf_counter()
        logits = sim_logits(model, method, window, dense_rows=task.dense_rows, attention=task.get("attention", "fused"))
        seconds.append(time.perf_counter() - t0)
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:], reduction="none").double()
        pos = torch.arange(1, task.seq_len)  # position of each predicted token
        scored = pos >= max(first, 1)
        nll_sum += float(nll[scored].sum())
        n_tok += int(scored.sum())
        chunk_sum.index_add_(0, pos[scored] // CHUNK, nll[scored].cpu())
        chunk_n.index_add_(0, pos[scored] // CHUNK, torch.ones(int(scored.sum()), dtype=torch.float64))
    mean_nll = nll_sum / n_tok
    stats = method.stats.summary()
    # What the method's decode-mode cache really holds at seq_len (quant: codes + scales; h2o: its budget), on
    # the first window; its stats are not counted.
    held, dense = cache_bytes(model, method, ids[: task.seq_len][None].to(device))
    method.reset_stats()
    return {
        "ppl": math.exp(mean_nll),
        "nll": mean_nll,
        "tokens": n_tok,
        "windows": len(spans),
        "seconds_per_window": sum(seconds) / len(seconds),
        "nll_by_chunk": {int(i) * CHUNK: float(chunk_sum[i] / chunk_n[i]) for i in range(len(chunk_n)) if chunk_n[i]},
        "kv_fraction": stats.get("kv_fraction"),
        "cache_bytes": held,
        "dense_cache_bytes": dense,
        "stats": stats,
    }
