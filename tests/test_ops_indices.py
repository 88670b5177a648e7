"""logits_bitmask with ``indices`` (bitmask row i masks logits row indices[i]) and with 1-D
logits: bit-exact against the brute-force reference on both CPU implementations, other rows
untouched, and every bad argument refused with a named error before anything is written."""

from __future__ import annotations

import zlib

import pytest
import torch

from conftest import bits, random_d2t
from capgraph import TensorArgError
from capgraph.bitmask import words_per_row
from capgraph.ops import logits_bitmask, logits_bitmask_reference
from capgraph.ops import torch_impl

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True, params=["native", "torch"])
def cpu_impl(request, monkeypatch):
    """Every test runs with both CPU implementations: the C++ one-pass mask (where it builds)
    and the torch code (the fallback, and the code the CUDA fallback runs)."""
    from capgraph.ops import cpu_mask

    if request.param == "native":
        reason = cpu_mask.unavailable_reason()
        if reason is not None:
            pytest.skip(f"C++ CPU mask unavailable: {reason}")
        assert torch_impl.cpu_apply_indices() is not None
    else:
        monkeypatch.setattr(torch_impl, "cpu_apply", lambda: None)
        monkeypatch.setattr(torch_impl, "cpu_apply_indices", lambda: None)
    return request.param


