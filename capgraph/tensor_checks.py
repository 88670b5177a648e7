"""The checks a decoder runs on the logits and d2t tensors it is given, before any matcher moves.

A retry after a :class:`~capgraph.errors.TensorArgError` must find the matchers where they were,
so everything here runs before the build. It runs on every step: each tensor attribute read
is a call into torch, and they are read once each.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from .errors import TensorArgError
from .ops.op import _FLOAT_DTYPES, d2t_first_bad_target

__all__ = ["LogitsChecks"]


class LogitsChecks:
    """Logits and d2t checks for a decoder on ``device`` with full rows of ``vocab_size_padded``
    (``words`` bitmask words), tensor-parallel ``rank`` and ``max_rows`` bitmask rows."""

    def __init__(self, device: torch.device, vocab_size_padded: int, words: int, rank: int,
                 max_rows: int) -> None:
        self.device = device
        self._on_cpu = device.type == "cpu"
        self.vocab_size_padded = vocab_size_padded
        self.words = words
        self.rank = rank
        self.max_rows = max_rows
        # on CUDA, the d2t tables whose values were read; on both, the bitmask words of the
        # target ids each table's draft ids map to (on CPU with the values they were read
        # from, which each read compares)
        self._d2t_checked: _Remembered[bool] = _Remembered(8)
        self._d2t_reach: _Remembered[tuple[np.ndarray | None, np.ndarray]] = _Remembered(4)

    def check(self, logits: torch.Tensor, d2t: torch.Tensor | None, rows: int | None,
              min_rows: int = 0) -> None:
        """Refuse bad logits / d2t. ``rows``: the exact row count; None: at least
        ``min_rows`` and at most ``max_rows`` (the capturable decoder's static logits)."""
        if not isinstance(logits, torch.Tensor) or len(shape := logits.shape) != 2:
            raise TensorArgError(f"logits must be a 2-D tensor, got "
                                 f"{getattr(logits, 'shape', type(logits))}")
        if self._on_cpu:
            misplaced = not logits.is_cpu
        else:
            device = logits.device
            misplaced = device != self.device and not (
                device.type == "cuda" and self.device.index is None)
        if misplaced:
            raise TensorArgError(f"logits are on {logits.device}, the decoder on {self.device}")
        if rows is None:  # capturable: static rows, at least the layout's (padding allowed)
            if shape[0] < min_rows:
                raise TensorArgError(f"logits have {shape[0]} rows, fewer than the "
                                     f"batch layout's {min_rows}")
            if shape[0] > self.max_rows:
                raise TensorArgError(f"logits have {shape[0]} rows, more than the decoder's "
                                     f"{self.max_rows} (max_num_sequences * "
                                     "(max_num_draft_tokens + 1))")
        elif shape[0] != rows:
            raise TensorArgError(f"logits have {shape[0]} rows, the batch layout has "
                                 f"{rows} (1 per context request, 1 + draft length per "
                                 "generation request)")
        if logits.layout is not torch.strided:
            raise TensorArgError(f"logits must be a dense (strided) tensor, got layout "
                                 f"{logits.layout}: pass .to_dense() logits")
        if logits.dtype not in _FLOAT_DTYPES:
            raise TensorArgError(f"logits must be float32, float16 or bfloat16, got "
                                 f"{logits.dtype}")
        width = shape[1]
        if width > 1 and logits.stride(1) != 1:
            raise TensorArgError(f"logits columns must be contiguous (stride(1) == 1), got "
                                 f"strides {tuple(logits.stride())}: pass .contiguous() logits")
        if shape[0] > 1 and logits.stride(0) < width:
            raise TensorArgError(f"logits rows overlap (stride(0)={logits.stride(0)} < width "
                                 f"{width}, e.g. an expand()ed tensor): each row is masked "
                                 "for its own request, so rows need memory of their own")
        if d2t is not None:
            self._table_form(d2t)
            if d2t.device != logits.device:
                raise TensorArgError(f"d2t is on {d2t.device}, logits on {logits.device}")
            self.check_d2t(d2t)
        full = self.vocab_size_padded if d2t is None else d2t.shape[0]
        if d2t is not None and full < width:  # (an empty table: 0 % width passes below)
            raise TensorArgError(f"logits width {width} is not the full vocabulary nor a "
                                 f"tensor-parallel shard of it (len(d2t)={full}): d2t must be "
                                 "the full draft-vocab table, at least as long as the logits "
                                 "are wide")
        if width == 0 or full % width:
            what = "vocab_size_padded" if d2t is None else "len(d2t)"
            raise TensorArgError(f"logits width {width} is not the full vocabulary nor a "
                                 f"tensor-parallel shard of it ({what}={full})")
        tp_size = full // width
        if tp_size > 1:
            # (no word-count condition: the op reads the full row from col_offset = rank *
            # width, which need not be a multiple of 32)
            if self.rank >= tp_size:
                raise TensorArgError(f"rank {self.rank} is outside the {tp_size} shards "
                                     f"implied by logits width {width}")

    def check_table(self, d2t: torch.Tensor) -> None:
        """Refuse a bad ``d2t`` given without its logits (``prepare``): as :meth:`check`
        checks it, on the decoder's device."""
        self._table_form(d2t)
        if (not d2t.is_cpu) if self._on_cpu else (
                d2t.device != self.device and not (d2t.device.type == "cuda"
                                                   and self.device.index is None)):
            raise TensorArgError(f"d2t is on {d2t.device}, the decoder on {self.device}")
        self.check_d2t(d2t)

    @staticmethod
    def _table_form(d2t: Any) -> None:
        """A dense 1-D int32 tensor, or TensorArgError."""
        if isinstance(d2t, torch.Tensor) and d2t.layout is not torch.strided:
            raise TensorArgError(f"d2t must be a dense (strided) tensor, got layout "
                                 f"{d2t.layout}")
        if not isinstance(d2t, torch.Tensor) or d2t.dim() != 1:
            raise TensorArgError(f"d2t must be a 1-D tensor, got shape "
                                 f"{tuple(getattr(d2t, 'shape', ()))}")
        if d2t.dtype != torch.int32:
            raise TensorArgError(f"d2t must be int32, got {d2t.dtype}")

    def check_d2t(self, d2t: torch.Tensor) -> None:
        """Check that every draft id ``g`` of ``d2t`` maps to a target id ``g + d2t[g]`` in
        ``[0, vocab_size_padded)``.

        On CPU the values are read on every call (one add and one max: about 8 us for 32000
        ids, 42 us for 151936), so no change to a table can slip past. On CUDA reading them is
        a host sync, so a table is read the first time this decoder sees it and remembered by
        identity (a weak reference to the tensor object), ``_version``, data pointer and
        length: another tensor object, even at the same address, is read again, and so is a
        table changed in place through torch (which bumps ``_version``). A write that torch
        does not count (through ``.data``, DLPack, another library, or to an inference-mode
        tensor, which has no version counter) is not seen there; the
        kernel then masks every column whose target lies outside the bitmask row and never
        reads past it. Inside a CUDA graph capture an unseen table is not read (a sync would
        break the capture), with the same kernel guarantee.

        Raises:
            TensorArgError: a target id is out of range (names the draft id and its target).
        """
        if self._on_cpu:
            self._check_d2t_values(d2t)
            return
        if self._d2t_checked.get(d2t) or torch.cuda.is_current_stream_capturing():
            return
        self._check_d2t_values(d2t)
        self._d2t_checked.put(d2t, True)

    def reach(self, d2t: torch.Tensor) -> np.ndarray | None:
        """The target ids the draft ids of ``d2t`` map to (``g + d2t[g]`` in range), as
        int32 bitmask words of a row: a draft row whose allowed tokens miss all of them
        would be masked whole. Remembered per table as :meth:`check_d2t` remembers tables;
        on CPU each call also compares the table's values with those it was read from (one
        compare of the table, as the value check reads it on every call), so a write torch
        does not count is seen; on CUDA (a read is a host sync) it is read once per table,
        and None inside a CUDA graph capture for a table not read before."""
        entry = self._d2t_reach.get(d2t)
        if entry is not None:
            values, words = entry
            if values is None or np.array_equal(values, d2t.numpy()):
                return words
        if not d2t.is_cpu and torch.cuda.is_current_stream_capturing():
            return None
        host = (d2t if d2t.is_cpu else d2t.cpu()).numpy()
        targets = np.arange(host.shape[0], dtype=np.int64) + host
        flags = np.zeros(self.words * 32, dtype=bool)
        flags[targets[(targets >= 0) & (targets < self.vocab_size_padded)]] = True
        words = np.packbits(flags, bitorder="little").view("<i4")
        self._d2t_reach.put(d2t, (host.copy() if d2t.is_cpu else None, words))
        return words

    def _check_d2t_values(self, d2t: torch.Tensor) -> None:
        host = d2t if d2t.is_cpu else d2t.cpu()
        g = d2t_first_bad_target(host, 0, host.shape[0], self.vocab_size_padded)
        if g is not None:
            raise TensorArgError(f"d2t maps draft id {g} to target id {g + int(host[g])} "
                                 f"(= {g} + d2t[{g}]), outside [0, vocab_size_padded="
                                 f"{self.vocab_size_padded})")


_Value = TypeVar("_Value")


class _Remembered(Generic[_Value]):
    """Values read from d2t tables, newest first (at most ``size``), each by the tensor
    object (a weak reference), its ``_version``, data pointer and length: another tensor
    object, even at the same address, or one changed in place through torch, is not found."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: list[tuple[weakref.ref, tuple, _Value]] = []

    @staticmethod
    def _key(d2t: torch.Tensor) -> tuple:
        try:
            version: int | None = d2t._version
        except RuntimeError:  # an inference-mode tensor counts no versions
            version = None
        return version, d2t.data_ptr(), d2t.shape[0]

    def get(self, d2t: torch.Tensor) -> _Value | None:
        key = self._key(d2t)
        for ref, seen, value in self._entries:
            if ref() is d2t and seen == key:
                return value
        return None

    def put(self, d2t: torch.Tensor, value: _Value) -> None:
        live = [e for e in self._entries if e[0]() is not None and e[0]() is not d2t]
        self._entries = [(weakref.ref(d2t), self._key(d2t), value), *live[:self._size - 1]]
