"""The C++ host build library (``csrc/builder.cc``, ``csrc/python_entry.cc``): loading it and
binding it to a decoder's buffers. The strategies that use it are in :mod:`capgraph.build.native`.

Why: at batch 1-32 a decode step's host build is a few microseconds of xgrammar work per
request, and calling it from Python costs about as much again (docs/BENCHMARKS.md, "build").
The C++ loop calls xgrammar's own FFI methods (tvm-ffi Functions, handed in from Python) with
no Python in between, and reports per request a status and two counts; which requests take it
and what a status means stay in Python (:mod:`capgraph.build`, :class:`capgraph.GuidedDecoder`).

Where Python's headers are installed the library is also a CPython extension module
(``csrc/python_entry.cc``, :func:`python_module`): its ``fast_step`` reads a steady-state batch
of request objects and per-slot matcher handles that Python keeps
(:meth:`NativeBuilder.bind_fast`), never the layout of Python objects: each request field is
read by the name Python hands it (:data:`capgraph.requests.NATIVE_RECORD_FIELDS`), through
the descriptor :class:`~capgraph.requests.GuidedRequest` serves it with (its ``__slots__``
member, looked up once) or, for any other object, by attribute lookup. It runs the same loop
with the GIL released, so a plain decode step makes one call
from Python; any other batch is declined untouched and takes the tvm-ffi step above. Its
``fast_begin`` / ``fast_end`` split the same step in two around a thread of the library's own,
which never takes the GIL: the capturable decoder's CPU host step starts the xgrammar work
there and returns, so that no Python thread competes with a CPU forward for the GIL (see
:class:`FastPath`).
``CAPGRAPH_NATIVE_PYTHON=off`` builds without it.

Both steps fill a step of :data:`POOL_MIN_REQUESTS` requests or more on a pool of threads of
the builder's own and the calling thread (:meth:`NativeBuilder.set_fill_threads`;
``GuidedDecodingConfig.native_fill_threads``), where the pool has been the faster lately; the
results are those of one thread. Its threads (``capgraph-fill``) never take the GIL.

Nothing compiles at import. :func:`load` builds the library (``builder.cc`` and
``python_entry.cc``) on first use through :mod:`capgraph.jit`: the machine's C++ compiler
(``$CXX``, else ``c++``) against tvm-ffi's headers (xgrammar's own FFI layer, installed with
it), cached on disk under ``$CAPGRAPH_CACHE_DIR/native`` (default ``~/.cache/capgraph/native``)
and keyed by the sources, compiler, flags and tvm-ffi version. A first compile takes a few
seconds; later processes load the cached file.

``GuidedDecodingConfig.native_build`` (whose default the environment variable
``CAPGRAPH_NATIVE_BUILD`` sets) chooses: ``"auto"`` uses the loop where it compiles and warns
once where it does not (the Python build then runs, with the same results), ``"on"`` makes a
failure an error, ``"off"`` keeps that decoder on the Python loop. The CPU mask is an op of its
own, :mod:`capgraph.ops.cpu_mask`.
"""

from __future__ import annotations

import os
import sysconfig
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np
import torch

from .. import jit
from ..errors import ConfigError, NativeBuildError

__all__ = ["FastPath", "HostNode", "NativeBuildError", "NativeBuilder", "NodeStats",
           "matcher_rollback",
           "StepThreads", "load", "python_module", "unavailable_reason", "source_path",
           "matcher_methods", "automatic_fill_threads", "POOL_MIN_REQUESTS",
           "MAX_AUTO_FILL_THREADS", "MAX_FILL_THREADS",
           "STATUS_REJECTED", "STATUS_DEAD_END", "STATUS_FAULT", "STATUS_OVER_BUDGET",
           "TERMINATED"]

# what csrc/host_build.h's Builder reports per request (out[k, 0]); TERMINATED is a flag on any
# status (0 is a plain OK, which the C++ steps do not report). STATUS_OVER_BUDGET: the
# request's step took longer than its budget (NativeBuilder.set_budget_ms); its rows are left
# unmasked and its counts are zero
STATUS_REJECTED, STATUS_DEAD_END, STATUS_FAULT, STATUS_OVER_BUDGET, TERMINATED = 1, 2, 3, 4, 8

#: The fewest requests a step needs before the fill uses more than one thread
#: (:meth:`NativeBuilder.set_fill_threads`); below it, waking the pool's threads costs more
#: than they save. Measured with ``tools/bench_fill_threads.py`` (docs/BENCHMARKS.md,
#: "native fill threads").
POOL_MIN_REQUESTS = 32
#: The most fill threads ``native_fill_threads=0`` (automatic) starts.
MAX_AUTO_FILL_THREADS = 8
#: The most fill threads a builder takes (csrc/host_build.h, kMaxFillThreads).
MAX_FILL_THREADS = 256