def random_logits(g, rows, width, dtype, pad=0):
    """[rows, width + pad] with inf/-inf/nan sprinkled (bit-exactness covers them)."""
    t = torch.randn(rows, width + pad, generator=g)
    flat = t.view(-1)
    for value in (float("inf"), float("-inf"), float("nan")):
        flat[torch.randint(flat.numel(), (max(1, flat.numel() // 50),), generator=g)] = value
    return t.to(dtype)


def random_words(g, rows, words):
    """[rows, words] int32 with dense, empty and random words, as a strided slice."""
    buf = torch.randint(-2**31, 2**31 - 1, (rows + 1, words + 3), generator=g,
                        dtype=torch.int32)
    buf[:, ::3] = -1
    buf[:, 1::5] = 0
    return buf[:rows, 1:1 + words]


def check(logits, bitmask, indices, token_mask=None, d2t=None, col_offset=0):
    """Run the op and pin: the chosen rows equal the reference bit for bit, masked entries are
    exactly -inf, every row not chosen (or whose token_mask entry is 0) keeps every bit."""
    before = logits.clone()
    expected = logits_bitmask_reference(logits, bitmask, token_mask, d2t,
                                        col_offset=col_offset, indices=indices)
    logits_bitmask(logits, bitmask, token_mask, d2t, col_offset=col_offset, indices=indices)
    assert torch.equal(bits(logits), bits(expected)), "differs from the brute-force reference"
    listed = [int(i) for i in indices]
    active = [r for k, r in enumerate(listed) if token_mask is None or int(token_mask[k])]
    for r in range(logits.shape[0]):
        if r not in active:
            assert torch.equal(bits(logits[r]), bits(before[r])), f"row {r} changed"
    masked = torch.isneginf(expected) & ~torch.isneginf(before)
    assert masked.any() or not active, "the case masked nothing: it pins nothing"


@pytest.mark.parametrize("index_form", ["list", "int64", "int32", "strided"])
@pytest.mark.parametrize("vocab", [31, 33, 1000, 1001])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indices_match_reference(dtype, vocab, index_form):
    """Unsorted indices given as a list, an int64 and an int32 tensor, and a strided int32
    view, mask exactly their rows with the compact bitmask's rows in order, for every dtype and
    V not a multiple of 32."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{vocab}{index_form}".encode()))
    logits = random_logits(g, 7, vocab, dtype)
    rows = [5, 0, 3]
    indices = {"list": rows, "int64": torch.tensor(rows),
               "int32": torch.tensor(rows, dtype=torch.int32),
               "strided": torch.tensor([5, 6, 0, 6, 3], dtype=torch.int32)[::2]}[index_form]
    check(logits, random_words(g, 3, words_per_row(vocab)), indices)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indices_with_wider_bitmask_offset_token_mask_and_strided_logits(dtype):
    """A bitmask wider than the logits need (extra words ignored), a non-word-aligned
    col_offset, a token mask over the mask rows (entry i gates logits row indices[i]) and
    logits that are a column slice of a wider tensor: only the active chosen rows change."""
    g = torch.Generator().manual_seed(17)
    parent = random_logits(g, 9, 500, dtype, pad=6)
    view = parent[:, 3:503]
    before = parent.clone()
    indices = torch.tensor([8, 2, 6, 1])
    token_mask = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32)  # longer than needed
    check(view, random_words(g, 4, words_per_row(500 + 45) + 4), indices, token_mask,
          col_offset=45)
    assert torch.equal(bits(parent[:, :3]), bits(before[:, :3]))
    assert torch.equal(bits(parent[:, 503:]), bits(before[:, 503:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indices_with_d2t(dtype):
    """With a draft-to-target table the chosen rows read bits of their target rows (the
    torch path on either implementation: the C++ pass has no d2t)."""
    g = torch.Generator().manual_seed(23)
    draft, target = 300, 1001
    d2t = random_d2t(g, draft, target)
    check(random_logits(g, 6, draft - 7, dtype), random_words(g, 2, words_per_row(target)),
          [4, 1], d2t=d2t, col_offset=7)


def test_indices_in_row_blocks(monkeypatch):
    """Mask rows processed in blocks of a few rows (the torch path's cache-sized blocks) still
    scatter each block to the right logits rows."""
    monkeypatch.setattr(torch_impl, "_BLOCK_ELEMENTS", 300)  # 3 rows of 100 columns
    g = torch.Generator().manual_seed(29)
    order = torch.randperm(20, generator=g)[:11]
    token_mask = torch.randint(0, 2, (11,), generator=g, dtype=torch.int32)
    check(random_logits(g, 20, 100, torch.bfloat16), random_words(g, 11, words_per_row(100)),
          order, token_mask)


def test_indices_sync_free_path(monkeypatch):
    """The off-CPU torch path (token mask never read on the host) with indices, forced on
    CPU: the same result."""
    monkeypatch.setattr(torch_impl, "_host_readable", lambda token_mask: None)
    monkeypatch.setattr(torch_impl, "cpu_apply_indices", lambda: None)
    g = torch.Generator().manual_seed(31)
    check(random_logits(g, 8, 257, torch.float16), random_words(g, 4, words_per_row(257)),
          torch.tensor([7, 0, 4, 3], dtype=torch.int32),
          torch.tensor([1, 1, 0, 1], dtype=torch.int32))


def test_indices_all_rows_reordered_differs_from_plain():
    """Indices naming every row in another order mask row indices[i] with bitmask row i: the
    result is the plain call's with the bitmask rows permuted, not the plain call's."""
    g = torch.Generator().manual_seed(37)
    logits = random_logits(g, 4, 200, torch.float32)
    bitmask = random_words(g, 4, words_per_row(200))
    order = [2, 0, 3, 1]
    ours, permuted = logits.clone(), logits.clone()
    logits_bitmask(ours, bitmask, indices=order)
    inverse = torch.empty(4, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(4)
    logits_bitmask(permuted, bitmask[inverse])
    assert torch.equal(bits(ours), bits(permuted))
    plain = logits.clone()
    logits_bitmask(plain, bitmask)
    assert not torch.equal(bits(ours), bits(plain))


def test_matches_xgrammar_apply_with_gathered_bitmask():
    """xgrammar's apply with indices (bitmask row k for logits row k) equals this op with the
    compact bitmask bitmask[indices]."""
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(41)
    v = 1001
    logits = random_logits(g, 6, v, torch.float32)
    bitmask = random_words(g, 6, words_per_row(v)).contiguous()
    rows = [1, 4, 5]
    ours, theirs = logits.clone(), logits.clone()
    logits_bitmask(ours, bitmask[rows], indices=rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=v, indices=rows)
    assert torch.equal(bits(ours), bits(theirs))


@pytest.mark.parametrize("empty", [[], "int64", "int32"])
def test_empty_indices_mask_nothing(empty):
    """Empty indices (list or tensor) with a 0-row bitmask leave every logit untouched."""
    logits = torch.randn(3, 100)
    before = logits.clone()
    indices = [] if empty == [] else torch.empty(0, dtype=getattr(torch, empty))
    logits_bitmask(logits, torch.zeros(0, 4, dtype=torch.int32), indices=indices)
    assert torch.equal(bits(logits), bits(before))


@pytest.mark.parametrize("bitmask_1d", [True, False])
@pytest.mark.parametrize("vocab", [33, 1001])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_1d_logits(dtype, vocab, bitmask_1d):
    """1-D logits [W] are one row: with a 1-D bitmask [words] or a 2-D one (its row 0), and a
    token mask; the result is the reference's, written through to the caller's tensor, also
    when the 1-D logits are a column slice of a row of a bigger tensor."""
    g = torch.Generator().manual_seed(vocab + bitmask_1d)
    words = random_words(g, 2, words_per_row(vocab) + 1)
    bitmask = words[0] if bitmask_1d else words
    logits = random_logits(g, 1, vocab, dtype)[0]
    expected = logits_bitmask_reference(logits, words[0])
    logits_bitmask(logits, bitmask)
    assert logits.shape == (vocab,)
    assert torch.equal(bits(logits), bits(expected))

    parent = random_logits(g, 2, vocab, dtype, pad=5)
    before = parent.clone()
    row = parent[1, 2:2 + vocab]
    expected = logits_bitmask_reference(row, words[0])
    logits_bitmask(row, bitmask, torch.ones(1, dtype=torch.int32))
    assert torch.equal(bits(parent[1, 2:2 + vocab]), bits(expected))
    assert torch.equal(bits(parent[0]), bits(before[0]))
    logits_bitmask(parent[0, 2:2 + vocab], bitmask, torch.zeros(1, dtype=torch.int32))
    assert torch.equal(bits(parent[0]), bits(before[0])), "an inactive single row changed"


# ---- argument errors ---------------------------------------------------------------------


def _args(**over):
    args = dict(logits=torch.zeros(4, 100), bitmask=torch.zeros(2, 4, dtype=torch.int32),
                indices=torch.tensor([3, 1]))
    args.update(over)
    return args


BAD_ARGS = {
    "float_indices": (_args(indices=torch.tensor([3.0, 1.0])), "indices", "int32 or int64"),
    "bool_indices": (_args(indices=torch.tensor([True, False])), "indices", "int32 or int64"),
    "int16_indices": (_args(indices=torch.tensor([3, 1], dtype=torch.int16)), "indices",
                      "int32 or int64"),
    "2d_indices": (_args(indices=torch.tensor([[3, 1]])), "indices", "1-D"),
    "float_in_list": (_args(indices=[3, 1.0]), "indices", "must hold ints"),
    "bool_in_list": (_args(indices=[True, 1]), "indices", "must hold ints"),
    "not_a_sequence": (_args(indices=3), "indices", "sequence of ints"),
    "huge_in_list": (_args(indices=[2**70, 1]), "indices", "int64"),
    "index_too_big": (_args(indices=torch.tensor([4, 1])), "indices", "entry 0 is 4"),
    "index_negative": (_args(indices=[3, -1]), "indices", "entry 1 is -1"),
    "duplicate": (_args(indices=[1, 1]), "indices", "row 1 twice"),
    "duplicate_far": (_args(bitmask=torch.zeros(3, 4, dtype=torch.int32), indices=[0, 2, 0]),
                      "indices", "entries 0 and 2"),
    "bitmask_rows_more": (_args(bitmask=torch.zeros(4, 4, dtype=torch.int32)), "bitmask",
                          "bitmask[indices]"),
    "bitmask_rows_fewer": (_args(bitmask=torch.zeros(1, 4, dtype=torch.int32)), "bitmask",
                           "indices has 2 entries"),
    "empty_indices_bitmask_rows": (_args(indices=[]), "bitmask", "indices has 0 entries"),
    "token_mask_short": (_args(token_mask=torch.ones(1, dtype=torch.int32)), "token_mask",
                         ">= 2 entries"),
    "indices_device": (_args(indices=torch.tensor([3, 1], device="meta")), "indices", "meta"),
    "indices_with_1d_logits": (_args(logits=torch.zeros(100), indices=[0]), "indices", "1-D"),
    "1d_logits_2d_bitmask_rows": (_args(logits=torch.zeros(100), indices=None,
                                        bitmask=torch.zeros(0, 4, dtype=torch.int32)),
                                  "bitmask", "fewer than logits' 1"),
    "1d_logits_narrow_bitmask": (_args(logits=torch.zeros(100), indices=None,
                                       bitmask=torch.zeros(3, dtype=torch.int32)),
                                 "bitmask", "words per row"),
    "1d_bitmask_2d_logits": (_args(indices=None, bitmask=torch.zeros(4, dtype=torch.int32)),
                             "bitmask", "2-D"),
    "3d_logits": (_args(logits=torch.zeros(1, 4, 100), indices=None), "logits", "2-D"),
    "0d_logits": (_args(logits=torch.zeros(()), indices=None), "logits", "2-D"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_argument_raises_named_error(case):
    """Each bad indices / 1-D argument raises TensorArgError (a ValueError) naming the argument
    and what was wrong; the logits are left untouched."""
    args, name, detail = BAD_ARGS[case]
    before = args["logits"].clone()
    with pytest.raises(TensorArgError) as e:
        logits_bitmask(**args)
    assert isinstance(e.value, ValueError)
    assert name in str(e.value) and detail in str(e.value), str(e.value)
    assert torch.equal(args["logits"], before)


# ---- the registered op -------------------------------------------------------------------


def test_registered_op_takes_indices_and_compiles():
    """The op's schema has an optional trailing indices argument (existing 5-argument calls
    still work), and a function masking chosen rows compiles with fullgraph=True to the eager
    result (aot_eager: functionalisation through the fake kernel)."""
    schema = torch.ops.capgraph.logits_bitmask.default._schema
    assert schema.arguments[-1].name == "indices"
    g = torch.Generator().manual_seed(43)
    logits = random_logits(g, 5, 200, torch.float32).nan_to_num(0.0, 1e4, -1e4)
    bitmask = random_words(g, 2, words_per_row(200))
    bitmask[:, 0] = -1  # every row keeps a token
    indices = torch.tensor([4, 1])
    torch.ops.capgraph.logits_bitmask(logits[:2].clone(), bitmask, None, None, 0)

    def step(logits, bitmask, indices):
        logits = logits * 2.0
        logits_bitmask(logits, bitmask, indices=indices)
        return logits.softmax(-1)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(logits, bitmask, indices), step(logits, bitmask, indices))
