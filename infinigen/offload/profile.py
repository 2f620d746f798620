"""The hardware profile the performance model prices on (conf/hardware/*.yaml): each field's unit and whether it
may be null, how the ops the runtime dispatches are priced (`DISPATCH`), and `hardware`, which turns a profile
into a `Hardware` or refuses it naming the field. A profile with `h2d_gbps: null` is a CPU: host and device are
one (`Hardware.host_is_device`). Its own module because it is the model's input: a profile is checked (a run's
validation, calibrate's dry run) before anything is modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# profile field -> (unit, may be null)
HARDWARE_FIELDS = {
    "matmul_tflops": ("TFLOP/s, dense matmul at the model's dtype", False),
    "memory_gbps": ("GB/s, device memory", False),
    "h2d_gbps": ("GB/s, pinned host->device copies; null: the host is the device", True),
    "d2h_gbps": ("GB/s, device->host copies; null: the host is the device", True),
    "launch_us": ("microseconds per dispatched op", False),
    "copy_gbps": ("GB/s, elementwise ops and copies on the device, bytes read + written", False),
    "gather_gbps": ("GB/s, indexed ops (gather, scatter, index_select) on the device", False),
    "host_gbps": ("GB/s, host memory copy rate of gathers", False),
    "device_memory_gib": ("GiB of device memory", False),
    # a CPU runs the LM head's (vocab x hidden) matmul at a few rows slower than the layers' shapes (smollm2-135m's
    # 49152 x 576 at 8 rows: 0.57-0.76x their FLOP/s here), and it is a fifth of the step's matmul FLOPs; a GPU's
    # tensor cores run it at their peak
    "head_tflops": ("TFLOP/s, the LM head's matmul; null or absent: matmul_tflops", True),
    # host-side tensor work that is not the gather (the launching thread's compaction of indices read back from
    # the device, a worker's bookkeeping): one thread's rate, bytes read + written
    "host_op_gbps": ("GB/s, host tensor ops besides the gather, bytes read + written; null or absent: host_gbps",
                     True),
    # a blocking device->host read (`.cpu()` of selected indices) lands in pageable memory
    "pageable_gbps": ("GB/s, blocking copies through pageable host memory; null or absent: d2h_gbps", True),
    # a job of the link's worker costs host time beyond its ops: the hand-off to the thread, its Python, the event
    # and stream calls around its copies
    "job_us": ("microseconds of host time per link job beyond its ops; null or absent: 0", True),
    # the paper's runtime (infinigen/offload/paper.py) copies contiguous slices on the host (a pageable cache into
    # pinned staging) and gathers on its launching thread with torch's intra-op threads
    "host_copy_gbps": ("GB/s, a contiguous host copy, bytes read + written; null or absent: the host gather's",
                       True),
}
OPTIONAL_FIELDS = ("head_tflops", "host_op_gbps", "pageable_gbps", "job_us", "host_copy_gbps")
# How a profile prices the ops the runtime dispatches: `ops` = launch_us each (a GPU: launches queue ahead of the
# device); `stand_in` = the seconds the runtime's code takes per segment on this machine, timed on the stand-in at
# the run's size (a CPU profile calibrated here: per-op costs differ by op and by tensor size, and the harness's
# Python between ops counts too)
DISPATCH = ("ops", "stand_in")


@dataclass(frozen=True)
class Hardware:
    name: str
    matmul_tflops: float
    memory_gbps: float
    h2d_gbps: float | None
    d2h_gbps: float | None
    launch_us: float
    copy_gbps: float
    gather_gbps: float
    host_gbps: float
    device_memory_gib: float
    dispatch: str = "ops"
    head_tflops: float | None = None
    host_op_gbps: float | None = None
    pageable_gbps: float | None = None
    job_us: float | None = None
    host_copy_gbps: float | None = None
    host_gbps_threads: dict | None = None  # the host gather's rate by thread count (informational for overlapped)

    @property
    def host_is_device(self) -> bool:
        return self.h2d_gbps is None

    @property
    def host_op_rate(self) -> float:
        """Bytes/s of host tensor work besides the gather."""
        return (self.host_op_gbps or self.host_gbps) * 1e9

    @property
    def readback_rate(self) -> float:
        """Bytes/s of a blocking device->host read."""
        return (self.pageable_gbps or self.d2h_gbps or self.host_gbps) * 1e9


def hardware(cfg) -> Hardware:
    """A conf/hardware profile -> Hardware; ValueError naming the field for a missing or non-positive number."""
    if cfg is None:
        raise ValueError("hardware is not set: choose a profile, e.g. hardware=a6000_pcie3 (conf/hardware/*.yaml), "
                         "or calibrate this machine with `python -m experiments.calibrate`")
    values = {}
    for name, (unit, nullable) in HARDWARE_FIELDS.items():
        if name not in cfg and name in OPTIONAL_FIELDS:
            values[name] = None
            continue
        if name not in cfg:
            raise ValueError(f"hardware.{name} is missing from profile {cfg.get('name')!r} ({unit})")
        value = cfg[name]
        if value is None and nullable:
            values[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise ValueError(f"hardware.{name} must be a positive number ({unit}), got {value!r}")
        values[name] = float(value)
    dispatch = cfg.get("dispatch", "ops")
    if dispatch not in DISPATCH:
        raise ValueError(f"hardware.dispatch must be one of {DISPATCH}, got {dispatch!r}")
    values["dispatch"] = dispatch
    threads = cfg.get("host_gbps_threads")
    if threads is not None:
        if not hasattr(threads, "items") or not all(isinstance(k, int) and not isinstance(v, bool)
                                                    and isinstance(v, (int, float)) and v > 0
                                                    for k, v in threads.items()):
            raise ValueError(f"hardware.host_gbps_threads must map thread counts to positive GB/s, got {threads!r}")
        values["host_gbps_threads"] = {int(k): float(v) for k, v in threads.items()}
    if (values["h2d_gbps"] is None) != (values["d2h_gbps"] is None):
        raise ValueError("hardware.h2d_gbps and hardware.d2h_gbps must both be numbers or both null")
    return Hardware(name=str(cfg.get("name")), **values)
