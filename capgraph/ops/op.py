"""``logits_bitmask``: the public function, its argument checks and the registered op.

The op is ``torch.ops.capgraph.logits_bitmask`` (schema ``(Tensor(a!) logits, Tensor bitmask,
Tensor? token_mask, Tensor? d2t, SymInt col_offset) -> ()``) with a fake kernel, so that
``torch.compile(fullgraph=True)`` traces through it (logits functionalised as mutated). On CPU
its kernel is vectorised torch (:mod:`capgraph.ops.torch_impl`). On CUDA tensors the first call
imports :mod:`capgraph.ops.cuda`, which compiles ``csrc/logits_bitmask.cu`` through NVRTC (cached
in memory and on disk) and launches it on torch's current stream; where that cannot run (no
NVRTC, sizes past int32) the same torch code serves CUDA tensors too, without host syncs.
Nothing loads before the first call: run the op once eagerly before capturing a CUDA graph, so
the compile does not happen inside the capture."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Callable

import torch

from ..bitmask import BITS_PER_WORD, bitmask_dtype, d2t_dtype, token_mask_dtype
from ..errors import TensorArgError
from .torch_impl import apply_logits_bitmask_

__all__ = ["logits_bitmask", "logits_bitmask_op"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def logits_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                   token_mask: torch.Tensor | None = None, d2t: torch.Tensor | None = None,
                   *, col_offset: int = 0) -> None:
    """Set the logits of disallowed tokens to -inf, in place. Returns None.

    Graph-safe: on CUDA it launches work on the current stream and never synchronises with the
    host, so it may be captured in a CUDA graph. On CPU a token mask is read on the host to skip
    inactive rows.

    Args:
        logits: ``[rows, W]`` float32/float16/bfloat16, unit column stride; any row stride
            (a column slice of a wider tensor or every other row is fine). Written through the
            view; masked entries become exactly -inf, every other entry keeps its bits.
        bitmask: ``[>= rows, words]`` int32, unit column stride, any row stride. Bit ``b`` of
            word ``w`` (LSB first, xgrammar's layout) is global id ``32*w + b``; 1 = allowed.
            Rows past ``rows`` are ignored.
        token_mask: ``[>= rows]`` int32 or None. Row ``r`` is left untouched where
            ``token_mask[r] == 0``; None masks every row. Entries past ``rows`` are ignored.
        d2t: None, or the FULL draft-to-target table: ``[draft_vocab]`` int32, draft id ``g``
            is target id ``g + d2t[g]`` (EAGLE-3 convention).
        col_offset: global id of logits column 0.

            * Without d2t: column ``j`` reads bit ``col_offset + j`` of the bitmask row; for a
              tensor-parallel shard pass the full bitmask row and ``col_offset =`` the shard's
              first target column (need not be a multiple of 32). Requires
              ``words >= ceil((col_offset + W) / 32)``.
            * With d2t: ``col_offset`` is the shard's first DRAFT column; column ``j`` is draft
              id ``g = col_offset + j`` and reads bit ``g + d2t[g]`` of the full target bitmask
              row. Requires ``len(d2t) >= col_offset + W`` and every such target id in
              ``[0, 32*words)``; the target range is checked on CPU (one reduction), and is a
              precondition on other devices (checking it there would synchronise).

    Raises:
        TensorArgError: naming the argument and the values received.
    """
    _check_args(logits, bitmask, token_mask, d2t, col_offset)
    logits_bitmask_op(logits, bitmask, token_mask, d2t, col_offset)


def _fail(arg: str, problem: str) -> TensorArgError:
    return TensorArgError(f"logits_bitmask: {arg} {problem}")


def _check_args(logits: torch.Tensor, bitmask: torch.Tensor, token_mask: torch.Tensor | None,
                d2t: torch.Tensor | None, col_offset: int) -> None:
    """Metadata checks only: no data is read, so nothing synchronises."""
    if logits.dtype not in _FLOAT_DTYPES:
        raise _fail("logits", f"must be float32, float16 or bfloat16, got {logits.dtype}")
    if logits.dim() != 2:
        raise _fail("logits", f"must be 2-D [rows, W], got shape {tuple(logits.shape)}")
    rows, width = logits.shape
    if width > 1 and logits.stride(1) != 1:
        raise _fail("logits", f"must have unit column stride, got strides {logits.stride()}")
    if bitmask.dtype != bitmask_dtype:
        raise _fail("bitmask", f"must be int32, got {bitmask.dtype}")
    if bitmask.dim() != 2:
        raise _fail("bitmask", f"must be 2-D [rows, words], got shape {tuple(bitmask.shape)}")
    if bitmask.size(1) > 1 and bitmask.stride(1) != 1:
        raise _fail("bitmask", f"must have unit column stride, got strides {bitmask.stride()}")
    if bitmask.size(0) < rows:
        raise _fail("bitmask", f"has {bitmask.size(0)} rows, fewer than logits' {rows}")
    if col_offset < 0:
        raise _fail("col_offset", f"must be >= 0, got {col_offset}")
    if d2t is None:
        need = -(-(col_offset + width) // BITS_PER_WORD)
        if bitmask.size(1) < need:
            raise _fail("bitmask", f"has {bitmask.size(1)} words per row, fewer than the {need} "
                        f"that columns [{col_offset}, {col_offset + width}) need")
    else:
        if d2t.dtype != d2t_dtype:
            raise _fail("d2t", f"must be int32, got {d2t.dtype}")
        if d2t.dim() != 1:
            raise _fail("d2t", f"must be 1-D [draft_vocab], got shape {tuple(d2t.shape)}")
        if d2t.size(0) < col_offset + width:
            raise _fail("d2t", f"has length {d2t.size(0)}, shorter than col_offset + W = "
                        f"{col_offset} + {width}: it must be the full draft-vocab table")
    if token_mask is not None:
        if token_mask.dtype != token_mask_dtype:
            raise _fail("token_mask", f"must be int32, got {token_mask.dtype}")
        if token_mask.dim() != 1 or token_mask.size(0) < rows:
            raise _fail("token_mask", f"must be 1-D with >= {rows} entries, got shape "
                        f"{tuple(token_mask.shape)}")
    for name, t in (("bitmask", bitmask), ("token_mask", token_mask), ("d2t", d2t)):
        if t is not None and t.device != logits.device:
            raise _fail(name, f"is on {t.device}, logits on {logits.device}")


def _check_d2t_targets(d2t: torch.Tensor, col_offset: int, width: int, words: int) -> None:
    """On CPU: every target id the columns read lies in [0, 32*words)."""
    ids = torch.arange(col_offset, col_offset + width, dtype=torch.int64)
    lo_t, hi_t = torch.aminmax(d2t[col_offset:col_offset + width].to(torch.int64) + ids)
    lo, hi = int(lo_t), int(hi_t)
    if lo < 0 or hi >= words * BITS_PER_WORD:
        raise _fail("d2t", f"maps columns [{col_offset}, {col_offset + width}) to target ids "
                    f"[{lo}, {hi}], outside the bitmask's [0, {words * BITS_PER_WORD})")


@functools.cache
def _cuda_kernel() -> Callable[..., None] | None:
    """The dedicated CUDA kernel of capgraph/ops/cuda.py, or None (pure torch runs instead)."""
    name = f"{__package__}.cuda"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name).load_kernel()


# Registered through torch.library.Library rather than the torch.library.custom_op decorator:
# the decorator's Python dispatch glue costs ~14 us per call on CPU, a quarter of a whole
# 131k-row apply; a plain kernel registration costs ~1.6 us.
_LIB = torch.library.Library("capgraph", "FRAGMENT")
_LIB.define("logits_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor? token_mask, "
            "Tensor? d2t, SymInt col_offset) -> ()")


def _logits_bitmask_kernel(logits: torch.Tensor, bitmask: torch.Tensor,
                           token_mask: torch.Tensor | None, d2t: torch.Tensor | None,
                           col_offset: int) -> None:
    """The kernel of every real device; arguments already checked by :func:`logits_bitmask`."""
    if logits.numel() == 0:
        return
    if logits.device.type == "cuda":
        kernel = _cuda_kernel()
        if kernel is not None:
            kernel(logits, bitmask, token_mask, d2t, col_offset)
            return
    elif d2t is not None and logits.device.type == "cpu":
        _check_d2t_targets(d2t, col_offset, logits.size(1), bitmask.size(1))
    apply_logits_bitmask_(logits, bitmask, token_mask, d2t, col_offset)


_LIB.impl("logits_bitmask", _logits_bitmask_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("capgraph::logits_bitmask", lib=_LIB)
def _logits_bitmask_fake(logits, bitmask, token_mask, d2t, col_offset) -> None:
    return None


#: The registered op: ``torch.ops.capgraph.logits_bitmask.default`` (no argument checks).
logits_bitmask_op = torch.ops.capgraph.logits_bitmask.default
