"""``masked_argmax``: greedy sampling fused with the token bitmask.

``masked_argmax(logits, bitmask)`` is ``argmax(logits with the disallowed tokens at -inf)`` per
row, without writing the logits. On CUDA one kernel (``capgraph_masked_argmax_*`` in
``csrc/logits_bitmask.cu``, loaded with the mask kernel) reads each row's bitmask words and the
logits of its allowed tokens only: a masked token is -inf without a load. Masking in place and
then taking ``argmax`` reads every logit twice and writes the masked ones, so for a greedy
sampler the fused call removes the mask's pass over the logits. Elsewhere (CPU, or a GPU where
the kernel cannot load) it masks a copy and takes torch's argmax, which is the definition.

A launch reads only metadata on the host and enqueues one kernel on the current stream: no host
synchronisation, no allocation when ``out`` and ``scratch`` are given, so it may be captured in
a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch

from ..bitmask import BITS_PER_WORD
from ..errors import TensorArgError
from .op import _check_args, _cuda_kernel, _tensors, logits_bitmask_op

__all__ = ["masked_argmax", "argmax_scratch", "argmax_out"]


def argmax_scratch(rows: int, device: torch.device | str) -> torch.Tensor:
    """A scratch tensor for :func:`masked_argmax`'s CUDA kernel for up to ``rows`` logits rows:
    int64 ``[2, rows]``, zero (each launch leaves it zero again). Reuse one per stream."""
    return torch.zeros(2, rows, dtype=torch.int64, device=device)


def argmax_out(out: object, logits: torch.Tensor, caller: str) -> torch.Tensor:
    """``out`` checked as the argmax of ``logits`` (``[rows, W]``) is written to it: an int64
    ``[rows]`` tensor with unit stride on the logits' device; None: a new one. A bad one is a
    :class:`TensorArgError` from ``caller``, naming what it got."""
    rows = logits.shape[0]
    if out is None:
        return torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or out.dim() != 1 \
            or out.size(0) != rows or (rows > 1 and out.stride(0) != 1) \
            or out.device != logits.device:
        got = (f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise TensorArgError(f"{caller}: out must be an int64 [{rows}] tensor with unit stride "
                             f"on {logits.device}, got {got}")
    return out


def full_vocabulary(logits: torch.Tensor, vocab_size_padded: int, caller: str) -> None:
    """Refuse ``logits`` narrower than the full vocabulary (checked otherwise already: a
    tensor-parallel shard, whose argmax needs the other shards') with a
    :class:`TensorArgError` from ``caller``."""
    if logits.shape[1] != vocab_size_padded:
        raise TensorArgError(
            f"{caller}: logits have {logits.shape[1]} columns, a tensor-parallel shard of the "
            f"vocabulary's {vocab_size_padded}; the fused argmax needs the full vocabulary: "
            "mask a shard with execute and reduce across the shards")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors (first to last element) overlap."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n)
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _fail(arg: str, problem: str) -> TensorArgError:
    return TensorArgError(f"masked_argmax: {arg} {problem}")


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor,
                  token_mask: torch.Tensor | None = None, *, mask_rows: int | None = None,
                  out: torch.Tensor | None = None,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The column of each row's largest allowed logit; the logits are not written.

    ``out[r]`` equals ``torch.argmax`` of logits row ``r`` masked as
    :func:`capgraph.ops.logits_bitmask` masks it: floats compared as floats (-0 equals +0),
    NaN above every number, the lowest column among equal values, and column 0 for a row
    whose entries are all -inf after the mask.

    Args:
        logits: ``[rows, W]`` float32/float16/bfloat16, unit column stride, any row stride.
        bitmask: ``[>= mask_rows, words]`` int32, unit column stride, ``32 * words >= W``; bit
            ``b`` of word ``w`` (LSB first) allows column ``32*w + b``.
        token_mask: None, or int32 ``[>= mask_rows]``: a row whose entry is 0 is not masked.
        mask_rows: the rows the bitmask masks (default: every row); rows from ``mask_rows`` on
            take a plain argmax.
        out: int64 ``[rows]`` with unit stride on the logits' device, written and returned;
            None: a new tensor.
        scratch: the CUDA kernel's scratch (:func:`argmax_scratch` for at least ``rows``
            rows), all zero, as each launch leaves it, used by one launch at a time; None: a
            new one per call (one more allocation and memset). Checked on every device, read
            on CUDA only.

    Returns:
        ``out``.

    Raises:
        TensorArgError: naming the argument and what was wrong with it.
    """
    _tensors(_fail, (("logits", logits), ("bitmask", bitmask)),
             (("token_mask", token_mask), ("scratch", scratch)))
    if logits.dim() != 2:
        raise _fail("logits", f"must be 2-D [rows, W], got shape {tuple(logits.shape)}")
    rows, width = logits.shape
    if mask_rows is None:
        mask_rows = rows
    elif isinstance(mask_rows, bool) or not isinstance(mask_rows, int) \
            or not 0 <= mask_rows <= rows:
        raise _fail("mask_rows", f"must be an int in [0, {rows}] (the logits' rows), got "
                    f"{mask_rows!r}")
    if width == 0:
        raise _fail("logits", "has no columns: there is no argmax of an empty row")
    try:
        _check_args(logits[:mask_rows], bitmask, token_mask, None, 0)
    except TensorArgError as e:  # (the same checks as the mask's, named for this call)
        raise TensorArgError(str(e).replace("logits_bitmask:", "masked_argmax:", 1)) from None
    if mask_rows == 0 and -(-width // BITS_PER_WORD) > bitmask.size(1):
        raise _fail("bitmask", f"has {bitmask.size(1)} words per row, fewer than the "
                    f"{-(-width // BITS_PER_WORD)} that {width} columns need")
    out = argmax_out(out, logits, "masked_argmax")
    if scratch is not None:
        if scratch.dtype != torch.int64 or scratch.dim() != 2 or scratch.size(0) != 2 \
                or scratch.size(1) < rows or scratch.stride(1) != 1 \
                or scratch.stride(0) < scratch.size(1) or scratch.device != logits.device:
            raise _fail("scratch", f"must be an int64 [2, >= {rows}] tensor on {logits.device} "
                        f"whose two rows do not overlap, with unit column stride "
                        f"(argmax_scratch), got {scratch.dtype} {tuple(scratch.shape)} strides "
                        f"{scratch.stride()} on {scratch.device}")
        if rows and _overlap(scratch, out):
            raise _fail("scratch", "overlaps out: the kernel writes both")
    if rows == 0:
        return out
    if logits.device.type == "cuda" and width + BITS_PER_WORD < 2**31:
        kernel: Any = _cuda_kernel()  # (the loaded _CudaLogitsBitmask: its argmax method)
        if kernel is not None:
            if scratch is None:
                scratch = argmax_scratch(rows, logits.device)
            kernel.argmax(logits, bitmask, token_mask, mask_rows, out, scratch)
            return out
    if mask_rows:
        masked = logits[:mask_rows].clone()
        logits_bitmask_op(masked, bitmask, token_mask, None, 0, None)
        torch.argmax(masked, dim=-1, out=out[:mask_rows])
    if mask_rows < rows:
        torch.argmax(logits[mask_rows:], dim=-1, out=out[mask_rows:])
    return out
