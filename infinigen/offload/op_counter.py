"""Counting what code dispatches on the thread that launches kernels, with torch dispatch modes: every aten op,
the bytes ops move, and the host synchronisations among them (`sync_name`: the one rule of which ops make the host
wait for the device, the tables `SYNC_OPS`, `MASK_INDEXED`, `SYNC_TAGS`). Two counters count by that rule:

  OpCounter    the census's (infinigen/offload/census.py, experiments/calibrate.py): for each measure asked for,
               ops, bytes streamed / indexed on device tensors, bytes of host-tensor work (`HostTensors`: which
               tensors would be host memory on a GPU), syncs, joins of the link's jobs, write-backs queued to its
               fetch worker, bytes read back; read as one clock value by the runtime's marks (`Tally`)
  SyncCounter  experiments/bench_ops.py's: ops (a composite op under inference_mode by what it runs), syncs by name
               and by where the repository's code asked for them (`call_site`), blocking device->host copies, and
               waits on the runtime's link (Future.result, event / stream / device synchronisation)

Dispatch modes are thread-local: both count the thread that enters them.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from infinigen.offload import link as link_module
from infinigen.offload.timing import Timer


# ----------------------------------------------------------------------------------------------- the sync rule

# Ops that make the host wait for the device (OpCounter and SyncCounter below count by the same rule, `sync_name`):
# a scalar read (item, int(), bool()), ops whose output shape depends on the data, a bool-mask index; by overload
# packet
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero", "argwhere",
                      "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
                      "unique_dim_consecutive", "bincount"})
MASK_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
SYNC_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def sync_name(func, args, kwargs) -> str | None:
    """The name an op that makes the host wait for the device (on device tensors) is counted under, or None: the
    one rule this census and experiments/bench_ops.py count by."""
    packet = func.overloadpacket.__name__
    overload = str(func).removeprefix("aten.").removesuffix(".default")
    if packet in MASK_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masked = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
        return f"{overload} (bool mask)" if masked else None
    if packet == "repeat_interleave":  # tensor repeats: the output's length is their sum
        sums = func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
        return overload if sums else None
    if packet == "one_hot":
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return overload if classes is None or classes < 0 else None
    return overload if packet in SYNC_OPS or any(tag in func.tags for tag in SYNC_TAGS) else None


def syncs(func, args, kwargs) -> bool:
    """Whether this op, on a device tensor, makes the host wait for the device."""
    return sync_name(func, args, kwargs) is not None


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in a nest of args (lists, tuples, dicts)."""
    return [x for x in torch.utils._pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


# ----------------------------------------------------------------------------------------------- the census's counter

INDEXED = {"gather", "index_select", "index", "index_put", "index_put_", "scatter", "scatter_", "scatter_add",
           "scatter_add_", "index_copy", "index_copy_", "index_fill", "index_fill_", "masked_select", "take"}
# the host gather itself: its bytes are the selected rows', which the model takes from the run's selection
HOST_GATHER = frozenset({"index_select"})
# torch functions that make a tensor from nothing: on the host unless given a device (or "cpu", or pinned)
FACTORIES = frozenset({"arange", "empty", "zeros", "ones", "full", "tensor", "as_tensor", "randint", "rand", "randn",
                       "linspace", "scalar_tensor", "empty_strided"})


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class HostTensors:
    """Which tensors would be host memory on a GPU, on a CPU run where all are: host pools and staging buffers
    (made without a device, or pinned), `.cpu()` results, and what ops whose first tensor is one return."""

    def __init__(self):
        self._host = WeakIdKeyDictionary()

    def __contains__(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self._host

    def tag(self, value) -> None:
        for t in tensors_in(value):
            self._host[t] = True

    def untag(self, value) -> None:
        for t in tensors_in(value):
            self._host.pop(t, None)


def _device_arg(args, kwargs):
    for a in (kwargs.get("device"), *args):
        if isinstance(a, (str, torch.device)):
            return a
    return None


class _Placement(TorchFunctionMode):
    """Python-level calls that move data between host and device (no op of their own on a CPU tensor) and tensor
    factories: tags host tensors, and counts a blocking device->host read as the sync it is on a GPU."""

    def __init__(self, counter: "OpCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        c, host = self.counter, self.counter.host
        if name in ("cpu", "tolist", "numpy") or (name == "to" and _to_host(args[1:], kwargs)):
            src = args[0]
            if isinstance(src, torch.Tensor) and src not in host:
                if not kwargs.get("non_blocking"):
                    c.synced()
                c.read_back(src)
                if name in ("cpu", "to"):  # a copy, as on a GPU (on a CPU tensor `.cpu()` returns itself)
                    with _disable_current_modes():
                        out = func(*args, **kwargs).clone()
                    host.tag(out)
                    return out
            return func(*args, **kwargs)
        if name == "to" and isinstance(args[0], torch.Tensor) and args[0] in host and _device_arg(args[1:], kwargs):
            with _disable_current_modes():  # host -> device: a device tensor (a blocking copy unless asked not to)
                out = func(*args, **kwargs).clone()
            if not kwargs.get("non_blocking"):
                c.synced()
            return out
        out = func(*args, **kwargs)
        if name in FACTORIES or name.endswith("_like"):
            device = kwargs.get("device")
            if kwargs.get("pin_memory") or (isinstance(device, str) and device.startswith("cpu")) or (
                    device is None and not name.endswith("_like")):
                host.tag(out)
            elif device is not None:
                host.untag(out)
        return out


def _to_host(args, kwargs) -> bool:
    """Tensor.to("cpu", ...): only a string target counts (on a CPU run `.to(x.device)` names the device)."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"


class Tally:
    """Several counts read as one clock value (the runtime's marks and a fetch's host_s are differences of its
    clock): arithmetic per count, a plain number applying to each, order by the first."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = tuple(v)

    def _other(self, o):
        return o.v if isinstance(o, Tally) else (o,) * len(self.v)

    def __add__(self, o):
        return Tally(a + b for a, b in zip(self.v, self._other(o)))

    __radd__ = __add__

    def __sub__(self, o):
        return Tally(a - b for a, b in zip(self.v, self._other(o)))

    def __rsub__(self, o):
        return Tally(b - a for a, b in zip(self.v, self._other(o)))

    def __mul__(self, k):
        return Tally(a * k for a in self.v)

    __rmul__ = __mul__

    def __truediv__(self, k):
        return Tally(a / k for a in self.v) if not isinstance(k, Tally) else float(self) / float(k) if k.v[0] else 0.0

    def __rtruediv__(self, o):  # what the runtime derives from host_s (a gather rate): a plain number
        return float(o) / self.v[0] if self.v[0] else 0.0

    def __neg__(self):
        return Tally(-a for a in self.v)

    def __abs__(self):
        return Tally(abs(a) for a in self.v)

    def __round__(self, n=None):
        return round(self.v[0], n)

    def __format__(self, spec):
        return format(self.v[0], spec)

    def __lt__(self, o):
        return self.v[0] < (o.v[0] if isinstance(o, Tally) else o)

    def __gt__(self, o):
        return self.v[0] > (o.v[0] if isinstance(o, Tally) else o)

    def __le__(self, o):
        return not self > o

    def __ge__(self, o):
        return not self < o

    def __float__(self):
        return float(self.v[0])

    def part(self, k: int) -> float:
        return self.v[k]


def part(value, k: int) -> float:
    """The k-th count of a Tally (a plain number: no op moved the clock there, every count 0)."""
    return value.part(k) if isinstance(value, Tally) else float(value)


class OpCounter(TorchDispatchMode):
    """Counts, for each of `measures`, the aten ops dispatched while active (ops), the bytes the non-view ones read
    and write (stream / indexed: device tensors only; host: host tensors only), host synchronisations (syncs),
    blocking joins of the link's jobs (joins), write-back jobs queued to its fetch worker (writebacks) or bytes
    read back from the device by a blocking copy (readback). `value`: the first measure's count; `tally()`: all."""

    def __init__(self, measure: str | tuple = "ops"):
        super().__init__()
        self.measures = (measure,) if isinstance(measure, str) else tuple(measure)
        self.counts = [0.0] * len(self.measures)
        self._at = {m: i for i, m in enumerate(self.measures)}
        self.host = HostTensors()
        self._placement = _Placement(self)
        self._thread = None
        self._undo = []

    @property
    def value(self) -> float:
        return self.counts[0]

    def tally(self) -> Tally:
        return Tally(self.counts)

    def add(self, measure: str, n: float) -> None:
        i = self._at.get(measure)
        if i is not None:
            self.counts[i] += n

    def synced(self) -> None:
        self.add("syncs", 1)

    def read_back(self, t: torch.Tensor) -> None:
        self.add("readback", t.numel() * t.element_size())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = tensors_in((args, kwargs))
        on_host = bool(tensors) and tensors[0] in self.host
        if on_host and not _mutates(func):
            self.host.tag(out)
        at = self._at
        if "ops" in at:
            self.counts[at["ops"]] += 1
        if "syncs" in at and not on_host and syncs(func, args, kwargs):
            self.counts[at["syncs"]] += 1
        if func.is_view or not (at.keys() & {"host", "stream", "indexed"}):
            return out
        packet = func.overloadpacket.__name__
        if on_host:
            if "host" in at and packet not in HOST_GATHER:
                self.counts[at["host"]] += _nbytes(tensors + tensors_in(out))
        else:
            m = "indexed" if packet in INDEXED else "stream"
            if m in at:
                self.counts[at[m]] += _nbytes(tensors + tensors_in(out))
        return out

    # ------------------------------------------------------------------ Python-level calls
    def _wrap(self, owner, attr: str, count) -> None:
        original = getattr(owner, attr)
        counter = self

        def wrapper(*args, **kwargs):
            if threading.get_ident() == counter._thread:
                count()
            return original(*args, **kwargs)

        setattr(owner, attr, wrapper)
        self._undo.append(lambda: setattr(owner, attr, original))

    def __enter__(self):
        self._thread = threading.get_ident()
        if "joins" in self._at:
            self._wrap(Future, "result", lambda: self.add("joins", 1))
        if "writebacks" in self._at:  # a job to the fetch worker that no fetch's `issue` mark follows
            self._wrap(link_module.Link, "submit", lambda: self.add("writebacks", 1))
            self._wrap(Timer, "issue", lambda: self.add("writebacks", -1))
        self._placement.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._placement.__exit__(*exc)
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()


def _mutates(func) -> bool:
    """An in-place or out= op: its output is an argument, whose placement it keeps."""
    schema = func._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# ----------------------------------------------------------------------------------------------- bench_ops' counter

COPIES = frozenset({"_to_copy", "copy_", "copy", "_copy_from"})


ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()


def call_site() -> str:
    """file:line of the innermost frame in this repository's code (not this file): where a sync was asked for."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_absolute() and path != HERE and path.is_relative_to(ROOT) and ".venv" not in path.parts:
            return f"{path.relative_to(ROOT).as_posix()}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type not in ("cpu", "meta")


def _blocking_d2h(packet: str, args, kwargs) -> bool:
    """A device->host copy the host waits for: not non_blocking, or into memory that is not pinned."""
    if packet == "_to_copy":
        src, device = args[0], kwargs.get("device")
        return (_on_device(src) and device is not None and torch.device(device).type == "cpu"
                and not kwargs.get("non_blocking", False))
    if packet in ("copy_", "copy", "_copy_from"):
        dst, src = (args[0], args[1]) if packet != "_copy_from" else (args[1], args[0])
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and _on_device(src)
                and dst.device.type == "cpu" and not (non_blocking and dst.is_pinned()))
    return False


def sync_or_copy_name(func, args, kwargs, device_only: bool) -> str | None:
    """The name a host synchronisation is counted under, or None when the op does not synchronise.
    device_only: count an op only when it touches a device tensor (a CUDA run; on a CPU run the CPU stands in
    for the device and every tensor is a device tensor)."""
    packet = func.overloadpacket.__name__
    if packet in COPIES:
        return "d2h copy" if _blocking_d2h(packet, args, kwargs) else None
    name = sync_name(func, args, kwargs)
    if name is None:
        return None
    if device_only and not any(_on_device(t) for t in tensors_in((args, kwargs))):
        return None
    return name


@dataclass
class Snapshot:
    ops: int = 0
    nonview: int = 0
    syncs: Counter = field(default_factory=Counter)
    waits: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)

    def __sub__(self, other: "Snapshot") -> "Snapshot":
        return Snapshot(self.ops - other.ops, self.nonview - other.nonview, self.syncs - other.syncs,
                        self.waits - other.waits, self.sites - other.sites)


class SyncCounter(TorchDispatchMode):
    """Counts, on the thread that enters it, aten ops, host synchronisations (`sync_or_copy_name`, by name) and
    waits on the runtime's link (Future.result, event/stream/device synchronisation, by name). Dispatch modes are
    thread-local: work on other threads is not counted; the Python-level hooks check the thread themselves.

    device: the run's device. "cpu": every tensor stands in for a device tensor, and `.cpu()`, `.to("cpu")`,
    `.tolist()` and `.numpy()` (which dispatch no copy on a CPU tensor) count as device->host copies."""

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.ops = self.nonview = 0
        self.syncs: Counter = Counter()
        self.sites: Counter = Counter()  # "name @ file:line" of the repository's code that synchronised
        self.waits: Counter = Counter()
        self.thread = None
        self._patches = None
        self._outer: str | None = None
        self._depth = 0

    @property
    def sync_total(self) -> int:
        return sum(self.syncs.values())

    def snapshot(self) -> Snapshot:
        return Snapshot(self.ops, self.nonview, Counter(self.syncs), Counter(self.waits), Counter(self.sites))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
            # under inference_mode a composite op (item, einsum, repeat_interleave, sdpa) reaches the mode whole:
            # count what it runs, as outside inference_mode, and name a sync inside it after the outermost one
            outer, self._outer = self._outer, self._outer or str(func).removeprefix("aten.").removesuffix(".default")
            try:
                with self:
                    out = func.decompose(*args, **kwargs)
            finally:
                self._outer = outer
            if out is not NotImplemented:
                return out
        self.ops += 1
        self.nonview += not func.is_view
        name = sync_or_copy_name(func, args, kwargs, device_only=self.device.type != "cpu")
        if name is not None:  # a sync inside a composite op goes by the composite's name (item, is_nonzero)
            self._sync(name if name == "d2h copy" or self._outer is None else self._outer)
        return func(*args, **kwargs)

    def _sync(self, name: str) -> None:
        self.syncs[name] += 1
        self.sites[f"{name} @ {call_site()}"] += 1

    # ------------------------------------------------------------------ Python-level hooks
    def _mine(self) -> bool:
        return threading.get_ident() == self.thread

    def _wrap(self, owner, attr: str, counts: Counter, name: str, when=None):
        original = getattr(owner, attr)
        counter = self

        def wrapper(*args, **kwargs):
            if counter._mine() and (when is None or when(*args, **kwargs)):
                if counts is counter.syncs:
                    counter._sync(name)
                else:
                    counts[name] += 1
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original
        own = attr in vars(owner)  # torch.Tensor inherits cpu/tolist/...: restore by removing the wrapper
        setattr(owner, attr, wrapper)
        return lambda: setattr(owner, attr, original) if own else delattr(owner, attr)

    def __enter__(self):
        self._depth += 1
        if self._patches is not None:  # re-entered to count a composite op's decomposition
            return super().__enter__()
        self.thread = threading.get_ident()
        undo = [self._wrap(Future, "result", self.waits, "Future.result")]
        if hasattr(link_module, "NoEvent"):  # the CPU stand-in of a CUDA event
            undo.append(self._wrap(link_module.NoEvent, "synchronize", self.waits, "Event.synchronize"))
        if torch.cuda.is_available():
            undo += [self._wrap(torch.cuda.Event, "synchronize", self.waits, "Event.synchronize"),
                     self._wrap(torch.cuda.Stream, "synchronize", self.waits, "Stream.synchronize"),
                     self._wrap(torch.cuda, "synchronize", self.waits, "cuda.synchronize")]
        if self.device.type == "cpu":  # no op of their own on a CPU tensor: the copy they are on a device
            undo += [self._wrap(torch.Tensor, "cpu", self.syncs, "Tensor.cpu"),
                     self._wrap(torch.Tensor, "tolist", self.syncs, "Tensor.tolist"),
                     self._wrap(torch.Tensor, "numpy", self.syncs, "Tensor.numpy"),
                     self._wrap(torch.Tensor, "to", self.syncs, "Tensor.to(cpu)", when=_blocking_to_host)]
        self._patches = undo
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        try:
            return super().__exit__(*exc)
        finally:
            if not self._depth:
                for restore in reversed(self._patches or []):
                    restore()
                self._patches = None


def _blocking_to_host(self, *args, **kwargs) -> bool:
    """Tensor.to("cpu", ...) without non_blocking. Only a string target counts: on a CPU run `.to(x.device)` or
    `.to(device=x.device)` names the device itself (the model's rotary embedding does it every layer)."""
    if kwargs.get("non_blocking") or any(isinstance(a, bool) and a for a in args[1:3]):
        return False
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"
