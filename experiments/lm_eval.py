"""lm-eval task: any lm-eval 0.4.13 task, with every scored token computed under a KV method.

lm-eval's HF backend scores a (context, continuation) request with one plain dense forward (see lm-eval issues
#3298 / #2506: a KV-cache policy installed only for `generate()` never sees those forwards). `KVMethodLM` keeps
lm-eval's request handling (tokenisation, truncation, batching, the one-token logits cache, metrics) but replaces
the model call by `infinigen.modes.sim_logits`, so every log-likelihood comes out of the method.

Two protocols, recorded in every row:

* ``paper`` (default): the whole context + continuation is one sim-mode sequence and every row at or after
  ``dense_rows`` (default 0) is treated as a decoded token, as the H2O / InfiniGen accuracy scripts do (they mask
  attention over the whole sequence). The context therefore goes through the method too.
* ``serving``: the context is prefilled densely and only the continuation tokens run as decoded queries:
  ``dense_rows`` = that request's context length. The first continuation token is predicted by the last context
  row, i.e. by the dense prefill (as in real serving, where the first output token comes out of the prefill), so
  single-token continuations (rte, mmlu-style letters) score exactly as under full attention. sim-mode
  ``dense_rows`` is one int per forward, so requests are grouped by context length and each group is scored
  separately (which also keeps lm-eval's logits cache from sharing logits across different context lengths).

Generative tasks (``generate_until``) decode greedily in decode mode (dense prefill of the prompt, then one token
per step through the method's `decode_attention`), whatever the protocol; sampling is refused.

Batching never pads: lm-eval right-pads a batch, and while causal attention keeps pads out of real rows, a
method's stats would count the pad rows and a method that sizes its budget from the sequence length
(`session.max_len`, e.g. InfiniGen with capacity < 1) would see the padded length. So a batch holds up to
``batch_size`` requests of one input length (and one context length under serving), and scores do not depend on
the batch size (tests/test_lm_eval.py). On CPU batching gains little anyway (~15% at batch 4); the default is 1,
where the stats are exact for every method.

Stats (`method.stats`) are reset before each requested task name, so each row carries its own task's summary (a
requested group shares one summary among its subtasks).

Models without a tokenizer (the random-init test models) read UTF-8 bytes: token id = byte value
(`infinigen.adapter.byte_tokenizer`).
"""

from __future__ import annotations

import difflib
import math
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from omegaconf import ListConfig, OmegaConf
from tqdm import tqdm

from experiments.lm_eval_tasks import LOCAL_TASKS, resolve_task_names, task_manager
from infinigen import adapter, modes

PROTOCOLS = ("paper", "serving")
BOOTSTRAP_ITERS = 1000  # stderr of non-mean metrics only (acc/acc_norm stderr are closed-form)


# ----------------------------------------------------------------------------------------------- the LM


