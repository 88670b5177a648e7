"""Pure-torch kernel of ``capgraph::logits_bitmask``: the CPU path, and the CUDA fallback.

Branch-free bit arithmetic instead of ``masked_fill_``: a random 0/1 mask makes masked_fill's
per-element branch mispredict, about 10x slower on CPU. Here every allowed bit is widened to an
all-ones integer lane ("keep") by two shifts, and the logits, viewed as integers of their own
width, are rewritten as ``((x ^ NEG_INF) & keep) ^ NEG_INF``: an allowed entry keeps its exact
bits (NaN payloads included), a masked one becomes the bit pattern of -inf.

Rows are processed in blocks so that the keep buffer stays cache sized (on CPU) or bounded (on
accelerators); the buffer is a per-thread workspace that only grows, so steady-state calls
allocate no scratch. On CPU a token mask is read through NumPy and only runs of active rows are
touched; on other devices nothing reads data back to the host (inactive rows get an all-ones
keep), so the path never synchronises and may be captured in a CUDA graph.

With ``indices`` the blocks run over the bitmask's rows and gather/scatter their logits rows.

Precondition: arguments checked by :func:`capgraph.ops.logits_bitmask`.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from .cpu_mask import cpu_apply, cpu_apply_indices

__all__ = ["apply_logits_bitmask_", "apply_logits_bitmask_torch_"]

# float dtype -> (integer view of the same width, bit pattern of -inf in it)
_INT_VIEW = {
    torch.float32: (torch.int32, -0x00800000),  # 0xFF800000
    torch.float16: (torch.int16, -0x0400),  # 0xFC00
    torch.bfloat16: (torch.int16, -0x0080),  # 0xFF80
}

# Elements of the keep buffer per block (int32: 1 MB, best of 128K..1M on a 2-core EPYC at
# V=131072), so that a block stays in cache between its ops; the buffer is allocated once per
# call.
_BLOCK_ELEMENTS = 1 << 18
# On accelerators blocks only bound the scratch memory (64 MB); fewer blocks, fewer launches.
_DEVICE_BLOCK_ELEMENTS = 1 << 24


@functools.lru_cache(maxsize=8)
def _lane_shifts(device: torch.device) -> torch.Tensor:
    """``[32]`` int32: a left shift by ``31 - b`` moves bit ``b`` of a word into the sign bit."""
    return torch.arange(31, -1, -1, dtype=torch.int32, device=device)


def _host_readable(token_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The token mask where reading it on the host costs no device synchronisation, else None."""
    return token_mask if token_mask is not None and token_mask.device.type == "cpu" else None


def _row_spans(rows: int, block_rows: int,
               token_mask: torch.Tensor) -> list[tuple[int, int]]:
    """Runs of consecutive active rows, cut to at most ``block_rows`` each.

    ``token_mask`` is on CPU; it is read through NumPy (no torch allocation), and only active
    rows are ever touched, so inactive rows need no neutralising copy of the bitmask.
    """
    active = token_mask[:rows].numpy() != 0
    if active.all():
        runs = [(0, rows)]
    else:
        edges = np.flatnonzero(np.diff(active.astype(np.int8), prepend=0, append=0))
        runs = list(zip(edges[0::2].tolist(), edges[1::2].tolist()))
    return [(s, min(s + block_rows, e)) for start, e in runs
            for s in range(start, e, block_rows)]


_local = threading.local()


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scratch buffer of at least ``numel`` elements, kept per thread, device and dtype, so
    that steady-state calls allocate nothing (it only grows)."""
    cache: dict = _local.__dict__.setdefault("workspaces", {})
    key = (device, dtype)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf


@functools.lru_cache(maxsize=32)
def _scalar(value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim constant tensor: passing it instead of a Python int spares torch wrapping the
    number into a fresh tensor on every call. Made by a fill, not ``torch.tensor`` (a blocking
    host-to-device copy that a CUDA graph capture forbids)."""
    return torch.full((), value, dtype=dtype, device=device)


def apply_logits_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                          token_mask: torch.Tensor | None, d2t: torch.Tensor | None,
                          col_offset: int, indices: torch.Tensor | None = None) -> None:
    """Mask ``logits`` in place (semantics: :func:`capgraph.ops.logits_bitmask`)."""
    if (d2t is None and logits.device.type == "cpu" and logits.stride(1) == 1
            and bitmask.stride(1) == 1 and (token_mask is None or token_mask.stride(0) == 1)
            and (indices is None or indices.stride(0) == 1)):
        # the same, in one pass over the logits (csrc/cpu_mask.cc)
        if indices is None:
            native = cpu_apply()
            if native is not None:
                native(logits, bitmask, token_mask, col_offset)
                return
        else:
            native = cpu_apply_indices()
            if native is not None:
                native(logits, bitmask, token_mask, col_offset, indices)
                return
    apply_logits_bitmask_torch_(logits, bitmask, token_mask, d2t, col_offset, indices)


