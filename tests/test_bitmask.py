"""The bitmask layout contracts of capgraph.bitmask."""

from __future__ import annotations

import pytest
import torch

from capgraph import LayoutError
from capgraph.bitmask import (BITS_PER_WORD, VocabShard, allocate_bitmask, allocate_host_bitmask,
                              allocate_host_token_mask, allocate_token_mask, bitmask_dtype,
                              bitmask_shape, row_has_valid_token, rows_have_valid_token,
                              token_mask_dtype, vocab_shard, words_per_row)


def _row_with_bits(vocab_size: int, bits) -> torch.Tensor:
    row = torch.zeros(words_per_row(vocab_size), dtype=torch.int32)
    for b in bits:
        word, bit = divmod(b, 32)
        # int32 view of the unsigned word: bit 31 is the sign bit
        value = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
        row[word] = value - (1 << 32) if value >= 1 << 31 else value
    return row


def test_layout_constants():
    """Words are int32 holding 32 tokens; a row has ceil(V/32) words."""
    assert bitmask_dtype == torch.int32 and token_mask_dtype == torch.int32
    assert BITS_PER_WORD == 32
    assert [words_per_row(v) for v in (0, 1, 31, 32, 33, 128001, 131072)] == \
        [0, 1, 1, 1, 2, 4001, 4096]
    assert bitmask_shape(7, 1001) == (7, 32)


def test_allocation_shapes_dtypes_and_zeros():
    """Allocators return zeroed tensors of the layout's shape and dtype; the host twins are
    pinned only where CUDA exists (never on this CPU build) and can be forced unpinned."""
    bm = allocate_bitmask(3, 1001, "cpu")
    hb = allocate_host_bitmask(3, 1001)
    tm = allocate_token_mask(3, "cpu")
    ht = allocate_host_token_mask(3, pin=False)
    assert bm.shape == hb.shape == (3, 32) and bm.dtype == hb.dtype == torch.int32
    assert tm.shape == ht.shape == (3,) and tm.dtype == ht.dtype == torch.int32
    for t in (bm, hb, tm, ht):
        assert not t.any() and t.device.type == "cpu"
    assert hb.is_pinned() == torch.cuda.is_available()
    assert not ht.is_pinned()


def test_dead_row_has_no_valid_token():
    """An all-zero row is a dead end."""
    row = torch.zeros(words_per_row(1001), dtype=torch.int32)
    assert row_has_valid_token(row, 1001) is False
    assert not rows_have_valid_token(row.unsqueeze(0), 1001).item()


@pytest.mark.parametrize("vocab_size", [1001, 128001, 128])
@pytest.mark.parametrize("position", [0, 31, 32, "last"])
def test_single_bit_anywhere_is_valid(vocab_size, position):
    """A single allowed token anywhere below V (first, bit 31 of word 0, first bit of word 1,
    V-1) makes the row valid, in both the scalar and the batch variant."""
    pos = vocab_size - 1 if position == "last" else position
    row = _row_with_bits(vocab_size, [pos])
    assert row_has_valid_token(row, vocab_size) is True
    assert rows_have_valid_token(row.unsqueeze(0), vocab_size).tolist() == [True]


def test_bit_31_of_a_word_counts():
    """Bit 31 (the int32 sign bit) of an inner word is a token like any other."""
    row = torch.zeros(4, dtype=torch.int32)
    row[2] = -(1 << 31)  # only bit 31: token 95
    assert row_has_valid_token(row, 128)
    assert rows_have_valid_token(row.unsqueeze(0), 128).item()


def test_tail_garbage_is_ignored():
    """V=128001: only bit 0 of the last word is a token; garbage in its 31 padding bits does
    not make a dead row valid, while bit 0 alone does."""
    v = 128001
    row = torch.zeros(words_per_row(v), dtype=torch.int32)
    row[-1] = -2  # every bit but bit 0
    assert row_has_valid_token(row, v) is False
    assert rows_have_valid_token(row.unsqueeze(0), v).tolist() == [False]
    row[-1] = 1
    assert row_has_valid_token(row, v) is True


