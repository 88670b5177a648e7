"""``logits_bitmask``: the public function, its argument checks and the registered op.

The op is ``torch.ops.capgraph.logits_bitmask`` (schema ``(Tensor(a!) logits, Tensor bitmask,
Tensor? token_mask, Tensor? d2t, SymInt col_offset, Tensor? indices=None) -> ()``, 2-D logits
only) with a fake kernel, so that
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
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..bitmask import BITS_PER_WORD, bitmask_dtype, d2t_dtype, token_mask_dtype
from ..errors import TensorArgError
from .torch_impl import apply_logits_bitmask_

__all__ = ["logits_bitmask", "logits_bitmask_op", "index_dtypes", "d2t_first_bad_target"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: dtypes an ``indices`` tensor may have (a list of ints becomes int64).
index_dtypes = (torch.int32, torch.int64)


def logits_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                   token_mask: torch.Tensor | None = None, d2t: torch.Tensor | None = None,
                   *, col_offset: int = 0,
                   indices: torch.Tensor | Sequence[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place. Returns None.

    Graph-safe: on CUDA it launches work on the current stream and never synchronises with the
    host, so it may be captured in a CUDA graph (``indices`` then given as a CUDA tensor). On
    CPU a token mask is read on the host to skip inactive rows.

    The mask rows are the bitmask rows the call reads: row ``i`` of the bitmask (and entry
    ``i`` of ``token_mask``) masks logits row ``i``, or logits row ``indices[i]`` where
    ``indices`` is given.

    Args:
        logits: ``[rows, W]``, or ``[W]`` for a single row; float32/float16/bfloat16, unit
            column stride; any row stride (a column slice of a wider tensor or every other row
            is fine). Written through the view; masked entries become exactly -inf, every other
            entry keeps its bits.
        bitmask: ``[mask_rows, words]`` int32, unit column stride, any row stride (``[words]``
            also accepted with 1-D logits). Bit ``b`` of word ``w`` (LSB first, xgrammar's
            layout) is global id ``32*w + b``; 1 = allowed. Without ``indices`` it needs
            ``>= rows`` rows (rows past ``rows`` are ignored); with ``indices`` exactly
            ``len(indices)`` rows.
        token_mask: ``[>= mask_rows]`` int32 or None. Mask row ``i`` is skipped (its logits row
            left untouched) where ``token_mask[i] == 0``; None masks every row. Entries past
            the mask rows are ignored.
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
              ``[0, 32*words)``: on CPU a target outside is a ``TensorArgError`` (one add and
              one max over the table, each call); on other devices a check would synchronise,
              so none is made, and a column whose target lies outside the row is masked (the
              CUDA kernel and the torch code never read outside the row).
        indices: None (every logits row), or the logits rows to mask: a 1-D int32/int64 tensor
            on the logits' device, or a sequence of ints, distinct, each in ``[0, rows)``;
            other rows are untouched and empty indices mask nothing. Unlike xgrammar's
            ``apply_token_bitmask_inplace(..., indices=)``, which masks logits row ``k`` with
            bitmask row ``k``, the bitmask here is compact: its row ``i`` belongs to logits
            row ``indices[i]`` (xgrammar's call is this one with ``bitmask[indices]``). Range
            and distinctness are checked on CPU; on other devices they are a precondition (a
            check would synchronise): the CUDA kernel skips an out-of-range index, and of
            duplicates any one row's mask may win. A sequence is copied to the device on each
            call (not capturable); pass a device tensor inside a CUDA graph.

    Raises:
        TensorArgError: naming the argument and the values received.
    """
    _tensors(_fail, (("logits", logits), ("bitmask", bitmask)),
             (("token_mask", token_mask), ("d2t", d2t)))
    if isinstance(col_offset, bool) or not isinstance(col_offset, (int, np.integer)):
        raise _fail("col_offset", f"must be an int, got {col_offset!r}")
    col_offset = int(col_offset)
    if indices is not None and not isinstance(indices, torch.Tensor):
        indices = _indices_tensor(indices, logits.device)
    if logits.dim() == 1:
        if indices is not None:
            raise _fail("indices", "must be None with 1-D logits (one row): pass 2-D logits "
                        "[rows, W] to choose rows")
        logits = logits.unsqueeze(0)  # a view: the op writes through it
        if bitmask.dim() == 1:
            bitmask = bitmask.unsqueeze(0)
    _check_args(logits, bitmask, token_mask, d2t, col_offset, indices)
    logits_bitmask_op(logits, bitmask, token_mask, d2t, col_offset, indices)