_LIBRARY = "host_build"
_SOURCES = ("builder.cc", "python_entry.cc")
_HEADERS = ("host_build.h",)
_PYTHON_MODULE = "capgraph_host_build"  # python_entry.cc's PyInit_ name


def source_path() -> Path:
    """``builder.cc``, the build loop's source: from the installed package
    (``capgraph/csrc``) or the source tree."""
    return jit.csrc_path(_SOURCES[0])


def _python_flags() -> list[str]:
    """What makes the library also a CPython extension module (its ``fast_step``): Python's
    include folder and a define, where Python's headers are installed; else nothing (the
    native strategy is then ``"native-loop"``: Python selection around the tvm-ffi step)."""
    include = sysconfig.get_paths().get("include") or ""
    if (os.environ.get("CAPGRAPH_NATIVE_PYTHON") or "").strip().lower() == "off" or \
            not os.path.isfile(os.path.join(include, "Python.h")):
        return []
    return ["-DCAPGRAPH_WITH_PYTHON", f"-I{include}"]


def nvtx_include() -> str | None:
    """The folder holding NVTX v3's headers (``nvtx3/nvToolsExt.h``, header-only: nothing to
    link), or None: ``$CAPGRAPH_NVTX_INCLUDE``, the CUDA toolkit's (``$CUDA_HOME``,
    ``/usr/local/cuda``), or the ``nvidia-nvtx`` wheel's (a dependency of CUDA builds of
    torch: ``nvidia/nvtx/include`` or ``nvidia/cu13/include``). With them the native host
    node marks each run as an NVTX range in the ``capgraph`` domain, as the Python stages are
    marked (``capgraph._nvtx``); ``CAPGRAPH_NVTX_INCLUDE=off`` builds without."""
    given = (os.environ.get("CAPGRAPH_NVTX_INCLUDE") or "").strip()
    if given.lower() == "off":
        return None
    candidates = [given] if given else []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "include"))
    try:
        import nvidia  # type: ignore[import-not-found]  # the namespace of NVIDIA's wheels

        for root in getattr(nvidia, "__path__", []):
            candidates.extend(sorted(str(p) for p in Path(root).glob("*/include")))
    except ImportError:
        pass
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "nvtx3", "nvToolsExt.h")):
            return folder
    return None


def _nvtx_flags() -> list[str]:
    """The native node's NVTX range, where the headers are found (:func:`nvtx_include`) and
    the library has its CPython side (the node lives there)."""
    include = nvtx_include()
    if include is None or not _python_flags():
        return []
    return ["-DCAPGRAPH_WITH_NVTX", f"-I{include}"]


def _library_spec() -> jit.JitSpec:
    """The host build library's :class:`~capgraph.jit.JitSpec` (reads the compiler's version)."""
    return jit.cxx_library(_LIBRARY, _SOURCES, headers=_HEADERS,
                           cflags=_python_flags() + _nvtx_flags())


_lock = threading.Lock()
_module: Any = None
_python_module: Any = None  # the same library as a CPython extension, or False
_error: NativeBuildError | None = None


def load() -> Any:
    """The loaded tvm-ffi module (built on the first call of the machine); raises
    :class:`NativeBuildError` where it cannot be built. A failure is remembered."""
    global _module, _python_module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        try:
            path = jit.build(_library_spec())
            module = jit.load_tvm_ffi_module(path)
            python = jit.load_python_extension(path, _PYTHON_MODULE)
            _python_module = python or False
            _module = module
        except NativeBuildError as e:
            _error = e
            raise
        return _module


def loaded() -> Any:
    """The tvm-ffi module if :func:`load` has loaded it, else None (nothing is built)."""
    return _module


def python_module() -> Any:
    """The CPython side of the library (``make_fast`` / ``fast_step``), or None where the
    library was built without Python's headers or cannot be built."""
    try:
        load()
    except NativeBuildError:
        return None
    return _python_module or None


def unavailable_reason() -> str | None:
    """None if :func:`load` succeeds, else why it does not (compiling if needed)."""
    return jit.unavailable_reason(load)


