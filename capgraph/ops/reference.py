"""Brute-force reference of ``logits_bitmask`` for tests: slow, obvious, out of place."""

from __future__ import annotations

import torch

__all__ = ["logits_bitmask_reference"]


def logits_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                             token_mask: torch.Tensor | None = None,
                             d2t: torch.Tensor | None = None, *,
                             col_offset: int = 0) -> torch.Tensor:
    """Return a masked copy of ``logits`` (semantics of :func:`capgraph.ops.logits_bitmask`).

    Element by element in Python: find the global id a column stands for, read that bit of the
    row's words, write -inf where it is 0. No argument checks.
    """
    out = logits.detach().cpu().clone()
    rows, width = out.shape
    table = None if d2t is None else d2t.tolist()
    for r in range(rows):
        if token_mask is not None and int(token_mask[r]) == 0:
            continue
        words = [w & 0xFFFFFFFF for w in bitmask[r].tolist()]  # as unsigned 32-bit
        masked = []
        for j in range(width):
            g = col_offset + j
            token = g if table is None else g + table[g]
            word, bit = divmod(token, 32)
            masked.append((words[word] >> bit) & 1 == 0)
        out[r, torch.tensor(masked, dtype=torch.bool)] = float("-inf")
    return out
