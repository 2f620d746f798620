"""The framework side of the contract: the code that runs a method, which a method author does not write.

* sim mode: one teacher-forced forward over a whole sequence (`forward_attention`), attended in chunks of query rows
  (infinigen/rows.py) so that memory stays O(heads x chunk x t), never O(heads x t^2). Per layer it asks the method
  for its compact state once (`sim_state`) and, per chunk, which KV entries each row may attend (`sim_keep`) and
  what it sees (`sim_kv`); rows below `dense_rows` attend densely. A chunk is attended by torch's fused SDPA kernel
  (`attention="fused"`, the default) or by the eager math transformers' own eager attention uses
  (`attention="exact"`, what the sim == decode contract is checked with). A layer that keeps everything takes one
  fused causal call (`sim_dense`, `sim_causal`).
* decode mode: the dense prefill, chunked the same way (`prefill_attention`, with the prefill's attention mass for a
  method that reads it), then `after_prefill`; each step the method's `decode_attention`, whose default for a
  gathering method is `select`, then `attend_selected` (what an offloading runtime splits around its gather:
  `select_indices`, `attend_gathered`).
* both modes record the same statistics (`record_sim`, `record_decode`; infinigen/stats.py).

Local layers (a sliding window of W positions, Gemma 3's sliding_attention): every method keeps the model's own
semantics. A decoded row never attends a position the model's attention would not (sim: transformers' sliding mask
is the `allowed` every keep set is combined with; decode: `in_window` masks what the base decode steps attend and
what a gathering method selects), and kv_fraction counts against what full attention attends on that layer
(`full_past`: the W - 1 positions before the row, not the whole prefix).
"""

from __future__ import annotations

import dataclasses
import types
import typing

import torch

from infinigen.adapter import AttentionLayer, KVStore, Session
from infinigen.attention import attend, attend_fused, sim_attend
from infinigen.rows import chunk_allowed, count_true, full_past, in_window, keep_mask, row_chunks
from infinigen.stats import KVStats


def check_field_types(method) -> None:
    """Each hyperparameter (dataclass field) against its annotation, so `method.budget=abc` is refused by name
    before a method's own range checks compare it with numbers. float accepts int (the numeric tower); bool is
    never a number; annotations other than int/float/str/bool/None are left to the method."""
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    hints = typing.get_type_hints(type(method))
    for f in dataclasses.fields(method):
        kinds = typing.get_args(hints[f.name]) if isinstance(hints[f.name], types.UnionType) else (hints[f.name],)
        if not f.init or not all(k in names for k in kinds):
            continue
        value = getattr(method, f.name)
        accepted = set(kinds) | ({int} if float in kinds else set())
        if not any(type(value) is k for k in accepted):
            allowed = " or ".join(dict.fromkeys(names[k] for k in kinds if not (k is int and float in kinds)))
            raise ValueError(f"method.{f.name} must be {allowed}, got {value!r}")


def contract_default(hook):
    """Marks the contract's own (do-nothing) `sim_keep` / `sim_kv`: a method that keeps both attends densely in sim
    mode (`MethodDriver.sim_dense`)."""
    hook.contract_default = True
    return hook