def matcher_methods(ffi_type: type) -> tuple[Any, Any, Any]:
    """xgrammar's ``accept_token``, ``fill_next_token_bitmask`` and ``is_terminated`` as
    tvm-ffi Functions, read from the type information of its matcher's FFI class."""
    info = getattr(ffi_type, "__tvm_ffi_type_info__", None)
    methods = {m.name: m.func for m in getattr(info, "methods", ())}
    try:
        return (methods["accept_token"], methods["fill_next_token_bitmask"],
                methods["is_terminated"])
    except KeyError as e:
        raise NativeBuildError(f"xgrammar's matcher type {ffi_type.__name__} has no FFI "
                               f"method {e}; this xgrammar is not supported by the native "
                               "build") from None


def matcher_rollback(ffi_type: type) -> Any:
    """xgrammar's matcher ``rollback`` as a tvm-ffi Function (the native host node's rollback
    of rejected drafts calls it), read from the type information of its matcher's FFI class."""
    info = getattr(ffi_type, "__tvm_ffi_type_info__", None)
    methods = {m.name: m.func for m in getattr(info, "methods", ())}
    if "rollback" not in methods:
        raise NativeBuildError(f"xgrammar's matcher type {ffi_type.__name__} has no FFI method "
                               "'rollback'; this xgrammar is not supported by the native host "
                               "node")
    return methods["rollback"]


