"""The runtime the InfiniGen paper timed, as a schedule of the performance model (`task.schedule=paper`).

The paper's speed figures (OSDI'24, Figs. 14-18) come from its artifact, snu-comparch/InfiniGen `speedup/`: a
FlexGen fork run as `python -m flexgen.flex_opt --percent 100 0 0 100 100 0 --overlap false ...` (weights on the
GPU, the KV cache in host memory) with one scheme per method: `original` (FlexGen: the whole cache crosses),
`original --compress-cache` (INT4), `h2o` and `infinigen`. That runtime differs from this project's
(infinigen/offload/runtime.py, which perf.py models: `overlapped`) in the ways `Switches` lists, each its own
field with where the artifact does it, so one can be turned off at a time (`task.paper.<name>=...`) to see its cost.

A step is layer after layer, each layer's movement then its compute (the artifact synchronises the device after
every layer), priced on a hardware profile: copies at its pinned (`h2d_gbps`) or pageable (`pageable_gbps`) rate,
host copies and gathers at `host_gbps`, device work at the roofline, each kernel's launch at `launch_us`.
Throughput is FlexGen's: batch x generated tokens / (prefill + decode), the prefill yielding the first token and
gen_len - 1 decode steps after it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from infinigen.offload.plan import Plan, Shape, held_rows, plan
from infinigen.offload.profile import Hardware
from infinigen.offload.roofline import head_seconds, roofline

SCHEDULES = ("overlapped", "paper")
# the conf/method names of the schemes the artifact ran (full: the ideal, everything on the GPU)
PAPER_METHODS = ("full", "offload", "quant", "h2o", "infinigen")
# InfiniGen's fetch on OPT-13B as the paper reports it (Sec. 6.4, Fig. 16a): tokens per layer and head at 512,
# 1024, 1536 and 2048 tokens of context (`task.fetch_fraction=paper`; linear between, flat past the ends)
PAPER_FETCH_TOKENS = {512: 37, 1024: 60, 1536: 66, 2048: 73}

# The artifact's weight placement per model (speedup/scripts/figure16b/run.sh: `--percent 70 30 ...` for OPT-30B,
# whose weights and KV do not fit the A6000's 48 GB; `--percent 100 0 ...` for every other run)
ARTIFACT_WEIGHT_OFFLOAD = {"opt-30b": 0.3}
# ops a decoder layer dispatches per decode step in the artifact, read from its code (flexgen/*/pytorch_backend.py
# mha_gen and mlp, flex_opt.py load_cache / store_cache / prefetch_cache): FlexGen's layer norm, q/k/v
# projections, scaling, the new token's two cache writes, the K and V relayout copies, bmm, mask, softmax, bmm,
# output projection, residual (14) and MLP (5), with the cache's load and store copies and the hidden state's
# (6); INT4 adds each of K and V decompressed (two nibble unpacks, split, div_, add_, the scales' copy: 8 each);
# H2O adds the accumulated attention's update, copies and the evicted entry's replacement on the host (14);
# InfiniGen adds the speculation (partial query, bmm, max, threshold, count, mean + .item(), top-k: 12), the
# indices' read-back and the host gather with its pinned staging (select_kv, prefetch_kv: 9), the partial key
# cache's update (set_partial_cache + cat: 4) and the concatenations that replace the cache writes (2). Each is
# priced at the profile's launch_us: the artifact synchronises the device after every layer, so nothing hides it
SCHEME_OPS = {"ideal": 19, "flexgen": 25, "int4": 41, "h2o": 39, "infinigen": 52}
# attention layers whose cache H2O's loop loads in series (h2o/flex_opt.py: attn_layer[:2]); later ones are
# loaded by the previous attention layer, beside the MLP between them
H2O_SERIAL_LAYERS = 2
# device bytes per cached element that FlexGen's decode attention moves: K and V relaid out by
# permute().reshape() (a copy: read + write) before the bmm reads them: 3 passes of the element
ATTEND_PASSES = 3
# compression.py TorchCompressedDevice.decompress, per fp16 element produced: two nibble unpacks (each reads the
# packed byte, writes a uint8 temporary, reads it, writes the fp16 into every other slot: 2.5 bytes per output
# element each), then div_ by the scale and add_ of the minimum (read + write of 2 bytes each): 13 bytes
DEQUANT_BYTES = 13.0
# _attention_weights at the prefill: the (b*h, s, s) scores written by bmm, read and written by the mask and the
# softmax, read by the second bmm: 6 passes of 2 bytes
PREFILL_SCORE_BYTES = 12.0


@dataclass(frozen=True)
class Switches:
    """How the artifact's runtime differs from this project's; each False (or 0) is this project's way."""

    # flex_opt.py generation_loop_normal (--overlap false): each layer's weights and cache are loaded, then it
    # computes, then the device is synchronised; nothing of the next layer moves meanwhile. Off: a layer's
    # movement overlaps the previous layer's compute
    serial: bool = True
    # infinigen/flex_opt.py OptLM.load_cache skips `attn_layer[2:]`: layers 0 and 1 load their whole cache every
    # step (speculation starts at layer 2). Off (0): the method's own dense layers
    dense_layers: int = 2
    # pytorch_backend.py init_cache_one_gpu_batch: "disable pin_memory due to high memory overhead": the cache's
    # home is pageable, so FlexGen and INT4 copy it at the pageable rate, and H2O and InfiniGen first copy their
    # rows on the host into a pinned prefetch buffer (`prefetch_kv`). Off: a pinned pool
    pageable: bool = True
    # h2o/flex_opt.py SelfAttention.set_task / load_cache: hh_k = hh_ratio x prompt (0.5 x prompt on layers 0-1),
    # and every step moves min(2 hh_k - 1, prompt) + 1 rows, the heavy hitters and recent window replaced in
    # place; the prefill stores only those (its KV pruned on the device first). Off: the rows this project's H2O
    # holds at that step, and the whole prompt stored
    fixed_h2o: bool = True
    # compression.py: the 4-bit cache crosses compressed and is decompressed on the device into fp16 (new tensors)
    # before attention reads it. Off: attention reads the codes (a fused kernel: no extra pass)
    serial_dequant: bool = True
    # --percent <gpu> <cpu> of the weights: this share of each layer's weights lives on the host and crosses
    # (pinned, FlexGen's --pin-weight default) every time the layer runs. None: as the artifact ran the model
    # (ARTIFACT_WEIGHT_OFFLOAD)
    weight_offload: float | None = None


