"""The offloading runtime (task=latency): a method's KV in host memory, its traffic moved or modelled.

link.py (streams, events, the worker threads) -> kernels.py (Triton programs on CUDA) -> codecs.py (row layout)
-> pool.py (host pool + the pool-backed cache layer) -> timing.py (per-step timing, CPU link model) ->
executors.py (resident / held / gather decode steps) -> runtime.py (OffloadRuntime, Report).
"""
