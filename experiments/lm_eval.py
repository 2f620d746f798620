"""lm-eval task: any lm-eval 0.4.13 task, with every scored token computed under a KV method.

lm-eval's HF backend scores a (context, continuation) request with one plain dense forward (see lm-eval issues
#3298 / #2506: a KV-cache policy installed only for `generate()` never sees those forwards). `KVMethodLM` keeps
lm-eval's request handling (tokenisation, truncation, metrics) but scores each request from a sim-mode forward
through the method (`infinigen.modes.sim_hidden`), so every log-likelihood comes out of the method; only the rows
predicting the continuation go through the LM head, in blocks (`modes.token_logprobs`), never the whole
(batch, t, vocab) logits lm-eval's HF backend forms.

Two protocols, recorded in every row:

* ``paper`` (default): the whole context + continuation is one sim-mode sequence and every row at or after
  ``dense_rows`` (default 0) is treated as a decoded token, as the H2O / InfiniGen accuracy scripts do (they mask
  attention over the whole sequence). The context therefore goes through the method too.
* ``serving``: the context is prefilled densely and only the continuation tokens run as decoded queries:
  ``dense_rows`` = that request's context length. The first continuation token is predicted by the last context
  row, i.e. by the dense prefill (as in real serving, where the first output token comes out of the prefill), so
  single-token continuations (rte, mmlu-style letters) score exactly as under full attention. sim-mode
  ``dense_rows`` is one int per forward, so requests are grouped by context length and each group is scored
  separately (which also keeps requests with different context lengths from sharing a forward).

Generative tasks (``generate_until``) decode greedily in decode mode (dense prefill of the prompt, then one token
per step through the method's `decode_attention`), whatever the protocol; sampling is refused. They run one
request at a time whatever ``batch_size``: RULER's prompts differ in length, and decode mode never pads.

Batching never pads: lm-eval right-pads a batch, and while causal attention keeps pads out of real rows, a
method's stats would count the pad rows and a method that sizes its budget from the sequence length
(`session.max_len`, e.g. InfiniGen with capacity < 1) would see the padded length. So a batch holds up to
``batch_size`` requests of one input length (and one context length under serving), and neither scores nor stats
depend on the batch size (tests/test_lm_eval.py), nor does a run's config hash (infinigen/semantic.py). The default,
``auto``, takes as many as fill `lm_eval_protocols.AUTO_TOKENS` tokens per forward: short requests (PIQA's ~35
tokens) share a forward, where one alone leaves the CPU's matrix units idle, and a long one runs alone, its memory
bounded (experiments/bench_lm_eval.py measures it against lm-eval's own HF backend). A forward's requests go through
the LM head together.

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

from omegaconf import DictConfig, ListConfig, OmegaConf

from experiments.lm_eval_protocols import check_batch_size, check_protocol
from experiments.lm_eval_tasks import LOCAL_TASKS, check_include_path, resolve_task_names, task_manager
from experiments.lm_eval_tasks import ruler

BOOTSTRAP_ITERS = 1000  # stderr of non-mean metrics only (acc/acc_norm stderr are closed-form)


def __getattr__(name: str):
    # the LM class imports lm-eval (seconds): loaded on first use, so `validate` stays cheap to import
    if name == "KVMethodLM":
        from experiments.lm_eval_lm import KVMethodLM

        return KVMethodLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------- task module


@lru_cache(maxsize=8)
def _cached_task_manager(data_dir: str | None, local_tasks: tuple[str, ...], include: tuple[str, ...] = ()):
    return task_manager(data_dir, tasks=list(local_tasks) if data_dir else None, include_path=list(include))


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


def lm_eval_setup(names: list[str], data_dir, include_path=None) -> tuple[list[str], Any]:
    """Resolved task names (copa -> copa_local when data_dir is set, unless include_path defines copa) and a
    (cached) TaskManager that knows them and the include_path tasks. Raises ValueError for a missing data file, a
    bad include_path or an unknown task name."""
    data_dir = str(Path(data_dir).expanduser().resolve()) if data_dir else None
    scan = check_include_path(include_path, names) if include_path is not None else None
    own = scan["tasks"] if scan else {}
    include = tuple(str(d) for d in scan["dirs"]) if scan else ()
    resolved = resolve_task_names(names, data_dir, own=own)
    try:  # one manager per data dir when it holds every local task's files (a build takes ~10 s)
        tm = _cached_task_manager(data_dir, tuple(sorted(LOCAL_TASKS.values())), include)
    except ValueError:  # some local task's files are missing (caught before anything is built): only ours
        tm = _cached_task_manager(data_dir, tuple(sorted({n for n in resolved if n in LOCAL_TASKS.values()})), include)
    known = set(tm.all_tasks)
    for name, asked in zip(resolved, names, strict=True):
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=5)
            mine = f"; task.include_path defines {sorted(own)}" if scan else ""
            broken = scan and {str(p): e for p, e in scan["unreadable"].items()}
            raise ValueError(
                f"unknown lm-eval task {asked!r}" + (f"; close matches: {close}" if close else "") + mine
                + (f"; these YAMLs could not be read: {broken}" if broken else "") + " (see `lm_eval ls tasks`)"
            )
    return resolved, tm


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate(task, data_dir) -> None:
    protocol = task.get("protocol")
    check_protocol(protocol)
    nshot = task.get("num_fewshot")
    if nshot is not None and (not _is_int(nshot) or nshot < 0):
        raise ValueError(f"task.num_fewshot must be null (each task's default) or an integer >= 0, got {nshot!r}")
    limit = task.get("limit")
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise ValueError(f"task.limit must be null (every doc) or an integer >= 1, got {limit!r}")
    check_batch_size(task.get("batch_size"))
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
    names, include_path = tasks_of(task), task.get("include_path")
    scan = check_include_path(include_path, names) if include_path is not None else None
    own = scan["tasks"] if scan else {}
    rulers = [name for name in ruler.ruler_names(names) if name not in own]
    if rulers:
        ruler.check_options(rulers, _plain(task.get("max_seq_lengths")), task.get("haystack"), data_dir,
                            _plain(task.get("qa_data")), task.get("limit"))
    names = [name for name in names if name not in rulers]
    resolved = resolve_task_names(names, str(Path(data_dir).expanduser().resolve()) if data_dir else None, own=own)
    if any(name not in LOCAL_TASKS.values() and name not in own for name in resolved):
        lm_eval_setup(names, data_dir, include_path)  # only lm-eval's task index (built in 10-30 s) knows them


def validate_config(cfg, method) -> None:
    """A model without a tokenizer reads bytes (one token per byte): RULER's vt, cwe and fwe samples must still fit
    their lengths, or lm-eval's generators loop forever (checked again with a real tokenizer once it is loaded)."""
    rulers = ruler_tasks(cfg.task)
    if rulers and cfg.model.get("random_init"):
        ruler.check_fits(rulers, _plain(cfg.task.max_seq_lengths), ruler.byte_count,
                         f"the byte tokenizer of {cfg.model.name} (random_init: no tokenizer of its own)")