class MethodDriver:
    """How sim and decode mode run any method (infinigen/contract.py `KVMethod` inherits it)."""

    def reset_stats(self) -> None:
        self.stats = KVStats()

    def sim_rows(self, session: Session, q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
        """(t, prompt rows) of sim mode's one forward over the whole sequence; anything else is refused, and so is
        a method that compresses a prompt (needs_prompt) given none."""
        t, s = q.shape[2], k.shape[2]
        name = type(self).__name__
        if s != t:
            raise ValueError(f"{name} sim mode expects one forward over the whole sequence (t == s), got t={t}, s={s}")
        if self.needs_prompt and session.dense_rows == 0:
            raise ValueError(f"{name} compresses a prompt: with dense_rows=0 there is none (set task.dense_rows to "
                             "the prompt length, or use lm-eval's protocol=serving)")
        return t, min(session.dense_rows, t)

    def forward_attention(self, session: Session, layer: AttentionLayer, q, k, v, allowed) -> torch.Tensor:
        """A multi-token forward: the whole sequence in sim mode, the dense prefill in decode mode."""
        if session.mode == "decode":
            return self.prefill_attention(session, layer, q, k, v, allowed)
        t, s = q.shape[2], k.shape[2]
        offset = s - t  # sequence position of query row 0
        if offset == 0 and session.plain_causal and session.attention == "fused" and self.sim_dense(layer):
            return self.sim_causal(session, layer, q, k, v)
        state = self.sim_state(session, layer, q, k, v, allowed)
        outs = []
        for r0, r1 in row_chunks(t, session.dense_rows - offset):
            allowed_c = chunk_allowed(allowed, r0, r1, offset, session.plain_causal)  # (b|1, 1, r, e)
            rows = torch.arange(offset + r0, offset + r1, device=q.device)
            session.chunk = (offset + r0, offset + r1)
            e = allowed_c.shape[-1]
            keep = self.sim_keep(session, layer, state, rows, e)
            # no chunk straddles dense_rows: its rows are all prompt rows (dense) or all decoded ones
            keep = allowed_c if keep is None or offset + r1 <= session.dense_rows else allowed_c & keep
            kc, vc = self.sim_kv(session, layer, state, k[:, :, :e], v[:, :, :e], rows)
            outs.append(sim_attend(session, q[:, :, r0:r1], kc, vc, keep, layer.logit_scale))
            self.record_sim(session, layer, keep, allowed_c, rows, start=offset + r0)
        return torch.cat(outs, dim=2)  # (b, h, t, d)

    def dense_layer(self, layer: AttentionLayer) -> bool:
        """Whether the method leaves `layer` dense (InfiniGen's first layers, H2O's `dense_layers`): its rows are not
        counted in `density` (infinigen/stats.py), as the InfiniGen artifact counts only the layers it selects on."""
        return False

    def record_kept(self, layer: AttentionLayer, kept: torch.Tensor, causal, offset: float = 0.0) -> None:
        """Per row the entries kept (kept + offset) and those the model's attention sees (`causal`: a tensor of
        kept's shape, or one host number for every row), on the layers the method does not leave dense."""
        if self.dense_layer(layer):
            return
        self.stats.add(layer.index, "kept", kept, offset=offset)
        if isinstance(causal, torch.Tensor):
            self.stats.add(layer.index, "causal", causal)
        else:
            self.stats.add_total(layer.index, "causal", float(causal) * kept.numel(), kept.numel())

    def sim_dense(self, layer: AttentionLayer) -> bool:
        """Whether every sim-mode row of `layer` attends its whole causal prefix of the real KV: true unless the
        method defines which entries rows keep (`sim_keep`) or what they see (`sim_kv`)."""
        return all(getattr(getattr(type(self), hook), "contract_default", False) for hook in ("sim_keep", "sim_kv"))

    def sim_causal(self, session: Session, layer: AttentionLayer, q, k, v) -> torch.Tensor:
        """A dense layer over a plain causal sequence: one fused causal call, no mask, no chunks."""
        out, _ = attend_fused(q, k, v, None, layer.logit_scale, causal=True)
        t = q.shape[2]
        first = min(session.dense_rows, t)
        if t > first:
            self.stats.add(layer.index, "kv_fraction", q.new_ones(q.shape[0], layer.num_kv_heads, t - first))
            if not self.dense_layer(layer):  # every decoded row keeps its whole prefix: host sums, nothing dispatched
                rows = q.shape[0] * layer.num_kv_heads
                causal = causal_entries(layer, first, t) * rows
                self.stats.add_total(layer.index, "kept", causal, rows * (t - first))
                self.stats.add_total(layer.index, "causal", causal, rows * (t - first))
        return out

    needs_prefill_probs = False  # set True if after_prefill reads the prefill attention probabilities

    def prefill_mass(self, probs: torch.Tensor) -> torch.Tensor:
        """Decode mode, needs_prefill_probs: one chunk's probabilities (b, h_kv, g, r, e) -> what after_prefill
        receives summed over every prefill row, (b, h_kv, e)."""
        return probs.sum(dim=(2, 3))

    def prefill_attention(self, session: Session, layer: AttentionLayer, q, k, v, allowed) -> torch.Tensor:
        """The dense decode-mode prefill, chunked like sim mode; a method that reads the prefill attention gets
        it accumulated chunk by chunk (`prefill_mass`), never as a (t, s) tensor."""
        t, s = q.shape[2], k.shape[2]
        mass, outs = None, []
        for r0, r1 in row_chunks(t):
            allowed_c = chunk_allowed(allowed, r0, r1, s - t, session.plain_causal)
            e = allowed_c.shape[-1]
            if self.needs_prefill_probs:
                out, probs = attend(q[:, :, r0:r1], k[:, :, :e], v[:, :, :e], allowed_c, layer.logit_scale, need_probs=True)
                part = self.prefill_mass(probs)  # (b, h_kv, e)
                mass = part.new_zeros(*part.shape[:2], s) if mass is None else mass
                mass[..., :e] += part
            else:
                out = sim_attend(session, q[:, :, r0:r1], k[:, :, :e], v[:, :, :e], allowed_c, layer.logit_scale)
            outs.append(out)
        self.after_prefill(session, layer, session.cache.layers[layer.index], q, mass)
        return torch.cat(outs, dim=2)

    def record_sim(self, session: Session, layer: AttentionLayer, keep, allowed, rows: torch.Tensor,
                   start: int | None = None, kept: torch.Tensor | None = None) -> None:
        """kv_fraction of the chunk's rows at sequence positions `rows` that are decoded (>= dense_rows). start:
        rows[0] (ascending, consecutive), when the caller knows it: nothing is then read back from the device.
        kept: (b|1, h_kv|1, r) entries each row kept, where that is not what it attended (infinigen/stats.py)."""
        if start is None:
            first = int((rows < session.dense_rows).sum())  # rows are ascending: the decoded ones come last
        else:
            first = min(max(session.dense_rows - start, 0), rows.numel())
        if first == rows.numel():
            return
        attended = count_true(keep[:, :, first:]).float()  # (b|1, h_kv|1, rows)
        causal = count_true(allowed[:, :, first:]).float()
        batch = session.attn_inputs[layer.index].shape[0]  # keep/allowed may be broadcast over the batch
        attended = attended.expand(batch, layer.num_kv_heads if keep.shape[1] == 1 else keep.shape[1], -1)
        self.stats.add(layer.index, "kv_fraction", attended / causal.clamp(min=1))
        kept = attended if kept is None else kept[:, :, first:].expand_as(attended)
        self.record_kept(layer, kept, causal.expand_as(attended))

    def record_decode(self, layer: AttentionLayer, store: KVStore, attended) -> None:
        """kv_fraction of the current row: `attended` entries (its own included) of what full attention attends."""
        b = store.positions.shape[0]
        attended = torch.as_tensor(attended, dtype=torch.float32).expand(b, layer.num_kv_heads)
        causal = full_past(layer, store.seen - 1) + 1
        self.stats.add(layer.index, "kv_fraction", attended / causal)
        self.record_kept(layer, attended, causal)


def causal_entries(layer: AttentionLayer, start: int, stop: int) -> int:
    """Entries the model's own attention lets the rows at positions start..stop-1 attend, summed (each row its
    `full_past` and itself)."""
    if layer.sliding_window is None:
        return (stop * (stop + 1) - start * (start + 1)) // 2
    return sum(full_past(layer, p) + 1 for p in range(start, stop))


class GatheringDriver:
    """How a gathering method's decode step runs: `select`, then `attend_selected` (before_step, attention over the
    selection and the current token, statistics, after_step); and the two halves an offloading runtime runs around
    its gather of exactly the selected rows from host memory (`select_indices`, `attend_gathered`)."""

    def select_indices(self, session: Session, layer: AttentionLayer, q, store: KVStore, past: int,
                       position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`select` as the offloading runtime gathers it: (index (b, h_kv, k) long, valid (b, h_kv, k) bool), the
        selected entries first in position order, then entries that are not fetched; k =
        `selection_width(...)`, known on the host, so nothing here waits for the device. The default sorts
        `select`'s mask (less what a local layer's window hides); a method that ranks with top-k returns its indices
        directly, and then selects within the window itself."""
        keep = self.windowed(layer, store, self.select(session, layer, q, store, past, position), position)
        k = self.selection_width(session, past, position)
        index = torch.argsort(keep.to(torch.uint8), dim=-1, descending=True, stable=True)[..., :k]  # kept first
        return index, torch.arange(k, device=keep.device) < keep.sum(-1, keepdim=True)

    @staticmethod
    def windowed(layer: AttentionLayer, store: KVStore, keep: torch.Tensor, position: int) -> torch.Tensor:
        """A selection keep (b, h_kv, past) less what a local layer's window hides from the row at `position`."""
        window = in_window(layer, store, position, keep.shape[-1])
        return keep if window is None else keep & window

    def decode_attention(self, session, layer, q, store):
        if self.dense_layer(layer):
            return super().decode_attention(session, layer, q, store)
        past, position = store.stored - 1, store.seen - 1
        keep = self.windowed(layer, store, self.select(session, layer, q, store, past, position), position)
        return self.attend_selected(session, layer, q, store, keep)

    def attend_selected(self, session, layer, q, store: KVStore, keep: torch.Tensor) -> torch.Tensor:
        """q (b, h, 1, d) attends the `keep`-selected past entries (b, h_kv, past) and itself."""
        self.before_step(session, layer, store)
        keys, values, mask = store.selected(keep)
        out, _ = attend(q, keys, values, mask, layer.logit_scale)
        full = full_past(layer, store.seen - 1) + 1  # what the model's own attention attends at this row
        selected = keep.sum(-1)
        self.stats.add(layer.index, "kv_fraction", selected, offset=1, scale=1 / full)
        self.record_kept(layer, selected, full, offset=1)
        self.after_step(session, layer, q, store, keep)
        return out

    def attend_gathered(self, session, layer, q, store: KVStore, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The offloading runtime's second half of a gathering step: the rows `select_indices` returned (index,
        valid: (b, h_kv, k)) are in `store.gathered` (the runtime's rows (b, h_kv, k + 1, W), the current token's
        last, with `valid` and the per-(row, KV head) `counts`). By default the selection as a mask over the past,
        then `attend_selected`, as decode mode runs it; a method whose selection has static buffers may attend the
        rows directly."""
        return self.attend_selected(session, layer, q, store, keep_mask(index, valid, store.stored - 1))

