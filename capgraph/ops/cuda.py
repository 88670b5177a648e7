"""CUDA backend of ``logits_bitmask``: ``csrc/logits_bitmask.cu`` compiled by NVRTC on first use.

Nothing happens at import: no CUDA, NVRTC or cuda.core is touched until :func:`load_kernel` is
called (by :mod:`capgraph.ops.op` on the first CUDA call of the op). ``load_kernel`` returns None
where the kernel cannot run (no CUDA device, no cuda.core, no NVRTC, an architecture NVRTC does
not know) and :func:`unavailable_reason` then says why; the op falls back to pure torch.

Compiled code is cached per target architecture in memory and, through :mod:`capgraph.jit`,
on disk under ``$CAPGRAPH_CACHE_DIR/kernels`` (default ``~/.cache/capgraph/kernels``), one
file per hash of (source, target, NVRTC version, options), written under a file lock.

A launch reads only tensor metadata (pointers, strides, shapes) and enqueues the kernel on
torch's current stream: no host synchronisation, no device allocation, no host-device copy, so
it is recorded by ``torch.cuda.graph`` capture like any torch kernel.

The kernel has three ways to handle a packed group with both allowed and masked lanes
(:data:`MASK_KERNELS`, described in the source): ``rmw``, and the ``ahead`` and ``store``
variants, which exist for 4 and 8 columns per thread (small launches). By default (``auto``) a
launch takes the variant :data:`AUTO_VARIANTS` names for its logits' element size and columns
per thread (``store`` for fp32, ``ahead`` for 2-byte logits, ``rmw`` at 16 columns per thread);
``$CAPGRAPH_MASK_KERNEL`` (:func:`mask_kernel_variant`) or a caller of :func:`plan_launch`
names one for every launch; ``tools/bench_kernel.py`` measures all three.

Verification status: the source compiles with ``nvcc -c -arch=sm_90`` and with NVRTC (checked
on CPU-only CI by tests/test_kernel_compile.py, which also runs the kernel's arithmetic on the
host through a C++ emulation of the launch grid, driven by :func:`plan_launch` and by the
launcher below with cuda.core faked). Everything that talks to a GPU -- module loading, the
launch through cuda.core, stream and context handling, capture and replay, speed -- is
exercised by tests/test_ops_gpu.py and tools/bench_kernel.py on a machine with a GPU
(``tools/gpu_check.sh``; the figures and the card they ran on are in docs/BENCHMARKS.md).
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from .. import jit
from ..errors import ConfigError

__all__ = [
    "THREADS_PER_BLOCK",
    "BITS_PER_THREAD",
    "MASK_KERNELS",
    "MASK_KERNEL_ENV",
    "MASK_KERNEL_CHOICES",
    "AUTO_VARIANTS",
    "VARIANT_BITS_PER_THREAD",
    "LaunchPlan",
    "mask_kernel_variant",
    "auto_variant",
    "entry_points",
    "argmax_entry_points",
    "ARGMAX_WORDS_PER_BLOCK",
    "kernel_name",
    "kernel_source",
    "plan_launch",
    "plan_argmax",
    "kernel_spec",
    "compile_kernel",
    "load_kernel",
    "unavailable_reason",
]

THREADS_PER_BLOCK = 256
#: Columns per thread, one kernel instantiation each; the smallest that fits is chosen (32 was
#: slower than 16 at every large batch size measured on an H200: docs/BENCHMARKS.md).
BITS_PER_THREAD = (4, 8, 16)
#: How the kernel handles a mixed group (csrc/logits_bitmask.cu): ``rmw`` reads it after its
#: bitmask word and writes it back; ``ahead`` loads every group's logits together with its
#: bitmask word and the row's token-mask entry; ``store`` writes only its masked lanes, reading
#: no logits.
MASK_KERNELS = ("rmw", "ahead", "store")
#: What a launch may be asked to run: ``auto`` (the default: :data:`AUTO_VARIANTS`) or one of
#: :data:`MASK_KERNELS` for every launch.
MASK_KERNEL_CHOICES = ("auto",) + MASK_KERNELS
#: The environment variable that chooses among :data:`MASK_KERNEL_CHOICES` (unset or empty:
#: ``auto``).
MASK_KERNEL_ENV = "CAPGRAPH_MASK_KERNEL"
#: Columns per thread that have ``ahead`` and ``store`` entry points; a launch that needs more
#: (a large batch: bandwidth-bound, where the variants have nothing to win) runs ``rmw``.
VARIANT_BITS_PER_THREAD = (4, 8)
#: ``auto``'s variant per (bytes per logit, columns per thread); any other launch runs ``rmw``.
#: From the H200 kernel table in docs/BENCHMARKS.md (``tools/bench_kernel.py``, V = 128000,
#: random, 2%- and 98%-allowed rows, batch 1-16): fp32 launches of 4 columns per thread (batch
#: 1-4) ran fastest with ``store`` in all six cells, and of 8 (batch 16) in the 2%- and
#: 98%-allowed ones; bf16 launches (8 columns per thread at batch 1-16) ran ``ahead`` no slower
#: than ``rmw`` in any cell, and ``store`` up to 1.9x ``ahead`` on random rows.
AUTO_VARIANTS = {(4, 4): "store", (4, 8): "store", (2, 4): "ahead", (2, 8): "ahead"}
# Target residency of the launch heuristic: 2048 threads (8 blocks of 256) per SM.
_THREADS_PER_SM = 2048
#: Bitmask words (32 columns each) one block of the masked argmax covers: 8 warps of 16 words
#: (``kArgmaxWordsPerBlock`` in the source).
ARGMAX_WORDS_PER_BLOCK = 128
_MAX_GRID_Y = 65535  # rows past it are covered by the kernel's grid-stride loop
_INT32_MAX = 2**31 - 1
_DTYPE_TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_SOURCE_NAME = "logits_bitmask.cu"
_NVRTC_OPTIONS = {"std": "c++17"}  # part of the cache key


# -- entry points and launch planning (pure host arithmetic, tested on CPU) -----------------

def mask_kernel_variant() -> str:
    """The mixed-group variant a launch uses unless its caller names one: the value of
    ``$CAPGRAPH_MASK_KERNEL``, read at each call, or ``"auto"`` where it is unset or empty.

    Raises:
        ConfigError: the variable holds anything other than one of
            :data:`MASK_KERNEL_CHOICES`.
    """
    value = os.environ.get(MASK_KERNEL_ENV)
    if not value:
        return "auto"
    if value not in MASK_KERNEL_CHOICES:
        raise ConfigError(f"{MASK_KERNEL_ENV}={value!r} is not a mask kernel variant; allowed "
                          f"values: {', '.join(MASK_KERNEL_CHOICES)} (unset: auto)")
    return value


def auto_variant(dtype: torch.dtype, bits_per_thread: int) -> str:
    """``auto``'s variant for a launch of ``dtype`` logits at ``bits_per_thread`` columns per
    thread (:data:`AUTO_VARIANTS`; ``rmw`` where it names none)."""
    return AUTO_VARIANTS.get((dtype.itemsize, bits_per_thread), "rmw")


def _check_variant(variant: str, choices: tuple[str, ...] = MASK_KERNELS) -> None:
    if variant not in choices:
        raise ValueError(f"variant={variant!r}: expected one of {', '.join(choices)}")


def kernel_name(dtype: torch.dtype, bits_per_thread: int, pack: int, d2t: bool = False,
                variant: str = "rmw") -> str:
    """The extern "C" entry point for one (dtype, columns per thread, columns per access), with
    or without the draft-to-target lookup, for one of :data:`MASK_KERNELS` (``ahead`` and
    ``store`` exist without d2t, at :data:`VARIANT_BITS_PER_THREAD` only: ValueError else)."""
    _check_variant(variant)
    if d2t and variant != "rmw":
        raise ValueError(f"no {variant} entry point with d2t: the d2t entries are rmw only")
    if variant != "rmw" and bits_per_thread not in VARIANT_BITS_PER_THREAD:
        raise ValueError(f"no {variant} entry point at {bits_per_thread} columns per thread "
                         f"(only at {VARIANT_BITS_PER_THREAD})")
    return _entry_name(dtype, bits_per_thread, pack, "d2t" if d2t else variant)


def _entry_name(dtype: torch.dtype, bits: int, pack: int, kind: str) -> str:
    """The name for kind ``rmw`` (no suffix), ``d2t``, ``ahead`` or ``store``, unchecked."""
    suffix = "" if kind == "rmw" else "_" + kind
    return f"capgraph_logits_bitmask_{_DTYPE_TAGS[dtype]}_b{bits}_p{pack}{suffix}"


def _max_pack(dtype: torch.dtype) -> int:
    return 16 // dtype.itemsize  # 16-byte accesses at most


def entry_points() -> list[str]:
    """Every entry point the source defines (pack <= bits per thread, <= 16 bytes; each with
    and without d2t; the ``ahead`` and ``store`` variants at :data:`VARIANT_BITS_PER_THREAD`)."""
    names = []
    for dtype in _DTYPE_TAGS:
        packs = [p for p in (1, 2, 4, 8) if p <= _max_pack(dtype)]
        names += [kernel_name(dtype, b, p, d2t) for b in BITS_PER_THREAD for p in packs
                  if p <= b for d2t in (False, True)]
        names += [kernel_name(dtype, b, p, variant=v) for v in MASK_KERNELS[1:]
                  for b in VARIANT_BITS_PER_THREAD for p in packs if p <= b]
    return names


def argmax_entry_points() -> list[str]:
    """The masked argmax's entry points, one per logits dtype."""
    return [f"capgraph_masked_argmax_{tag}" for tag in _DTYPE_TAGS.values()]