def switches(overrides: dict | None) -> Switches:
    """Switches from `task.paper` overrides; ValueError naming the option for an unknown name or a bad value."""
    sw = Switches()
    names = {f.name for f in fields(Switches)}
    for name, value in (overrides or {}).items():
        if name not in names:
            raise ValueError(f"task.paper.{name}: unknown switch; the switches are {sorted(names)}")
        if name == "dense_layers":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"task.paper.dense_layers must be an integer >= 0, got {value!r}")
        elif name == "weight_offload":
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < 1):
                raise ValueError(f"task.paper.weight_offload must be null (as the artifact ran the model) or a "
                                 f"share in [0, 1), got {value!r}")
        elif not isinstance(value, bool):
            raise ValueError(f"task.paper.{name} must be true or false, got {value!r}")
        sw = replace(sw, **{name: value})
    return sw


def scheme(kind: str, evicting: bool, decodes: bool) -> str:
    """The artifact's scheme for a layer as the method declares it (the runtime's layer kind and its pool)."""
    if kind == "resident":
        return "ideal"
    if kind == "gather":
        return "infinigen"
    if decodes:
        return "int4"
    return "h2o" if evicting else "flexgen"


def schemes(p: Plan, sw: Switches) -> list[str]:
    """Per layer, the artifact's scheme; a selecting method's first `dense_layers` load their whole cache."""
    selecting = "gather" in p.kinds
    return ["flexgen" if selecting and i < sw.dense_layers else scheme(k, e, d)
            for i, (k, e, d) in enumerate(zip(p.kinds, p.evicting, p.decodes))]