def _plain(value):
    return OmegaConf.to_container(value) if isinstance(value, (ListConfig, DictConfig)) else value


def ruler_tasks(task) -> list[str]:
    """The requested names that run as local RULER tasks (not defined by the user's include_path)."""
    names = tasks_of(task)
    include_path = task.get("include_path")
    own = check_include_path(include_path, names)["tasks"] if include_path is not None else {}
    return [name for name in ruler.ruler_names(names) if name not in own]


def positions_needed(task) -> tuple[str, int] | None:
    """RULER samples are sized to task.max_seq_lengths tokens, prompt + answer; other tasks are truncated to the
    model's length by lm-eval."""
    lengths = _plain(task.get("max_seq_lengths"))
    if not ruler_tasks(task) or not lengths:
        return None
    return "max(task.max_seq_lengths)", max(lengths)


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


def units_of(samples: list[dict]) -> dict:
    """lm-eval's logged samples of one task, compacted: the doc ids and each metric per doc, in doc order
    ({"id": [0, 1, ...], "acc": [1.0, 0.0, ...], "acc_norm": [...]}); a metric under a filter other than "none" is
    keyed "metric,filter", as in `task_metrics`. Prompts, responses and docs are left out: what paired statistics
    need (analysis/paired.py), a few KiB per task."""
    def plain(value):  # numpy scalars (some metrics) as Python numbers, pairs (word_perplexity's) as lists
        return [plain(v) for v in value] if isinstance(value, (tuple, list)) else getattr(value, "item", lambda: value)()

    out: dict[str, list] = {"id": []}
    first = min((s["filter"] for s in samples), default=None)
    for sample in sorted(samples, key=lambda s: (s["filter"], s["doc_id"])):
        if sample["filter"] == first:
            out["id"].append(sample["doc_id"])
        for metric in sample["metrics"]:
            key = metric if sample["filter"] == "none" else f"{metric},{sample['filter']}"
            out.setdefault(key, []).append(plain(sample[metric]))
    return out