@register_model("kv_method")
class KVMethodLM(HFLM):
    """lm-eval's HF causal LM around an already loaded model + tokenizer, every forward through `method`."""

    def __init__(
        self,
        model,
        tokenizer,
        method,
        protocol: str = "paper",
        dense_rows: int = 0,
        batch_size: int = 1,
        max_length: int | None = None,
    ):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if tokenizer is None:
            if model.config.vocab_size < 257:
                raise ValueError(f"byte_tokenizer needs a vocab of >= 257 ids, model has {model.config.vocab_size}")
            tokenizer = adapter.byte_tokenizer()
        super().__init__(
            pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=int(batch_size), max_length=max_length
        )
        self.method = method
        self.protocol = protocol
        self.dense_rows = dense_rows
        self._call_dense_rows = dense_rows  # what the next `_model_call` uses
        self.counts = {"requests": 0, "forwards": 0, "rows": 0, "generated": 0}

    def reset_counts(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)

    def input_rows(self, context_enc: list[int], continuation_enc: list[int]) -> int:
        """Length of the model input lm-eval's HFLM builds: (context + continuation)[-(max_length + 1):][:-1]."""
        return min(len(context_enc) + len(continuation_enc), self.max_length + 1) - 1

    def prefill_rows(self, context_enc: list[int], continuation_enc: list[int]) -> int:
        """Rows of that input holding context tokens (what the serving protocol prefills densely)."""
        return self.input_rows(context_enc, continuation_enc) - (len(continuation_enc) - 1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's scoring, run separately on each group of requests with the same input length (and, for serving,
        the same context length): every batch is then pad-free, so neither a method that reads the sequence length
        (`session.max_len`) nor its stats see pad rows, and the serving protocol's dense_rows is one int."""
        self.counts["requests"] += len(requests)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (_, context_enc, continuation_enc) in enumerate(requests):
            dense = self.prefill_rows(context_enc, continuation_enc) if self.protocol == "serving" else self.dense_rows
            groups.setdefault((self.input_rows(context_enc, continuation_enc), dense), []).append(i)
        out: list[Any] = [None] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc=f"loglikelihood ({self.protocol})") as bar:
            for (_, dense), index in groups.items():
                self._call_dense_rows = dense
                scored = super()._loglikelihood_tokens(
                    [requests[i] for i in index], disable_tqdm=True, override_bs=override_bs
                )
                for i, answer in zip(index, scored, strict=True):
                    out[i] = answer
                bar.update(len(index))
        return out

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if attn_mask is not None or labels is not None:
            raise ValueError("KVMethodLM is a causal LM: no encoder mask / labels")
        self.counts["forwards"] += 1
        self.counts["rows"] += inps.numel()
        return modes.sim_logits(self.model, self.method, inps, dense_rows=self._call_dense_rows)

    # ------------------------------------------------------------------ generation (decode mode)
    def _stop_ids(self) -> set[int]:
        """Token ids that end a generation, as `model.generate` would (generation config) plus the tokenizer's eos."""
        ids = {self.tokenizer.eos_token_id}
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
        return {i for i in ids if i is not None}

    @torch.inference_mode()
    def greedy(self, ids: torch.Tensor, new_tokens: int, stop: list[str]) -> list[int]:
        """Greedy continuation of ids (1, t) through the method in decode mode: dense prefill, then one token per
        step; ends after new_tokens, at an eos id, or once the decoded text contains a stop string."""
        stop_ids, stop = self._stop_ids(), [s for s in stop if s]
        cache = modes.new_cache(self.model, self.method)
        t = ids.shape[1]
        out: list[int] = []
        with adapter.install(self.model, self.method, mode="decode", dense_rows=t, cache=cache, max_len=t + new_tokens):
            logits = modes.prefill(self.model, ids, cache)
            for pos in range(t, t + new_tokens):
                out.append(int(logits.argmax(-1)))
                if out[-1] in stop_ids or len(out) == new_tokens:
                    break
                if stop and any(s in self.tok_decode(out) for s in stop):
                    break
                logits = modes.decode_step(self.model, torch.tensor([[out[-1]]], device=ids.device), cache, pos)
        self.counts["generated"] += len(out)
        return out

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """Replaces HFLM's `model.generate` (which would bypass the method). context (b, t) is left-padded;
        returns (b, t + new) with the generated ids after each row's padded context, right-padded."""
        if generation_kwargs.get("do_sample"):
            raise NotImplementedError("KVMethodLM generates greedily only (do_sample=false)")
        mask = generation_kwargs.pop("attention_mask", None)
        new_tokens = max_length - context.shape[1]
        rows = []
        for i in range(context.shape[0]):
            ids = context[i] if mask is None else context[i][mask[i].bool()]
            rows.append(self.greedy(ids[None], new_tokens, stop))
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        generated = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=context.device)
        return torch.cat([context, generated], dim=1)

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "kv_method": type(self.method).__name__,
            "protocol": self.protocol,
        }


# ----------------------------------------------------------------------------------------------- task module


@lru_cache(maxsize=8)
def _cached_task_manager(data_dir: str | None, local_tasks: tuple[str, ...]):
    return task_manager(data_dir, tasks=list(local_tasks) if data_dir else None)


def tasks_of(task_cfg) -> list[str]:
    names = task_cfg.get("tasks")
    if isinstance(names, ListConfig):
        names = OmegaConf.to_container(names)
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not names:
        raise ValueError(f"task.tasks must be a non-empty list of lm-eval task names, got {names!r}")
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"task.tasks entries must be non-empty strings, got {name!r}")
    return list(names)


