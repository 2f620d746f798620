"""A method's KV budget: one convention and one check for every method.

A budget is how many KV entries a method keeps, fetches or attends, given as papers give it: a fraction in (0, 1] of
what the method measures it against (the tokens seen so far, the sequence, the prompt: each method's docstring says
which), or a count of tokens >= 1. A method holds it in one field that takes either (an int is a count, a float a
fraction: H2O, TOVA, SnapKV, StreamingLLM), in two fields of which exactly one is set (`budget` a fraction,
`budget_tokens` a count: RocketKV, ShadowKV), or as a fraction alone (`counts=False`: Quest, random top-k, and
InfiniGen and the oracle, whose count is a cap of its own, `max_num_kv`).
"""

from __future__ import annotations

import math

ONE_FIELD = object()  # `check_budget(tokens=...)` not given: the budget is one field


def check_budget(name: str, value, *, of: str | None = None, counts: bool = True, tokens=ONE_FIELD) -> None:
    """Refuses a budget outside the convention (ValueError naming the option), before any model loads.
    One field: `value` an int >= 1 (a count) or a float in (0, 1] (a fraction of `of`); a fraction only with
    counts=False. Two fields (`tokens` given, None included): method.<name> a fraction, method.<name>_tokens a count,
    exactly one of them set."""
    whole = of or ("sequence" if tokens is not ONE_FIELD else "tokens seen so far")
    if tokens is not ONE_FIELD:
        if (value is None) == (tokens is None):
            got = "neither" if value is None else f"both ({value!r} and {tokens!r})"
            raise ValueError(f"exactly one of method.{name} (a fraction of the {whole}) and method.{name}_tokens (a "
                             f"token count) is given, got {got}: the other null, e.g. method.{name}=null "
                             f"method.{name}_tokens=256")
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"method.{name} must be a fraction in (0, 1] of the {whole}, got {value!r}")
        if tokens is not None and tokens < 1:
            raise ValueError(f"method.{name}_tokens must be a token count >= 1, got {tokens!r}")
        return
    if not counts:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{name} must be a fraction in (0, 1]{' of the ' + of if of else ''}, got {value!r}")
        return
    ok = not isinstance(value, bool) and (
        (isinstance(value, int) and value >= 1) or (isinstance(value, float) and 0.0 < value <= 1.0)
    )
    if not ok:
        raise ValueError(
            f"{name} must be an int >= 1 (absolute number of tokens) or a float in (0, 1] (fraction of the "
            f"{whole}), got {value!r}"
        )


def budget_at(budget, budget_tokens, length: int) -> float:
    """The token budget over `length` tokens of a two-field budget (checked by `check_budget`): the count, at most
    `length`, or the fraction of `length` (callers round it as their reference does)."""
    return float(min(budget_tokens, length)) if budget_tokens is not None else budget * length


def token_count(budget: int | float, seen: int) -> int:
    """Tokens a one-field budget allows once `seen` tokens exist (the current one included): min(budget, seen) for
    an int, min(seen, max(1, ceil(budget * seen))) for a fraction. The same function serves sim and decode mode.

    The -1e-9 keeps float noise from rounding an exact product up (0.1 * 30 = 3.0000000000000004 -> 3, not 4).
    For a fraction <= 1 the count grows by at most one per token, so a window [seen - count, seen) never
    moves backwards: permanent eviction never needs a token back.
    """
    if isinstance(budget, int):
        return min(budget, seen)
    return min(seen, max(1, math.ceil(budget * seen - 1e-9)))
