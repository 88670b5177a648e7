"""csrc/logits_bitmask.cu without a GPU: it compiles (nvcc, NVRTC), its arithmetic is right
(run on the host through a C++ emulation of the launch grid), the launch planning is right, and
importing the CUDA backend loads nothing; on a GPU (marker gpu), its ahead and store variants
against the CPU op."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch

from conftest import bits, random_d2t
from capgraph.bitmask import words_per_row
from capgraph.ops import cuda as cuda_backend
from capgraph.ops import logits_bitmask_reference
from capgraph.ops.cuda import THREADS_PER_BLOCK, entry_points, plan_launch

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "csrc" / "logits_bitmask.cu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _nvrtc_unavailable() -> str | None:
    try:
        cuda_backend._nvrtc_version()
        cuda_backend._cuda_core()
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot compile here"
        return (f"NVRTC cannot be loaded ({type(exc).__name__}: {exc}); "
                "pip install nvidia-cuda-nvrtc")
    return None


# ---- compilation ---------------------------------------------------------------------------


def test_nvcc_compiles_for_sm90(tmp_path):
    """`nvcc -c -arch=sm_90 csrc/logits_bitmask.cu` succeeds and defines every entry point the
    loader looks up."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    obj = tmp_path / "logits_bitmask.o"
    run = subprocess.run([nvcc, "-c", "-arch=sm_90", str(SOURCE), "-o", str(obj)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    data = obj.read_bytes()
    missing = [name for name in entry_points() if name.encode() not in data]
    assert not missing, missing


def test_nvrtc_compiles_and_caches(tmp_path, monkeypatch):
    """NVRTC (through cuda.core, no GPU needed) compiles the source to an sm_90 cubin holding
    every entry point; the cubin lands in $CAPGRAPH_CACHE_DIR/kernels and a later load reads it
    from there instead of compiling."""
    reason = _nvrtc_unavailable()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_backend, "_binaries", {})
    cubin = cuda_backend.compile_kernel("sm_90")
    assert cubin[:4] == b"\x7fELF"
    missing = [name for name in entry_points() if name.encode() not in cubin]
    assert not missing, missing
    cached = list((tmp_path / "kernels").glob("*.cubin"))
    assert len(cached) == 1 and cached[0].read_bytes() == cubin

    monkeypatch.setattr(cuda_backend, "_binaries", {})
    monkeypatch.setattr(cuda_backend, "_nvrtc_compile",
                        lambda *a: pytest.fail("compiled again despite the disk cache"))
    assert cuda_backend.compile_kernel("sm_90") == cubin


def test_source_defines_exactly_the_entry_points():
    """The entry points the loader expects are the ones the macros in the source expand to:
    rmw and d2t for every (dtype, bits, pack); ahead and store where the source invokes the
    variant macros (4 and 8 columns per thread)."""
    text = SOURCE.read_text()
    plain, variants = set(), set()
    # CAPGRAPH_ALL_DTYPES(ENTRY, BITS, SIXTEEN): f32 packs 1, 2, 4; f16 and bf16 the same, and 8
    # where SIXTEEN is the _WIDE list
    for entry, bits_, wide in re.findall(
            r"^CAPGRAPH_ALL_DTYPES\((\w+), (\d+), CAPGRAPH_16BIT_ENTRIES(_WIDE)?\)", text, re.M):
        names = {f"capgraph_logits_bitmask_f32_b{bits_}_p{p}" for p in (1, 2, 4)}
        for dtype in ("f16", "bf16"):
            names |= {f"capgraph_logits_bitmask_{dtype}_b{bits_}_p{p}"
                      for p in ((1, 2, 4, 8) if wide else (1, 2, 4))}
        (plain if entry == "CAPGRAPH_LOGITS_BITMASK_ENTRY" else variants).update(names)
    # each ENTRY defines the plain kernel and its _d2t twin, each VARIANTS _ahead and _store
    assert "##_d2t" in text and "##_ahead" in text and "##_store" in text
    defined = plain | {f"{name}_d2t" for name in plain}
    defined |= {f"{name}_{v}" for name in variants for v in ("ahead", "store")}
    assert defined == set(entry_points())
    assert {int(re.search(r"_b(\d+)_", n).group(1)) for n in variants} == set(
        cuda_backend.VARIANT_BITS_PER_THREAD)


def test_import_loads_nothing():
    """Importing capgraph.ops.cuda imports neither cuda.core nor NVRTC and compiles nothing."""
    code = textwrap.dedent("""
        import sys
        import capgraph.ops.cuda
        bad = [m for m in sys.modules if m.startswith(("cuda.core", "cuda.bindings.nvrtc"))]
        assert not bad, bad
        assert capgraph.ops.cuda.unavailable_reason() is None
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_load_kernel_is_none_without_gpu():
    """Without a CUDA device load_kernel() returns None and says why; the op still works on
    CPU tensors."""
    assert cuda_backend.load_kernel() is None
    assert cuda_backend.unavailable_reason().startswith("no CUDA device")


# ---- launch planning -----------------------------------------------------------------------


@pytest.mark.parametrize("rows,width,pack,sms,expected_bits", [
    (1, 128000, 1, 132, 4),     # 1056 blocks per row wanted: 1 column per thread would do
    (1, 128000, 8, 132, 8),     # ... but a thread covers at least one 8-wide access
    (8, 128000, 4, 132, 4),     # 132 blocks per row -> 4 columns per thread
    (16, 128000, 4, 132, 8),    # 66 -> ceil(128000 / (256 * 66)) = 8
    (32, 128000, 4, 132, 16),   # 33 -> 16
    (64, 128000, 4, 132, 16),   # 17 -> 30 -> capped at 16 (32 measured slower on an H200)
    (4096, 128000, 4, 132, 16),
    (2, 1000, 1, 1, 4),         # 4 blocks per row -> 1 column per thread -> 4
])
def test_bits_per_thread_follow_the_sm_heuristic(rows, width, pack, sms, expected_bits):
    """blocks_per_row = ceil(8 * SMs / rows); bits = smallest of 4/8/16 covering
    ceil(width / (256 * blocks_per_row)) and the pack width, else 16."""
    assert cuda_backend._bits_per_thread(rows, width, pack, sms) == expected_bits


def test_pack_width_follows_width_stride_and_alignment():
    """Packs are 16 bytes where width, row stride and base pointer allow, narrower otherwise."""
    parent = torch.zeros(4, 1024)
    assert cuda_backend._pack_width(parent) == 4
    assert cuda_backend._pack_width(parent[:, 2:1022]) == 2   # 8-byte aligned start
    assert cuda_backend._pack_width(parent[:, 1:1021]) == 1   # 4-byte aligned start
    assert cuda_backend._pack_width(parent[:, :1022]) == 2    # width 1022
    assert cuda_backend._pack_width(torch.zeros(4, 1030)[:, :1024]) == 2  # row stride 1030
    assert cuda_backend._pack_width(torch.zeros(1, 1030)[:, :1024]) == 4  # one row: no stride
    half = torch.zeros(3, 128001, dtype=torch.bfloat16)
    assert cuda_backend._pack_width(half) == 1
    assert cuda_backend._pack_width(torch.zeros(3, 131072, dtype=torch.float16)) == 8


@pytest.mark.parametrize("rows", [1, 7, 512, 70000])
@pytest.mark.parametrize("width", [1, 255, 32000, 128001, 151936])
def test_grid_covers_every_column_and_row(rows, width):
    """grid.x * 256 * bits >= width, grid.y = min(rows, 65535) (the kernel strides over the
    rest), and the named entry point exists."""
    logits = torch.empty(1).expand(rows, width)  # metadata only: nothing is launched
    bitmask = torch.empty(1, dtype=torch.int32).expand(rows, words_per_row(width))
    plan = plan_launch(logits, bitmask, None, None, 0, 132)
    b = int(re.search(r"_b(\d+)_", plan.kernel).group(1))
    assert plan.grid[0] * THREADS_PER_BLOCK * b >= width
    assert (plan.grid[0] - 1) * THREADS_PER_BLOCK * b < width
    assert plan.grid[1] == min(rows, 65535)
    assert plan.kernel in entry_points()


def _small_and_large_plans(**kw):
    """Plans of one fp32 row (4 columns per thread on 132 SMs) and of 64 rows (16 columns)."""
    small = plan_launch(torch.empty(1).expand(1, 128000),
                        torch.empty(1, dtype=torch.int32).expand(1, 4000), None, None, 0, 132,
                        **kw)
    large = plan_launch(torch.empty(1).expand(64, 128000),
                        torch.empty(1, dtype=torch.int32).expand(64, 4000), None, None, 0, 132,
                        **kw)
    return small.kernel, large.kernel


def test_mask_kernel_variant_follows_the_environment(monkeypatch):
    """Unset or empty CAPGRAPH_MASK_KERNEL is "auto" (test below); "rmw", "ahead" and
    "store" plan that variant's entry points where the launch takes 4 or 8 columns per thread,
    rmw where it takes 16 (no variant there) and the d2t entry for a d2t launch; an explicit
    variant argument wins over the variable."""
    monkeypatch.delenv("CAPGRAPH_MASK_KERNEL", raising=False)
    assert cuda_backend.mask_kernel_variant() == "auto"
    monkeypatch.setenv("CAPGRAPH_MASK_KERNEL", "")
    assert cuda_backend.mask_kernel_variant() == "auto"
    monkeypatch.setenv("CAPGRAPH_MASK_KERNEL", "rmw")
    assert _small_and_large_plans() == ("capgraph_logits_bitmask_f32_b4_p4",
                                        "capgraph_logits_bitmask_f32_b16_p4")
    for variant in ("ahead", "store"):
        monkeypatch.setenv("CAPGRAPH_MASK_KERNEL", variant)
        assert cuda_backend.mask_kernel_variant() == variant
        assert _small_and_large_plans() == (f"capgraph_logits_bitmask_f32_b4_p4_{variant}",
                                            "capgraph_logits_bitmask_f32_b16_p4")
        d2t = torch.zeros(128000, dtype=torch.int32)
        plan = plan_launch(torch.empty(1).expand(1, 128000),
                           torch.empty(1, dtype=torch.int32).expand(1, 4000), None, d2t, 0, 132)
        assert plan.kernel == "capgraph_logits_bitmask_f32_b4_p4_d2t"
    monkeypatch.setenv("CAPGRAPH_MASK_KERNEL", "ahead")
    assert _small_and_large_plans(variant="store")[0] == "capgraph_logits_bitmask_f32_b4_p4_store"
    assert _small_and_large_plans(variant="rmw")[0] == "capgraph_logits_bitmask_f32_b4_p4"
    assert _small_and_large_plans(variant="auto")[0] == "capgraph_logits_bitmask_f32_b4_p4_store"
    half = plan_launch(torch.empty(1, dtype=torch.bfloat16).expand(16, 128000),
                       torch.empty(1, dtype=torch.int32).expand(16, 4000), None, None, 0, 132)
    assert half.kernel == "capgraph_logits_bitmask_bf16_b8_p8_ahead"
    assert half.kernel in entry_points()


@pytest.mark.parametrize("dtype, rows, expected", [
    (torch.float32, 1, "f32_b4_p4_store"),      # batch 1-4 on 132 SMs: 4 columns per thread
    (torch.float32, 4, "f32_b4_p4_store"),
    (torch.float32, 16, "f32_b8_p4_store"),     # batch 16: 8 columns per thread
    (torch.float32, 64, "f32_b16_p4"),          # 16 columns per thread: rmw, the only one
    (torch.bfloat16, 1, "bf16_b8_p8_ahead"),    # 2-byte logits: 8-wide packs, 8 columns
    (torch.bfloat16, 16, "bf16_b8_p8_ahead"),
    (torch.float16, 4, "f16_b8_p8_ahead"),
    (torch.bfloat16, 256, "bf16_b16_p8"),
])
def test_auto_variant_is_chosen_per_element_size_and_launch_width(monkeypatch, dtype, rows,
                                                                  expected):
    """With CAPGRAPH_MASK_KERNEL unset, a launch runs AUTO_VARIANTS' variant for its logits'
    element size and columns per thread (from the H200 kernel table: store for fp32, ahead for
    2-byte logits), and rmw at 16 columns per thread; a d2t launch runs the d2t entry."""
    monkeypatch.delenv("CAPGRAPH_MASK_KERNEL", raising=False)
    logits = torch.empty(1, dtype=dtype).expand(rows, 128000)
    bitmask = torch.empty(1, dtype=torch.int32).expand(rows, 4000)
    plan = plan_launch(logits, bitmask, None, None, 0, 132)
    assert plan.kernel == f"capgraph_logits_bitmask_{expected}"
    assert plan.kernel in entry_points()
    bits = int(re.search(r"_b(\d+)_", plan.kernel).group(1))
    assert cuda_backend.auto_variant(dtype, bits) == (expected.split("_")[-1]
                                                      if bits < 16 else "rmw")
    d2t = torch.zeros(128000, dtype=torch.int32)
    assert plan_launch(logits, bitmask, None, d2t, 0, 132).kernel.endswith("_d2t")


@pytest.mark.parametrize("value", ["fast", "RMW", "ahead "])
def test_bad_mask_kernel_variable_is_a_config_error(monkeypatch, value):
    """A CAPGRAPH_MASK_KERNEL value outside auto/rmw/ahead/store raises ConfigError at plan time,
    naming the variable, the value and the allowed values."""
    from capgraph.errors import ConfigError
    monkeypatch.setenv("CAPGRAPH_MASK_KERNEL", value)
    for call in (cuda_backend.mask_kernel_variant, _small_and_large_plans):
        with pytest.raises(ConfigError) as info:
            call()
        assert "CAPGRAPH_MASK_KERNEL" in str(info.value) and repr(value) in str(info.value)
        assert "auto, rmw, ahead, store" in str(info.value)


def test_variant_arguments_are_checked(monkeypatch):
    """An unknown variant argument is a ValueError (the variable is not consulted); kernel_name
    refuses names the source does not define: a d2t variant, a variant at 16 columns."""
    monkeypatch.setenv("CAPGRAPH_MASK_KERNEL", "store")
    with pytest.raises(ValueError, match="variant='fast'"):
        _small_and_large_plans(variant="fast")
    with pytest.raises(ValueError, match="d2t"):
        cuda_backend.kernel_name(torch.float32, 4, 4, d2t=True, variant="ahead")
    with pytest.raises(ValueError, match="16 columns"):
        cuda_backend.kernel_name(torch.float16, 16, 8, variant="store")
    assert cuda_backend.kernel_name(torch.float16, 8, 8, variant="store") == (
        "capgraph_logits_bitmask_f16_b8_p8_store")


# ---- the kernel's arithmetic, run on the host ----------------------------------------------

_PRELUDE = """
// Host emulation of the CUDA built-ins the kernels use. The mask kernel has no shared memory
// and no synchronisation, and every packed group is owned by one thread, so running the
// threads of the grid one after another gives the result a GPU gives. The masked argmax
// merges keys with atomics (plain read-modify-writes here, one thread at a time) and, with
// CAPGRAPH_EMULATED_WARPS, each thread as a warp of one (tests/test_masked_argmax.py).
#define CAPGRAPH_EMULATED_WARPS
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct EmuDim3 { unsigned x, y, z; };
static EmuDim3 blockIdx, threadIdx, gridDim;
static unsigned long long atomicMax(unsigned long long* at, unsigned long long v) {
    unsigned long long old = *at; if (v > old) *at = v; return old; }
static unsigned long long atomicAdd(unsigned long long* at, unsigned long long v) {
    unsigned long long old = *at; *at = old + v; return old; }
static unsigned long long atomicExch(unsigned long long* at, unsigned long long v) {
    unsigned long long old = *at; *at = v; return old; }
static void __threadfence() {}
// every thread of a grid_x x grid_y grid of kThreads-thread blocks, one after another, runs CALL
#define EMU_GRID(GRID_X, GRID_Y, CALL)                                                  \
    gridDim = {GRID_X, GRID_Y, 1};                                                      \
    for (unsigned by = 0; by < GRID_Y; ++by)                                            \
        for (unsigned bx = 0; bx < GRID_X; ++bx)                                        \
            for (unsigned t = 0; t < capgraph::kThreads; ++t) {                         \
                blockIdx = {bx, by, 0};                                                 \
                threadIdx = {t, 0, 0};                                                  \
                CALL;                                                                   \
            }
"""

_DRIVER = """
typedef void (*EmuKernel)(void*, long long, const unsigned*, long long, const int*, const int*,
                          long long, long long, long long, const void*, long long, long long,
                          long long);
extern "C" void emu_launch(void* kernel, unsigned grid_x, unsigned grid_y, void* logits,
                           long long logits_stride, const unsigned* bitmask,
                           long long bitmask_stride, const int* token_mask, const int* d2t,
                           long long rows, long long width, long long col_offset,
                           const void* indices, long long index_bytes, long long logits_rows,
                           long long bitmask_words) {
    EmuKernel k = (EmuKernel)kernel;
    EMU_GRID(grid_x, grid_y, k(logits, logits_stride, bitmask, bitmask_stride, token_mask, d2t,
                               rows, width, col_offset, indices, index_bytes, logits_rows,
                               bitmask_words));
}
"""


def build_emulation(tmp_path_factory, driver: str, folder: str) -> ctypes.CDLL:
    """The kernel source built for the host (g++) after :data:`_PRELUDE`, with ``driver``'s
    launch functions after it (skips where g++ is missing)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: the kernel's host emulation needs it")
    work = tmp_path_factory.mktemp(folder)
    src = work / "emu.cpp"
    src.write_text(f'{_PRELUDE}\n#include "{SOURCE}"\n{driver}')
    lib = work / "emu.so"
    run = subprocess.run([gxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror",
                          "-Wno-unknown-pragmas", str(src), "-o", str(lib)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernel source built for the host (g++) with a driver that runs a launch grid."""
    so = build_emulation(tmp_path_factory, _DRIVER, "kernel_emu")
    so.emu_launch.restype = None
    so.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                              ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
                              ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p,
                              ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong]

    def launch(plan):
        kernel = ctypes.cast(getattr(so, plan.kernel), ctypes.c_void_p).value
        so.emu_launch(kernel, *plan.grid, *plan.args)
    return launch


def _random_bitmask(g, rows, words):
    """[rows, words] int32 with an explicit row stride; dense, empty and random words."""
    buf = torch.randint(-2**31, 2**31 - 1, (rows + 1, words + 3), generator=g,
                        dtype=torch.int32)
    buf[:, ::3] = -1
    buf[:, 1::5] = 0
    return buf[:, 1:1 + words]


def _logits(g, rows, width, dtype, layout):
    """(parent, view): view is [rows, width] inside parent, with inf/-inf/nan sprinkled."""
    extra = {"contiguous": 0, "shift1": 9, "shift2": 10, "row_step": 0}[layout]
    parent = torch.randn(rows * (2 if layout == "row_step" else 1), width + extra, generator=g)
    flat = parent.view(-1)
    for value in (float("inf"), float("-inf"), float("nan")):
        flat[torch.randint(flat.numel(), (max(1, flat.numel() // 64),), generator=g)] = value
    parent = parent.to(dtype)
    if layout == "row_step":
        return parent, parent[::2]
    start = {"contiguous": 0, "shift1": 1, "shift2": 2}[layout]
    return parent, parent[:, start:start + width]


def _run_and_check(launch, g, rows, width, dtype, layout, col_offset, use_d2t, use_tm, sms):
    parent, view = _logits(g, rows, width, dtype, layout)
    token_mask = torch.randint(0, 2, (rows,), generator=g, dtype=torch.int32) if use_tm else None
    if use_d2t:
        target = col_offset + width + 45
        d2t = random_d2t(g, col_offset + width, target)
        bitmask = _random_bitmask(g, rows, words_per_row(target))
    else:
        d2t = None
        bitmask = _random_bitmask(g, rows, words_per_row(col_offset + width))
    expected = logits_bitmask_reference(view, bitmask, token_mask, d2t, col_offset=col_offset)
    before = parent.clone()
    plan = plan_launch(view, bitmask, token_mask, d2t, col_offset, sms)
    launch(plan)
    assert torch.equal(bits(view), bits(expected)), plan
    outside = torch.ones_like(parent, dtype=torch.bool)
    if layout == "row_step":
        outside[::2] = False
    else:
        outside[:, view.storage_offset():view.storage_offset() + width] = False
    assert torch.equal(bits(parent)[outside], bits(before)[outside]), "wrote outside the view"
    return plan


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "shift1", "shift2", "row_step"])
@pytest.mark.parametrize("col_offset,use_d2t", [(0, False), (37, False), (29, False),
                                                (0, True), (13, True)])
def test_emulated_kernel_matches_reference(emulated, dtype, layout, col_offset, use_d2t):
    """Bit-exact against the brute-force reference for every dtype, strided/misaligned logits,
    non-word-aligned col_offset (packed groups straddling two words), d2t and token_mask, under
    launch plans of several SM counts (so several bits-per-thread/pack instantiations)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{layout}{col_offset}{use_d2t}".encode()))
    used = set()
    for rows, width, sms in [(3, 2048, 132), (5, 2000, 1), (3, 8192, 1), (2, 4104, 1),
                             (4, 16384, 1), (1, 776, 4)]:
        plan = _run_and_check(emulated, g, rows, width, dtype, layout, col_offset, use_d2t,
                              use_tm=rows > 1, sms=sms)
        used.add(plan.kernel)
    bits_used = {int(re.search(r"_b(\d+)_", k).group(1)) for k in used}
    widest = max(int(re.search(r"_p(\d+)", k).group(1)) for k in used)
    possible = [b for b in cuda_backend.BITS_PER_THREAD if b >= widest]
    assert len(bits_used) >= min(3, len(possible)), used


def _entry(name):
    """(dtype, bits, pack, suffix) of an entry point's name; suffix "" for the rmw kernel."""
    tag, b, p, suffix = re.fullmatch(r"capgraph_logits_bitmask_(\w+?)_b(\d+)_p(\d+)_?(\w*)",
                                     name).groups()
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[tag]
    return dtype, int(b), int(p), suffix


def test_emulated_every_entry_point(emulated):
    """Each entry point (rmw, d2t, ahead, store), forced, gives the reference result on a case
    where its packed groups straddle words (col_offset 29) and where they do not (col_offset
    0); the _d2t entry points through a draft-to-target table."""
    g = torch.Generator().manual_seed(7)
    for name in entry_points():
        dtype, b, p, suffix = _entry(name)
        cases = ((0, True), (3, True)) if suffix == "d2t" else ((0, False), (29, False))
        for col_offset, use_d2t in cases:
            rows, width = 3, 8 * 97
            parent, view = _logits(g, rows, width, dtype, "contiguous")
            token_mask = torch.tensor([1, 0, 1], dtype=torch.int32)
            if use_d2t:
                d2t = random_d2t(g, col_offset + width, col_offset + width + 40)
                bitmask = _random_bitmask(g, rows, words_per_row(col_offset + width + 40))
            else:
                d2t = None
                bitmask = _random_bitmask(g, rows, words_per_row(col_offset + width))
            expected = logits_bitmask_reference(view, bitmask, token_mask, d2t,
                                                col_offset=col_offset)
            plan = plan_launch(view, bitmask, token_mask, d2t, col_offset, 132)
            grid = (-(-width // (THREADS_PER_BLOCK * b)), rows)
            emulated(plan._replace(kernel=name, grid=grid))
            assert torch.equal(bits(view), bits(expected)), (name, col_offset, use_d2t)


DENSITIES = {"random": 0.5, "sparse": 0.02, "dense": 0.98}


def _density_bitmask(g, rows, words, density):
    """[rows, words] int32 with each bit set with probability ``density``, row stride
    words + 3 (a view inside a wider buffer)."""
    allowed = (torch.rand(rows, (words + 3) * 32, generator=g) < density).to(torch.int64)
    packed = (allowed.view(rows, words + 3, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed[:, 2:2 + words]


def _group_kinds(bitmask, col_offset, width, pack):
    """Counts of (all allowed, all masked, mixed) packed groups of the bitmask rows' columns."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, col_offset:col_offset + width]
    per_group = allowed.reshape(bitmask.size(0), width // pack, pack).sum(-1)
    return (int((per_group == pack).sum()), int((per_group == 0).sum()),
            int(((per_group > 0) & (per_group < pack)).sum()))


@pytest.mark.parametrize("variant", ["ahead", "store"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_variants_match_reference(emulated, variant, dtype):
    """Every ahead/store entry point of this dtype (each bits and pack), forced, is bit-exact
    against the reference under random, 2%-allowed and 98%-allowed bitmasks, with a token
    mask, a row-strided logits view and a column offset that is not a multiple of 32 (groups
    straddling words), and again through int32 and int64 indices; nothing outside the view
    is written, and each pattern had mixed groups wherever the pack allows them."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{variant}{dtype}".encode()))
    names = [n for n in entry_points() if _entry(n)[0] == dtype and _entry(n)[3] == variant]
    assert {(b, p) for _, b, p, _ in map(_entry, names)} == {
        (b, p) for b in cuda_backend.VARIANT_BITS_PER_THREAD for p in (1, 2, 4, 8)
        if p <= b and p * dtype.itemsize <= 16}
    rows, width = 5, 8 * 131  # two blocks of 4 columns per thread and a partial third
    for name in names:
        _, b, p, _ = _entry(name)
        grid_x = -(-width // (THREADS_PER_BLOCK * b))
        for pattern, density in DENSITIES.items():
            for index_dtype, col_offset in ((None, 29), (torch.int32, 45), (torch.int64, 3)):
                parent = torch.randn(2 * rows, width + 24, generator=g).to(dtype)
                parent.view(-1)[::97] = float("nan")
                view = parent[::2, 8:8 + width]  # row stride 2 * (width + 24), 16-byte aligned
                bitmask = _density_bitmask(g, rows, words_per_row(col_offset + width), density)
                token_mask = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32)
                chosen = None
                if index_dtype is not None:
                    chosen = [4, 0, 2, 3, 1]
                    indices = torch.tensor(chosen, dtype=index_dtype)
                expected = logits_bitmask_reference(view, bitmask, token_mask, None,
                                                    col_offset=col_offset, indices=chosen)
                before = parent.clone()
                plan = plan_launch(view, bitmask, token_mask, None, col_offset, 132,
                                   None if chosen is None else indices)
                emulated(plan._replace(kernel=name, grid=(grid_x, rows)))
                case = (name, pattern, index_dtype, col_offset)
                assert torch.equal(bits(view), bits(expected)), case
                assert torch.equal(bits(parent[1::2]), bits(before[1::2])), case
                assert torch.equal(bits(parent[:, :8]), bits(before[:, :8])), case
                assert torch.equal(bits(parent[:, 8 + width:]), bits(before[:, 8 + width:]))
                kinds = _group_kinds(bitmask, col_offset, width, p)
                assert kinds[2] > 0 if p > 1 else kinds[2] == 0, (case, kinds)


def _variants_against_cpu(kernel, device, sm_count, variant):
    """Launch ``variant`` through ``kernel`` (the loaded CUDA kernel's callable, or a stand-in)
    on ``device`` over the launches that have variants, each against the CPU op; returns the
    entry points used."""
    from capgraph.ops import logits_bitmask
    g = torch.Generator().manual_seed(zlib.crc32(variant.encode()))
    used = set()
    for dtype in DTYPES:
        for batch, vocab in ((1, 128000), (4, 128000), (16, 128000), (4, 128001)):
            for density in DENSITIES.values():
                for use_indices in (False, True):
                    col_offset = 29
                    parent = torch.randn(2 * batch, vocab + 8, generator=g).to(dtype)
                    view = parent[::2, :vocab]  # row stride 2 * (vocab + 8)
                    bitmask = _density_bitmask(g, batch, words_per_row(col_offset + vocab),
                                               density)
                    token_mask = torch.ones(batch, dtype=torch.int32)
                    token_mask[batch // 2] = 0
                    indices = (torch.randperm(batch, generator=g) if use_indices else None)
                    expected = view.clone()
                    logits_bitmask(expected, bitmask, token_mask, col_offset=col_offset,
                                   indices=indices)
                    on = [None if t is None else t.to(device)
                          for t in (parent, bitmask, token_mask, indices)]
                    view_on = on[0][::2, :vocab]
                    plan = plan_launch(view_on, on[1], on[2], None, col_offset, sm_count,
                                       on[3], variant=variant)
                    used.add(plan.kernel)
                    kernel(view_on, on[1], on[2], None, col_offset, on[3], variant=variant)
                    got = view_on.cpu()
                    case = (dtype, batch, vocab, density, use_indices, plan.kernel)
                    assert torch.equal(bits(got), bits(expected)), case
                    assert torch.equal(bits(on[0][1::2].cpu()), bits(parent[1::2])), case
    return used


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch.cuda.is_available() is False")
@pytest.mark.parametrize("variant", ["ahead", "store"])
def test_variants_on_gpu_match_the_cpu_op(variant):
    """On a GPU, the ahead and store entry points, launched through the loaded kernel with the
    benchmark's variant keyword, give the CPU op's bits for every dtype at batch 1, 4 and 16
    (the launches that have variants) over V = 128000 and 128001 (packs 4/8 and 1), under
    random, 2%-allowed and 98%-allowed bitmasks, with a token mask that skips a row, a
    row-strided view, col_offset 29, and with indices; rows outside the view untouched."""
    kernel = cuda_backend.load_kernel()
    assert kernel is not None, cuda_backend.unavailable_reason()
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    used = _variants_against_cpu(kernel, "cuda", sm_count, variant)
    assert all(name.endswith("_" + variant) for name in used), used


def test_emulated_rows_beyond_grid_y(emulated, monkeypatch):
    """More rows than grid.y: the kernel's row loop covers the rest (grid.y capped at 3 here
    instead of 65535 to keep the emulation small)."""
    monkeypatch.setattr(cuda_backend, "_MAX_GRID_Y", 3)
    g = torch.Generator().manual_seed(3)
    plan = _run_and_check(emulated, g, 11, 300, torch.float16, "contiguous", 5, False,
                          use_tm=True, sms=132)
    assert plan.grid[1] == 3


def test_emulated_all_allowed_and_all_masked_rows(emulated):
    """An all-ones row leaves every bit of the logits (NaN payloads too); an all-zero row
    becomes exactly -inf in each dtype."""
    for dtype in DTYPES:
        logits = torch.tensor([[1.0, float("nan"), float("inf"), -0.0] * 64] * 2).to(dtype)
        before = logits.clone()
        bitmask = torch.tensor([[-1] * 8, [0] * 8], dtype=torch.int32)
        emulated(plan_launch(logits, bitmask, None, None, 0, 132))
        assert torch.equal(bits(logits[0]), bits(before[0]))
        assert torch.equal(bits(logits[1]), bits(torch.full_like(logits[1], float("-inf"))))


def test_kernel_fits_guards_int32_columns():
    """Column arithmetic is int32 in the kernel; wider problems go to the torch path."""
    meta = torch.empty(1).expand(2, 1000)
    assert cuda_backend.kernel_fits(meta, 0)
    assert not cuda_backend.kernel_fits(meta, 2**31 - 1000)


def test_kernel_source_is_found():
    """The loader finds the source (package data capgraph.csrc, or the repository's csrc/)."""
    assert cuda_backend.kernel_source() == SOURCE.read_bytes()
    assert os.path.basename(SOURCE) == "logits_bitmask.cu"


def test_launcher_host_path_with_a_fake_cuda_core(emulated, monkeypatch):
    """The launcher's host code end to end without a GPU: cuda.core and torch.cuda are faked,
    each launch's (stream, grid, block, entry point, arguments) is recorded and run at once (as
    a stream would, before the launcher's temporaries go) by the host emulation, which must
    give the reference result. Pins: torch's current stream is the
    launch stream, module load and SM count once per device, launch configs cached, a strided
    token mask and strided indices made dense, a variant keyword reaching the plan, empty
    indices launch nothing, an int32-overflowing problem sent to the torch path."""
    from types import SimpleNamespace

    launches, loads = [], []

    class FakeCore:
        class ObjectCode:
            @staticmethod
            def from_cubin(binary, name=""):
                loads.append(binary)
                return SimpleNamespace(get_kernel=lambda n: n)

        class LaunchConfig:
            def __init__(self, grid, block):
                self.grid, self.block = grid, block

        class Stream:
            @staticmethod
            def from_handle(handle):
                return ("stream", handle)

        @staticmethod
        def launch(stream, config, kernel, *args):
            launches.append((stream, config, kernel, args))
            emulated(cuda_backend.LaunchPlan(kernel, config.grid, args))

    props = SimpleNamespace(major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda i: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i=None: SimpleNamespace(
        cuda_stream=0xABC))
    monkeypatch.setattr(cuda_backend, "_nvrtc_archs", lambda: [75, 80, 90])
    monkeypatch.setattr(cuda_backend, "compile_kernel", lambda arch, fmt: f"{fmt}:{arch}")
    monkeypatch.delenv("CAPGRAPH_MASK_KERNEL", raising=False)
    kernel = cuda_backend._CudaLogitsBitmask(FakeCore)
    monkeypatch.setattr(kernel, "_ensure_context", lambda index: None)

    g = torch.Generator().manual_seed(21)
    for dtype, col_offset, use_d2t in [(torch.float32, 0, False), (torch.bfloat16, 29, False),
                                       (torch.float16, 7, True)]:
        parent, view = _logits(g, 6, 4000, dtype, "shift2")
        token_mask = torch.randint(0, 2, (12,), generator=g, dtype=torch.int32)[::2]
        d2t = random_d2t(g, 4100, 5000) if use_d2t else None
        bitmask = _random_bitmask(g, 6, words_per_row(5000))
        expected = logits_bitmask_reference(view, bitmask, token_mask, d2t,
                                            col_offset=col_offset)
        kernel(view, bitmask, token_mask, d2t, col_offset)
        stream, config, _, args = launches[-1]
        assert stream == ("stream", 0xABC) and config.block == THREADS_PER_BLOCK
        assert args[4] != token_mask.data_ptr()  # the strided mask was made dense
        assert torch.equal(bits(view), bits(expected)), (dtype, col_offset, use_d2t)
    chosen = torch.tensor([5, 9, 0, 9, 3, 9])[::2]  # strided indices: made dense
    parent, view = _logits(g, 6, 4000, torch.float32, "shift2")
    bitmask = _random_bitmask(g, 3, words_per_row(4000))
    expected = logits_bitmask_reference(view, bitmask, indices=[5, 0, 3])
    kernel(view, bitmask, None, None, 0, chosen)
    args = launches[-1][3]
    assert args[-4] != chosen.data_ptr() and args[-3:-1] == (8, 6)
    assert torch.equal(bits(view), bits(expected))
    parent, view = _logits(g, 1, 4000, torch.float32, "contiguous")  # 4 columns per thread
    bitmask = _random_bitmask(g, 1, words_per_row(4000))
    expected = logits_bitmask_reference(view, bitmask)
    kernel(view, bitmask, None, None, 0, variant="store")  # the benchmark's keyword
    assert launches[-1][2] == "capgraph_logits_bitmask_f32_b4_p4_store"
    assert torch.equal(bits(view), bits(expected))
    n = len(launches)
    kernel(view, bitmask[:0], None, None, 0, chosen[:0])  # no mask rows: no launch
    assert len(launches) == n
    assert loads == ["cubin:sm_90"]
    for _ in range(2):
        kernel(torch.zeros(2, 2048), torch.zeros(2, 64, dtype=torch.int32), None, None, 0)
    assert launches[-1][1] is launches[-2][1]  # config cached per grid

    n = len(launches)
    huge = torch.zeros(1, 64)
    no_bits = torch.zeros(1, 1, dtype=torch.int32).expand(1, 2**26)  # metadata-sized only
    kernel(huge, no_bits, None, None, 2**31 - 64)
    assert len(launches) == n and torch.isneginf(huge).all()  # torch path, not the kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("col_offset,use_d2t", [(0, False), (29, False), (13, True)])
def test_emulated_kernel_with_indices(emulated, dtype, index_dtype, col_offset, use_d2t):
    """With indices the kernel masks logits row indices[i] with bitmask row i (and token_mask
    entry i), reading int32 and int64 indices: bit-exact against the reference, rows not named
    untouched, grid.y = len(indices)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{index_dtype}{col_offset}".encode()))
    rows, width, chosen = 9, 2000, [7, 0, 4, 5]
    parent, view = _logits(g, rows, width, dtype, "shift1")
    indices = torch.tensor(chosen, dtype=index_dtype)
    token_mask = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    if use_d2t:
        target = col_offset + width + 45
        d2t = random_d2t(g, col_offset + width, target)
        bitmask = _random_bitmask(g, len(chosen), words_per_row(target))
    else:
        d2t = None
        bitmask = _random_bitmask(g, len(chosen), words_per_row(col_offset + width))
    expected = logits_bitmask_reference(view, bitmask, token_mask, d2t, col_offset=col_offset,
                                        indices=chosen)
    before = parent.clone()
    plan = plan_launch(view, bitmask, token_mask, d2t, col_offset, 132, indices)
    assert plan.grid[1] == len(chosen)
    assert plan.args[-4:] == (indices.data_ptr(), indices.element_size(), rows,
                              bitmask.size(1))
    emulated(plan)
    assert torch.equal(bits(view), bits(expected)), plan
    for r in (1, 2, 3, 4, 6, 8):  # 4: named, but its token_mask entry is 0
        assert torch.equal(bits(parent[r]), bits(before[r])), f"row {r} changed"
    assert torch.equal(bits(parent[:, 0]), bits(before[:, 0]))


def test_emulated_kernel_masks_d2t_targets_outside_the_row(emulated):
    """A d2t target outside the bitmask row (no host check reads the table on a GPU: that would
    synchronise; a write torch does not count escapes the decoder's check) is masked without
    being read: the row sits inside a buffer of all-ones words, so a read of the word before
    or after the row would allow the column. Every other column equals the reference."""
    g = torch.Generator().manual_seed(53)
    rows, draft, words = 5, 3000, 100
    good = random_d2t(g, draft, 32 * words)
    bad = good.clone()
    ids = [0, 7, 33, 1500, draft - 1]
    bad[0] = 32 * words  # target 3200: the word just past the row
    bad[7] = -8  # target -1: the word just before it
    bad[33] = 32 * words + 31 - 33  # target 3231: last bit of the next word
    bad[1500] = -1500 - 32  # target -32
    bad[draft - 1] = 32 * words + 64 - (draft - 1)
    buffer = torch.full((rows, words + 4), -1, dtype=torch.int32)
    bitmask = buffer[:, 2:2 + words]
    bitmask.copy_(torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g,
                                dtype=torch.int32))
    for dtype in DTYPES:
        parent, view = _logits(g, rows, draft, dtype, "contiguous")
        expected = logits_bitmask_reference(view, bitmask, None, good)
        expected[:, ids] = float("-inf")
        assert torch.equal(bits(logits_bitmask_reference(view, bitmask, None, bad)),
                           bits(expected))
        plan = plan_launch(view, bitmask, None, bad, 0, 132)
        assert plan.kernel.endswith("_d2t") and plan.args[-1] == words
        emulated(plan)
        assert torch.equal(bits(view), bits(expected)), dtype


def test_emulated_kernel_skips_out_of_range_indices(emulated):
    """An index outside [0, rows) (a precondition the host cannot check on a GPU without a
    sync) is skipped by the kernel: nothing is written outside the logits, in-range entries are
    still masked."""
    g = torch.Generator().manual_seed(47)
    parent = torch.randn(12, 300, generator=g)
    view = parent[:8]
    before = parent.clone()
    bitmask = torch.zeros(4, words_per_row(300), dtype=torch.int32)  # mask everything
    indices = torch.tensor([6, -1, 8, 2])
    emulated(plan_launch(view, bitmask, None, None, 0, 132, indices))
    assert torch.isneginf(parent[6]).all() and torch.isneginf(parent[2]).all()
    changed = [r for r in range(12) if not torch.equal(bits(parent[r]), bits(before[r]))]
    assert changed == [2, 6]