def test_full_last_word_when_vocab_is_multiple_of_32():
    """With V a multiple of 32 every bit of the last word is a token (no tail to mask)."""
    row = torch.zeros(4, dtype=torch.int32)
    row[3] = -(1 << 31)  # token 127 = V - 1
    assert row_has_valid_token(row, 128) is True


def test_batch_variant_agrees_with_scalar_on_random_rows():
    """rows_have_valid_token equals row_has_valid_token row by row, with tail garbage and
    sparse rows, and accepts a strided slice of a bigger buffer."""
    g = torch.Generator().manual_seed(0)
    for v in (31, 33, 1001, 1024):
        words = words_per_row(v)
        buf = torch.zeros(64, words + 3, dtype=torch.int32)
        rows = buf[:, :words]
        for r in range(64):
            kind = r % 4
            if kind == 1:  # one random bit anywhere in the row, tail included
                bit = int(torch.randint(words * 32, (1,), generator=g))
                rows[r] = _row_with_bits(words * 32, [bit])
            elif kind == 2:
                rows[r] = torch.randint(-2**31, 2**31 - 1, (words,), generator=g,
                                        dtype=torch.int32)
            elif kind == 3:
                rows[r, -1] = -1
        expected = [row_has_valid_token(rows[r], v) for r in range(64)]
        assert rows_have_valid_token(rows, v).tolist() == expected


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_vocab_shard_ranges(tp_size):
    """Shards split V evenly into contiguous column ranges; each shard's word range covers
    exactly the words holding its bits, and bit_offset locates its first column there."""
    v = 131072
    shards = [vocab_shard(v, tp_size, r) for r in range(tp_size)]
    width = v // tp_size
    for r, s in enumerate(shards):
        assert isinstance(s, VocabShard) and (s.tp_size, s.tp_rank) == (tp_size, r)
        assert (s.start, s.end, s.width) == (r * width, (r + 1) * width, width)
        assert (s.word_start, s.word_end) == (r * width // 32, (r + 1) * width // 32)
        assert s.col_offset == s.start and s.bit_offset == 0
    with pytest.raises(AttributeError):
        shards[0].start = 1  # frozen


def test_vocab_shard_not_word_aligned():
    """V=66, tp=3 gives 22-column shards that start mid-word: rank 1 covers bits [22, 44),
    words [0, 2), bit_offset 22; rank 2 covers [44, 66), words [1, 3), bit_offset 12."""
    s = vocab_shard(66, 3, 1)
    assert (s.start, s.end, s.word_start, s.word_end, s.bit_offset) == (22, 44, 0, 2, 22)
    s = vocab_shard(66, 3, 2)
    assert (s.start, s.end, s.word_start, s.word_end, s.bit_offset) == (44, 66, 1, 3, 12)


def test_vocab_shard_word_count_not_divisible():
    """ceil(V/32) % tp_size != 0 is fine (the shard reads the full row from col_offset):
    V=96 (3 words) over tp=2 gives rank 1 bits [48, 96), from bit 16 of word 1; Qwen's 151936
    (4748 words) over tp=8 gives 18992 columns per rank."""
    s = vocab_shard(96, 2, 1)
    assert (s.start, s.end, s.word_start, s.word_end, s.bit_offset) == (48, 96, 1, 3, 16)
    for r in range(8):
        s = vocab_shard(151936, 8, r)
        assert (s.start, s.width, s.col_offset) == (r * 18992, 18992, r * 18992)
        assert s.word_end == -(-(r + 1) * 18992 // 32) and s.bit_offset == (r * 18992) % 32


def test_vocab_shard_other_errors():
    """V % tp_size != 0, tp_size < 1 and tp_rank out of range are LayoutErrors."""
    with pytest.raises(LayoutError, match=r"vocab_size_padded \(129\)"):
        vocab_shard(129, 5, 0)  # 5 words divide, 129 columns do not
    with pytest.raises(LayoutError, match="tp_size"):
        vocab_shard(128, 0, 0)
    with pytest.raises(LayoutError, match="tp_rank"):
        vocab_shard(128, 2, 2)
