"""Device seconds of the work of a decode step and of the prefill, from FLOPs and bytes: each segment's time is a
roofline, max(FLOPs / peak, bytes / memory bandwidth), over what the segment reads (weights, the KV it attends,
the selection's per-entry vectors: `GatheringMethod.selection_flops`), plus what grows with the context as the
census priced it (`layer_work`); the LM head at the profile's head rate (`head_seconds`); the dense prefill with
its KV writes to the host (`prefill_seconds`). How long, not when: clock.py places these seconds on the decode
step's timeline, and paper.py's schedule adds them up its own way.
"""

from __future__ import annotations

from dataclasses import dataclass

from infinigen.offload.plan import Plan, Shape
from infinigen.offload.profile import Hardware


def roofline(hw: Hardware, flops: float, nbytes: float, tflops: float | None = None) -> float:
    """Seconds for a kernel of `flops` reading/writing `nbytes` at the profile's peaks (`tflops`: another rate)."""
    return max(flops / ((tflops or hw.matmul_tflops) * 1e12), nbytes / (hw.memory_gbps * 1e9))


def head_seconds(hw: Hardware, shape: Shape, rows: int) -> float:
    """The LM head over `rows` hidden states, at the profile's head rate."""
    return roofline(hw, 2 * rows * shape.hidden * shape.vocab, (shape.hidden + rows) * shape.vocab * shape.elem,
                    hw.head_tflops)


@dataclass
class Segments:
    """Per-segment device seconds of one layer's decode step (roofline terms, no dispatch)."""

    projections: float = 0.0  # q/k/v (before the fetch is needed)
    attention: float = 0.0  # attention over what is attended + o_proj
    speculation: float = 0.0
    ffn: float = 0.0
    norms: float = 0.0


def layer_work(hw: Hardware, shape: Shape, plan_: Plan, method, i: int, batch: int, seen: int, attended: float,
               context_s: dict, timed_at: int = 0) -> Segments:
    """Roofline seconds of layer i's segments at a step where `seen` tokens exist and each (row, KV head) attends
    `attended` entries (itself included). Weights and FLOPs from the shapes; what grows with the context
    (`context_s`: seconds per batch row and context token per segment, `context_seconds`) past `timed_at` (the
    context the dispatch seconds were timed at, which hold what it cost there) on top."""
    b, e, d, h = batch, shape.elem, shape.head_dim, shape.heads
    q_w = shape.hidden * h * d
    kv_w = 2 * shape.hidden * shape.kv_heads * d
    ctx = b * (seen - timed_at)

    def seg(name: str, flops: float, weights: float) -> float:
        # matmuls over the weights at the roofline; what the context adds (attention's copies, scores, the
        # method's per-entry state) on top
        return roofline(hw, flops, weights * e) + ctx * context_s[name]

    # a profile of this machine (dispatch: stand_in) timed what each token of context costs, the scores and the
    # weighted sum over it included: its roofline prices the weights only, or that work would count twice
    per_entry = hw.dispatch != "stand_in"
    out = Segments()
    out.projections = roofline(hw, 2 * b * (q_w + kv_w), (q_w + kv_w) * e)
    out.attention = seg("attention", per_entry * 4 * b * h * attended * d + 2 * b * q_w, q_w)
    if plan_.kinds[i] == "gather":
        # what the selection spends however long the past (InfiniGen: the speculated query through the query
        # weight) is matmuls over weights, read once: flops / 2 of them per row
        fixed = method.selection_flops(shape.layer(i), 0)
        out.speculation = seg("speculation", b * method.selection_flops(shape.layer(i), seen - 1) if per_entry
                              else b * fixed, fixed / 2)
    out.ffn = seg("ffn", 2 * b * shape.ffn_weights, shape.ffn_weights)
    out.norms = seg("norms", 0, 0)
    return out


def prefill_seconds(hw: Hardware, shape: Shape, plan_: Plan, batch: int, prompt_len: int) -> float:
    """Dense prefill (all layers' matmuls and causal attention, logits for the last position) plus the offloaded
    layers' KV written to the host, each write overlapped with the next layer's compute."""
    b, P, e = batch, prompt_len, shape.elem
    per_layer = roofline(hw, 2 * b * P * (shape.attn_weights + shape.ffn_weights)
                         + 2 * b * shape.heads * P * P * shape.head_dim,
                         (shape.attn_weights + shape.ffn_weights) * e + 12 * b * P * shape.hidden * e)
    head = head_seconds(hw, shape, b)
    if hw.host_is_device:
        return shape.layers * per_layer + head
    t = 0.0
    for i in range(shape.layers):
        write = b * shape.kv_heads * P * plan_.row_bytes[i] / (hw.d2h_gbps * 1e9)
        t = max(t + per_layer, t + write) if i else per_layer
    return t + head
