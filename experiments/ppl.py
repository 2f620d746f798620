"""Perplexity task: teacher-forced sim mode over fixed windows of a corpus."""

from __future__ import annotations

import math
import time

from infinigen.corpora import check_dataset, corpus_text
from infinigen.models import check_attention

# torch, tqdm and the runtime are imported in the functions that use them: `validate` must stay cheap to import

CHUNK = 256  # positions per bucket of the NLL-vs-position curve (InfiniGen Fig. 12)


def validate(task, data_dir) -> None:
    if not isinstance(task.seq_len, int) or task.seq_len <= 1:
        raise ValueError(f"task.seq_len must be an integer > 1, got {task.seq_len!r}")
    check_dataset(task.dataset, data_dir, min_tokens=task.seq_len)  # a byte-count bound: no tokenizer yet
    stride = task.stride if task.stride is not None else task.seq_len
    if not isinstance(stride, int) or not 0 < stride <= task.seq_len:
        raise ValueError(f"task.stride must be an integer in 1..seq_len ({task.seq_len}), got {task.stride!r}")
    if task.max_windows is not None and (not isinstance(task.max_windows, int) or task.max_windows < 1):
        raise ValueError(f"task.max_windows must be null or an integer >= 1, got {task.max_windows!r}")
    if not isinstance(task.dense_rows, int) or not 0 <= task.dense_rows < task.seq_len:
        raise ValueError(f"task.dense_rows must be an integer in 0..seq_len-1, got {task.dense_rows!r}")
    check_attention(task.get("attention", "fused"))  # +task.attention=exact: transformers' eager math


def positions_needed(task) -> tuple[str, int]:
    """The option that sets the longest sequence this task feeds the model, and its value."""
    return "task.seq_len", task.seq_len


def windows(ids: torch.Tensor, seq_len: int, stride: int, max_windows: int | None) -> list[tuple[int, int]]:
    """(start, first scored position) of each window; overlapping windows score only their new tokens."""
    starts = list(range(0, ids.numel() - seq_len + 1, stride))[: max_windows or None]
    return [(s, 0 if i == 0 else seq_len - stride) for i, s in enumerate(starts)]


def first_nonfinite_layer(model, method, window, dense_rows: int) -> int | None:
    """Index of the first decoder layer whose output holds a NaN/inf on `window` (one more forward, run only once
    the logits are known to be bad), or None."""
    import torch

    from infinigen import adapter
    from infinigen.modes import sim_hidden

    bad: list[int] = []

    def hook(index):
        def check(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if not bad and isinstance(out, torch.Tensor) and not torch.isfinite(out).all():
                bad.append(index)
        return check

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(adapter.decoder_layers(model))]
    try:
        sim_hidden(model, method, window, dense_rows=dense_rows)
    finally:
        for h in handles:
            h.remove()
    return bad[0] if bad else None


def check_window(model, method, window, finite: bool, index: int, start: int, dense_rows: int) -> None:
    if finite:
        return
    layer = first_nonfinite_layer(model, method, window, dense_rows)
    where = f"decoder layer {layer}" if layer is not None else "the final norm / LM head"
    raise FloatingPointError(
        f"ppl: non-finite logits in window {index} (tokens {start}..{start + window.shape[1] - 1}), first in "
        f"{where} of {model.config.num_hidden_layers}; no row written (check model.arch, model.dtype, the method)"
    )


def run(model, tokenizer, method, task, data_dir, device="cpu") -> dict:
    import torch
    from tqdm import tqdm

    from infinigen.adapter import encode
    from infinigen.modes import cache_bytes, sim_hidden, token_logprobs

    text = corpus_text(task.dataset, data_dir)
    ids = encode(tokenizer, text, model.config.vocab_size)
    stride = task.stride or task.seq_len
    spans = windows(ids, task.seq_len, stride, task.max_windows)
    if not spans:  # the exact check, before any forward (validate could only bound the count by the bytes)
        raise ValueError(f"corpus {task.dataset!r} has {ids.numel()} tokens after tokenisation, fewer than one window "
                         f"(seq_len={task.seq_len}): use a longer text or a smaller task.seq_len")
    nll_sum, n_tok = 0.0, 0
    chunk_sum = torch.zeros(math.ceil(task.seq_len / CHUNK), dtype=torch.float64)
    chunk_n = torch.zeros_like(chunk_sum)
    seconds = []
    method.reset_stats()
    for index, (start, first) in enumerate(tqdm(spans, desc=f"ppl {task.dataset}", unit="window")):
        window = ids[start : start + task.seq_len][None].to(device)
        t0 = time.perf_counter()
        hidden = sim_hidden(model, method, window, dense_rows=task.dense_rows, attention=task.get("attention", "fused"))
        scores = token_logprobs(model, hidden[0, :-1], window[0, 1:])  # in blocks of rows: no (t, vocab) logits
        seconds.append(time.perf_counter() - t0)
        check_window(model, method, window, scores.finite, index, start, task.dense_rows)
        nll = -scores.logprob.cpu()
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
