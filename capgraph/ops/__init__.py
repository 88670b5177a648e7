"""The ``logits_bitmask`` op: masks logits in place from a token bitmask.

``logits_bitmask`` checks its arguments (2-D or 1-D logits, optional ``indices`` of the rows to
mask) and calls the torch custom op ``torch.ops.capgraph.logits_bitmask``; its kernels are the
C++ CPU mask (``cpu_mask``), the NVRTC-compiled CUDA kernel (``cuda``) and the torch code that
serves wherever neither can (``torch_impl``). ``masked_argmax`` (``argmax``) is greedy sampling
fused with the mask: the argmax over each row's allowed tokens, logits left as they are.
``logits_bitmask_reference`` is a brute-force copy of the mask's semantics for tests.
"""

from __future__ import annotations

from .argmax import argmax_scratch, masked_argmax
from .op import logits_bitmask, logits_bitmask_op
from .reference import logits_bitmask_reference

__all__ = ["logits_bitmask", "logits_bitmask_op", "logits_bitmask_reference", "masked_argmax",
           "argmax_scratch"]
