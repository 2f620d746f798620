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