def lm_eval_setup(names: list[str], data_dir) -> tuple[list[str], Any]:
    """Resolved task names (copa -> copa_local when data_dir is set) and a (cached) TaskManager that knows them.
    Raises ValueError for a missing data file or an unknown task name."""
    data_dir = str(Path(data_dir).expanduser().resolve()) if data_dir else None
    resolved = resolve_task_names(names, data_dir)
    try:  # one manager per data dir when it holds every local task's files (a build takes ~10 s)
        tm = _cached_task_manager(data_dir, tuple(sorted(LOCAL_TASKS.values())))
    except ValueError:  # some local task's files are missing (caught before anything is built): only ours
        tm = _cached_task_manager(data_dir, tuple(sorted({n for n in resolved if n in LOCAL_TASKS.values()})))
    known = set(tm.all_tasks)
    for name, asked in zip(resolved, names, strict=True):
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=5)
            raise ValueError(
                f"unknown lm-eval task {asked!r}" + (f"; close matches: {close}" if close else "")
                + " (see `lm_eval ls tasks`)"
            )
    return resolved, tm


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate(task, data_dir) -> None:
    protocol = task.get("protocol")
    if protocol not in PROTOCOLS:
        raise ValueError(f"task.protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
    nshot = task.get("num_fewshot")
    if nshot is not None and (not _is_int(nshot) or nshot < 0):
        raise ValueError(f"task.num_fewshot must be null (each task's default) or an integer >= 0, got {nshot!r}")
    limit = task.get("limit")
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise ValueError(f"task.limit must be null (every doc) or an integer >= 1, got {limit!r}")
    batch_size = task.get("batch_size")
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"task.batch_size must be an integer >= 1, got {batch_size!r}")
    dense_rows = task.get("dense_rows")
    if not _is_int(dense_rows) or dense_rows < 0:
        raise ValueError(f"task.dense_rows must be an integer >= 0, got {dense_rows!r}")
    if protocol == "serving" and dense_rows != 0:
        raise ValueError(
            "task.dense_rows applies to protocol=paper only; protocol=serving prefills each request's context "
            f"densely (set dense_rows=0), got dense_rows={dense_rows}"
        )
    if not _is_int(task.get("fewshot_seed")):
        raise ValueError(f"task.fewshot_seed must be an integer, got {task.get('fewshot_seed')!r}")
    lm_eval_setup(tasks_of(task), data_dir)


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def task_metrics(results: dict, name: str) -> dict:
    """lm-eval's `results[name]` ({"acc,none": .., "acc_stderr,none": .., "alias": ..}) -> {"acc": .., ...};
    a metric under a filter other than "none" keeps it: "exact_match,strict-match"."""
    out = {}
    for key, value in results["results"][name].items():
        if "," not in key:
            continue
        metric, flt = key.split(",", 1)
        out[metric if flt == "none" else key] = None if value == "N/A" else value
    return out


def evaluate_one(lm: KVMethodLM, requested: str, resolved: str, tm, task) -> list[dict]:
    """One requested task name (a task or a group) -> one row per lm-eval task it evaluated."""
    import lm_eval

    lm.method.reset_stats()
    lm.reset_counts()
    t0 = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=[resolved],
        num_fewshot=task.num_fewshot,
        limit=task.limit,
        task_manager=tm,
        fewshot_random_seed=task.fewshot_seed,
        bootstrap_iters=BOOTSTRAP_ITERS,
        log_samples=False,
    )
    seconds = time.perf_counter() - t0
    stats = lm.method.stats.summary()
    counts = dict(lm.counts)
    rows = []
    for name in results["results"]:
        samples = results.get("n-samples", {}).get(name, {})
        rows.append({
            "task": requested if name == resolved else name,
            "lm_eval_task": name,
            "requested": requested,
            "protocol": lm.protocol,
            "dense_rows": lm.dense_rows if lm.protocol == "paper" else None,  # serving: each request's context
            "num_fewshot": results.get("n-shot", {}).get(name, task.num_fewshot),
            "limit": task.limit,
            "fewshot_seed": task.fewshot_seed,
            "batch_size": lm.batch_size,
            **task_metrics(results, name),
            "n": samples.get("effective"),
            "n_docs": samples.get("original"),
            # requested-level cost and stats (shared by the subtasks of a group)
            "seconds": seconds,
            "requests": counts["requests"],
            "forwards": counts["forwards"],
            "rows": counts["rows"],
            "generated_tokens": counts["generated"],
            "seconds_per_request": seconds / counts["requests"] if counts["requests"] else None,
            "kv_fraction": _finite(stats.get("kv_fraction")),
            "stats": stats,
        })
    return rows


def run(model, tokenizer, method, task, data_dir, device="cpu") -> list[dict]:
    names = tasks_of(task)
    resolved, tm = lm_eval_setup(names, data_dir)
    lm = KVMethodLM(model, tokenizer, method, protocol=task.protocol, dense_rows=task.dense_rows,
                    batch_size=task.batch_size)
    rows = []
    for requested, name in zip(names, resolved, strict=True):
        rows.extend(evaluate_one(lm, requested, name, tm, task))
    for row in rows:
        shown = {k: row[k] for k in ("acc", "acc_norm", "word_perplexity") if k in row}  # the task's headline
        shown |= {k: row.get(k) for k in ("n", "kv_fraction", "seconds")}
        print(f"[lm_eval] {row['task']} ({row['protocol']}): {shown}")
    return rows
