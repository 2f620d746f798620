"""Beyond the paper: kernel launches and host syncs per decode step (experiments/bench_ops.py rows; analysis/ops.py)."""

from __future__ import annotations

from analysis import ops as O
from analysis.report.section import Section

SECTION = Section(
    "ops_decode", "Beyond the paper: kernel launches and host syncs per decode step",
    "On a GPU each dispatched op is a kernel launch (~5-10 us of host time) and each host synchronisation "
    "(`.item()`, `bool(t)`, `nonzero`, a boolean mask index, a blocking device->host copy) drains the launch "
    "queue. The offloading runtime's steady decode step for the paper's rows (full under runtime ideal and "
    "auto, offload, quant, H2O, InfiniGen) should synchronise the host nowhere, and InfiniGen's ops per "
    "layer-step should not grow with the prompt or the batch (tests/test_bench_ops.py, the gate).",
    (), O.decode_table, O.decode_verdict, script=O.decode_rows,
    note="Rows from `make bench-ops` (`python experiments/bench_ops.py --results results`, then `make "
         "export WHERE=task=ops`; not a run.py command): each conf/method at its defaults (`auto` runtime; "
         "full also `ideal`) on tiny-llama-gqa and tiny-opt (random weights), at batch x prompt 1 x 512 to "
         "8 x 2048. Counted with a TorchDispatchMode on the thread that launches kernels, through the "
         "runtime's CUDA code path run on the CPU (link work on its worker thread, which is host-side work "
         "and not counted), over the steady decode steps (Timer.begin..end after 2 steps, the last dropped). "
         "`ops/layer`: aten ops per step / layers (composite ops counted by what they run); `syncs/layer`: "
         "host syncs per step / layers (by op and call site in the rows, `metrics.sync_sites`); `waits/layer`: "
         "the launching thread blocking on the link (a worker's Future, an event). What each counts: the "
         "module doc of experiments/bench_ops.py.",
    order=170)
