"""The NVRTC-compiled CUDA kernel of logits_bitmask on a GPU: bit-exact against the CPU
implementation over batch sizes, vocabularies, dtypes and layouts, with token_mask, d2t and
non-word-aligned col_offset; sync-free and allocation-free; captured in a CUDA graph and replayed
with new inputs. Skipped where there is no CUDA device; tools/gpu_check.sh runs it."""

from __future__ import annotations

import pytest
import torch

from conftest import bits, random_d2t
from capgraph.bitmask import words_per_row
from capgraph.ops import logits_bitmask
from capgraph.ops import op as op_module

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_CUDA,
                                 reason="no CUDA device: torch.cuda.is_available() is False")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BATCHES = [1, 64, 512]
VOCABS = [32000, 128000, 128001, 131072, 151936]


@pytest.fixture(scope="module", autouse=True)
def cuda_kernel():
    """The dedicated kernel must load on a GPU machine (a missing NVRTC is a failure here)."""
    from capgraph.ops.cuda import load_kernel, unavailable_reason
    kernel = load_kernel()
    assert kernel is not None, f"CUDA kernel did not load: {unavailable_reason()}"
    return kernel


@pytest.fixture(autouse=True)
def no_torch_fallback(monkeypatch):
    """Every CUDA call in these tests must run the NVRTC kernel, not the pure-torch path (which
    still computes the CPU expectations)."""
    pure_torch = op_module.apply_logits_bitmask_

    def cpu_only(logits, *args):
        assert logits.device.type == "cpu", "the pure-torch fallback ran on CUDA"
        return pure_torch(logits, *args)
    monkeypatch.setattr(op_module, "apply_logits_bitmask_", cpu_only)


