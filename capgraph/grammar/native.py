"""The host build's every-step loop in C++ (``csrc/host_build.cc``), for the xgrammar backend.

Why: at batch 1-32 a decode step's host build is a few microseconds of xgrammar work per
request, and calling it from Python costs about as much again (docs/BENCHMARKS.md, "build").
The C++ loop calls xgrammar's own FFI methods (tvm-ffi Functions, handed in from Python) with
no Python in between, and reports per request a status and two counts; everything else --
which requests take it, failures, counters -- stays in :class:`capgraph.GuidedDecoder`. The
same library holds a one-pass CPU mask (:func:`cpu_apply`) for :func:`capgraph.ops.logits_bitmask`.

Where Python's headers are installed the library is also a CPython extension module
(:func:`python_module`): its ``fast_step`` reads a steady-state batch of
:class:`~capgraph.GuidedRequest` objects itself and runs the same loop with the GIL released
(:meth:`NativeBuilder.bind_fast`), so a plain decode step makes one call from Python; any other
batch is declined untouched and takes the tvm-ffi step above. Its ``fast_begin`` / ``fast_end``
split the same step in two around a thread of the library's own, which never takes the GIL:
the capturable decoder's CPU host step starts the xgrammar work there and returns, so that no
Python thread competes with a CPU forward for the GIL (see :class:`FastPath`).
``CAPGRAPH_NATIVE_PYTHON=off`` builds without it.

Nothing compiles at import. :func:`load` compiles the source on first use with the machine's
C++ compiler (``$CXX``, else ``c++``) against tvm-ffi's headers (xgrammar's own FFI layer,
installed with it) and caches the shared library on disk under
``$CAPGRAPH_CACHE_DIR/native`` (default ``~/.cache/capgraph/native``), keyed by a hash of the
source, compiler, flags and tvm-ffi version, written under a file lock. A first compile takes
a few seconds; later processes load the cached file.

``GuidedDecodingConfig.native_build`` (whose default the environment variable
``CAPGRAPH_NATIVE_BUILD`` sets) chooses: ``"auto"`` uses the loop where it compiles and warns once where it does not (the
Python build then runs, with the same results), ``"on"`` makes a failure an error, ``"off"``
keeps that decoder on the Python loop. The CPU mask (:func:`cpu_apply`) is process-wide and
follows only the environment variable: with ``CAPGRAPH_NATIVE_BUILD=off`` nothing compiles
unless a decoder asks for ``native_build="on"`` explicitly.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from .._cache import cache_dir, publish_once
from ..errors import NativeBuildError
from ..params import native_build_env

__all__ = ["FastPath", "NativeBuildError", "NativeBuilder", "load", "python_module",
           "unavailable_reason", "source_path", "cpu_apply",
           "STATUS_REJECTED", "STATUS_DEAD_END", "STATUS_FAULT", "STATUS_OVER_BUDGET",
           "TERMINATED"]

# what csrc/host_build.cc reports per request (out[k, 0]); TERMINATED is a flag on any status
# (0 is a plain OK, which the C++ steps do not report). STATUS_OVER_BUDGET: the request's
# step took longer than its budget (NativeBuilder.set_budget_ms); its rows are left unmasked
# and its counts are zero
STATUS_REJECTED, STATUS_DEAD_END, STATUS_FAULT, STATUS_OVER_BUDGET, TERMINATED = 1, 2, 3, 4, 8

_SOURCE = "host_build.cc"
_CFLAGS = ("-std=c++17", "-O3", "-fPIC", "-shared", "-fvisibility=hidden")
_LOCK_TIMEOUT_S = 300.0
_log = logging.getLogger(__name__)


def source_path() -> Path:
    """``host_build.cc``: from the installed package (``capgraph/csrc``) or the source tree."""
    try:
        res = importlib.resources.files("capgraph.csrc") / _SOURCE
        if res.is_file():
            return Path(str(res))
    except ModuleNotFoundError:  # pragma: no cover - capgraph.csrc is part of the package
        pass
    return Path(__file__).resolve().parents[2] / "csrc" / _SOURCE


def _compiler() -> list[str]:
    cxx = shlex.split(os.environ.get("CXX") or "c++")
    if not cxx or shutil.which(cxx[0]) is None:
        raise NativeBuildError(f"no C++ compiler: {' '.join(cxx) or '$CXX'!r} is not on PATH "
                               "(install g++ or set CXX)")
    return cxx


def _compiler_version(cxx: list[str]) -> str:
    try:
        out = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{' '.join(cxx)} --version failed: {e}") from e
    return out.stdout.splitlines()[0] if out.stdout else ""


def _tvm_ffi_paths() -> tuple[list[str], str]:
    import tvm_ffi.libinfo as libinfo

    includes = [libinfo.find_include_path(), libinfo.find_dlpack_include_path()]
    return includes, libinfo.find_libtvm_ffi()


def _python_flags() -> list[str]:
    """What makes the library also a CPython extension module (its ``fast_step``): Python's
    include folder and a define, where Python's headers are installed; else nothing (the
    decoder then runs its Python loop around the tvm-ffi step)."""
    include = sysconfig.get_paths().get("include") or ""
    if (os.environ.get("CAPGRAPH_NATIVE_PYTHON") or "").strip().lower() == "off" or \
            not os.path.isfile(os.path.join(include, "Python.h")):
        return []
    return ["-DCAPGRAPH_WITH_PYTHON", f"-I{include}"]


def _compile(source: Path, out: Path, cxx: list[str], includes: list[str], lib: str,
             extra: Sequence[str] = ()) -> None:
    libdir = os.path.dirname(lib)
    cmd = [*cxx, *_CFLAGS, *extra, *(f"-I{p}" for p in includes), str(source), "-o", str(out),
           f"-L{libdir}", "-ltvm_ffi", f"-Wl,-rpath,{libdir}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_LOCK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"compiling {source.name} failed: {e}") from e
    if proc.returncode:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise NativeBuildError(f"compiling {source.name} failed (exit {proc.returncode}): "
                               f"{' '.join(cmd)}\n{tail}")


def _build_library() -> Path:
    """The shared library's path: read from the disk cache or compiled into it."""
    import filelock
    import tvm_ffi

    source = source_path()
    if not source.is_file():
        raise NativeBuildError(f"{source} is missing from the installation")
    cxx = _compiler()
    includes, lib = _tvm_ffi_paths()
    extra = _python_flags()
    key = hashlib.sha256(b"\0".join(s.encode() if isinstance(s, str) else s for s in [
        source.read_bytes(), " ".join(cxx), _compiler_version(cxx), " ".join(_CFLAGS),
        getattr(tvm_ffi, "__version__", "?"), lib, " ".join(extra),
        str(sysconfig.get_config_var("EXT_SUFFIX"))])).hexdigest()[:24]
    path = cache_dir("native") / f"host_build-{key}.so"

    def compile_into(partial: Path) -> None:
        _log.info("compiling %s with %s (once per machine, a few seconds) into %s",
                  source.name, " ".join(cxx), path.parent)
        _compile(source, partial, cxx, includes, lib, extra)

    try:
        publish_once(path, compile_into, _LOCK_TIMEOUT_S)
    except (OSError, filelock.Timeout) as e:
        raise NativeBuildError(f"cannot write the native cache {path.parent}: {e}") from e
    return path


