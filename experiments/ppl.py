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
    skip = task.get("skip_windows", 0)
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise ValueError(f"task.skip_windows must be an integer >= 0, got {skip!r}")
    if not isinstance(task.dense_rows, int) or not 0 <= task.dense_rows < task.seq_len:
        raise ValueError(f"task.dense_rows must be an integer in 0..seq_len-1, got {task.dense_rows!r}")
    check_attention(task.get("attention", "fused"))  # +task.attention=exact: transformers' eager math


def positions_needed(task) -> tuple[str, int]:
    """The option that sets the longest sequence this task feeds the model, and its value."""
    return "task.seq_len", task.seq_len


def windows(ids: torch.Tensor, seq_len: int, stride: int, max_windows: int | None,
            skip: int = 0) -> list[tuple[int, int]]:
    """(start, first scored position) of each window after the first `skip`; overlapping windows score only their
    new tokens."""
    starts = list(range(skip * stride, ids.numel() - seq_len + 1, stride))[: max_windows or None]
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
    skip = task.get("skip_windows", 0)
    spans = windows(ids, task.seq_len, stride, task.max_windows, skip)
    if not spans:  # the exact check, before any forward (validate could only bound the count by the bytes)
        raise ValueError(f"corpus {task.dataset!r} has {ids.numel()} tokens after tokenisation, fewer than "
                         f"{skip + 1} window(s) (seq_len={task.seq_len}, skip_windows={skip}): use a longer text, a "
                         "smaller task.seq_len or task.skip_windows")
    n_chunks = math.ceil(task.seq_len / CHUNK)
    units = {"id": [], "nll": [], "tokens": [], "chunk_nll": [], "chunk_tokens": []}  # one entry per window
    seconds = []
    method.reset_stats()
    for index, (start, first) in enumerate(tqdm(spans, desc=f"ppl {task.dataset}", unit="window")):
        window = ids[start : start + task.seq_len][None].to(device)
        t0 = time.perf_counter()
        hidden = sim_hidden(model, method, window, dense_rows=task.dense_rows, attention=task.get("attention", "fused"))
        scores = token_logprobs(model, hidden[0, :-1], window[0, 1:])  # in blocks of rows: no (t, vocab) logits
        seconds.append(time.perf_counter() - t0)
        check_window(model, method, window, scores.finite, index, start, task.dense_rows)
        nll = -scores.logprob.cpu()  # float64
        pos = torch.arange(1, task.seq_len)  # position of each predicted token
        scored = pos >= max(first, 1)
        chunk = pos[scored] // CHUNK
        units["id"].append(start)
        units["nll"].append(float(nll[scored].sum()))
        units["tokens"].append(int(scored.sum()))
        units["chunk_nll"].append(torch.zeros(n_chunks, dtype=torch.float64).index_add_(0, chunk, nll[scored]).tolist())
        units["chunk_tokens"].append(torch.bincount(chunk, minlength=n_chunks).tolist())
    n_tok = sum(units["tokens"])
    mean_nll = sum(units["nll"]) / n_tok
    chunk_sum = torch.tensor(units["chunk_nll"]).sum(0)
    chunk_n = torch.tensor(units["chunk_tokens"]).sum(0)
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
        # each window's summed NLL (nats) and scored tokens, whole and per CHUNK positions: paired comparisons of
        # two methods over the same windows (analysis/paired.py); `id` is the window's first token
        "units": units,
    }