@dataclass
class Rates:
    """Bytes per second of the profile's paths."""

    pinned: float
    pageable: float
    gather: float  # rows gathered on the host by torch's intra-op threads (bytes read + written)
    copy: float  # a contiguous host copy (bytes read + written)
    device: float

    @classmethod
    def of(cls, hw: Hardware) -> "Rates":
        if hw.host_is_device:
            raise ValueError(f"hardware={hw.name}: the paper schedule needs a GPU profile (host->device rates); "
                             f"this one is a CPU's")
        gather = max((hw.host_gbps_threads or {}).values(), default=hw.host_gbps)  # the artifact's main thread
        return cls(hw.h2d_gbps * 1e9, (hw.pageable_gbps or hw.h2d_gbps) * 1e9, gather * 1e9,
                   (hw.host_copy_gbps or gather) * 1e9, hw.copy_gbps * 1e9)


def compute_seconds(hw: Hardware, shape: Shape, batch: int, attended: float, kv_bytes: float,
                    speculation: float = 0.0) -> dict:
    """One layer's device seconds at decode: attention (projections, `attended` entries per (row, head) moved
    ATTEND_PASSES times, `kv_bytes` of cached K|V elements) and MLP (its dispatch is the layer's `dispatch`)."""
    b, e = batch, shape.elem
    attn = roofline(hw, 2 * b * shape.attn_weights + 4 * b * shape.heads * attended * shape.head_dim,
                         shape.attn_weights * e) + ATTEND_PASSES * kv_bytes / (hw.copy_gbps * 1e9)
    mlp = roofline(hw, 2 * b * shape.ffn_weights, shape.ffn_weights * e)
    return {"attention": attn + speculation, "mlp": mlp}


def paper_fetch(seen: int) -> float:
    """PAPER_FETCH_TOKENS at `seen` tokens of context (linear between the reported points, flat past the ends)."""
    pts = sorted(PAPER_FETCH_TOKENS.items())
    if seen <= pts[0][0]:
        return float(pts[0][1])
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if seen <= x1:
            return y0 + (y1 - y0) * (seen - x0) / (x1 - x0)
    return float(pts[-1][1])


def selected_rows(method, fractions: list[float] | str | None, i: int, seen: int) -> float:
    """Past entries a (row, head) of gathering layer i fetches when `seen` tokens exist, capped by the method:
    per layer fractions of the context, or "paper" (PAPER_FETCH_TOKENS)."""
    if fractions == "paper":
        want = paper_fetch(seen)
    else:
        want = (fractions[i] if fractions else 1.0) * seen - 1
    return min(max(0.0, want), method.max_selected(seen), seen - 1.0)


def fixed_h2o_rows(method, i: int, prompt_len: int) -> int:
    """Rows per (row, head) of layer i that the artifact's H2O holds, moves every step and stores at the prefill
    (h2o/pytorch_backend.py mha: the prompt's KV pruned to its 2 hh_k heavy and recent rows before store_cache):
    max_held(prompt) = heavy + recent of the prompt, the whole prompt on layers 0-1 (hh_k = 0.5 x prompt)."""
    return prompt_len if i < 2 else method.max_held(prompt_len)