def _fail(arg: str, problem: str) -> TensorArgError:
    return TensorArgError(f"logits_bitmask: {arg} {problem}")


def _tensors(fail: Callable[[str, str], TensorArgError], required: Sequence[tuple[str, Any]],
             optional: Sequence[tuple[str, Any]]) -> None:
    """Refuse (``fail(name, problem)``) a ``(name, value)`` of ``required`` that is not a
    tensor, and one of ``optional`` that is neither a tensor nor None."""
    for name, given in required:
        if not isinstance(given, torch.Tensor):
            raise fail(name, f"must be a tensor, got {type(given).__name__}")
    for name, given in optional:
        if given is not None and not isinstance(given, torch.Tensor):
            raise fail(name, f"must be a tensor or None, got {type(given).__name__}")


def _indices_tensor(indices: Sequence[int], device: torch.device) -> torch.Tensor:
    """A sequence of row indices as an int64 tensor on ``device``; anything but ints is refused
    here (torch would turn floats and bools into numbers silently)."""
    try:
        items = list(indices)
    except TypeError:
        raise _fail("indices", f"must be a tensor or a sequence of ints, got "
                    f"{type(indices).__name__}") from None
    bad = [x for x in items if isinstance(x, bool) or not isinstance(x, (int, np.integer))]
    if bad:
        raise _fail("indices", f"must hold ints, got {bad[0]!r} ({type(bad[0]).__name__})")
    try:
        host = torch.tensor(items, dtype=torch.int64)
    except (RuntimeError, ValueError, OverflowError) as e:  # an int past int64
        raise _fail("indices", f"holds a value outside int64 ({e})") from None
    return host if device.type == "cpu" else host.to(device)


def _check_args(logits: torch.Tensor, bitmask: torch.Tensor, token_mask: torch.Tensor | None,
                d2t: torch.Tensor | None, col_offset: int,
                indices: torch.Tensor | None = None) -> None:
    """Metadata checks only: no data is read, so nothing synchronises."""
    if logits.dtype not in _FLOAT_DTYPES:
        raise _fail("logits", f"must be float32, float16 or bfloat16, got {logits.dtype}")
    if logits.dim() != 2:
        raise _fail("logits", f"must be 2-D [rows, W] or 1-D [W], got shape "
                    f"{tuple(logits.shape)}")
    rows, width = logits.shape
    if width > 1 and logits.stride(1) != 1:
        raise _fail("logits", f"must have unit column stride, got strides {logits.stride()}")
    if bitmask.dtype != bitmask_dtype:
        raise _fail("bitmask", f"must be int32, got {bitmask.dtype}")
    if bitmask.dim() != 2:
        raise _fail("bitmask", f"must be 2-D [rows, words] (or 1-D [words] with 1-D logits), "
                    f"got shape {tuple(bitmask.shape)}")
    if bitmask.size(1) > 1 and bitmask.stride(1) != 1:
        raise _fail("bitmask", f"must have unit column stride, got strides {bitmask.stride()}")
    mask_rows = rows
    if indices is not None:
        if indices.dtype not in index_dtypes:
            raise _fail("indices", f"must be int32 or int64, got {indices.dtype}")
        if indices.dim() != 1:
            raise _fail("indices", f"must be 1-D [n], got shape {tuple(indices.shape)}")
        if indices.device != logits.device:
            raise _fail("indices", f"is on {indices.device}, logits on {logits.device}")
        mask_rows = indices.size(0)
        if bitmask.size(0) != mask_rows:
            raise _fail("bitmask", f"has {bitmask.size(0)} rows, but indices has {mask_rows} "
                        f"entries: with indices, bitmask row i masks logits row indices[i] "
                        f"(for xgrammar's layout, pass bitmask[indices])")
    elif bitmask.size(0) < rows:
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
        if token_mask.dim() != 1 or token_mask.size(0) < mask_rows:
            raise _fail("token_mask", f"must be 1-D with >= {mask_rows} entries, got shape "
                        f"{tuple(token_mask.shape)}")
    for name, t in (("bitmask", bitmask), ("token_mask", token_mask), ("d2t", d2t)):
        if t is not None and t.device != logits.device:
            raise _fail(name, f"is on {t.device}, logits on {logits.device}")


