"""``masked_argmax``: greedy sampling fused with the bitmask. Its CUDA kernel's arithmetic runs
on the host through a C++ emulation of the launch grid (a block's threads one after another,
each merging its own key as a warp of one); the op's checks and its torch path run on CPU; on a
GPU (marker gpu) the kernel itself, eagerly and replayed in a CUDA graph."""

from __future__ import annotations

import ctypes
import re
import zlib
from pathlib import Path

import pytest
import torch

from capgraph.bitmask import words_per_row
from capgraph.errors import TensorArgError
from capgraph.ops import argmax_scratch, logits_bitmask_reference, masked_argmax
from capgraph.ops import cuda as cuda_backend
from capgraph.ops.cuda import ARGMAX_WORDS_PER_BLOCK, argmax_entry_points, plan_argmax
from test_kernel_compile import build_emulation  # (the host emulation's build)

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "csrc" / "logits_bitmask.cu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

_DRIVER = """
typedef void (*EmuArgmax)(const void*, long long, const unsigned*, long long, const int*,
                          long long, long long, long long, long long*, unsigned long long*,
                          unsigned long long*);
extern "C" void emu_argmax(void* kernel, unsigned grid_x, unsigned grid_y, const void* logits,
                           long long logits_stride, const unsigned* bitmask,
                           long long bitmask_stride, const int* token_mask, long long rows,
                           long long mask_rows, long long width, long long* out,
                           unsigned long long* keys, unsigned long long* counts) {
    EmuArgmax k = (EmuArgmax)kernel;
    EMU_GRID(grid_x, grid_y, k(logits, logits_stride, bitmask, bitmask_stride, token_mask, rows,
                               mask_rows, width, out, keys, counts));
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernel source built for the host (g++) with a driver that runs an argmax grid."""
    so = build_emulation(tmp_path_factory, _DRIVER, "argmax_emu")
    so.emu_argmax.restype = None
    so.emu_argmax.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint] + [
        ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong,
        ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def launch(plan):
        kernel = ctypes.cast(getattr(so, plan.kernel), ctypes.c_void_p).value
        so.emu_argmax(kernel, *plan.grid, *plan.args)
    return launch


def _expected(logits, bitmask, token_mask, mask_rows):
    """torch's argmax over the reference mask's rows, then plain argmax past ``mask_rows``."""
    rows = logits.shape[0]
    head = logits_bitmask_reference(logits[:mask_rows], bitmask[:mask_rows],
                                    None if token_mask is None else token_mask[:mask_rows])
    picks = head.argmax(-1).tolist() if mask_rows else []
    if mask_rows < rows:
        picks += logits[mask_rows:].argmax(-1).tolist()
    return picks


def _case(g, rows, width, dtype, layout, allowed):
    """(logits view, bitmask view): specials sprinkled (NaN, +-inf, -0, repeated maxima);
    ``allowed`` is the share of allowed bits, or "random"."""
    extra = {"contiguous": 0, "shift": 3, "row_step": 0}[layout]
    parent = torch.randn(rows * (2 if layout == "row_step" else 1), width + extra, generator=g)
    flat = parent.view(-1)
    for value in (float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 2.5):
        flat[torch.randint(flat.numel(), (max(1, flat.numel() // 200),), generator=g)] = value
    parent = parent.to(dtype)
    view = parent[::2] if layout == "row_step" else parent[:, extra:extra + width]
    words = words_per_row(width)
    store = torch.zeros(rows, words + 2, dtype=torch.int32)
    if allowed == "random":
        store[:] = torch.randint(-2**31, 2**31 - 1, store.shape, generator=g, dtype=torch.int32)
    else:
        keep = torch.rand(rows, words * 32, generator=g) < allowed
        weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
        packed = (keep.view(rows, words, 32).long() * weights).sum(-1)
        store[:, 1:1 + words] = torch.where(packed >= 2**31, packed - 2**32, packed).int()
        return view, store[:, 1:1 + words]
    return view, store[:, 1:1 + words]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "shift", "row_step"])
def test_emulated_argmax_matches_torch(emulated, dtype, layout):
    """The kernel's result is torch's argmax of the reference mask's rows, for every dtype,
    strided and offset logits, widths that end inside a word and inside a block, random, 2%-
    and 98%-allowed bitmasks, a token mask that skips rows, and rows past mask_rows; the
    scratch is zero again after each launch."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{layout}".encode()))
    for rows, width, allowed, mask_rows in [(3, 100, "random", 3), (4, 4096, 0.02, 3),
                                            (2, 4100, 0.98, 2), (3, 9000, "random", 1),
                                            (2, 32 * ARGMAX_WORDS_PER_BLOCK + 5, 0.02, 2)]:
        logits, bitmask = _case(g, rows, width, dtype, layout, allowed)
        token_mask = torch.ones(rows, dtype=torch.int32)
        token_mask[rows // 2] = 0
        out = torch.full((rows,), -7, dtype=torch.int64)
        scratch = argmax_scratch(rows, "cpu")
        plan = plan_argmax(logits, bitmask, token_mask, mask_rows, out, scratch)
        emulated(plan)
        assert out.tolist() == _expected(logits, bitmask, token_mask, mask_rows), (
            rows, width, allowed, mask_rows, plan.grid)
        assert not scratch.any(), "the launch left its scratch dirty"


def test_emulated_argmax_orders_values_as_torch(emulated):
    """Ties go to the lowest column, -0 equals +0, NaN beats +inf, and a row with nothing
    allowed (or every allowed entry -inf) gives column 0, in each dtype."""
    rows = [
        ([1.0, 3.0, 3.0, 2.0], [1, 1, 1, 1]),            # tie: the first 3.0
        ([-0.0, 0.0, -1.0, -0.0], [1, 1, 1, 1]),         # -0 == +0: column 0
        ([-1.0, 0.0, -0.0, -2.0], [1, 0, 1, 1]),         # column 1 masked: -0 at 2
        ([1.0, float("inf"), float("nan"), float("nan")], [1, 1, 1, 1]),  # the first NaN
        ([5.0, 1.0, 2.0, 9.0], [0, 0, 0, 0]),            # nothing allowed: column 0
        ([float("-inf"), 7.0, float("-inf"), 1.0], [0, 0, 1, 0]),  # allowed -inf only: 0
        ([7.0, 8.0, 9.0, 6.0], [1, 1, 0, 1]),            # the largest is masked
        ([-3.0, -2.0, -5.0, -4.0], [1, 0, 1, 1]),        # all negative: -3 at 0
    ]
    width = 40  # (columns past 4 are -inf and masked)
    for dtype in DTYPES:
        logits = torch.full((len(rows), width), float("-inf"))
        bitmask = torch.zeros(len(rows), 2, dtype=torch.int32)
        for r, (values, allowed) in enumerate(rows):
            logits[r, :4] = torch.tensor(values)
            bitmask[r, 0] = sum(bit << i for i, bit in enumerate(allowed))
        logits = logits.to(dtype)
        out = torch.empty(len(rows), dtype=torch.int64)
        scratch = argmax_scratch(len(rows), "cpu")  # (held: the plan holds its address only)
        emulated(plan_argmax(logits, bitmask, None, len(rows), out, scratch))
        assert out.tolist() == _expected(logits, bitmask, None, len(rows)) == [
            1, 0, 2, 2, 0, 0, 1, 0], dtype


def test_emulated_argmax_orders_every_fp16_value_as_torch(emulated):
    """fp16 widened inside the kernel orders as torch's fp16 for every finite value,
    subnormals and both signs included: each row holds 32 consecutive fp16 values (windows
    overlapping by half) in a shuffled order, and the kernel finds the largest."""
    g = torch.Generator().manual_seed(23)
    starts = torch.arange(0, 0x7C00 - 32, 16)
    patterns = starts[:, None] + torch.arange(32)[None, :]
    positive = patterns.to(torch.int16).view(torch.float16)
    rows = torch.cat([positive, -positive])
    order = torch.argsort(torch.rand(rows.shape, generator=g), dim=1)
    logits = torch.gather(rows, 1, order).contiguous()
    n = logits.shape[0]
    bitmask = torch.full((n, 1), -1, dtype=torch.int32)
    out = torch.empty(n, dtype=torch.int64)
    scratch = argmax_scratch(n, "cpu")
    emulated(plan_argmax(logits, bitmask, None, n, out, scratch))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_emulated_argmax_rows_beyond_grid_y(emulated, monkeypatch):
    """More rows than grid.y: the row loop covers the rest (grid.y capped at 3 here)."""
    monkeypatch.setattr(cuda_backend, "_MAX_GRID_Y", 3)
    g = torch.Generator().manual_seed(5)
    logits, bitmask = _case(g, 11, 700, torch.float32, "contiguous", "random")
    out = torch.empty(11, dtype=torch.int64)
    scratch = argmax_scratch(11, "cpu")
    plan = plan_argmax(logits, bitmask, None, 9, out, scratch)
    assert plan.grid[1] == 3
    emulated(plan)
    assert out.tolist() == _expected(logits, bitmask, None, 9)
    assert not scratch.any()


def test_plan_argmax_covers_every_word_and_row():
    """One block per ARGMAX_WORDS_PER_BLOCK words of the row, one grid row per logits row; the
    keys and counts are the scratch's two rows."""
    for rows, width in [(1, 1), (4, 32 * ARGMAX_WORDS_PER_BLOCK), (2, 131072), (3, 128001)]:
        logits = torch.empty(rows, width)
        bitmask = torch.empty(rows, words_per_row(width), dtype=torch.int32)
        out = torch.empty(rows, dtype=torch.int64)
        scratch = torch.zeros(2, rows + 3, dtype=torch.int64)
        plan = plan_argmax(logits, bitmask, None, rows, out, scratch)
        assert plan.grid == (-(-words_per_row(width) // ARGMAX_WORDS_PER_BLOCK), rows)
        assert plan.args[-2] == scratch.data_ptr()
        assert plan.args[-1] == scratch[1].data_ptr()
        assert plan.kernel == "capgraph_masked_argmax_f32"


def test_source_defines_the_argmax_entry_points():
    """The loader's argmax names are the ones the source's macro invocations define, and the
    source's words per block match the planner's."""
    text = SOURCE.read_text()
    tags = re.findall(r"^CAPGRAPH_MASKED_ARGMAX_KERNEL\((\w+), \w+\)", text, re.M)
    assert {f"capgraph_masked_argmax_{t}" for t in tags} == set(argmax_entry_points())
    per_warp = int(re.search(r"kArgmaxWordsPerWarp = (\d+);", text).group(1))
    assert (cuda_backend.THREADS_PER_BLOCK // 32) * per_warp == ARGMAX_WORDS_PER_BLOCK


# ---- the op on CPU -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_op_matches_torch_on_cpu(dtype):
    """The op's torch path (CPU) agrees with the reference, with and without a token mask and
    mask_rows, into a given ``out`` and a new one; the logits are not written."""
    g = torch.Generator().manual_seed(11)
    logits, bitmask = _case(g, 6, 1000, dtype, "shift", "random")
    before = logits.clone()
    token_mask = torch.tensor([1, 0, 1, 1, 1, 1], dtype=torch.int32)
    out = torch.empty(6, dtype=torch.int64)
    assert masked_argmax(logits, bitmask, token_mask, mask_rows=4, out=out) is out
    assert out.tolist() == _expected(logits, bitmask, token_mask, 4)
    assert masked_argmax(logits, bitmask).tolist() == _expected(logits, bitmask, None, 6)
    raw = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(logits.view(raw), before.view(raw)), "the op wrote the logits"


@pytest.mark.parametrize("call,match", [
    (lambda x, b: masked_argmax(x[0], b), r"masked_argmax: logits must be 2-D"),
    (lambda x, b: masked_argmax(x.int(), b), r"masked_argmax: logits must be float32"),
    (lambda x, b: masked_argmax(x, b[:1]), r"masked_argmax: bitmask has 1 rows"),
    (lambda x, b: masked_argmax(x, b[:, :1]), r"masked_argmax: bitmask has 1 words"),
    (lambda x, b: masked_argmax(x, b, mask_rows=4), r"mask_rows must be an int in \[0, 3\]"),
    (lambda x, b: masked_argmax(x, b, mask_rows=True), r"mask_rows must be an int"),
    (lambda x, b: masked_argmax(x, b, out=torch.empty(3, dtype=torch.int32)),
     r"masked_argmax: out must be an int64 \[3\]"),
    (lambda x, b: masked_argmax(x, b, out=torch.empty(4, dtype=torch.int64)),
     r"masked_argmax: out must be an int64 \[3\]"),
    (lambda x, b: masked_argmax(x, b, torch.ones(2, dtype=torch.int32)),
     r"masked_argmax: token_mask must be 1-D with >= 3"),
    (lambda x, b: masked_argmax(x[:, :0], b), r"masked_argmax: logits has no columns"),
    (lambda x, b: masked_argmax(x, b.tolist()), r"masked_argmax: bitmask must be a tensor"),
    (lambda x, b: masked_argmax(x, b, scratch=torch.zeros(2, 2, dtype=torch.int64)),
     r"masked_argmax: scratch must be an int64 \[2, >= 3\]"),
    (lambda x, b: masked_argmax(x, b, scratch=torch.zeros(1, 3, dtype=torch.int64).expand(2, 3)),
     r"masked_argmax: scratch .* whose two rows do not overlap"),
    (lambda x, b: masked_argmax(x, b, scratch=torch.zeros(2, 3, dtype=torch.int32)),
     r"masked_argmax: scratch must be an int64"),
    (lambda x, b: (lambda buf: masked_argmax(x, b, out=buf[0, :3], scratch=buf[:, 2:]))(
        torch.zeros(2, 8, dtype=torch.int64)), r"masked_argmax: scratch overlaps out"),
])
def test_op_refuses_bad_arguments(call, match):
    """Each bad argument is a TensorArgError naming the call, the argument and the problem."""
    logits = torch.randn(3, 70)
    bitmask = torch.full((3, 3), -1, dtype=torch.int32)
    with pytest.raises(TensorArgError, match=match):
        call(logits, bitmask)


# ---- on a GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch.cuda.is_available() is False")
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_on_gpu_matches_torch_eagerly_and_in_a_graph(dtype):
    """The CUDA kernel gives torch's argmax of the masked rows at batch 1, 7 and 256 over
    V = 128000 and 131072 (random, 2%- and 98%-allowed), eagerly and in a CUDA graph replayed
    twice over new logits with one scratch (left zero); the logits are not written."""
    assert cuda_backend.load_kernel() is not None, cuda_backend.unavailable_reason()
    g = torch.Generator().manual_seed(17)
    for rows, width, allowed in [(1, 128000, 0.02), (7, 131072, "random"), (256, 128000, 0.98),
                                 (256, 131072, 0.02)]:
        logits, bitmask = _case(g, rows, width, dtype, "contiguous", allowed)
        token_mask = torch.ones(rows, dtype=torch.int32)
        token_mask[rows // 2] = 0
        mask_rows = max(1, rows - 1)
        expected = _expected(logits, bitmask, token_mask, mask_rows)
        x, bm, tm = logits.cuda(), bitmask.cuda(), token_mask.cuda()
        before = x.clone()
        scratch = argmax_scratch(rows, "cuda")
        out = torch.empty(rows, dtype=torch.int64, device="cuda")
        masked_argmax(x, bm, tm, mask_rows=mask_rows, out=out, scratch=scratch)
        assert out.tolist() == expected, (rows, width, allowed)
        raw = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(x.view(raw), before.view(raw)), "the kernel wrote the logits"
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                masked_argmax(x, bm, tm, mask_rows=mask_rows, out=out, scratch=scratch)
        for _ in range(2):
            fresh, _ = _case(g, rows, width, dtype, "contiguous", allowed)
            x.copy_(fresh.cuda())
            graph.replay()
            torch.cuda.synchronize()
            assert out.tolist() == _expected(fresh, bitmask, token_mask, mask_rows)
        assert not scratch.any().item()
