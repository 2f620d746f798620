"""Decode performance model of the offloading runtime: what `task=latency` would measure on hardware we may not
have, replayed from a hardware profile instead of a clock. This module holds its entry points, `modelled_steps`
(each decode step's modelled seconds) and `summarize` (a run's metrics), and the glue that reads a census: the
ops the runtime's own code dispatches (counted once on a small stand-in of the model, in the model's dtype:
infinigen/offload/census.py) times the profile's per-op cost, or, on a profile of this machine, as timed here
(`dispatch_seconds`, `context_seconds`, `census_events`; a census kept as JSON: `census_of`, `from_census`).

The model's other parts, each its own module:
  profile.py   the hardware profile (`Hardware`, `hardware`): a machine's rates, checked field by field
  plan.py      the model's shape and what the runtime sets up per layer (`Shape`, `Plan`, `plan`), and the bytes
               it moves and holds (`step_bytes`, `memory`)
  roofline.py  each segment's device seconds from its FLOPs and bytes (`layer_work`), the LM head, the prefill
  clock.py     the simulated timeline: the host thread, the device stream and the link, on which `decode_steps`
               replays the runtime's order of events

Nothing here loads weights: an OPT-13B point computes from its config in well under a second (after the census,
cached per method config and model structure).
"""

from __future__ import annotations

import statistics

from infinigen.offload.clock import EVENTS, decode_steps, no_events
from infinigen.offload.plan import Shape
from infinigen.offload.profile import Hardware


def dispatch_seconds(hw: Hardware, model_cfg, method, runtime: str, batch: int, prompt_len: int,
                     kinds: list[str]) -> tuple[list[dict], int]:
    """(per layer {segment: seconds} the runtime's ops take beyond the weights' roofline, the context length
    they were timed at). A GPU profile: each dispatched op at launch_us, at no context (what grows with it is
    priced from bytes). A profile of this machine: the stand-in timed here at the run's prompt, batch and head
    width; the host segment at the census's short prompt (host work is priced from the bytes the real selection
    moves, not the stand-in's own)."""
    from infinigen.offload import census

    if hw.dispatch == "stand_in":
        point = census.census(model_cfg, method, runtime, batch, kinds, "point_seconds", prompt=prompt_len)
        short = census.census(model_cfg, method, runtime, batch, kinds, measure="seconds")
        return [{**p, "host": s["host"]} for p, s in zip(point, short)], census.timed_context(prompt_len)
    ops = census.census(model_cfg, method, runtime, batch, kinds)
    return [{seg: n * hw.launch_us * 1e-6 for seg, n in layer.items()} for layer in ops], 0


def census_events(hw: Hardware, model_cfg, method, runtime: str, batch: int, kinds: list[str]) -> list[dict]:
    """Per layer {measure: {segment: value}} of what the launching thread does besides dispatching (the census's
    syncs, joins, writebacks, host and readback). A profile of this machine has none to add: host and device are
    one thread there, and its timed seconds hold that work."""
    from infinigen.offload import census

    if hw.host_is_device:
        return no_events(len(kinds))
    per = {m: census.census(model_cfg, method, runtime, batch, kinds, measure=m) for m in EVENTS}
    return [{m: per[m][i] for m in EVENTS} for i in range(len(kinds) + 1)]


def context_seconds(hw: Hardware, model_cfg, method, runtime: str, batch: int, kinds: list[str]) -> list[dict]:
    """Per layer {segment: seconds per (batch row, context token)}. A profile of this machine (dispatch: stand_in)
    times the method's code at two context lengths here; any other prices the bytes the census counts that grow
    with the context: streamed at the profile's copy rate, indexed at its gather rate."""
    from infinigen.offload import census

    if hw.dispatch == "stand_in":
        return census.census(model_cfg, method, runtime, batch, kinds, measure="context_seconds")
    stream, indexed = (census.census(model_cfg, method, runtime, batch, kinds, measure=m) for m in ("stream", "indexed"))
    return [{seg: s[seg] / (hw.copy_gbps * 1e9) + x[seg] / (hw.gather_gbps * 1e9) for seg in s}
            for s, x in zip(stream, indexed)]


