"""The token bitmask layout, as small named contracts.

One bitmask row holds one bit per token of the (padded) target vocabulary, packed into
``ceil(V / 32)`` int32 words, LSB first: bit ``j`` of word ``w`` is token ``32 * w + j`` (the
layout xgrammar and llguidance fill). A set bit means the token is allowed. ``token_mask`` holds
one int32 per row; a row whose entry is 0 is left unmasked.

Bits at and above ``V`` in the last partial word are padding. Backends do not promise to clear
them (xgrammar sets them where most tokens are allowed), so nothing here reads them as
tokens, and the decoders clear them in every row they fill: a d2t target among them, which
:func:`capgraph.ops.logits_bitmask` reads as it reads any bit of the row, is then masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import LayoutError

__all__ = [
    "BITS_PER_WORD",
    "bitmask_dtype",
    "token_mask_dtype",
    "d2t_dtype",
    "words_per_row",
    "bitmask_shape",
    "allocate_bitmask",
    "allocate_host_bitmask",
    "allocate_token_mask",
    "allocate_host_token_mask",
    "split_last_word",
    "row_has_valid_token",
    "rows_have_valid_token",
    "VocabShard",
    "vocab_shard",
]

BITS_PER_WORD = 32
bitmask_dtype = torch.int32
token_mask_dtype = torch.int32
#: dtype of a draft-to-target table: draft id ``g`` is target id ``g + d2t[g]``.
d2t_dtype = torch.int32


def words_per_row(vocab_size: int) -> int:
    """int32 words in one bitmask row: ``ceil(vocab_size / 32)``."""
    if vocab_size < 0:
        raise LayoutError(f"vocab_size must be >= 0, got {vocab_size}")
    return -(-vocab_size // BITS_PER_WORD)


def bitmask_shape(rows: int, vocab_size: int) -> tuple[int, int]:
    """Shape of a bitmask with ``rows`` rows: ``(rows, ceil(vocab_size / 32))``."""
    return (rows, words_per_row(vocab_size))


def _pin_host() -> bool:
    # Checked on each allocation, never at import; a CPU-only torch answers False without
    # touching any driver.
    return torch.cuda.is_available()


def allocate_bitmask(rows: int, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed bitmask ``[rows, ceil(V/32)]`` int32 on ``device`` (zero: every token masked)."""
    return torch.zeros(bitmask_shape(rows, vocab_size), dtype=bitmask_dtype, device=device)


def allocate_host_bitmask(rows: int, vocab_size: int, *, pin: bool | None = None) -> torch.Tensor:
    """A zeroed host bitmask ``[rows, ceil(V/32)]`` int32, the twin of :func:`allocate_bitmask`.

    ``pin=None`` pins it where CUDA is available (so that a ``non_blocking`` copy to the device
    is truly asynchronous) and leaves it pageable otherwise; True/False force the choice.
    """
    pin = _pin_host() if pin is None else pin
    return torch.zeros(bitmask_shape(rows, vocab_size), dtype=bitmask_dtype, pin_memory=pin)


