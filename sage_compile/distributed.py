"""Context parallelism: one attention over a sequence split across the ranks of a process group (``ring_attention``,
``ulysses_attention``), and the sequence shards they take (``shard_sequence``, ``gather_sequence``). Implemented in
``sage_compile/ops/context_parallel.py``, whose docstring says how each works."""
from .ops.context_parallel import gather_sequence, ring_attention, shard_sequence, ulysses_attention

__all__ = ["ring_attention", "ulysses_attention", "shard_sequence", "gather_sequence"]
