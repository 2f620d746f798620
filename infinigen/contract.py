"""The KV-method contract: what a method author writes, and nothing else (docs/adding_a_method.md walks through it).

A method is a dataclass of its hyperparameters (checked in `__post_init__`) that runs in two modes, which must agree:

* sim: one teacher-forced forward over a whole sequence. Per layer the method computes a compact state once
  (`sim_state`) and from it, per chunk of query rows, which KV entries each row may attend (`sim_keep`, a
  (b, h_kv, rows, s) bool mask) or what it sees (`sim_kv`).
* decode: a real prefill (dense; `after_prefill` sees the filled store), then one token per step through a `KVStore`
  cache layer that holds exactly what the method keeps (`new_store`, `decode_attention`). A gathering method instead
  says which past entries each step attends (`select`), around per-entry bookkeeping (`before_step`, `after_step`).

The code that runs these (chunking, the prefill, recording kv_fraction) is infinigen/driver.py; what the offloading
runtime and the performance model ask of a method (where its KV lives, codecs, sizes, selection cost) is
infinigen/runtime_needs.py; attention kernels, row chunks and windows, statistics and budgets have their own modules
(infinigen/attention.py, rows.py, stats.py, budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from infinigen.adapter import AttentionLayer, KVStore, Session
from infinigen.attention import attend
from infinigen.driver import GatheringDriver, MethodDriver, check_field_types, contract_default
from infinigen.rows import in_window
from infinigen.runtime_needs import GatheringNeeds, RuntimeNeeds
from infinigen.stats import KVStats


@dataclass
class KVMethod(RuntimeNeeds, MethodDriver):
    """Dense attention over every cached entry: the reference every method is compared with."""

    # hyperparameters that set how much KV the method keeps or attends: figures place points along them
    size_params: ClassVar[tuple[str, ...]] = ()
    # a method that compresses a prompt (SnapKV) has nothing to do without one: sim mode needs dense_rows > 0
    needs_prompt: ClassVar[bool] = False
    # settings worth testing beside the defaults (overrides of conf/method/<name>.yaml, e.g. eviction on): every
    # method-wide test (tests/conftest.py `variants`) runs them too, so a new method's own settings need no test edit
    test_variants: ClassVar[tuple[dict, ...]] = ()
    # sim mode resumes after a prefix: a row's output depends on the tokens up to it only (not on the sequence's
    # length, `session.max_len`), and a forward over a past (modes.sim_prefix, then sim_resume) computes for its rows
    # what one forward of the whole sequence does. lm-eval then scores a doc's choices from one forward of their
    # shared context (tests/test_lm_eval_shared.py checks the log-likelihoods of every method that says so)
    prefix_resumable: ClassVar[bool] = False

    def __post_init__(self):
        check_field_types(self)
        self.stats = KVStats()

    def check_shape(self, num_kv_heads: int, head_dim: int) -> None:
        """Refuse hyperparameters a model of this attention shape cannot take (ValueError naming the option); run
        before the model loads where its config declares the shape (experiments/validation.py validate)."""

    def check_data(self) -> None:
        """Refuse missing or unreadable files `bind` will read (a calibration text): run before a model loads, by
        runs that load one (a modelled latency run binds nothing, so it needs no data)."""

    def bind(self, session: Session) -> None:
        """Called when installed into a model (e.g. to calibrate on its weights)."""

    def new_store(self, layer: AttentionLayer) -> KVStore:
        return KVStore()

    def sim_state(self, session: Session, layer: AttentionLayer, q, k, v, allowed) -> Any:
        """Computed once per layer and sim forward, before any chunk: whatever `sim_keep` / `sim_kv` need
        (kept compact: O(t) or O(h_kv x t), never per (row, entry) pair). q (b, h, t, d); k, v (b, h_kv, s, d)."""
        return None

    @contract_default
    def sim_keep(self, session: Session, layer: AttentionLayer, state, rows: torch.Tensor, s: int) -> torch.Tensor | None:
        """(b|1, h_kv|1, r, s) bool: which of the first s entries the query rows at sequence positions `rows`
        (r,) may attend (combined with causality and a local window by the caller), each row's own position
        included as decode mode attends it; None = all of them. `session.chunk` holds the same positions as host
        ints: branch and slice on those (reading `rows` would wait for the device)."""
        return None

    @contract_default
    def sim_kv(self, session: Session, layer: AttentionLayer, state, k, v, rows: torch.Tensor):
        """The keys/values the rows at `rows` attend ((b, h_kv, s, d) each): the real ones unless the method
        changes what attention sees (quantisation)."""
        return k, v

    def after_prefill(self, session: Session, layer: AttentionLayer, store: KVStore, q, mass) -> None:
        """Decode mode: called once the dense prefill has filled `store` (mass: the `prefill_mass` of every
        prefill row, (b, h_kv, s), if needs_prefill_probs, else None)."""

    def decode_attention(self, session: Session, layer: AttentionLayer, q, store: KVStore) -> torch.Tensor:
        """One decoded token: q (b, h, 1, d); `store` already holds this token's KV (a local layer attends those in
        its window)."""
        keys, values = store.kv()
        window = in_window(layer, store, store.seen - 1)  # (b, h_kv, s) or None
        out, _ = attend(q, keys, values, None if window is None else window[:, :, None], layer.logit_scale)
        self.record_decode(layer, store, store.stored if window is None else window.sum(-1))
        return out


@dataclass
class GatheringMethod(GatheringNeeds, GatheringDriver, KVMethod):
    """A method whose decoded rows attend a selection of the past plus themselves. Its decode step is three
    parts, run back to back in decode mode and split by the offloading runtime (which gathers exactly the
    selected rows from host memory between `select` and `attend_selected`):

    select(...)           which past entries the current token attends, (b, h_kv, past) bool
    attend_selected(...)  attention over them + the current token, statistics, then `after_step`
    after_step(...)       per-entry bookkeeping (counters, eviction) once the step has attended
    """

    speculation_point: ClassVar[str] = "query"  # SPECULATION_POINTS: when `select` can run

    def select(self, session: Session, layer: AttentionLayer, q, store: KVStore, past: int, position: int):
        """keep (b, h_kv, past) bool over the store's first `past` entries (those before the current token) for
        the token at `position`. q (b, h, 1, d) is the true query, or None when the runtime calls this ahead of
        the layer (speculation_point != "query"): then only what `session` captured so far may be used."""
        raise NotImplementedError

    def before_step(self, session, layer, store: KVStore) -> None:
        """Per-entry state for the current token (already appended to `store`), before it attends."""

    def after_step(self, session, layer, q, store: KVStore, keep: torch.Tensor) -> None:
        """Bookkeeping once the current token attended `keep`."""