class NativeBuilder:
    """One decoder's C++ build loop, bound to its host bitmask and token mask.

    Args:
        methods: ``(accept_token, fill_next_token_bitmask, is_terminated)`` callables taking
            the matcher's FFI object first (:func:`matcher_methods`; tests wrap them).
        bitmask: the host bitmask ``[rows, words]`` int32 (contiguous, CPU).
        token_mask: the host token mask ``[>= rows]`` int32.
        max_requests: most requests in one step.
        stop_ids: the stop tokens (accepting one may terminate a matcher).
        full_words, tail_mask: the bits that count for ``vocab_size_padded``
            (:func:`capgraph.bitmask.split_last_word`).
        clear: ``(word, bits)`` of the tokenizer's vocabulary when it is smaller than
            ``vocab_size_padded`` (ids from there on are cleared on every filled row), or None.
    """

    def __init__(self, methods: Sequence[Any], bitmask: torch.Tensor, token_mask: torch.Tensor,
                 max_requests: int, stop_ids: Sequence[int], full_words: int, tail_mask: int,
                 clear: tuple[int, int] | None) -> None:
        import tvm_ffi

        module = load()
        self._out = torch.zeros((max(1, max_requests), 3), dtype=torch.int32)
        self.out = self._out.numpy()  # [status, accepted, guided] per request of the last step
        clear_word, clear_keep = (-1, 0) if clear is None else (
            clear[0], (1 << clear[1]) - 1 if clear[1] else 0)
        accept, fill, is_terminated = methods
        try:
            (self.step, self._errors, self._address, self._set_budget, self._set_fill,
             self._close_pool, self._last_step, self._set_utf8) = module.make_builder(
                accept, fill, is_terminated, tvm_ffi.from_dlpack(bitmask),
                tvm_ffi.from_dlpack(token_mask), tvm_ffi.from_dlpack(self._out),
                [int(t) for t in stop_ids], int(full_words), int(tail_mask) & 0xFFFFFFFF,
                int(clear_word), int(clear_keep))
        except Exception as e:
            raise NativeBuildError(f"the native build refused its buffers: "
                                   f"{type(e).__name__}: {e}") from e
        # the fill threads run the matcher methods, which a test may hand in as Python
        # callables: they need the GIL, so the step must not hold it (tvm-ffi's default)
        self.step.release_gil = True
        # closing the pool or changing its threads waits for a step that runs on them (whose
        # fill threads may need the GIL): neither holds it while it waits
        self._close_pool.release_gil = self._set_fill.release_gil = True
        self._keep = (bitmask, token_mask)  # the C++ side views their memory
        self.fill_threads, self.pool_min_requests, self.adaptive = 1, 1, True

    def set_fill_threads(self, threads: int, min_requests: int = POOL_MIN_REQUESTS,
                         adaptive: bool = True) -> None:
        """Fill a step's requests on ``threads`` threads in all: the calling thread and
        ``threads - 1`` threads of this builder's pool (started by the first step that uses
        them, parked between steps, ended by :meth:`close`), for a step of at least
        ``min_requests`` requests; one thread below (``threads=1``: always). The results are
        the same; a request's host-step budget is measured on the thread that runs it.
        ``FastPath.begin``'s thread, which yields to the caller's, always fills alone.

        ``adaptive`` (default): such a step runs on the pool only while the pool has been
        faster per request than the calling thread alone (each side's recent average; the
        other side runs a step now and then to stay measured: every 16th while the pool
        wins, from every 16th to every 256th while it loses), so a machine whose cores are
        busy with other work pays next to nothing for the pool. The step that starts the
        pool's threads is not measured, and each side first runs two steps whose times only
        seed its average (the pool's first), so one-time costs of a thread's first work do
        not decide the choice. False: the pool runs every such step
        (``tools/bench_fill_threads.py`` measures it so).

        Raises:
            ConfigError: ``threads`` outside ``[1, MAX_FILL_THREADS]``, ``min_requests``
                below 1 (either not an int), or ``adaptive`` not a bool.
        """
        for name, value, low, high in (("threads", threads, 1, MAX_FILL_THREADS),
                                       ("min_requests", min_requests, 1, None)):
            if type(value) is not int or value < low or (high is not None and value > high):
                bound = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ConfigError(f"NativeBuilder.set_fill_threads: {name}={value!r}, "
                                  f"expected an int {bound}")
        if type(adaptive) is not bool:
            raise ConfigError(f"NativeBuilder.set_fill_threads: adaptive={adaptive!r}, "
                              "expected a bool")
        self._set_fill(threads, min_requests, adaptive)
        self.fill_threads, self.pool_min_requests, self.adaptive = threads, min_requests, \
            adaptive

    def set_utf8(self, tables: Any) -> None:
        """Guard the masks with ``tables`` (:class:`~capgraph.grammar.utf8.Utf8Tables`) from
        now on: a matcher whose guard was handed to the C++ side (``utf8_guard_new``, which
        ``XGrammarMatcher.native_handle`` calls) refuses a token whose bytes are not UTF-8
        after its text, and each row it fills is ANDed with the tokens that are."""
        import tvm_ffi

        trans = torch.from_numpy(tables.trans)
        allowed = torch.from_numpy(tables.allowed)
        self._set_utf8(tvm_ffi.from_dlpack(trans), tvm_ffi.from_dlpack(allowed))
        self._utf8 = (trans, allowed)  # (the C++ side views their memory)

    def last_step(self) -> StepThreads:
        """How the last step's requests ran (:class:`StepThreads`)."""
        threads, pooled, start_ns, end_ns = (int(x) for x in self._last_step())
        return StepThreads(threads, pooled, start_ns, end_ns)

    def close(self) -> None:
        """End the fill threads (parked between steps: at once; a step running on them is
        waited for); a later step that uses the pool starts new ones."""
        self._close_pool()

    def errors(self) -> list[str]:
        """Messages of the last step's faulted requests and the milliseconds measured for
        its over-budget ones (as text), in request order."""
        return [str(e) for e in self._errors()]

    def set_budget_ms(self, budget_ms: float | None) -> None:
        """One request's host-step budget from the next step on (None or 0: none): a request
        whose accept and fills take longer, measured on the monotonic clock once per request
        (from the end of the previous request on the same thread to its own), ends with
        :data:`STATUS_OVER_BUDGET` where the thread's CPU time agrees (a thread preempted, at
        nice 19 behind busier ones, or waiting for the GIL spends wall time, not the budget)."""
        self._set_budget(max(1, round(budget_ms * 1e6)) if budget_ms else 0)

    def bind_fast(self, handles: list, draft_terminated: list, advanced: list, guided: list,
                  vocab_size: int, max_num_draft_tokens: int) -> FastPath | None:
        """The CPython fast path bound to a decoder's per-slot lists (mutated in place only);
        None where the library has no CPython side.

        ``handles``: per slot, kept in step with the slot's matcher, None (no matcher), the
        address of the matcher's xgrammar FFI object (``XGrammarMatcher.ffi_address``: the
        C++ runs it with this builder's methods), or anything else (a matcher only Python can
        run: a batch that needs it is declined). ``draft_terminated``, ``advanced``,
        ``guided``: the slots' drafting-stopped flags (exact bools) and last-build counters.
        The entry reads :class:`~capgraph.requests.GuidedRequest`'s
        :data:`~capgraph.requests.NATIVE_RECORD_FIELDS` through the type's descriptors, any
        other request object by attribute lookup."""
        from ..requests import NATIVE_RECORD_FIELDS, GuidedRequest

        module = python_module()
        if module is None:
            return None
        state = module.make_fast(int(self._address), self.step, handles, draft_terminated,
                                 advanced, guided, GuidedRequest, NATIVE_RECORD_FIELDS,
                                 len(handles), int(vocab_size), int(max_num_draft_tokens))
        return FastPath(module.fast_step, module.fast_begin, module.fast_end, module.fast_close,
                        module.fast_admit, state)