_lock = threading.Lock()
_module: Any = None
_python_module: Any = None  # the same library as a CPython extension, or False
_error: NativeBuildError | None = None


def load() -> Any:
    """The loaded module (compiled on the first call of the machine); raises
    :class:`NativeBuildError` where it cannot be built. A failure is remembered."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        try:
            import tvm_ffi

            path = _build_library()
            try:
                module = tvm_ffi.load_module(str(path))
            except Exception as e:
                raise NativeBuildError(f"loading {path} failed: {type(e).__name__}: {e}") from e
            global _python_module
            _python_module = _load_python_module(path)
            _module = module
        except NativeBuildError as e:
            _error = e
            raise
        except ImportError as e:
            _error = NativeBuildError(f"tvm-ffi (installed with xgrammar) is missing: {e}")
            raise _error from e
        return _module


def _load_python_module(path: Path) -> Any:
    """The library's CPython module (``fast_step``), or False where it was built without
    Python's headers (or fails to load: then logged, and the tvm-ffi step still serves)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader("capgraph_host_build", str(path))
    spec = importlib.util.spec_from_file_location("capgraph_host_build", str(path),
                                                  loader=loader)
    if spec is None:  # pragma: no cover - the file exists
        return False
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:  # no PyInit_: compiled without Python's headers
        _log.debug("no CPython entry in %s: %s", path, e)
        return False
    return module


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
    try:
        load()
    except NativeBuildError as e:
        return str(e)
    return None