def layer_terms(method, shape: Shape, p: Plan, hw: Hardware, sw: Switches, batch: int,
                prompt_len: int, past: int, fractions: list[float] | str | None, weight_share: float) -> list[dict]:
    """Per layer, seconds of one decode step with `past` earlier tokens under the artifact's schedule: what the
    layer adds to the step (`layer`) and its terms."""
    r = Rates.of(hw)
    bh = batch * shape.kv_heads
    kv_row = 2 * shape.head_dim * shape.elem  # one (token, head) of K|V at the model's precision
    seen = past + 1
    home = r.pageable if sw.pageable else r.pinned
    launch = hw.launch_us * 1e-6
    out = []
    prev_mlp = 0.0
    for i, name in enumerate(schemes(p, sw)):
        moved = host = dequant = spec = prefetched = 0.0
        attended = seen
        if name == "flexgen":
            moved = past * bh * kv_row / home
        elif name == "int4":
            moved = past * bh * p.row_bytes[i] / home
            dequant = DEQUANT_BYTES * past * bh * 2 * shape.head_dim / r.device if sw.serial_dequant else 0.0
        elif name == "h2o":
            rows = (fixed_h2o_rows(method, i, prompt_len) if sw.fixed_h2o
                    else held_rows(method, p, i, past, prompt_len))
            attended = rows + 1
            host = 2 * rows * bh * kv_row / r.copy if sw.pageable else 0.0  # home -> pinned prefetch_kv
            # h2o/flex_opt.py generation_loop_normal: layers 0-1 load their cache in series; from layer 2 on the
            # previous attention issues it (load_cache, overlap=True: the host copy on the host thread, then the
            # copy on the load stream) and it runs beside that layer's MLP, as InfiniGen's prefetch below
            if i < H2O_SERIAL_LAYERS:
                moved = rows * bh * kv_row / r.pinned
            else:
                prefetched = rows * bh * kv_row / r.pinned
        elif name == "infinigen":
            rows = selected_rows(method, fractions, i, seen)
            attended = rows + 1
            # kv_selection_controller.select_kv: F.embedding gathers the rows on the host into a new tensor
            # (read + write), then copied into the pinned prefetch_kv (read + write) where the home is pageable
            host = 2 * rows * bh * kv_row * (1 / r.gather + sw.pageable / r.copy)
            # flex_opt.py prefetch_cache issues the copy on its own stream after the previous layer's attention:
            # it runs beside that layer's MLP, and the device waits for it before this attention
            prefetched = rows * bh * kv_row / r.pinned
            lw = shape.layer(i)
            spec = roofline(hw, batch * method.selection_flops(lw, seen - 1),
                                 method.selection_flops(lw, 0) / 2 * shape.elem)
        c = compute_seconds(hw, shape, batch, attended, attended * bh * kv_row, spec)
        weights = weight_share * (shape.attn_weights + shape.ffn_weights) * shape.elem / r.pinned
        exposed = max(0.0, prefetched - prev_mlp)
        compute = c["attention"] + c["mlp"]
        dispatch = SCHEME_OPS[name] * launch
        if sw.serial:
            layer = host + moved + dequant + weights + exposed + compute + dispatch
        else:  # the layer's movement beside the previous layer's compute, its ops queued ahead of the device
            layer = host + dequant + max(moved + weights + exposed - prev_mlp, 0.0) + max(compute, dispatch)
        out.append({"layer": layer, "transfer": moved + exposed, "host": host, "dequant": dequant,
                    "weights": weights, "speculation": spec, "compute": compute - spec, "dispatch": dispatch})
        prev_mlp = c["mlp"]
    return out


def decode_step(method, shape: Shape, p: Plan, hw: Hardware, sw: Switches, batch: int,
                prompt_len: int, past: int, fractions: list[float] | str | None, weight_share: float) -> dict:
    """Seconds of one decode step (the layers, then the LM head) and its terms summed over the layers."""
    layers = layer_terms(method, shape, p, hw, sw, batch, prompt_len, past, fractions, weight_share)
    out = {f"{k}_s": sum(t[k] for t in layers) for k in layers[0] if k != "layer"}
    return {"step_s": sum(t["layer"] for t in layers) + head_seconds(hw, shape, batch), **out}


