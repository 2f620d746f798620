"""Full attention: every cached token, every step."""

from dataclasses import dataclass
from typing import ClassVar

from infinigen.contract import KVMethod


@dataclass
class Full(KVMethod):
    """Keeps and attends the whole KV cache (kv_fraction 1.0): the dense reference of every comparison. Its KV
    stays on the compute device in the offloading runtime (the no-offload bound); runtime=offload moves it all."""

    offload: ClassVar[str] = "resident"
    prefix_resumable: ClassVar[bool] = True
