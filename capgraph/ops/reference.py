"""Brute-force reference of ``logits_bitmask`` for tests: slow, obvious, out of place."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["logits_bitmask_reference"]


def logits_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                             token_mask: torch.Tensor | None = None,
                             d2t: torch.Tensor | None = None, *,
                             col_offset: int = 0,
                             indices: torch.Tensor | Sequence[int] | None = None
                             ) -> torch.Tensor:
    """Return a masked copy of ``logits`` (semantics of :func:`capgraph.ops.logits_bitmask`).

    Element by element in Python: for each mask row ``i`` (logits row ``i``, or
    ``indices[i]``), find the global id a column stands for, read that bit of bitmask row
    ``i``, write -inf where it is 0. 1-D logits are one row. No argument checks.
    """
    out = logits.detach().cpu().clone()
    if out.dim() == 1:
        return logits_bitmask_reference(out.unsqueeze(0), bitmask.reshape(1, -1)
                                        if bitmask.dim() == 1 else bitmask, token_mask, d2t,
                                        col_offset=col_offset)[0]
    rows, width = out.shape
    targets = list(range(rows)) if indices is None else [int(i) for i in indices]
    table = None if d2t is None else d2t.tolist()
    for i, r in enumerate(targets):
        if token_mask is not None and int(token_mask[i]) == 0:
            continue
        words = [w & 0xFFFFFFFF for w in bitmask[i].tolist()]  # as unsigned 32-bit
        masked = []
        for j in range(width):
            g = col_offset + j
            token = g if table is None else g + table[g]
            word, bit = divmod(token, 32)
            # a d2t target outside the row is masked (the kernels never read past the row)
            masked.append(not 0 <= word < len(words) or (words[word] >> bit) & 1 == 0)
        out[r, torch.tensor(masked, dtype=torch.bool)] = float("-inf")
    return out