def apply_logits_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor,
                                token_mask: torch.Tensor | None, d2t: torch.Tensor | None,
                                col_offset: int, indices: torch.Tensor | None = None, *,
                                bound_targets: bool | None = None) -> None:
    """The torch code of :func:`apply_logits_bitmask_` (any device, d2t, no compiler).

    With ``indices`` the blocks run over the mask rows (bitmask row ``i`` for logits row
    ``indices[i]``): each block's logits rows are gathered, masked and scattered back; indices
    are distinct (checked on CPU, a precondition elsewhere), so the scatter is exact.

    ``bound_targets``: mask the columns whose d2t target lies outside the bitmask row instead
    of reading it (None: everywhere but on CPU, where the op refuses such a table first).
    """
    width = logits.size(1)
    rows = logits.size(0) if indices is None else indices.size(0)  # mask rows
    if rows == 0 or width == 0:
        return
    int_dtype, neg_inf_bits = _INT_VIEW[logits.dtype]
    device = logits.device

    words = bitmask[:rows]  # [rows, words]
    if d2t is None:
        first_word = col_offset // 32
        words = words[:, first_word:-(-(col_offset + width) // 32)]
        bit0 = col_offset - first_word * 32
        keep_cols = words.shape[1] * 32
    else:
        # column j -> target id t = g + d2t[g], g = col_offset + j (draft coordinates)
        if bound_targets is None:
            bound_targets = device.type != "cpu"
        # (int64 where targets may lie anywhere: g + d2t[g] may pass int32)
        draft_ids = torch.arange(col_offset, col_offset + width, device=device,
                                 dtype=torch.int64 if bound_targets else torch.int32)
        targets = d2t[col_offset:col_offset + width] + draft_ids  # [width]
        inside_bits: torch.Tensor | None = None
        if bound_targets:
            # a target outside the row's bits is masked and its word never read (on CPU the
            # op refuses such a table first; elsewhere a check would synchronise)
            inside = (targets >= 0) & (targets < words.shape[1] * 32)
            targets = targets.where(inside, 0)
            inside_bits = inside.to(torch.int32).neg_()  # all ones inside, 0 outside
        word_index = targets >> 5
        bit_shift = (31 - (targets & 31)).to(torch.int32)  # (a no-op for int32 targets)
        keep_cols = width

    budget = _BLOCK_ELEMENTS if device.type == "cpu" else _DEVICE_BLOCK_ELEMENTS
    block_rows = max(1, budget // keep_cols)
    host_mask = _host_readable(token_mask)
    if host_mask is None:  # read nothing back: every block, inactive rows neutralised below
        spans = [(s, min(s + block_rows, rows)) for s in range(0, rows, block_rows)]
        if token_mask is not None:
            # inactive rows read as all-allowed: their logits keep every bit
            words = words.masked_fill(token_mask[:rows].eq(0).unsqueeze(1), -1)
    else:
        spans = _row_spans(rows, block_rows, host_mask)
    if not spans:
        return

    shifts = _lane_shifts(device)
    max_block = max(end - start for start, end in spans)
    # Keys are built in int32 (int16 shifts do not vectorise in torch's CPU kernels) and
    # narrowed into a second buffer for 16-bit logits.
    wide = _workspace(max_block * keep_cols, torch.int32, device)
    narrow = None if int_dtype == torch.int32 else _workspace(max_block * width, int_dtype, device)
    neg_inf = _scalar(neg_inf_bits, int_dtype, device)
    sign = _scalar(31, torch.int32, device)
    logits_int = logits.view(int_dtype)
    if indices is not None and indices.dtype != torch.int64:
        indices = indices.long()  # index_copy_ takes int64 only
    for start, end in spans:
        n = end - start
        if d2t is None:
            # keep: [n, words, 32] -> [n, words * 32] -> the logits' columns
            keep = wide[:n * keep_cols].view(n, -1, 32)
            torch.bitwise_left_shift(words[start:end].unsqueeze(-1), shifts, out=keep)
            keep = keep.view(n, keep_cols)[:, bit0:bit0 + width]
        else:
            keep = wide[:n * keep_cols].view(n, width)
            torch.index_select(words[start:end], 1, word_index, out=keep)
            keep.bitwise_left_shift_(bit_shift)
            if inside_bits is not None:
                keep.bitwise_and_(inside_bits)  # outside: sign bit cleared, masked
        keep.bitwise_right_shift_(sign)  # arithmetic: sign bit -> all ones / all zeros
        if narrow is not None:
            keep = narrow[:n * width].view(n, width).copy_(keep)
        if indices is None:
            block = logits_int[start:end]
        else:
            rows_of_block = indices[start:end]
            block = logits_int.index_select(0, rows_of_block)  # [n, width], a copy
        block.bitwise_xor_(neg_inf)
        block.bitwise_and_(keep)
        block.bitwise_xor_(neg_inf)
        if indices is not None:
            logits_int.index_copy_(0, rows_of_block, block)