def random_logits(gen, rows, width, dtype, pad=0):
    """[rows, width + pad] on the GPU with inf/-inf/nan sprinkled."""
    t = torch.randn(rows, width + pad, generator=gen, device="cuda")
    flat = t.view(-1)
    for value in (float("inf"), float("-inf"), float("nan")):
        idx = torch.randint(flat.numel(), (max(1, flat.numel() // 97),), generator=gen,
                            device="cuda")
        flat[idx] = value
    return t.to(dtype)


def random_bitmask(gen, rows, words):
    """[rows, words] int32 on the GPU, a column slice (explicit row stride), with all-ones,
    all-zero and random words."""
    buf = torch.randint(-2**31, 2**31 - 1, (rows, words + 2), generator=gen, dtype=torch.int32,
                        device="cuda")
    buf[:, ::3] = -1
    buf[:, 1::5] = 0
    return buf[:, 1:1 + words]


def expect_cpu(logits, bitmask, token_mask=None, d2t=None, col_offset=0):
    """The CPU implementation's result (itself pinned to the brute-force reference)."""
    out = logits.cpu()
    cpu = [None if t is None else t.cpu() for t in (bitmask, token_mask, d2t)]
    logits_bitmask(out, *cpu, col_offset=col_offset)
    return out


def check(logits, *args, **kwargs):
    expected = expect_cpu(logits, *args, **kwargs)
    logits_bitmask(logits, *args, **kwargs)
    assert torch.equal(bits(logits.cpu()), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("batch", BATCHES)
def test_matches_cpu(batch, vocab, dtype):
    """Contiguous logits (widest packed path the width allows) and a misaligned strided view
    with a token mask: bit-exact with the CPU implementation."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + vocab)
    bitmask = random_bitmask(gen, batch, words_per_row(vocab))
    check(random_logits(gen, batch, vocab, dtype), bitmask)

    parent = random_logits(gen, batch, vocab, dtype, pad=3)
    token_mask = torch.randint(0, 2, (batch,), generator=gen, dtype=torch.int32, device="cuda")
    view = parent[:, 1:1 + vocab]
    before = parent.clone()
    check(view, bitmask, token_mask)
    assert torch.equal(bits(parent[:, 0]), bits(before[:, 0]))
    assert torch.equal(bits(parent[:, 1 + vocab:]), bits(before[:, 1 + vocab:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [32000, 128000, 151936])
def test_d2t_and_tp_shards(vocab, dtype):
    """A pruned draft vocabulary (V/4, non-monotone d2t), whole and as 2 and 4 TP shards with
    col_offset = shard start in draft coordinates, reads bits of the full target row."""
    gen = torch.Generator(device="cuda").manual_seed(vocab + 1)
    draft, rows = vocab // 4, 64
    d2t = random_d2t(gen, draft, vocab, device="cuda")
    bitmask = random_bitmask(gen, rows, words_per_row(vocab))
    token_mask = torch.randint(0, 2, (rows,), generator=gen, dtype=torch.int32, device="cuda")
    for tp in (1, 2, 4):
        width = draft // tp
        for rank in range(tp):
            check(random_logits(gen, rows, width, dtype), bitmask, token_mask, d2t,
                  col_offset=rank * width)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width,col_offset", [(32000, 37), (64000, 5), (40000, 29),
                                              (16001, 61), (8, 31), (131072 // 3 * 2, 1)])
def test_unaligned_col_offset(width, col_offset, dtype):
    """col_offset not a multiple of 32 (nor of the pack width): packed groups straddle two
    bitmask words."""
    gen = torch.Generator(device="cuda").manual_seed(width + col_offset)
    rows = 33
    bitmask = random_bitmask(gen, rows, words_per_row(col_offset + width) + 1)
    check(random_logits(gen, rows, width, dtype), bitmask, col_offset=col_offset)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab,tp", [(151936, 8), (151936, 16), (32064, 8)])
def test_tp_shards_whose_word_count_does_not_divide_tp(vocab, tp, dtype):
    """Every rank of a vocabulary whose word count ceil(V/32) is not a multiple of tp (Qwen's
    151936 = 4748 words over 8 and 16, Phi-3's 32064 = 1002 words over 8): the shard reads the
    exact-width full row from col_offset = rank * V / tp (mid-word for most ranks) and equals
    its slice of the full-row result, the last rank ending at the row's last bit."""
    gen = torch.Generator(device="cuda").manual_seed(vocab + tp)
    rows = 17
    bitmask = random_bitmask(gen, rows, words_per_row(vocab))
    token_mask = torch.randint(0, 2, (rows,), generator=gen, dtype=torch.int32, device="cuda")
    logits = random_logits(gen, rows, vocab, dtype)
    whole = logits.clone()
    logits_bitmask(whole, bitmask, token_mask)
    assert torch.equal(bits(whole.cpu()), bits(expect_cpu(logits, bitmask, token_mask)))
    width = vocab // tp
    for rank in range(tp):
        shard = logits[:, rank * width:(rank + 1) * width].clone()
        logits_bitmask(shard, bitmask, token_mask, col_offset=rank * width)
        assert torch.equal(bits(shard), bits(whole[:, rank * width:(rank + 1) * width])), rank


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_d2t_targets_outside_the_row_are_masked_not_read(dtype):
    """A d2t whose targets leave the bitmask row (the host reads no table on a GPU): those
    columns become -inf and the words around the row (all ones here, so a stray read would
    allow the column) are never read; every other column equals the CPU result with a good
    table."""
    gen = torch.Generator(device="cuda").manual_seed(97)
    rows, draft, vocab = 9, 8000, 32000
    words = words_per_row(vocab)
    good = random_d2t(gen, draft, vocab, device="cuda")
    bad = good.clone()
    ids = [0, 7, 33, 4000, draft - 1]
    for g, target in zip(ids, [vocab, -1, vocab + 31, -32, 2**31 + 5]):
        bad[g] = max(-2**31, min(2**31 - 1, target - g))
    buffer = torch.full((rows, words + 4), -1, dtype=torch.int32, device="cuda")
    bitmask = buffer[:, 2:2 + words]
    bitmask.copy_(random_bitmask(gen, rows, words))
    logits = random_logits(gen, rows, draft, dtype)
    expected = expect_cpu(logits, bitmask, None, good)
    expected[:, ids] = float("-inf")
    logits_bitmask(logits, bitmask, None, bad)
    assert torch.equal(bits(logits.cpu()), bits(expected))


def test_many_rows_beyond_grid_y():
    """More rows than the 65535 blocks of grid.y: the kernel's row loop covers the rest."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = 70000
    check(random_logits(gen, rows, 40, torch.float16), random_bitmask(gen, rows, 2))


def test_no_sync_no_allocation():
    """A call never synchronises with the host and allocates no device memory."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    logits = random_logits(gen, 8, 1000, torch.bfloat16)
    bitmask = random_bitmask(gen, 8, words_per_row(1250))
    token_mask = torch.ones(8, dtype=torch.int32, device="cuda")
    d2t = random_d2t(gen, 1000, 1250)
    logits_bitmask(logits, bitmask, token_mask, d2t)  # warm-up
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits_bitmask(logits, bitmask, token_mask, d2t)
        logits_bitmask(logits[:, 3:900], bitmask, token_mask, col_offset=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations


def test_graph_capture_and_replay_with_new_inputs():
    """Captured once, replayed three times with new logits, bitmask, token mask and d2t
    contents copied into the static buffers: each replay gives that step's CPU result. The
    capture holds launch variants not launched eagerly before (other shapes, packs)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    rows, vocab, draft = 16, 32000, 8000
    logits_a = torch.empty(rows, vocab, dtype=torch.bfloat16, device="cuda")
    logits_b = torch.empty(rows, 4001, dtype=torch.float32, device="cuda")  # pack 1, offset 9
    logits_c = torch.empty(rows, draft, dtype=torch.float16, device="cuda")  # d2t
    bitmask = torch.empty(rows, words_per_row(vocab), dtype=torch.int32, device="cuda")
    token_mask = torch.empty(rows, dtype=torch.int32, device="cuda")
    d2t = torch.empty(draft, dtype=torch.int32, device="cuda")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits_bitmask(logits_a, bitmask, token_mask)
        logits_bitmask(logits_b, bitmask, token_mask, col_offset=9)
        logits_bitmask(logits_c, bitmask, token_mask, d2t)

    for step in range(3):
        new = {"a": random_logits(gen, rows, vocab, torch.bfloat16),
               "b": random_logits(gen, rows, 4001, torch.float32),
               "c": random_logits(gen, rows, draft, torch.float16)}
        bm = random_bitmask(gen, rows, words_per_row(vocab))
        tm = torch.randint(0, 2, (rows,), generator=gen, dtype=torch.int32, device="cuda")
        tm[step] = 1
        table = random_d2t(gen, draft, vocab)
        expected = {"a": expect_cpu(new["a"], bm, tm),
                    "b": expect_cpu(new["b"], bm, tm, col_offset=9),
                    "c": expect_cpu(new["c"], bm, tm, table)}
        for static, name in ((logits_a, "a"), (logits_b, "b"), (logits_c, "c")):
            static.copy_(new[name])
        bitmask.copy_(bm)
        token_mask.copy_(tm)
        d2t.copy_(table)
        graph.replay()
        torch.cuda.synchronize()
        for static, name in ((logits_a, "a"), (logits_b, "b"), (logits_c, "c")):
            assert torch.equal(bits(static.cpu()), bits(expected[name])), (step, name)


def expect_cpu_rows(logits, bitmask, indices, token_mask=None, d2t=None, col_offset=0):
    """The CPU implementation's result with indices."""
    out = logits.cpu()
    cpu = [None if t is None else t.cpu() for t in (bitmask, token_mask, d2t)]
    logits_bitmask(out, *cpu, col_offset=col_offset, indices=indices.cpu())
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [32000, 128001])
@pytest.mark.parametrize("batch", [1, 64, 512])
def test_indices_match_cpu(batch, vocab, dtype):
    """Indices on the GPU (a random half of the rows, unsorted; int32 at V=32000, int64 at
    V=128001) with a compact bitmask and a token mask over it: bit-exact with the CPU
    implementation, the rows not named untouched; also on a misaligned column slice with a
    d2t table."""
    index_dtype = torch.int32 if vocab == 32000 else torch.int64
    gen = torch.Generator(device="cuda").manual_seed(batch * 3 + vocab)
    chosen = torch.randperm(batch, generator=gen, device="cuda")[:max(1, batch // 2)]
    indices = chosen.to(index_dtype)
    n = indices.numel()
    bitmask = random_bitmask(gen, n, words_per_row(vocab))
    token_mask = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32, device="cuda")
    logits = random_logits(gen, batch, vocab, dtype)
    expected = expect_cpu_rows(logits, bitmask, indices, token_mask)
    logits_bitmask(logits, bitmask, token_mask, indices=indices)
    assert torch.equal(bits(logits.cpu()), bits(expected))

    draft = vocab // 4
    d2t = random_d2t(gen, draft, vocab, device="cuda")
    parent = random_logits(gen, batch, draft, dtype, pad=3)
    view = parent[:, 1:1 + draft - 5]
    expected = expect_cpu_rows(view, bitmask, indices, token_mask, d2t, col_offset=5)
    logits_bitmask(view, bitmask, token_mask, d2t, col_offset=5, indices=indices)
    assert torch.equal(bits(view.cpu()), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_1d_logits_and_empty_indices(dtype):
    """1-D logits (one row, 1-D bitmask) give the CPU result; empty indices change nothing."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    row = random_logits(gen, 1, 128001, dtype)[0]
    words = random_bitmask(gen, 1, words_per_row(128001))[0]
    expected = expect_cpu(row.unsqueeze(0), words.unsqueeze(0))[0]
    logits_bitmask(row, words)
    assert torch.equal(bits(row.cpu()), bits(expected))
    logits = random_logits(gen, 4, 1000, dtype)
    before = logits.clone()
    logits_bitmask(logits, random_bitmask(gen, 0, 32),
                   indices=torch.empty(0, dtype=torch.int64, device="cuda"))
    assert torch.equal(bits(logits), bits(before))


def test_indices_out_of_range_are_skipped():
    """An index outside the logits' rows cannot be checked without a sync; the kernel skips it
    and writes nothing outside the logits (the parent's other rows keep their bits)."""
    gen = torch.Generator(device="cuda").manual_seed(19)
    parent = random_logits(gen, 12, 4096, torch.float32)
    before = parent.clone()
    indices = torch.tensor([6, -1, 8, 2, 1 << 40], device="cuda")
    logits_bitmask(parent[:8], torch.zeros(5, 128, dtype=torch.int32, device="cuda"),
                   indices=indices)
    changed = (bits(parent) != bits(before)).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= {2, 6} and torch.isneginf(parent[[2, 6]]).all()


def test_indices_no_sync_no_allocation_and_graph_replay():
    """With device indices a call neither synchronises nor allocates; captured in a CUDA
    graph, replays with new logits, bitmask, token mask and indices contents give each step's
    CPU result."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    rows, vocab, n = 32, 32000, 12
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device="cuda")
    bitmask = torch.empty(n, words_per_row(vocab), dtype=torch.int32, device="cuda")
    token_mask = torch.ones(n, dtype=torch.int32, device="cuda")
    indices = torch.arange(n, dtype=torch.int32, device="cuda")
    logits.copy_(random_logits(gen, rows, vocab, torch.bfloat16))
    bitmask.copy_(random_bitmask(gen, n, words_per_row(vocab)))
    logits_bitmask(logits, bitmask, token_mask, indices=indices)  # warm-up
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits_bitmask(logits, bitmask, token_mask, indices=indices)
        logits_bitmask(logits[:, 3:900], bitmask, token_mask, col_offset=3, indices=indices)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits_bitmask(logits, bitmask, token_mask, indices=indices)
    for step in range(3):
        new = random_logits(gen, rows, vocab, torch.bfloat16)
        bm = random_bitmask(gen, n, words_per_row(vocab))
        tm = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32, device="cuda")
        chosen = torch.randperm(rows, generator=gen, device="cuda")[:n].to(torch.int32)
        expected = expect_cpu_rows(new, bm, chosen, tm)
        logits.copy_(new)
        bitmask.copy_(bm)
        token_mask.copy_(tm)
        indices.copy_(chosen)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(logits.cpu()), bits(expected)), step