class StepThreads(NamedTuple):
    """How a step's requests ran (:meth:`NativeBuilder.last_step`): on ``threads`` threads
    (the calling one included; 0: no request), ``pool_requests`` of them on the pool's
    threads, from ``start_ns`` to ``end_ns`` on the monotonic clock that
    :func:`time.monotonic_ns` reads (Linux: ``CLOCK_MONOTONIC``)."""

    threads: int
    pool_requests: int
    start_ns: int
    end_ns: int


def automatic_fill_threads(cores: int | None = None) -> int:
    """The fill threads ``GuidedDecodingConfig.native_fill_threads=0`` stands for:
    ``min(cores, MAX_AUTO_FILL_THREADS)``, ``cores`` the CPUs this process may run on
    (``os.sched_getaffinity``, else ``os.cpu_count()``); 1 on one core."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_AUTO_FILL_THREADS))


class FastPath(NamedTuple):
    """The C++ build's CPython entry bound to one decoder (:meth:`NativeBuilder.bind_fast`).

    ``step(state, requests, offsets, draft_len, clear_rows)`` reads a steady-state batch of
    request objects (a list; fields by :data:`capgraph.requests.NATIVE_RECORD_FIELDS`) and
    builds it, the GIL released while xgrammar works: ``(masked, unusual)``, or None where
    some guided request is not the plain case (nothing was touched;
    :class:`~capgraph.build.native.NativeLoopBuild` then runs it). ``begin`` takes the same
    arguments and declines the same batches, but hands the xgrammar work to the state's own
    thread, which never takes the GIL, and returns True at once; ``end(state)`` waits for
    that work (GIL released) and returns what ``step`` would have. Between the two nothing
    may read the decoder's matchers, counters or masks (``GuidedDecoder._finish_build``).
    That thread runs at the lowest priority (nice 19) so that it never preempts the caller's
    threads; ``close(state)`` ends it (``GuidedDecoder.close``), and a later ``begin`` would
    start another. ``admit(state, requests, slot_guides, slot_owners)`` counts the leading
    requests that pass the inline admission test
    (:meth:`capgraph.admission.Admission.admit`; it only reads them).
    """

    step: Callable[..., Any]
    begin: Callable[..., Any]
    end: Callable[..., Any]
    close: Callable[..., Any]
    admit: Callable[..., int]
    state: Any


#: the kinds of :meth:`HostNode.take`'s records, by their number
NODE_RECORDS = ("step", "rollback", "draft_start", "draft_build", "draft_end")


class NodeStats(NamedTuple):
    """Counters of a :class:`HostNode`: steps run (``python_runs`` of them Python steps), the
    monotonic-clock nanoseconds (``time.monotonic_ns``'s clock) at which its latest run (a
    step, a rollback or a draft step) began and ended, the nanoseconds spent in all of them
    (a step's wait for its batch after launch not counted), the rows the steps and draft steps
    guided, and
    the rollbacks of rejected drafts run (``python_rollback_runs`` of them Python's), the
    draft steps of drafting loops run (``python_draft_runs`` of them Python's), and when the
    latest run had its job (``last_job_ns``: after a step's wait for its batch after launch,
    else its start)."""

    runs: int
    python_runs: int
    last_start_ns: int
    last_end_ns: int
    busy_ns: int
    rows: int
    rollback_runs: int
    python_rollback_runs: int
    draft_runs: int
    python_draft_runs: int
    last_job_ns: int


class HostNode:
    """A capturable decoder's step as a native host function (``csrc/python_entry.cc``, "the
    native host node"), which a captured graph calls as its host node through
    :func:`hostfunc.launch_native` (``run(launch)``, ``launch`` from :meth:`launch`; ``retain``
    / ``release`` tie the node's life to the graph) and which never takes the GIL for a
    steady-state batch.

    Per step: :meth:`push` (at ``add_batch``) reads the batch's requests into a native job, or
    declines a batch that is not the plain case, which :meth:`push_python` then queues as a
    Python step (the node takes the GIL and calls ``fallback(epoch, rows, launch)``); the node runs
    the job when the stream reaches it; :meth:`take` (after the step's sync) returns what it
    did. Each launch carries the logits rows its step masks (:meth:`launch`): a captured graph
    keeps those of its capture, and a request of a replayed batch whose bitmask rows lie past
    them fails (a ``LayoutError``: its tokens would be sampled unmasked).
    :meth:`set_slot` keeps the node's per-slot table in step with the decoder's matchers.

    The rollback of rejected drafts is a second C function, ``run_rollback(launch)``: it rolls
    the requests of the batch the next step runs back to the accepted counts in ``counts``
    (by batch position), from the tokens each slot's matcher advanced in its last step, which
    the node keeps itself (:meth:`sync_counts` hands it Python's after a Python stage). After
    a Python step, for a slot holding a draft tree (until the node builds the slot again), or
    for a slot whose matcher only Python can run, it calls ``rollback_fallback()`` under the
    GIL instead.

    A drafting loop's steps are C functions too (``run_draft(launch)``, the launch naming the
    step's index in the loop): the first takes the loop's batch off the queue and rolls its
    rejected drafts back, each builds the draft rows from the draft-token buffer ``drafts``
    (by batch position), the last rolls the loop's draft advances back; which step is the
    last is read from the loop's batch (its runtime draft length) when the step runs, and a
    step past it guides nothing. A loop the node cannot run (as for a rollback, or a batch
    with context requests) is ``draft_fallback(draft_step, rows, launch)`` under the GIL, from its
    first step to its last.

    Args:
        fast: the decoder's :class:`FastPath` (its Builder and request fields).
        buffer: the decoder's pinned ``[positions, max_num_sequences]`` int32 token buffer,
            read by the node for requests whose tokens come from it.
        fallback: ``fallback(epoch, rows, launch)``, the decoder's Python host step (called
            under the GIL on the node's thread; it must not raise); ``launch``: the address of
            the launch it runs for (:meth:`launch`; its pruned draft vocabulary:
            :meth:`reach_of`).
        counts: the decoder's pinned ``[max_num_sequences]`` int32 accepted-count buffer.
        rollback: xgrammar's matcher rollback (:func:`matcher_rollback`).
        rollback_fallback: the decoder's Python rollback (as ``fallback``).
        drafts: the decoder's pinned ``[max_num_sequences]`` int32 draft-token buffer.
        draft_fallback: the decoder's Python draft step (as ``fallback``).
        ticket: the decoder's pinned one-element int32 step ticket: ``add_batch`` writes its
            epoch modulo ``ticket_ring`` there in stream order, so that a step takes its own
            job (a later ``add_batch`` may have queued the next one already).
        ticket_ring: the ticket's modulus.
    """

    def __init__(self, fast: FastPath, buffer: torch.Tensor,
                 fallback: Callable[[int, int, int], None], counts: torch.Tensor, rollback: Any,
                 rollback_fallback: Callable[[], None], drafts: torch.Tensor,
                 draft_fallback: Callable[[int, int, int], None],
                 ticket: torch.Tensor, ticket_ring: int) -> None:
        module = python_module()
        if module is None or not hasattr(module, "node_create"):
            raise NativeBuildError("the host build library has no native host node (built "
                                   "without Python's headers)")
        if buffer.device.type != "cpu" or buffer.dtype != torch.int32 or buffer.dim() != 2 \
                or not buffer.is_contiguous():
            raise NativeBuildError(f"the host node's token buffer must be a contiguous CPU "
                                   f"int32 [positions, slots] tensor, got {buffer.dtype} "
                                   f"{tuple(buffer.shape)} on {buffer.device}")
        for name, t, size in (("count", counts, buffer.shape[1]),
                              ("draft-token", drafts, buffer.shape[1]), ("ticket", ticket, 1)):
            if t.device.type != "cpu" or t.dtype != torch.int32 \
                    or tuple(t.shape) != (size,) or not t.is_contiguous():
                raise NativeBuildError(f"the host node's {name} buffer must be a contiguous "
                                       f"CPU int32 [{size}] tensor, got {t.dtype} "
                                       f"{tuple(t.shape)} on {t.device}")
        chandle = getattr(rollback, "__chandle__", None)
        if chandle is None:
            raise NativeBuildError(f"the host node's rollback must be a tvm-ffi Function, got "
                                   f"{type(rollback).__name__}")
        self._module = module
        self._fast = fast
        #: the C functions ``f(launch)``: a step, a rollback, a drafting loop's step; and the
        #: launch's retain / release for :func:`hostfunc.launch_native`
        self.run: int
        self.run_rollback: int
        self.run_draft: int
        self.retain: int
        self.release: int
        (self._capsule, self.run, self.retain, self.release, self.run_rollback,
         self.run_draft) = module.node_create(fast.state, buffer, buffer.data_ptr(),
                                            buffer.shape[0], fallback, counts,
                                            counts.data_ptr(), rollback, chandle(),
                                            rollback_fallback, drafts, drafts.data_ptr(),
                                            draft_fallback, ticket, ticket.data_ptr(),
                                            ticket_ring)
        self._push, self._push_python = module.node_push, module.node_push_python
        self._repeat = module.node_repeat
        self._commit = module.node_commit
        self._drop, self._set_slot, self._take = (module.node_drop, module.node_set_slot,
                                                  module.node_take)
        self._forget_slot = module.node_forget_slot
        self._pending = module.node_pending
        self._sync = module.node_sync_counts
        self._launches: dict[tuple[int, int, bytes | None], int] = {}
        self._reaches: dict[int, np.ndarray | None] = {}  # by launch address
        _shutdown_at_exit(module)

    def launch(self, rows: int, draft_step: int = -1, reach: np.ndarray | None = None) -> int:
        """The address to launch the node's C functions with for a step that masks ``rows``
        logits rows (``draft_step``: the index of a drafting loop's step; -1 for a step or a
        rollback; ``reach``: the step's pruned draft vocabulary as the int32 bitmask
        words of the target ids it reaches, :meth:`LogitsChecks.reach
        <capgraph.tensor_checks.LogitsChecks.reach>`: a row allowing none of them is
        left unmasked). Made once per shape and table contents (a table given anew each
        step makes no new launch); it lives as long as the node."""
        key = (rows, draft_step, None if reach is None else reach.tobytes())
        address = self._launches.get(key)
        if address is None:
            address = self._launches[key] = self._module.node_launch(self._capsule, rows,
                                                                     draft_step, key[2])
            self._reaches[address] = reach
        return address

    def reach_of(self, launch: int) -> np.ndarray | None:
        """The pruned draft vocabulary :meth:`launch` made ``launch`` with (None: none): what a
        Python step the node runs for that launch guards its rows with."""
        return self._reaches.get(launch)

    def push(self, requests: list, offsets: list, draft_len: int, clear_rows: int, epoch: int,
             from_buffer: bool, ticketed: bool) -> tuple[list[int], list[int]] | None:
        """Read the step's native job and return the batch indices of the requests whose
        matchers the caller creates now, before the step runs: ``(context requests at their
        last chunk, disaggregated requests at their first generation step)``; the node fills
        a context request's row without accepting a token, and an earlier chunk has nothing to
        do. The job is queued now where there are none, else by :meth:`commit`, which the
        caller must call next. None (nothing queued) where the batch is not the plain case
        (every guided request a target request, generating with a chain of drafts or in its
        context phase, exact-int fields in range, each slot once). ``from_buffer``: a
        generation request with a ``prev_seq_slot`` takes its token and drafts from the token
        buffer (its slot's column) when the node runs. ``ticketed``: ``add_batch`` wrote the
        epoch to the ticket."""
        inits = self._push(self._capsule, self._fast.state, requests, offsets, draft_len,
                           clear_rows, epoch, from_buffer, ticketed)
        return inits or None

    def commit(self, handles: list | None) -> None:
        """Queue the job :meth:`push` left waiting, with the matchers created for its inits
        (in the order push returned them: context, then disaggregated) as handles (an FFI
        object's address, or None where the creation failed: the slot is cleared); the job
        installs them in their slots when it runs natively, so that a step queued before it
        still runs the slots' previous matchers. ``handles`` None: queue a Python step instead
        (a matcher only Python can run was created)."""
        self._commit(self._capsule, handles)

    def repeat(self, tokens: list, epoch: int, ticketed: bool) -> bool:
        """Queue the job :meth:`push` queued last again as ``epoch``'s, each request's token
        ``tokens[its batch index]`` (one item per request of that batch). False (nothing
        queued) where that job was not every guided request generating with its own token and
        no drafts, another job was queued since, or a token the job reads is not an exact
        int in the vocabulary."""
        return self._repeat(self._capsule, tokens, epoch, ticketed)

    def push_python(self, epoch: int, ticketed: bool, drops: Sequence[int] = ()) -> None:
        """Queue a Python step (the node calls ``fallback(epoch)`` under the GIL). ``drops``:
        the slots its batch drops (failed requests' matchers), which the node clears itself
        where a queue error consumes the step instead of running it."""
        self._push_python(self._capsule, epoch, ticketed, [int(s) for s in drops])

    def drop(self, newest: bool = False) -> bool:
        """Forget the oldest queued step (its batch was consumed host side), or the newest;
        False if none was queued."""
        return self._drop(self._capsule, newest)

    def forget_slot(self, slot: int) -> int:
        """The queued steps (none has taken them yet) run nothing for ``slot``: its request
        was released before its step. Their entries there are skipped, their matchers for it
        not installed, and the last step is no longer repeated; how many were taken out."""
        return self._forget_slot(self._capsule, slot)

    def set_slot(self, slot: int, handle: Any, stopped: bool) -> None:
        """What the node runs for ``slot`` from now on: ``handle`` as in
        :meth:`NativeBuilder.bind_fast` (None, an FFI object's address, or anything else for a
        matcher only Python can run, which makes a step holding the slot a Python step);
        ``stopped``: the slot's drafting loop stopped guiding it (skipped)."""
        self._set_slot(self._capsule, slot, handle, stopped)

    def take(self, advanced: list, guided: list, drafted: list) -> list[tuple]:
        """What the node did since the last call, in order, as ``(kind, epoch, queue error or
        None, masked, unusual, columns, rolled, stale)``; ``kind``: one of :data:`NODE_RECORDS`
        (a step; a rollback; a drafting loop taking its batch, a draft step's build, its
        end); ``epoch``: the batch the record's indices refer to (for a queue error: the
        latest batch consumed); ``stale``: the batch indices of unusual requests whose slot
        holds another matcher by now (a later step's new request); ``unusual`` as
        :attr:`FastPath.step`'s (a rollback's and a loop end's ``(batch index, 1, text)``
        where a count cannot roll back and ``(batch index, 2, "Kind: message")`` where the
        matcher raised); ``columns``: None or ``[(batch index, [token, drafts...])]`` read
        from the token buffer, for the unusual requests alone (what their reports name);
        ``rolled``: for a rollback the slots whose matchers rolled back, for a loop end every
        slot of its batch, for a step the slots whose rollback left out it settled first (see
        :meth:`sync_counts`), else None. Their counters are written to ``advanced`` / ``guided``
        / ``drafted`` (per slot), where the slot's matcher is still the one the run used."""
        return self._take(self._capsule, advanced, guided, drafted)

    def pending(self) -> tuple[int, int, bool]:
        """What :meth:`take` would return now, without taking it: ``(records, latest epoch
        (-1 where none), plain)``; ``plain``: every record is a step's with no queue error,
        no matcher installed and every request's status ok, so that reading it changes
        nothing on the host side but the counters and which batch ran."""
        return self._pending(self._capsule)

    def sync_counts(self, advanced: list, drafted: list, trees: list,
                    due: Iterable[int]) -> None:
        """The node's per-slot advance and draft-advance counts from the decoder's lists
        (after a Python stage changed them), which slots hold a draft tree (``trees``,
        :attr:`SlotState.draft_trees <capgraph.build.slots.SlotState.draft_trees>`: not
        None): the rollback of such a slot is Python's, until the node builds the slot; and
        which slots are due: their last step advanced drafts and no rollback of rejected
        tokens has run for them since, so the next step that runs one rolls it back to its
        request's ``num_accepted_draft_tokens`` first (as the decoder's build settles a
        rollback left out)."""
        self._sync(self._capsule, advanced, drafted, trees, due)

    def due(self) -> list[int]:
        """The slots due now (see :meth:`sync_counts`), as the node's runs so far left
        them: what a Python stage starts from."""
        return self._module.node_due(self._capsule)

    def set_warmup(self, on: bool) -> None:
        """From now on the node's runs take no job and mask nothing (graph warm-up), or
        run steps again."""
        self._module.node_set_warmup(self._capsule, on)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the latest batch consumed (the next unticketed job's must be one
        more)."""
        self._module.node_set_epoch(self._capsule, epoch)

    def set_batch_wait(self, milliseconds: int, epoch: int | None = None) -> None:
        """The batch after launch: from now on a step's batch is the epoch after the last
        consumed, and a step that finds none queued waits up to ``milliseconds`` (on its own
        thread, no GIL) for :meth:`push` / :meth:`commit` / :meth:`push_python` to queue it;
        0: the mode is off (a waiting step is woken). ``epoch``: the latest epoch the host has
        put, every queued job dropped: the epochs resynchronised, a stopped mode resumed."""
        self._module.node_set_batch_wait(self._capsule, int(milliseconds), epoch)

    def batch_wait_stopped(self) -> bool:
        """Whether a step's wait for its batch ran out: every step masks nothing until
        :meth:`set_batch_wait` resynchronises the epochs."""
        return bool(self._module.node_batch_wait_stopped(self._capsule))

    def stats(self) -> NodeStats:
        """The node's counters and latest timestamps."""
        return NodeStats(*self._module.node_stats(self._capsule))


_exit_hooked: list[bool] = []


def _shutdown_at_exit(module: Any) -> None:
    """At interpreter exit, stop the nodes' Python steps (no thread may enter Python then)."""
    if not _exit_hooked:
        import atexit

        _exit_hooked.append(True)
        atexit.register(module.node_shutdown)