def allocate_token_mask(rows: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed token mask ``[rows]`` int32 on ``device`` (zero: no row is masked)."""
    return torch.zeros(rows, dtype=token_mask_dtype, device=device)


def allocate_host_token_mask(rows: int, *, pin: bool | None = None) -> torch.Tensor:
    """A zeroed host token mask ``[rows]`` int32; ``pin`` as in :func:`allocate_host_bitmask`."""
    pin = _pin_host() if pin is None else pin
    return torch.zeros(rows, dtype=token_mask_dtype, pin_memory=pin)


def split_last_word(vocab_size_padded: int) -> tuple[int, int]:
    """(full words, mask of the valid bits of the last partial word or 0): the bits that count
    for a row of ``vocab_size_padded`` tokens (the rest of the last word is padding)."""
    full, tail_bits = divmod(vocab_size_padded, BITS_PER_WORD)
    return full, (1 << tail_bits) - 1


def row_has_valid_token(row: torch.Tensor, vocab_size_padded: int) -> bool:
    """Whether a bitmask row allows at least one token below ``vocab_size_padded``.

    An all-zero row would mask a whole logits row to -inf and make softmax return NaN, so the
    decoder checks every filled row. Only bits below ``vocab_size_padded`` count: the padding
    bits of a partial last word are never applied and may hold garbage.

    Args:
        row: ``[>= ceil(V/32)]`` int32 words. Meant for host rows; on a device this synchronises.
        vocab_size_padded: ``V``.
    """
    full, tail_mask = split_last_word(vocab_size_padded)
    # bitmask: [words]
    if bool(row[:full].any()):
        return True
    return tail_mask != 0 and bool(int(row[full]) & tail_mask)


def rows_have_valid_token(bitmask_rows: torch.Tensor, vocab_size_padded: int) -> torch.Tensor:
    """:func:`row_has_valid_token` for every row at once: a ``[rows]`` bool tensor.

    Vectorised, no host synchronisation (the result stays on the rows' device).

    Args:
        bitmask_rows: ``[rows, >= ceil(V/32)]`` int32.
        vocab_size_padded: ``V``.
    """
    full, tail_mask = split_last_word(vocab_size_padded)
    # bitmask_rows: [rows, words] -> valid: [rows]
    valid = bitmask_rows[:, :full].ne(0).any(dim=1)
    if tail_mask:
        valid |= (bitmask_rows[:, full] & tail_mask).ne(0)
    return valid


@dataclass(frozen=True, slots=True)
class VocabShard:
    """The vocabulary columns one tensor-parallel rank holds, and where its bits live.

    Columns ``[start, end)`` are in the coordinates of the vocabulary being sharded: the
    target vocabulary for target logits, the draft vocabulary for pruned-draft (d2t) logits.

    Without d2t, column ``c`` of the shard's logits is token ``start + c`` and its bit is global
    bit ``start + c`` of the full bitmask row. ``start`` need not be a multiple of 32, so the op
    takes the full row with ``col_offset=start`` (or the word slice ``[word_start, word_end)``
    with ``col_offset=bit_offset``) rather than a word slice that assumes alignment.

    With d2t the bits are looked up through the full d2t table at draft ids
    ``start + c``; pass the full target bitmask row and ``col_offset=start`` (draft
    coordinates). ``word_start``/``word_end`` do not apply then.
    """

    tp_size: int
    tp_rank: int
    start: int  #: first column (inclusive), vocabulary coordinates
    end: int  #: last column (exclusive)
    word_start: int  #: first bitmask word holding a bit of [start, end)
    word_end: int  #: one past the last such word

    @property
    def width(self) -> int:
        """Columns of this shard: ``V / tp_size``."""
        return self.end - self.start

    @property
    def col_offset(self) -> int:
        """``col_offset`` for the op given the full bitmask row: ``start``."""
        return self.start

    @property
    def bit_offset(self) -> int:
        """``col_offset`` for the op given the words ``[word_start, word_end)`` only."""
        return self.start - self.word_start * BITS_PER_WORD


def vocab_shard(vocab_size_padded: int, tp_size: int, tp_rank: int) -> VocabShard:
    """The :class:`VocabShard` of rank ``tp_rank`` of ``tp_size`` over ``vocab_size_padded``.

    Raises:
        LayoutError: ``tp_size < 1``, ``tp_rank`` outside ``[0, tp_size)``, or ``V`` not
            divisible by ``tp_size``. The word count ``ceil(V/32)`` need not divide: a shard
            reads the full row from ``col_offset``, wherever in a word it starts (Qwen's
            151936 = 4748 words over tp=8 gives 18992-column shards, the first bits of rank
            1 in the middle of word 593).
    """
    if tp_size < 1:
        raise LayoutError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if vocab_size_padded % tp_size:
        raise LayoutError(
            f"vocab_size_padded ({vocab_size_padded}) is not divisible by tp_size ({tp_size})")
    width = vocab_size_padded // tp_size
    start = tp_rank * width
    end = start + width
    return VocabShard(tp_size=tp_size, tp_rank=tp_rank, start=start, end=end,
                      word_start=start // BITS_PER_WORD, word_end=words_per_row(end))