class LaunchPlan(NamedTuple):
    """One launch: entry point, grid ``(x, y)`` of 256-thread blocks, and kernel arguments.

    ``args`` follow the kernel signature: ``(logits, logits_row_stride, bitmask,
    bitmask_row_stride, token_mask, d2t, rows, width, col_offset, indices, index_bytes,
    logits_rows, bitmask_words)``, pointers as ints (0 for null); ``rows`` counts mask rows
    (``len(indices)`` where indices are given), ``logits_rows`` the logits' rows,
    ``bitmask_words`` the words of a bitmask row (a d2t target outside them is masked). Every parameter is 64-bit on
    the device side, matching Python ints.
    """

    kernel: str
    grid: tuple[int, int]
    args: tuple[int, ...]


def _pack_width(logits: torch.Tensor) -> int:
    """Widest access (elements) that divides the width and the row stride and that the base
    pointer is aligned to: logits may be a column slice of a wider tensor."""
    rows, width = logits.shape
    size = logits.element_size()
    pack = _max_pack(logits.dtype)
    while pack > 1:
        if (width % pack == 0 and logits.data_ptr() % (pack * size) == 0
                and (rows == 1 or logits.stride(0) % pack == 0)):
            break
        pack //= 2
    return pack


def _bits_per_thread(rows: int, width: int, pack: int, sm_count: int) -> int:
    """Columns per thread: fill the GPU (8 blocks per SM) across all rows, then give each
    thread as few columns as that allows, never fewer than one packed access."""
    blocks_per_row = -(-(_THREADS_PER_SM // THREADS_PER_BLOCK) * sm_count // rows)
    needed = -(-width // (THREADS_PER_BLOCK * blocks_per_row))
    for bits in BITS_PER_THREAD:
        if needed <= bits and pack <= bits:
            return bits
    return BITS_PER_THREAD[-1]


def plan_launch(logits: torch.Tensor, bitmask: torch.Tensor, token_mask: torch.Tensor | None,
                d2t: torch.Tensor | None, col_offset: int, sm_count: int,
                indices: torch.Tensor | None = None, *, variant: str | None = None
                ) -> LaunchPlan:
    """The launch for these (already checked) arguments; reads metadata only, never data.

    ``variant`` is one of :data:`MASK_KERNEL_CHOICES`, or None for :func:`mask_kernel_variant`
    (the environment's choice, ``auto`` by default: :func:`auto_variant`); a d2t launch, or one
    that needs more columns per thread than :data:`VARIANT_BITS_PER_THREAD`, runs ``rmw``
    whatever the variant.

    Preconditions (``kernel_fits``): ``rows >= 1`` (mask rows: ``len(indices)`` where given),
    ``width >= 1``, ``col_offset + width`` in int32; ``token_mask``, ``d2t`` and ``indices``
    contiguous.
    """
    if variant is None:
        variant = mask_kernel_variant()
    else:
        _check_variant(variant, MASK_KERNEL_CHOICES)
    logits_rows, width = logits.shape
    rows = logits_rows if indices is None else indices.size(0)
    pack = _pack_width(logits)
    bits = _bits_per_thread(rows, width, pack, sm_count)
    if variant == "auto":
        variant = auto_variant(logits.dtype, bits)
    if d2t is not None:
        kind = "d2t"
    elif variant != "rmw" and bits in VARIANT_BITS_PER_THREAD:
        kind = variant
    else:
        kind = "rmw"
    grid = (-(-width // (THREADS_PER_BLOCK * bits)), min(rows, _MAX_GRID_Y))
    args = (logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
            0 if token_mask is None else token_mask.data_ptr(),
            0 if d2t is None else d2t.data_ptr(), rows, width, col_offset,
            0 if indices is None else indices.data_ptr(),
            0 if indices is None else indices.element_size(), logits_rows, bitmask.size(1))
    return LaunchPlan(_entry_name(logits.dtype, bits, pack, kind), grid, args)


def plan_argmax(logits: torch.Tensor, bitmask: torch.Tensor, token_mask: torch.Tensor | None,
                mask_rows: int, out: torch.Tensor, scratch: torch.Tensor) -> LaunchPlan:
    """The masked argmax's launch for these (already checked) arguments; reads metadata only.

    ``args`` follow the kernel signature: ``(logits, logits_row_stride, bitmask,
    bitmask_row_stride, token_mask, rows, mask_rows, width, out, keys, counts)``, pointers as
    ints (0 for no token mask); ``keys`` and ``counts`` are rows 0 and 1 of ``scratch``
    (int64 ``[2, >= rows]``, contiguous, all zero, as each launch leaves it).

    Preconditions: ``rows >= 1``, ``1 <= width <= 32 * bitmask words`` and in int32,
    ``token_mask`` contiguous, ``out`` int64 with unit stride.
    """
    rows, width = logits.shape
    words = -(-width // 32)
    grid = (-(-words // ARGMAX_WORDS_PER_BLOCK), min(rows, _MAX_GRID_Y))
    keys = scratch.data_ptr()
    args = (logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
            0 if token_mask is None else token_mask.data_ptr(), rows, mask_rows, width,
            out.data_ptr(), keys, keys + scratch.stride(0) * scratch.element_size())
    return LaunchPlan(f"capgraph_masked_argmax_{_DTYPE_TAGS[logits.dtype]}", grid, args)


def kernel_fits(logits: torch.Tensor, col_offset: int) -> bool:
    """Whether the kernel's int32 column arithmetic covers these columns."""
    return col_offset + logits.shape[1] + THREADS_PER_BLOCK * BITS_PER_THREAD[-1] <= _INT32_MAX


# -- source and compilation (needs NVRTC, not a GPU) ----------------------------------------

def kernel_source() -> bytes:
    """The CUDA source: package data ``capgraph.csrc`` when installed, else the repo's csrc/."""
    return jit.csrc_path(_SOURCE_NAME).read_bytes()


def _cuda_core():
    """cuda.core's namespace (1.x at top level, 0.x under ``experimental``)."""
    import cuda.core as core
    if not hasattr(core, "Program"):
        import cuda.core.experimental as core  # type: ignore[no-redef]
    return core


def _nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc
    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def _nvrtc_archs() -> list[int]:
    from cuda.bindings import nvrtc
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcGetSupportedArchs failed: {err}")
    return sorted(int(a) for a in archs)


class _UnsupportedArch(RuntimeError):
    pass


def _target_for(cc: int, supported: list[int]) -> tuple[str, str]:
    """(format, arch) to compile for compute capability ``cc`` (e.g. 90): a cubin where NVRTC
    knows the architecture, else PTX for the newest older one, which the driver JIT-compiles."""
    if cc in supported:
        return "cubin", f"sm_{cc}"
    older = [a for a in supported if a < cc]
    if not older:
        raise _UnsupportedArch(f"NVRTC supports sm_{supported[0]}..sm_{supported[-1]}, "
                               f"the device is sm_{cc}")
    return "ptx", f"compute_{older[-1]}"


_binaries: dict[tuple[str, str], bytes] = {}
_binaries_lock = threading.Lock()


def kernel_spec(arch: str, fmt: str) -> jit.JitSpec:
    """The :class:`~capgraph.jit.JitSpec` of the kernel for ``arch`` in ``fmt`` (``cubin`` or
    ``ptx``): NVRTC builds it; its identity is the target, NVRTC's version and the options."""
    major, minor = _nvrtc_version()

    def build(sources: list[Path], out: Path) -> None:
        out.write_bytes(_nvrtc_compile(sources[0].read_bytes(), arch, fmt))

    return jit.JitSpec(name=f"logits_bitmask-{arch}", sources=(_SOURCE_NAME,), build=build,
                       identity=(arch, fmt, f"nvrtc-{major}.{minor}",
                                 repr(sorted(_NVRTC_OPTIONS.items()))),
                       folder="kernels", suffix=f".{fmt}")


def compile_kernel(arch: str = "sm_90", fmt: str = "cubin", *, use_cache: bool = True) -> bytes:
    """NVRTC-compile the source for ``arch`` (``sm_90`` for a cubin, ``compute_80`` for PTX).

    Needs NVRTC only, no GPU. Cached in memory and, unless ``use_cache`` is False, on disk
    (:func:`kernel_spec` through :func:`capgraph.jit.build`; an unwritable cache directory
    only costs the caching).
    """
    with _binaries_lock:
        if use_cache and (arch, fmt) in _binaries:
            return _binaries[(arch, fmt)]
        if not use_cache:
            return _nvrtc_compile(kernel_source(), arch, fmt)
        try:
            binary = jit.build(kernel_spec(arch, fmt)).read_bytes()
        except jit.JitCacheError:  # no usable cache directory: compile uncached
            binary = _nvrtc_compile(kernel_source(), arch, fmt)
        _binaries[(arch, fmt)] = binary
        return binary


def _nvrtc_compile(source: bytes, arch: str, fmt: str) -> bytes:
    core = _cuda_core()
    options = core.ProgramOptions(arch=arch, name=_SOURCE_NAME, **_NVRTC_OPTIONS)
    program = core.Program(source.decode(), "c++", options)
    try:
        return bytes(program.compile(fmt).code)
    finally:
        getattr(program, "close", lambda: None)()


# -- loading and launching: the host logic is tested on CPU against a fake cuda.core; the real
# driver calls (module load, launch, streams, contexts, capture) only by tests/test_ops_gpu.py.

class _DeviceKernels:
    """The loaded module of one device, its SM count, and small caches for launches."""

    def __init__(self, core: Any, index: int) -> None:
        props = torch.cuda.get_device_properties(index)
        fmt, arch = _target_for(props.major * 10 + props.minor, _nvrtc_archs())
        binary = compile_kernel(arch, fmt)
        loader = core.ObjectCode.from_cubin if fmt == "cubin" else core.ObjectCode.from_ptx
        try:
            self._code = loader(binary, name=_SOURCE_NAME)  # keeps the library loaded
        except TypeError:  # cuda.core 0.x: no name
            self._code = loader(binary)
        self.kernels = {name: self._code.get_kernel(name)
                        for name in entry_points() + argmax_entry_points()}
        self.sm_count = props.multi_processor_count
        self._core = core
        self._configs: dict[tuple[int, int], Any] = {}
        self._streams: dict[int, Any] = {}

    def config(self, grid: tuple[int, int]) -> Any:
        config = self._configs.get(grid)
        if config is None:
            config = self._configs[grid] = self._core.LaunchConfig(
                grid=grid, block=THREADS_PER_BLOCK)
        return config

    def stream(self, torch_stream: torch.cuda.Stream) -> Any:
        """cuda.core's view of a torch stream, cached by handle (torch pools its streams)."""
        handle = torch_stream.cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            if len(self._streams) > 1024:
                self._streams.clear()
            from_handle = getattr(self._core.Stream, "from_handle", None)
            if handle == 0 and hasattr(self._core, "LEGACY_DEFAULT_STREAM"):
                stream = self._core.LEGACY_DEFAULT_STREAM  # torch's default stream is stream 0
            elif from_handle is not None:
                stream = from_handle(handle)
            else:  # older cuda.core: launch() takes any object with __cuda_stream__ (torch's do)
                stream = torch_stream
            self._streams[handle] = stream
        return stream


class _CudaLogitsBitmask:
    """The callable :func:`load_kernel` returns: ``(logits, bitmask, token_mask, d2t,
    col_offset, indices=None, *, variant=None) -> None``, arguments already checked by
    :func:`capgraph.ops.logits_bitmask` (which never passes ``variant``: that is for
    benchmarks, see :func:`plan_launch`); its :meth:`argmax` launches the masked argmax."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._devices: dict[int, _DeviceKernels] = {}
        self._lock = threading.Lock()
        self._thread = threading.local()  # devices whose context this thread made current

    def device(self, index: int) -> _DeviceKernels:
        """Compile (or read from cache) and load the module of device ``index`` once."""
        kernels = self._devices.get(index)
        if kernels is None:
            with self._lock:
                kernels = self._devices.get(index)
                if kernels is None:
                    with torch.cuda.device(index):
                        kernels = self._devices[index] = _DeviceKernels(self._core, index)
        return kernels

    def _ensure_context(self, index: int) -> None:
        # The driver launch needs a current context; torch's runtime calls make the primary
        # context current lazily, so a thread that has not run a CUDA runtime call yet may
        # have none. Once per thread and device; the primary context is the one torch uses.
        seen = getattr(self._thread, "devices", None)
        if seen is None:
            seen = self._thread.devices = set()
        if index not in seen:
            from cuda.bindings import driver
            err, ctx = driver.cuCtxGetCurrent()
            if int(err) != 0 or int(ctx) == 0:
                self._core.Device(index).set_current()
            seen.add(index)

    def __call__(self, logits: torch.Tensor, bitmask: torch.Tensor,
                 token_mask: torch.Tensor | None, d2t: torch.Tensor | None,
                 col_offset: int, indices: torch.Tensor | None = None, *,
                 variant: str | None = None) -> None:
        if logits.numel() == 0 or (indices is not None and indices.numel() == 0):
            return  # nothing to mask (and a grid of 0 rows is not a launch)
        if not kernel_fits(logits, col_offset):
            from .torch_impl import apply_logits_bitmask_
            apply_logits_bitmask_(logits, bitmask, token_mask, d2t, col_offset, indices)
            return
        # 1-D views with a stride are legal op arguments; the kernel indexes them densely
        # (a copy only for that unusual case).
        if token_mask is not None and token_mask.stride(0) != 1:
            token_mask = token_mask.contiguous()
        if d2t is not None and d2t.stride(0) != 1:
            d2t = d2t.contiguous()
        if indices is not None and indices.stride(0) != 1:
            indices = indices.contiguous()
        self._on_device(logits, lambda kernels: plan_launch(
            logits, bitmask, token_mask, d2t, col_offset, kernels.sm_count, indices,
            variant=variant))

    def argmax(self, logits: torch.Tensor, bitmask: torch.Tensor,
               token_mask: torch.Tensor | None, mask_rows: int, out: torch.Tensor,
               scratch: torch.Tensor) -> None:
        """The masked argmax (:func:`capgraph.ops.masked_argmax`, arguments checked there)
        on torch's current stream."""
        if token_mask is not None and token_mask.stride(0) != 1:
            token_mask = token_mask.contiguous()
        self._on_device(logits, lambda kernels: plan_argmax(logits, bitmask, token_mask,
                                                            mask_rows, out, scratch))

    def _on_device(self, logits: torch.Tensor,
                   plan: Callable[[_DeviceKernels], LaunchPlan]) -> None:
        """Launch ``plan(the logits' device's kernels)`` on that device's current stream."""
        index = logits.device.index
        if index is None:
            index = torch.cuda.current_device()
        if index != torch.cuda.current_device():
            with torch.cuda.device(index):  # makes that device's primary context current
                self._launch_plan(index, plan)
            return
        self._ensure_context(index)
        self._launch_plan(index, plan)

    def _launch_plan(self, index: int, plan: Callable[[_DeviceKernels], LaunchPlan]) -> None:
        kernels = self.device(index)
        launch = plan(kernels)
        stream = kernels.stream(torch.cuda.current_stream(index))
        self._core.launch(stream, kernels.config(launch.grid), kernels.kernels[launch.kernel],
                          *launch.args)


_load_lock = threading.Lock()
_loaded: list[Any] = []  # [kernel or None, reason or None] once load_kernel has run


def _load() -> tuple[Callable[..., None] | None, str | None]:
    if not torch.cuda.is_available():
        return None, "no CUDA device: torch.cuda.is_available() is False"
    try:
        core = _cuda_core()
    except ImportError as exc:
        return None, f"cuda.core is not importable ({exc})"
    try:
        _nvrtc_version()
    except Exception as exc:  # library not found, or a broken install
        return None, f"NVRTC is unavailable ({type(exc).__name__}: {exc})"
    kernel = _CudaLogitsBitmask(core)
    try:
        # Compile and load for the current device now, so that a first call inside a graph
        # capture does not compile or load a module.
        kernel.device(torch.cuda.current_device())
    except _UnsupportedArch as exc:
        return None, f"NVRTC cannot target this GPU ({exc})"
    return kernel, None


def load_kernel() -> Callable[..., None] | None:
    """The CUDA ``logits_bitmask`` kernel as a callable, or None where it cannot run.

    The first call compiles (or reads the cached binary) and loads the module for the current
    device; later calls return the same object. Call it (or run the op once eagerly) before
    capturing a CUDA graph, so that no compilation or module load happens inside the capture
    (a device first used inside a capture loads its module there: unverified on a GPU). Where
    a GPU exists but the kernel cannot be used a RuntimeWarning names the reason once (the op
    then runs its pure-torch kernel).
    """
    with _load_lock:
        if not _loaded:
            kernel, reason = _load()
            _loaded[:] = [kernel, reason]
            if kernel is None and torch.cuda.is_available():
                warnings.warn(f"capgraph: CUDA logits_bitmask kernel unavailable, using the "
                              f"pure-torch kernel: {reason}", RuntimeWarning, stacklevel=2)
        return _loaded[0]


def unavailable_reason() -> str | None:
    """Why :func:`load_kernel` returned None (None if it loaded or has not been called)."""
    return _loaded[1] if _loaded else None