def evaluate_one(lm, requested: str, resolved: str, tm, task) -> list[dict]:
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
        log_samples=True,
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
            "batch_size": lm.batch_option,
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
            "units": units_of(results.get("samples", {}).get(name, [])),
        })
    return rows


def evaluate_ruler(lm, name: str, task, data_dir) -> list[dict]:
    """A RULER task (experiments/lm_eval_tasks/ruler.py): one lm-eval evaluation and one row per length, each
    with the method's stats over that length's samples. `task.limit` samples are generated per length (null:
    RULER's 500)."""
    import lm_eval

    rows = []
    for length in _plain(task.max_seq_lengths):
        tm = ruler.task_manager(name, [length], task.limit or ruler.DEFAULT_SAMPLES, lm.tokenizer,
                                task.haystack, data_dir, _plain(task.get("qa_data")))
        lm.method.reset_stats()
        lm.reset_counts()
        t0 = time.perf_counter()
        results = lm_eval.simple_evaluate(model=lm, tasks=[name], num_fewshot=None, limit=None, task_manager=tm,
                                          bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True)
        seconds = time.perf_counter() - t0
        metrics = task_metrics(results, name)
        generated, stats = lm.counts["generated"], lm.method.stats.summary()
        samples = results.get("n-samples", {}).get(name, {})
        rows.append({
            "task": name,
            "lm_eval_task": name,
            "requested": name,
            "benchmark": "ruler",
            "length": int(length),
            "score": metrics[str(length)],
            "score_stderr": _finite(metrics.get(f"{length}_stderr")),
            "protocol": "decode",  # generation: dense prefill, then one token per step through the method
            "limit": task.limit,
            "n": samples.get("effective"),
            "max_gen_toks": ruler.RULER_TASKS[name],
            "seconds": seconds,
            "generated_tokens": generated,
            "seconds_per_sample": seconds / samples["effective"] if samples.get("effective") else None,
            "kv_fraction": _finite(stats.get("kv_fraction")),
            "stats": stats,
            "units": units_of(results.get("samples", {}).get(name, [])),
        })
    return rows


def run(model, tokenizer, method, task, data_dir, device="cpu") -> list[dict]:
    from experiments.lm_eval_lm import KVMethodLM

    rulers = ruler_tasks(task)
    names = [name for name in tasks_of(task) if name not in rulers]
    resolved, tm = lm_eval_setup(names, data_dir, task.get("include_path")) if names else ([], None)
    lm = KVMethodLM(model, tokenizer, method, protocol=task.protocol, dense_rows=task.dense_rows,
                    batch_size=task.batch_size)
    rows = []
    for requested in tasks_of(task):
        if requested in rulers:
            rows.extend(evaluate_ruler(lm, requested, task, data_dir))
        else:
            rows.extend(evaluate_one(lm, requested, resolved[names.index(requested)], tm, task))
    for row in rows:
        shown = {k: row[k] for k in ("acc", "acc_norm", "word_perplexity", "length", "score") if k in row}
        shown |= {k: row.get(k) for k in ("n", "kv_fraction", "seconds")}
        print(f"[lm_eval] {row['task']} ({row['protocol']}): {shown}")
    return rows
