"""How lm-eval requests are scored under a KV method: the two protocols of experiments/lm_eval.py (its docstring
says what each means). A module of its own, below both users: the task module checks a config with it without
importing lm-eval, and the LM class (experiments/lm_eval_lm.py, which imports lm-eval) scores with it.
"""

from __future__ import annotations

PROTOCOLS = ("paper", "serving")


def check_protocol(protocol, option: str = "task.protocol") -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"{option} must be one of {list(PROTOCOLS)}, got {protocol!r}")


def dense_rows_of(protocol: str, input_len: int, continuation_len: int, dense_rows: int) -> int:
    """Rows of one request's model input that attend densely: under `serving` its context (the input less the
    continuation tokens it holds, all but the last), under `paper` the task's dense_rows for every request."""
    return input_len - (continuation_len - 1) if protocol == "serving" else dense_rows


AUTO = "auto"
# task.batch_size=auto: one forward takes as many equal-length inputs as fill this many tokens. On a 2-core CPU
# (smollm2-135m) a forward's time per token stops falling by about this size (experiments/bench_lm_eval.py
# --forwards prints the curve), so a larger batch only costs memory: activations and the sim-mode attention working
# set grow with the batch's tokens, which bounds what a long few-shot or RULER-length input may share a forward with
AUTO_TOKENS = 2048


def check_batch_size(batch_size, option: str = "task.batch_size") -> None:
    if batch_size != AUTO and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"{option} must be an integer >= 1 or '{AUTO}', got {batch_size!r}")


def requests_per_forward(batch_size: int | str, rows: int) -> int:
    """How many distinct equal-length inputs of `rows` tokens one forward takes: task.batch_size, or with auto as
    many as fill AUTO_TOKENS tokens (at least one). Never padded: the scores are the same whatever it is."""
    return max(1, AUTO_TOKENS // rows) if batch_size == AUTO else batch_size


# a group of inputs that would save fewer rows than this by sharing its prefix (p tokens, n inputs: p(n - 1) rows) is
# scored whole: its prefix's forward and the inputs' tails, each a forward of its own (few rows: they cost about what
# reading the weights costs), take longer than the rows save. Measured with experiments/bench_lm_eval.py
# (smollm2-135m, 2 threads, PIQA 200 docs, two choices each): 0-shot contexts of 15-60 tokens shared from 16 on took
# 50.5 s against 31.5 s whole; 5-shot contexts of ~300 tokens 129.7 s against 171.9 s
SHARED_MIN = 128


def common_prefix(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def shared_prefixes(inputs: list[tuple[int, ...]], fewest: int | None = None) -> list[tuple[int, list[int]]]:
    """Groups of distinct inputs that begin with a common prefix, as (prefix length, the inputs' indices), chosen to
    save the most rows (a group of n sharing p tokens computes p(n - 1) fewer), each saving >= `fewest` rows
    (SHARED_MIN): a doc's choices share their context (and the few-shot examples before it; WinoGrande's, whose contexts
    differ, those). Sorted, inputs with a common prefix are neighbours; the run between two neighbours of the shortest
    common prefix is either one group or split there, whichever saves more, down to single inputs (not grouped):
    a post-order over the Cartesian tree of the neighbours' common prefixes, O(n log n) with the sort."""
    fewest = SHARED_MIN if fewest is None else fewest
    order = sorted(range(len(inputs)), key=inputs.__getitem__)
    lcp = [common_prefix(inputs[a], inputs[b]) for a, b in zip(order, order[1:])]
    if not lcp:
        return []
    # the tree: each node m splits its run of order positions between order[m] and order[m + 1] at its least lcp
    left, right, stack = [-1] * len(lcp), [-1] * len(lcp), []
    for i, v in enumerate(lcp):
        last = -1
        while stack and lcp[stack[-1]] > v:
            last = stack.pop()
        left[i] = last
        if stack:
            right[stack[-1]] = i
        stack.append(i)
    saved, whole, visit = {}, {}, [(stack[0], 0, len(order), False)]
    while visit:  # post-order (explicit: a run of many nested prefixes would recurse deeply)
        m, lo, hi, children_done = visit.pop()
        if not children_done:
            visit.append((m, lo, hi, True))
            visit += [(c, a, b, False) for c, a, b in ((left[m], lo, m + 1), (right[m], m + 1, hi)) if c >= 0]
            continue
        split = sum(saved[c] for c in (left[m], right[m]) if c >= 0)
        one = lcp[m] * (hi - lo - 1)
        one = one if one >= fewest else 0
        whole[m] = (lo, hi) if one > split else None
        saved[m] = max(one, split)
    groups, visit = [], [stack[0]]
    while visit:  # the groups: the topmost nodes that stay whole
        m = visit.pop()
        if whole[m] is not None:
            lo, hi = whole[m]
            groups.append((lcp[m], order[lo:hi]))
        else:
            visit += [c for c in (right[m], left[m]) if c >= 0]
    return groups
