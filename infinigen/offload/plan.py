"""What the offloading runtime sets up and moves per layer, from the model's config and the method's declarations
alone (no weights): the model's shape (`Shape`: weights, heads, a local layer's window), where each layer's KV
lives and how its pool is laid out (`plan`: the method's `offload_kind`, a pool's rows at the method's `codec`
width and its slots, as OffloadRuntime.generate and PoolExecutor.new_store set them up), and the byte accounting
the performance model prices: what crosses the link per decode step (`step_bytes`: the same bytes the runtime's
counters report), the entries a gathering layer selects and a layer attends, and the device and host memory a
run holds (`memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class LayerSpec:
    """What a method's offload declarations read of a layer (duck-types adapter.AttentionLayer's fields)."""

    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    sliding_window: int | None = None  # a local layer's window W (Gemma 3's sliding_attention); None: global

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def layer_windows(arch: dict, layers: int) -> tuple:
    """Per layer the sliding window W of a local layer, None for a global one, as transformers reads the config:
    `layer_types` names each layer (Gemma 3: sliding_attention / full_attention); a `sliding_window` without
    them applies to every layer (Mistral); neither: every layer global."""
    window = arch.get("sliding_window")
    if not window:
        return ()
    types = arch.get("layer_types")
    if types is None:
        return (int(window),) * layers
    if len(types) != layers:
        raise ValueError(f"model.arch.layer_types names {len(types)} layers, num_hidden_layers is {layers}")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class Shape:
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    ffn_matrices: int  # 3: gated (Llama), 2: OPT
    vocab: int
    elem: int  # bytes per element of the model's dtype
    dtype: str
    tied: bool
    windows: tuple = ()  # per layer, a local layer's window W or None (empty: every layer global)

    @classmethod
    def of(cls, model_cfg) -> "Shape":
        arch = dict(model_cfg.arch)
        heads = int(arch["num_attention_heads"])
        hidden = int(arch["hidden_size"])
        opt = arch["model_type"] == "opt"
        layers = int(arch["num_hidden_layers"])
        return cls(
            family="opt" if opt else "llama", layers=int(arch["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(arch.get("num_key_value_heads") or heads),
            head_dim=int(arch.get("head_dim") or hidden // heads),
            ffn=int(arch["ffn_dim"] if opt else arch["intermediate_size"]), ffn_matrices=2 if opt else 3,
            vocab=int(arch["vocab_size"]), elem=DTYPE_BYTES[str(model_cfg.dtype)], dtype=str(model_cfg.dtype),
            tied=bool(arch.get("tie_word_embeddings", opt)), windows=layer_windows(arch, layers),
        )

    def layer(self, i: int) -> LayerSpec:
        window = self.windows[i] if self.windows else None
        return LayerSpec(i, self.heads, self.kv_heads, self.head_dim, self.hidden, window)

    @property
    def attn_weights(self) -> int:
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def ffn_weights(self) -> int:
        return self.ffn_matrices * self.hidden * self.ffn

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (self.attn_weights + self.ffn_weights) + embed


@dataclass
class Plan:
    """Per layer: the offload kind, and for pools the row width (bytes) and slots."""

    kinds: list[str]
    row_bytes: list[int]  # bytes of one entry of one KV head as the pool stores it (0: resident)
    slots: list[int]
    evicting: list[bool]
    decodes: list[bool]  # the codec is not plain K|V: its rows are decoded into a fresh K, V before attending
    windows: list = field(default_factory=list)  # a local layer's window W, None: global (empty: all global)

    def visible(self, i: int, seen: int) -> int:
        """Positions the row that makes `seen` tokens attends on layer i (itself included): all of them on a
        global layer, at most W on a local one (what kv_fraction counts against)."""
        window = self.windows[i] if self.windows else None
        return seen if window is None else min(seen, window)


def plan(method, shape: Shape, runtime: str, max_len: int) -> Plan:
    """What the runtime sets up per layer (OffloadRuntime.generate + PoolExecutor.new_store), from declarations."""
    import torch

    from infinigen.offload.runtime import layer_kind

    dtype = getattr(torch, shape.dtype)
    out = Plan([], [], [], [], [], [shape.layer(i).sliding_window for i in range(shape.layers)])
    for i in range(shape.layers):
        layer = shape.layer(i)
        kind = layer_kind(method, layer, runtime)
        out.kinds.append(kind)
        if kind == "resident":
            out.row_bytes.append(0), out.slots.append(0), out.evicting.append(False), out.decodes.append(False)
            continue
        codec = method.codec(layer, dtype)
        width, cdtype = (2 * shape.head_dim, dtype) if codec is None else (codec.width, codec.dtype)
        slots = min(max_len, method.max_held(max_len))
        out.row_bytes.append(width * torch.empty((), dtype=cdtype).element_size())
        out.slots.append(slots)
        out.evicting.append(slots < max_len)
        out.decodes.append(codec is not None)
    return out


def held_rows(method, plan_: Plan, i: int, past: int, prompt_len: int) -> int:
    """Rows a held layer's fetch carries at a step with `past` earlier tokens: every written row of a pool that
    never evicts (of a local layer, those in its window); an evicting pool's high-water mark: what the prefill
    kept (max_held(P) - 1: max_held counts the current token on top), or the most held at once by an earlier step
    (max_held of its length)."""
    if not plan_.evicting[i]:
        return plan_.visible(i, past + 1) - 1  # entry n in slot n: a local layer sends its window's rows only
    kept = method.max_held(prompt_len) - 1
    return min(plan_.slots[i], kept if past == prompt_len else max(kept, method.max_held(past - 1)))


def step_bytes(method, shape: Shape, plan_: Plan, batch: int, past: int, prompt_len: int,
               selected: list[float]) -> list[float]:
    """Host->device bytes per layer of the step with `past` earlier tokens; `selected[i]` is the mean number of
    past entries a (row, KV head) of gather layer i selects."""
    out = []
    for i, kind in enumerate(plan_.kinds):
        bh = batch * shape.kv_heads
        if kind == "held":
            out.append(held_rows(method, plan_, i, past, prompt_len) * bh * plan_.row_bytes[i])
        elif kind == "gather":
            out.append(selected[i] * bh * plan_.row_bytes[i])
        else:
            out.append(0.0)
    return out


def selected_counts(fractions: list[float] | None, plan_: Plan, seen: int) -> list[float]:
    """Mean past entries a (row, KV head) of each gather layer selects when `seen` tokens exist, from the layer's
    kv_fraction (selected past + itself, over what the row may attend: `Plan.visible`)."""
    if fractions is None:
        return [0.0] * len(plan_.kinds)
    visible = [plan_.visible(i, seen) for i in range(len(plan_.kinds))]
    return [min(v - 1.0, max(0.0, f * v - 1)) if k == "gather" else 0.0
            for f, k, v in zip(fractions, plan_.kinds, visible)]


def attended_entries(method, plan_: Plan, i: int, seen: int, selected: float) -> float:
    """Entries a (row, KV head) of layer i attends at a step where `seen` tokens exist (itself included)."""
    if plan_.kinds[i] == "gather":
        return selected + 1
    if plan_.kinds[i] == "held" and plan_.evicting[i]:
        return min(seen, method.max_held(seen))
    return seen


def memory(shape: Shape, plan_: Plan, method, batch: int, max_len: int) -> dict:
    """Device and host bytes: weights, resident KV, landing buffers (two per executor kind) and per-entry state."""
    bh = batch * shape.kv_heads
    kv = 2 * shape.head_dim * shape.elem
    device = shape.params * shape.elem
    host = 0
    staging = {"held": 0, "gather": 0}
    for i, kind in enumerate(plan_.kinds):
        if kind == "resident":
            device += bh * max_len * kv
            continue
        host += plan_.slots[i] * bh * plan_.row_bytes[i]
        if kind == "held":
            staging["held"] = max(staging["held"], plan_.slots[i] * bh * plan_.row_bytes[i])
        else:
            rows = max(1, min(plan_.slots[i], method.max_selected(max_len)))
            staging["gather"] = max(staging["gather"], rows * bh * plan_.row_bytes[i])
            # the selection's vectors, counters and slots stay on the device
            device += bh * plan_.slots[i] * (method.score_channels(shape.layer(i)) * shape.elem + 24)
    device += 2 * sum(staging.values())
    return {"device_bytes": device, "host_pool_bytes": host}
