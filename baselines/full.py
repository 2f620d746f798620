"""Full attention: every cached token, every step."""

from dataclasses import dataclass

from infinigen.method import KVMethod


@dataclass
class Full(KVMethod):
    """Keeps and attends the whole KV cache (kv_fraction 1.0): the dense reference of every comparison."""