GPU_MEASURES = ("ops", "stream", "indexed") + EVENTS  # what a profile that is not this machine reads of a census


def census_of(model_cfg, method, runtime: str, batch: int, kinds: list[str]) -> dict:
    """{measure: per layer {segment: value}}: the census a GPU profile's model reads (`from_census`); JSON, so the
    census of one version of the runtime can be kept and modelled by another version of this model."""
    from infinigen.offload import census

    return {m: census.census(model_cfg, method, runtime, batch, kinds, measure=m) for m in GPU_MEASURES}


def from_census(hw: Hardware, cen: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """A census (`census_of`) priced on a profile: (dispatch seconds, context seconds, events) per layer, as
    `dispatch_seconds`, `context_seconds` and `census_events` give them for a profile that is not this machine."""
    dispatch = [{seg: n * hw.launch_us * 1e-6 for seg, n in layer.items()} for layer in cen["ops"]]
    context = [{seg: st[seg] / (hw.copy_gbps * 1e9) + ix[seg] / (hw.gather_gbps * 1e9) for seg in st}
               for st, ix in zip(cen["stream"], cen["indexed"])]
    events = [{m: cen[m][i] for m in EVENTS} for i in range(len(cen["ops"]))]
    return dispatch, context, events


def modelled_steps(hw: Hardware, model_cfg, method, runtime: str, batch: int, prompt_len: int, gen_len: int,
                   fractions: list[float] | None, cen: dict | None = None, gather: str = "host") -> list[dict]:
    """decode_steps with the census of the method's code (cached after the first call per configuration), or,
    on a profile that is not this machine, the census `cen` given (`census_of`, e.g. of another runtime)."""
    from infinigen.offload.runtime import layer_kind

    shape = Shape.of(model_cfg)
    kinds = [layer_kind(method, shape.layer(i), runtime) for i in range(shape.layers)]
    if hw.dispatch == "stand_in":
        dispatch, timed_at = dispatch_seconds(hw, model_cfg, method, runtime, batch, prompt_len, kinds)
        return decode_steps(method, model_cfg, hw, runtime, batch, prompt_len, gen_len, fractions, dispatch,
                            context_seconds(hw, model_cfg, method, runtime, batch, kinds), timed_at,
                            census_events(hw, model_cfg, method, runtime, batch, kinds))
    dispatch, context, events = from_census(hw, cen or census_of(model_cfg, method, runtime, batch, kinds))
    return decode_steps(method, model_cfg, hw, runtime, batch, prompt_len, gen_len, fractions, dispatch, context,
                        0, events, gather)


def summarize(steps: list[dict], warmup: int, batch: int) -> dict:
    keep = steps[min(warmup, max(len(steps) - 1, 0)):]
    med = {k: statistics.median(r[k] for r in keep) * 1e3 for k in
           ("step_s", "compute_s", "speculation_s", "exposed_transfer_s", "host_s", "transfer_s", "sync_wait_s",
            "join_wait_s", "host_work_s", "host_busy_s")}
    return {
        "decode_ms_median": med["step_s"], "modelled_decode_ms_per_token": med["step_s"],
        "tokens_per_s": batch * 1e3 / statistics.fmean(r["step_s"] * 1e3 for r in keep),
        "compute_ms": med["compute_s"], "speculation_ms": med["speculation_s"],
        "exposed_transfer_ms": med["exposed_transfer_s"], "host_ms": med["host_s"], "transfer_ms": med["transfer_s"],
        # the launching thread's time not spent dispatching: waiting for the device at host synchronisations,
        # blocked on the link's jobs, host tensor work (compactions, blocking reads)
        "sync_wait_ms": med["sync_wait_s"], "syncs_per_step": statistics.median(r["syncs"] for r in keep),
        "join_wait_ms": med["join_wait_s"], "host_work_ms": med["host_work_s"],
        "host_busy_ms": med["host_busy_s"],  # the link worker's host work, hidden or not
        "h2d_bytes_per_token": statistics.fmean(r["h2d_bytes"] for r in keep),
    }
