"""The logits_bitmask op: bit-exact semantics, argument errors, xgrammar layout, tracing."""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import bits, random_d2t
from capgraph import TensorArgError
from capgraph.bitmask import vocab_shard, words_per_row
from capgraph.ops import logits_bitmask, logits_bitmask_reference
from capgraph.ops import torch_impl

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["contiguous", "col_slice", "row_step"]

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True, params=["native", "torch"])
def cpu_impl(request, monkeypatch):
    """Every test runs with both CPU implementations: the one-pass C++ mask
    (csrc/cpu_mask.cc, used where it builds) and the torch code (the fallback, and the CUDA
    fallback's code)."""
    from capgraph.ops import cpu_mask

    if request.param == "native":
        reason = cpu_mask.unavailable_reason()
        if reason is not None:
            pytest.skip(f"C++ CPU mask unavailable: {reason}")
        assert torch_impl.cpu_apply() is not None
    else:
        monkeypatch.setattr(torch_impl, "cpu_apply", lambda: None)
    return request.param


def make_logits(g, rows, width, dtype, layout):
    """(parent, idx): parent[idx] is [rows, width] inside the parent; inf/-inf/nan sprinkled."""
    if layout == "contiguous":
        parent = torch.randn(rows, width, generator=g)
        idx = (slice(None), slice(None))
    elif layout == "col_slice":
        parent = torch.randn(rows, width + 7, generator=g)
        idx = (slice(None), slice(3, 3 + width))
    else:
        parent = torch.randn(2 * rows, width, generator=g)
        idx = (slice(None, None, 2), slice(None))
    flat = parent.view(-1)
    for value in (float("inf"), float("-inf"), float("nan")):
        flat[torch.randint(flat.numel(), (max(1, flat.numel() // 50),), generator=g)] = value
    parent = parent.to(dtype)
    return parent, idx


def random_words(g, rows, words):
    """A bitmask [rows, words] as a slice of a wider, taller buffer (explicit row stride)."""
    buf = torch.randint(-2**31, 2**31 - 1, (rows + 2, words + 5), generator=g, dtype=torch.int32)
    # mix in dense and empty words so that all-allowed / all-masked runs occur
    buf[:, ::3] = -1
    buf[:, 1::5] = 0
    return buf[:, 2:2 + words]


def check_against_reference(parent, idx, bitmask, token_mask=None, d2t=None, col_offset=0):
    """Run the op on parent[idx] and pin every property of the result."""
    view = parent[idx]
    before = parent.clone()
    expected = logits_bitmask_reference(view, bitmask, token_mask, d2t, col_offset=col_offset)
    ref_masked = torch.isneginf(logits_bitmask_reference(
        torch.zeros(view.shape), bitmask, token_mask, d2t, col_offset=col_offset))

    logits_bitmask(view, bitmask, token_mask, d2t, col_offset=col_offset)

    assert torch.equal(bits(view), bits(expected)), "differs from the brute-force reference"
    assert torch.isneginf(view[ref_masked]).all(), "a masked entry is not exactly -inf"
    assert torch.equal(bits(view)[~ref_masked], bits(before[idx])[~ref_masked]), \
        "an allowed entry changed"
    if token_mask is not None:
        for r in (token_mask[:view.shape[0]] == 0).nonzero().flatten().tolist():
            assert torch.equal(bits(view[r]), bits(before[idx][r])), f"inactive row {r} changed"
    outside = parent.clone()
    outside[idx] = before[idx]
    assert torch.equal(bits(outside), bits(before)), "an element outside the view changed"


MODES = ["plain", "token_mask+offset", "d2t", "d2t+token_mask+offset"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vocab", [31, 33, 1000, 1001])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, layout, vocab, mode):
    """Bit-exact against the reference for every dtype, strided layout, V not a multiple of
    32, random token_mask, non-word-aligned col_offset and a random non-monotone d2t; masked
    entries are -inf, allowed and inactive-row entries and the rest of the parent are
    untouched, bitmask rows past the logits are ignored."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{layout}{vocab}{mode}".encode()))
    rows = 5
    use_tm = "token_mask" in mode
    col_offset = 13 if "offset" in mode else 0
    token_mask = torch.tensor([1, 0, 1, 1, 0, 1, 0], dtype=torch.int32) if use_tm else None
    if "d2t" in mode:
        draft = max(vocab // 2, 20)
        width = draft - col_offset
        d2t = random_d2t(g, draft, vocab + 40)
        bitmask = random_words(g, rows, words_per_row(vocab + 40))
    else:
        width = vocab - col_offset if vocab > col_offset else vocab
        col_offset = col_offset if vocab > col_offset else 0
        d2t = None
        bitmask = random_words(g, rows, words_per_row(col_offset + width))
    parent, idx = make_logits(g, rows, width, dtype, layout)
    check_against_reference(parent, idx, bitmask, token_mask, d2t, col_offset)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_vocab_128001(dtype):
    """V=128001 (one token in the last word, garbage padding bits): bit-exact, padding ignored;
    a column slice of a wider tensor with a token mask and a non-aligned col_offset."""
    g = torch.Generator().manual_seed(7)
    v, col_offset = 128001, 5
    bitmask = random_words(g, 2, words_per_row(v))
    parent, idx = make_logits(g, 2, v - col_offset, dtype, "col_slice")
    check_against_reference(parent, idx, bitmask, torch.tensor([0, 1], dtype=torch.int32),
                            col_offset=col_offset)


@pytest.mark.parametrize("pattern", ["none", "all", "alternate", "first", "last", "cluster"])
def test_row_blocks_with_token_mask(monkeypatch, pattern):
    """With blocks of a few rows (CPU skips blocks with no active row and trims the rest), any
    token-mask pattern still gives the reference result."""
    monkeypatch.setattr(torch_impl, "_BLOCK_ELEMENTS", 300)  # 3 rows of 100 columns
    g = torch.Generator().manual_seed(3)
    rows = 20
    tm = {"none": [0] * rows, "all": [1] * rows, "alternate": [r % 2 for r in range(rows)],
          "first": [1] + [0] * (rows - 1), "last": [0] * (rows - 1) + [1],
          "cluster": [1 if 4 <= r < 11 else 0 for r in range(rows)]}[pattern]
    bitmask = random_words(g, rows, words_per_row(100))
    parent, idx = make_logits(g, rows, 100, torch.float32, "row_step")
    check_against_reference(parent, idx, bitmask, torch.tensor(tm, dtype=torch.int32))
    d2t = random_d2t(g, 100, 150)
    parent, idx = make_logits(g, rows, 100, torch.bfloat16, "col_slice")
    check_against_reference(parent, idx, random_words(g, rows, words_per_row(150)),
                            torch.tensor(tm, dtype=torch.int32), d2t)


@pytest.mark.parametrize("pattern", ["alternate", "none", "first"])
def test_sync_free_token_mask_path(monkeypatch, pattern):
    """The path used off CPU (token mask never read on the host: every block is processed and
    inactive rows get an all-allowed keep) gives the same result, forced here on CPU."""
    monkeypatch.setattr(torch_impl, "_host_readable", lambda token_mask: None)
    monkeypatch.setattr(torch_impl, "_BLOCK_ELEMENTS", 300)
    g = torch.Generator().manual_seed(4)
    rows = 9
    tm = {"alternate": [r % 2 for r in range(rows)], "none": [0] * rows,
          "first": [1] + [0] * (rows - 1)}[pattern]
    token_mask = torch.tensor(tm, dtype=torch.int32)
    parent, idx = make_logits(g, rows, 100, torch.float16, "col_slice")
    check_against_reference(parent, idx, random_words(g, rows, words_per_row(120)), token_mask,
                            col_offset=20)
    parent, idx = make_logits(g, rows, 100, torch.float32, "row_step")
    check_against_reference(parent, idx, random_words(g, rows, words_per_row(150)), token_mask,
                            random_d2t(g, 100, 150))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 200), col_offset=st.integers(0, 70),
       dtype=st.sampled_from(DTYPES), layout=st.sampled_from(LAYOUTS),
       use_tm=st.booleans(), use_d2t=st.booleans(), extra_words=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
def test_property_random_shapes(rows, width, col_offset, dtype, layout, use_tm, use_d2t,
                                extra_words, seed):
    """Any shape, offset, layout and option combination matches the reference bit for bit."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.randint(0, 2, (rows + 1,), generator=g, dtype=torch.int32) \
        if use_tm else None
    d2t = None
    if use_d2t:
        target = col_offset + width + 10
        d2t = random_d2t(g, col_offset + width, target)
        words = words_per_row(target) + extra_words
    else:
        words = words_per_row(col_offset + width) + extra_words
    parent, idx = make_logits(g, rows, width, dtype, layout)
    check_against_reference(parent, idx, random_words(g, rows, words), token_mask, d2t,
                            col_offset)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_masked_row_is_true_neg_inf(dtype):
    """A zero bitmask turns every entry, finite, inf or NaN, into exactly -inf."""
    logits = torch.tensor([[1.0, float("nan"), float("inf"), -float("inf"), -0.0, 3e4]]).to(dtype)
    logits_bitmask(logits, torch.zeros(1, 1, dtype=torch.int32))
    assert torch.isneginf(logits).all()
    assert torch.equal(bits(logits), bits(torch.full_like(logits, float("-inf"))))


def test_empty_logits_are_a_no_op():
    """Zero rows or zero columns do nothing and raise nothing."""
    logits_bitmask(torch.empty(0, 64), torch.zeros(0, 2, dtype=torch.int32))
    logits_bitmask(torch.empty(3, 0), torch.zeros(3, 0, dtype=torch.int32))


@pytest.mark.parametrize("vocab,tp_size", [(66, 3), (131072, 4), (96 * 7, 7)])
def test_tp_shards_compose(vocab, tp_size):
    """Masking each TP shard with the full bitmask row and col_offset=shard.start, or with the
    shard's word slice and col_offset=shard.bit_offset, equals masking the full logits."""
    g = torch.Generator().manual_seed(vocab)
    full, _ = make_logits(g, 3, vocab, torch.float32, "contiguous")
    bitmask = random_words(g, 3, words_per_row(vocab))
    expected = full.clone()
    logits_bitmask(expected, bitmask)
    for use_slice in (False, True):
        got = full.clone()
        for r in range(tp_size):
            s = vocab_shard(vocab, tp_size, r)
            shard = got[:, s.start:s.end]
            if use_slice:
                logits_bitmask(shard, bitmask[:, s.word_start:s.word_end],
                               col_offset=s.bit_offset)
            else:
                logits_bitmask(shard, bitmask, col_offset=s.col_offset)
        assert torch.equal(bits(got), bits(expected))


def test_tp_shards_compose_with_d2t():
    """Draft logits sharded over the draft vocab: each shard with the FULL d2t table, the FULL
    target bitmask row and col_offset = its first draft column equals the unsharded result
    (the coordinate mix-up of the reference design cannot happen)."""
    g = torch.Generator().manual_seed(11)
    draft, target, tp_size = 96, 1000, 3
    d2t = random_d2t(g, draft, target)
    bitmask = random_words(g, 4, words_per_row(target))
    full, _ = make_logits(g, 4, draft, torch.bfloat16, "contiguous")
    expected = full.clone()
    logits_bitmask(expected, bitmask, d2t=d2t)
    got = full.clone()
    for r in range(tp_size):
        s = vocab_shard(draft, tp_size, r)
        logits_bitmask(got[:, s.start:s.end], bitmask, d2t=d2t, col_offset=s.col_offset)
    assert torch.equal(bits(got), bits(expected))


# ---- xgrammar's layout -------------------------------------------------------------------


def test_bit_layout_is_xgrammars_fill():
    """A bitmask filled by xgrammar's own matcher (tiny raw vocab, grammar allowing tokens
    0, 31, 32 and 68) keeps exactly those columns: bit j of word w is token 32*w + j."""
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(ord("!") + i) for i in range(70)]  # "!" is 0, "@" 31, "A" 32, "e" 68
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[69])
    grammar = xgr.GrammarCompiler(info).compile_grammar('root ::= "!" | "@" | "A" | "e"')
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, 70)
    logits_bitmask(logits, bitmask)
    assert (~torch.isneginf(logits[0])).nonzero().flatten().tolist() == [0, 31, 32, 68]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_xgrammar_apply(dtype):
    """On the same random inputs, the result equals xgrammar.apply_token_bitmask_inplace's
    bit for bit (its token_mask counterpart: indices of the active rows)."""
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(5)
    v = 1001
    logits, _ = make_logits(g, 6, v, dtype, "contiguous")
    bitmask = random_words(g, 6, words_per_row(v)).contiguous()[:6]
    token_mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.int32)
    ours, theirs = logits.clone(), logits.clone()
    logits_bitmask(ours, bitmask, token_mask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=v,
                                    indices=token_mask.nonzero().flatten().tolist())
    assert torch.equal(bits(ours), bits(theirs))


# ---- argument errors ---------------------------------------------------------------------


def _args(**over):
    args = dict(logits=torch.zeros(2, 100), bitmask=torch.zeros(2, 4, dtype=torch.int32),
                token_mask=None, d2t=None, col_offset=0)
    args.update(over)
    return args


BAD_ARGS = {
    "int_logits": (_args(logits=torch.zeros(2, 100, dtype=torch.int32)), "logits"),
    "float64_logits": (_args(logits=torch.zeros(2, 100, dtype=torch.float64)), "logits"),
    "3d_logits": (_args(logits=torch.zeros(1, 2, 100)), "logits"),
    "column_stride": (_args(logits=torch.zeros(100, 2).t()), "logits"),
    "int64_bitmask": (_args(bitmask=torch.zeros(2, 4, dtype=torch.int64)), "bitmask"),
    "uint8_bitmask": (_args(bitmask=torch.zeros(2, 16, dtype=torch.uint8)), "bitmask"),
    "1d_bitmask": (_args(bitmask=torch.zeros(4, dtype=torch.int32)), "bitmask"),
    "bitmask_rows": (_args(bitmask=torch.zeros(1, 4, dtype=torch.int32)), "bitmask"),
    "bitmask_narrow": (_args(bitmask=torch.zeros(2, 3, dtype=torch.int32)), "bitmask"),
    "bitmask_narrow_offset": (_args(col_offset=40), "bitmask"),
    "bitmask_col_stride": (_args(bitmask=torch.zeros(8, 2, dtype=torch.int32).t()), "bitmask"),
    "token_mask_dtype": (_args(token_mask=torch.ones(2, dtype=torch.int64)), "token_mask"),
    "token_mask_short": (_args(token_mask=torch.ones(1, dtype=torch.int32)), "token_mask"),
    "token_mask_2d": (_args(token_mask=torch.ones(2, 1, dtype=torch.int32)), "token_mask"),
    "d2t_dtype": (_args(d2t=torch.zeros(100, dtype=torch.int64)), "d2t"),
    "d2t_short": (_args(d2t=torch.zeros(99, dtype=torch.int32)), "d2t"),
    "d2t_short_offset": (_args(d2t=torch.zeros(100, dtype=torch.int32), col_offset=1), "d2t"),
    "d2t_2d": (_args(d2t=torch.zeros(1, 100, dtype=torch.int32)), "d2t"),
    "d2t_target_range": (_args(d2t=torch.full((100,), 40, dtype=torch.int32)), "d2t"),
    "d2t_negative_target": (_args(d2t=torch.full((100,), -1, dtype=torch.int32)), "d2t"),
    "negative_offset": (_args(col_offset=-1), "col_offset"),
    "bitmask_device": (_args(bitmask=torch.zeros(2, 4, dtype=torch.int32, device="meta")),
                       "bitmask"),
    "token_mask_device": (_args(token_mask=torch.ones(2, dtype=torch.int32, device="meta")),
                          "token_mask"),
    "d2t_device": (_args(d2t=torch.zeros(100, dtype=torch.int32, device="meta")), "d2t"),
    "float_offset": (_args(col_offset=1.5), "col_offset"),
    "bool_offset": (_args(col_offset=True), "col_offset"),
    "none_offset": (_args(col_offset=None), "col_offset"),
    "list_token_mask": (_args(token_mask=[1, 1]), "token_mask"),
    "list_d2t": (_args(d2t=[0] * 100), "d2t"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_argument_raises_named_error(case):
    """Each bad argument raises TensorArgError (a ValueError) whose message names it; the
    logits are left untouched."""
    args, name = BAD_ARGS[case]
    before = args["logits"].clone()
    with pytest.raises(TensorArgError) as e:
        logits_bitmask(**args)
    assert torch.equal(args["logits"], before)
    assert isinstance(e.value, ValueError)
    assert name in str(e.value), str(e.value)


def _bad_target_table(draft: int, words: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(good d2t, the same with 5 targets outside the row's 32*words bits, their draft ids):
    one past the row, far past it, -1, int32's minimum, past int32 (a sum that wraps)."""
    good = random_d2t(torch.Generator().manual_seed(draft), draft, 32 * words)
    bad = good.clone()
    ids = [3, 17, 40, 41, draft - 1]
    bad[3] = 32 * words - 3  # target 32*words: one past the row
    bad[17] = 10**9
    bad[40] = -41  # target -1
    bad[41] = -2**31
    bad[draft - 1] = 2**31 - 1  # target past int32
    return good, bad, ids


def test_torch_code_masks_d2t_targets_outside_the_row():
    """The torch code (the op's CUDA fallback, where no check reads the table: a check would
    synchronise) masks a column whose d2t target lies outside the bitmask row instead of
    indexing outside it; every other column equals the reference, and the reference masks
    those columns too. On CPU the op itself refuses such a table (TensorArgError)."""
    from capgraph.ops.torch_impl import apply_logits_bitmask_torch_

    draft, words, rows = 64, 4, 3
    good, bad, ids = _bad_target_table(draft, words)
    g = torch.Generator().manual_seed(5)
    bitmask = torch.full((rows, words), -1, dtype=torch.int32)  # all allowed
    bitmask[1] = torch.randint(-2**31, 2**31 - 1, (words,), generator=g, dtype=torch.int32)
    logits = torch.randn(rows, draft, generator=g)
    got = logits.clone()
    apply_logits_bitmask_torch_(got, bitmask, None, bad, 0, bound_targets=True)  # CUDA's way
    expected = logits_bitmask_reference(logits, bitmask, None, good)
    expected[:, ids] = float("-inf")
    assert torch.equal(bits(got), bits(expected))
    assert torch.equal(bits(logits_bitmask_reference(logits, bitmask, None, bad)),
                       bits(expected))
    with pytest.raises(TensorArgError, match="draft id 3"):
        logits_bitmask(logits.clone(), bitmask, None, bad)


# ---- registration and tracing ------------------------------------------------------------


def test_registered_op_schema():
    """The op is torch.ops.capgraph.logits_bitmask and its schema marks logits as mutated."""
    schema = torch.ops.capgraph.logits_bitmask.default._schema
    assert schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
    assert len(schema.returns) == 0


def test_fake_tensor_mode():
    """Under FakeTensorMode the op runs its fake kernel (no data read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        logits = torch.empty(4, 100)
        torch.ops.capgraph.logits_bitmask(logits, torch.empty(4, 4, dtype=torch.int32),
                                          torch.empty(4, dtype=torch.int32), None, 0)


def test_torch_compile_fullgraph():
    """A function calling logits_bitmask compiles with fullgraph=True and gives the eager
    result, on an intermediate and on a mutated input view. Backend aot_eager (dynamo plus
    functionalisation through the fake kernel): inductor also works but its C++ build takes
    ~15 s on 2 cores."""
    g = torch.Generator().manual_seed(1)

    def step(logits, bitmask, token_mask):
        logits = logits * 2.0
        logits_bitmask(logits, bitmask, token_mask, col_offset=3)
        return logits.softmax(-1)

    def in_place(logits, bitmask):
        logits_bitmask(logits[:, 1:], bitmask, col_offset=1)
        return logits.argmax(-1)

    logits = torch.randn(4, 200, generator=g)
    bitmask = random_words(g, 4, words_per_row(203))
    bitmask[:, 0] = -1  # every row keeps a token
    token_mask = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(logits, bitmask, token_mask), step(logits, bitmask, token_mask))

    ours, eager = logits.clone(), logits.clone()
    compiled = torch.compile(in_place, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(ours, bitmask), in_place(eager, bitmask))
    assert torch.equal(bits(ours), bits(eager))


# ---- CUDA (skipped without a GPU) --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_reference_without_sync(dtype):
    """On CUDA the op gives the reference result, never synchronises with the host, and
    replays correctly from a captured CUDA graph."""
    g = torch.Generator().manual_seed(2)
    rows, draft, target, col_offset = 6, 300, 1001, 7
    parent, idx = make_logits(g, rows, draft - col_offset, dtype, "col_slice")
    bitmask = random_words(g, rows, words_per_row(target))
    token_mask = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.int32)
    d2t = random_d2t(g, draft, target)
    for use_d2t in (False, True):
        args = (bitmask, token_mask, d2t if use_d2t else None)
        offset = col_offset if use_d2t else 2
        expected = logits_bitmask_reference(parent[idx], *args, col_offset=offset)
        dev = [parent.cuda()] + [None if a is None else a.cuda() for a in args]
        logits_bitmask(dev[0][idx], *dev[1:], col_offset=offset)  # warm-up (caches)
        dev[0] = parent.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits_bitmask(dev[0][idx], *dev[1:], col_offset=offset)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(bits(dev[0][idx].cpu()), bits(expected))

        static = parent.cuda()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits_bitmask(static[idx], *dev[1:], col_offset=offset)
        static.copy_(parent.cuda())
        graph.replay()
        assert torch.equal(bits(static[idx].cpu()), bits(expected))
