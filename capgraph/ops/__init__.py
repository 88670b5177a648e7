"""The ``logits_bitmask`` op: masks logits in place from a token bitmask.

``logits_bitmask`` checks its arguments and calls the torch custom op
``torch.ops.capgraph.logits_bitmask``; its kernel is pure torch on every device until a
dedicated CUDA backend (``capgraph/ops/cuda.py``) is present. ``logits_bitmask_reference`` is a
brute-force copy of the semantics for tests.
"""

from __future__ import annotations

from .op import logits_bitmask, logits_bitmask_op
from .reference import logits_bitmask_reference

__all__ = ["logits_bitmask", "logits_bitmask_op", "logits_bitmask_reference"]