def prefill_seconds(method, shape: Shape, p: Plan, hw: Hardware, sw: Switches, batch: int,
                    prompt_len: int, weight_share: float) -> float:
    """The artifact's prefill: each layer's weights (the offloaded share), its compute (the scores materialised
    by bmm), then its KV stored to the host home (compressed for INT4; H2O's pruned rows), layer after layer."""
    r = Rates.of(hw)
    b, P, e = batch, prompt_len, shape.elem
    total = 0.0
    for i, name in enumerate(schemes(p, sw)):
        compute = roofline(hw, 2 * b * P * (shape.attn_weights + shape.ffn_weights)
                                + 4 * b * shape.heads * P * P * shape.head_dim,
                                (shape.attn_weights + shape.ffn_weights) * e + 12 * b * P * shape.hidden * e
                                + PREFILL_SCORE_BYTES * b * shape.heads * P * P)
        store = 0.0
        if name != "ideal":
            row = p.row_bytes[i] if name == "int4" else 2 * shape.head_dim * e
            rows = fixed_h2o_rows(method, i, P) if name == "h2o" and sw.fixed_h2o else P
            store = b * shape.kv_heads * rows * row / (r.pageable if sw.pageable else r.pinned)
        weights = weight_share * (shape.attn_weights + shape.ffn_weights) * e / r.pinned
        total += compute + store + weights if sw.serial else max(compute, store + weights)
    return total + head_seconds(hw, shape, b)


def weight_share_of(sw: Switches, model_name: str) -> float:
    return ARTIFACT_WEIGHT_OFFLOAD.get(model_name, 0.0) if sw.weight_offload is None else float(sw.weight_offload)


def modelled(method, model_cfg, hw: Hardware, runtime: str, batch: int, prompt_len: int, gen_len: int,
             fractions: list[float] | str | None, overrides: dict | None = None) -> dict:
    """The latency task's metrics under the artifact's schedule: decode ms per token, prefill, total latency and
    FlexGen's throughput, with each step's terms (medians over the steps). As flex_opt.py run_flexgen times it, the
    prefill yields the first token and `gen_len - 1` decode steps follow (decode_latency = sum(costs[1:]))."""
    if gen_len < 2:
        raise ValueError(f"task.gen_len must be >= 2 under task.schedule=paper (the prefill yields the first "
                         f"token, then gen_len - 1 decode steps), got {gen_len!r}")
    sw = switches(overrides)
    shape = Shape.of(model_cfg)
    p = plan(method, shape, runtime, prompt_len + gen_len)
    share = weight_share_of(sw, str(model_cfg.get("name", "")))
    steps = [decode_step(method, shape, p, hw, sw, batch, prompt_len, prompt_len + s, fractions, share)
             for s in range(gen_len - 1)]
    prefill = prefill_seconds(method, shape, p, hw, sw, batch, prompt_len, share)
    decode = sum(s["step_s"] for s in steps)
    mid = sorted(steps, key=lambda s: s["step_s"])[len(steps) // 2]
    return {
        "schedule": "paper", "switches": {**asdict(sw), "weight_offload": share},
        "decode_ms_median": mid["step_s"] * 1e3, "modelled_decode_ms_per_token": mid["step_s"] * 1e3,
        "prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode,
        "tokens_per_s": batch * gen_len / (prefill + decode),  # FlexGen's throughput: prefill included
        "decode_tokens_per_s": batch * (gen_len - 1) / decode,  # run_flexgen's decode_throughput
        **{f"{k[:-2]}_ms": v * 1e3 for k, v in mid.items() if k != "step_s"},
        "schemes": schemes(p, sw),
        **block_split(method, model_cfg, hw, runtime, batch, prompt_len, fractions, overrides),
    }


def block_split(method, model_cfg, hw: Hardware, runtime: str, batch: int, context: int,
                fractions: list[float] | str | None, overrides: dict | None = None) -> dict:
    """Fig. 18: one decoder block past the dense layers at `context` tokens under the artifact's schedule: its
    seconds and the share that is movement (copies, host work, dequantisation) rather than compute."""
    sw = switches(overrides)
    shape = Shape.of(model_cfg)
    p = plan(method, shape, runtime, context + 1)
    share = weight_share_of(sw, str(model_cfg.get("name", "")))
    terms = layer_terms(method, shape, p, hw, sw, batch, context, context, fractions, share)
    block = terms[max(2, sw.dense_layers)]
    moving = block["transfer"] + block["host"] + block["dequant"] + block["weights"]
    return {"block_ms": block["layer"] * 1e3, "block_movement_share": moving / block["layer"]}
