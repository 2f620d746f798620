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