def _check_indices_values(indices: torch.Tensor, rows: int) -> None:
    """On CPU: every index lies in [0, rows) and none repeats (the C++ mask trusts both)."""
    values = indices.numpy()
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        where = int(np.flatnonzero(values == bad)[0])
        raise _fail("indices", f"entry {where} is {bad}, outside the logits' rows [0, {rows})")
    seen = np.bincount(values, minlength=rows)
    if values.size > 1 and seen.max() > 1:
        row = int(np.flatnonzero(seen > 1)[0])
        where = np.flatnonzero(values == row)[:2].tolist()
        raise _fail("indices", f"names logits row {row} twice (entries {where[0]} and "
                    f"{where[1]}): each row may be masked once")


_arange_int32 = np.arange(0, dtype=np.int32)


def d2t_first_bad_target(d2t: torch.Tensor, start: int, end: int, bound: int) -> int | None:
    """On CPU: the first draft id ``g`` in ``[start, end)`` whose target ``g + d2t[g]`` lies
    outside ``[0, bound)``, or None where every target is inside.

    One int32 add and one max over the table (about 8 us for 32000 ids, 42 us for 151936 on
    the project's 2-core host): the sum wraps in int32, and read as uint32 every target outside
    ``[0, bound)`` (negative, past ``bound``, or wrapped past 2**31) is ``>= bound``, since
    ``bound <= 2**31``.
    """
    global _arange_int32
    values = d2t.numpy()[start:end]
    if end > 2**31 or bound > 2**31:  # (no int32 arithmetic: not a real vocabulary)
        targets64 = values.astype(np.int64) + np.arange(start, end, dtype=np.int64)
        bad = np.flatnonzero((targets64 < 0) | (targets64 >= bound))
        return int(bad[0]) + start if bad.size else None
    if _arange_int32.size < end:
        _arange_int32 = np.arange(max(end, 2 * _arange_int32.size), dtype=np.int32)
    targets = np.add(values, _arange_int32[start:end])
    unsigned = targets.view(np.uint32)
    if end == start or int(unsigned.max()) < bound:
        return None
    return int(np.flatnonzero(unsigned >= bound)[0]) + start


def _check_d2t_targets(d2t: torch.Tensor, col_offset: int, width: int, words: int) -> None:
    """On CPU: every target id the columns read lies in [0, 32*words)."""
    bound = words * BITS_PER_WORD
    g = d2t_first_bad_target(d2t, col_offset, col_offset + width, bound)
    if g is not None:
        raise _fail("d2t", f"maps draft id {g} (column {g - col_offset}) to target id "
                    f"{g + int(d2t[g])} (= {g} + d2t[{g}]), outside the bitmask's "
                    f"[0, {bound})")


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
            "Tensor? d2t, SymInt col_offset, Tensor? indices=None) -> ()")


def _logits_bitmask_kernel(logits: torch.Tensor, bitmask: torch.Tensor,
                           token_mask: torch.Tensor | None, d2t: torch.Tensor | None,
                           col_offset: int, indices: torch.Tensor | None = None) -> None:
    """The kernel of every real device; arguments already checked by :func:`logits_bitmask`."""
    if logits.numel() == 0 or (indices is not None and indices.numel() == 0):
        return
    if logits.device.type == "cuda":
        kernel = _cuda_kernel()
        if kernel is not None:
            kernel(logits, bitmask, token_mask, d2t, col_offset, indices)
            return
    elif logits.device.type == "cpu":
        if d2t is not None:
            _check_d2t_targets(d2t, col_offset, logits.size(1), bitmask.size(1))
        if indices is not None:
            _check_indices_values(indices, logits.size(0))
    apply_logits_bitmask_(logits, bitmask, token_mask, d2t, col_offset, indices)


_LIB.impl("logits_bitmask", _logits_bitmask_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("capgraph::logits_bitmask", lib=_LIB)
def _logits_bitmask_fake(logits, bitmask, token_mask, d2t, col_offset, indices=None) -> None:
    return None


#: The registered op: ``torch.ops.capgraph.logits_bitmask.default`` (no argument checks).
logits_bitmask_op = torch.ops.capgraph.logits_bitmask.default