_cpu_apply: Any = None


def cpu_apply() -> Any:
    """The library's one-pass CPU mask, ``apply_bitmask(logits, bitmask, token_mask,
    col_offset)``, or None where the library cannot be built or ``CAPGRAPH_NATIVE_BUILD=off``
    (:func:`capgraph.ops.logits_bitmask` then runs its torch code; the decoder is the one that
    warns about a missing compiler)."""
    global _cpu_apply
    if _cpu_apply is None:  # decided once per process: this runs on every CPU mask
        if native_build_env() == "off":
            _cpu_apply = False
        else:
            try:
                _cpu_apply = load().apply_bitmask
            except NativeBuildError:
                _cpu_apply = False
    return _cpu_apply or None


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
            self.step, self._errors, self._address, self._set_budget = module.make_builder(
                accept, fill, is_terminated, tvm_ffi.from_dlpack(bitmask),
                tvm_ffi.from_dlpack(token_mask), tvm_ffi.from_dlpack(self._out),
                [int(t) for t in stop_ids], int(full_words), int(tail_mask) & 0xFFFFFFFF,
                int(clear_word), int(clear_keep))
        except Exception as e:
            raise NativeBuildError(f"the native build refused its buffers: "
                                   f"{type(e).__name__}: {e}") from e
        self._keep = (bitmask, token_mask)  # the C++ side views their memory

    def errors(self) -> list[str]:
        """Messages of the last step's faulted requests and the milliseconds measured for
        its over-budget ones (as text), in request order."""
        return [str(e) for e in self._errors()]

    def set_budget_ms(self, budget_ms: float | None) -> None:
        """One request's host-step budget from the next step on (None or 0: none): a request
        whose accept and fills take longer, measured on the monotonic clock once per request
        (from the previous request's end to its own), ends with :data:`STATUS_OVER_BUDGET`. On ``FastPath.begin``'s thread,
        which runs at nice 19, an overrun also needs the thread's CPU time to agree."""
        self._set_budget(int(round((budget_ms or 0) * 1e6)))

    def bind_fast(self, matchers: list, draft_terminated: list, advanced: list, guided: list,
                  matcher_type: type, vocab_size: int, max_num_draft_tokens: int
                  ) -> FastPath | None:
        """The CPython fast path bound to a decoder's per-slot lists (mutated in place only),
        as :meth:`capgraph.GuidedDecoder._build` calls it; None where the library has no
        CPython side. ``matcher_type``'s instances must carry ``_terminated`` and
        ``_chandle`` (their FFI object's address), as ``XGrammarMatcher`` does."""
        module = python_module()
        if module is None:
            return None
        from ..requests import GuidedRequest

        state = module.make_fast(int(self._address), self.step, matchers, draft_terminated,
                                 advanced, guided, matcher_type, GuidedRequest, len(matchers),
                                 int(vocab_size), int(max_num_draft_tokens))
        return FastPath(module.fast_step, module.fast_begin, module.fast_end, module.fast_close,
                        module.fast_admit, state)


class FastPath(NamedTuple):
    """The C++ build's CPython entry bound to one decoder (:meth:`NativeBuilder.bind_fast`).

    ``step(state, requests, offsets, draft_len, clear_rows)`` reads a steady-state batch of
    :class:`~capgraph.requests.GuidedRequest` objects and builds it, the GIL released while
    xgrammar works: ``(masked, unusual)``, or None where some guided request is not the
    plain case (nothing was touched; the Python loop then runs). ``begin`` takes the same
    arguments and declines the same batches, but hands the xgrammar work to the state's own
    thread, which never takes the GIL, and returns True at once; ``end(state)`` waits for
    that work (GIL released) and returns what ``step`` would have. Between the two nothing
    may read the decoder's matchers, counters or masks (``GuidedDecoder._finish_build``).
    That thread runs at the lowest priority (nice 19) so that it never preempts the caller's
    threads; ``close(state)`` ends it (``GuidedDecoder.close``), and a later ``begin`` would
    start another. ``admit(state, requests, slot_guides)`` counts the leading requests that
    pass ``GuidedDecoder._admit``'s inline test (it only reads them).
    """

    step: Callable[..., Any]
    begin: Callable[..., Any]
    end: Callable[..., Any]
    close: Callable[..., Any]
    admit: Callable[..., int]
    state: Any
