"""The CPU stand-in's native lane: a C thread per HostStream that runs native host functions.

A Python worker thread cannot call a C function without the GIL, so each HostStream that runs
native host functions gets a :class:`Lane`: a C thread with a FIFO of calls, from
``csrc/lane.c``. That source is compiled on first use with the system C compiler (``$CC``, else
``cc``; ``-O2 -shared -fPIC -pthread``) into ``$HOSTFUNC_CACHE_DIR`` (default
``~/.cache/hostfunc``), under a name keyed by the source's hash and the compiler (its resolved
path, size and mtime), written atomically (a temporary file renamed into place, so that several
processes may build at once), and loaded with ctypes. Nothing is compiled at import; this
module is imported on the first native call.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import HostFuncTimeoutError, HostFuncUsageError

if TYPE_CHECKING:
    from .native import NativeCall

__all__ = ["AppendArgs", "Lane", "lane_library"]

SOURCE = Path(__file__).with_name("csrc") / "lane.c"
CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise HostFuncUsageError(
            f"native host functions on the CPU stand-in need a C compiler to build "
            f"hostfunc/csrc/lane.c, and {cc!r} (from $CC, else 'cc') was not found on PATH; "
            f"install one or set $CC (Python callbacks work without it)")
    return path


def _cache_dir() -> Path:
    return Path(os.environ.get("HOSTFUNC_CACHE_DIR") or Path.home() / ".cache" / "hostfunc")


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    real = os.path.realpath(compiler)
    stat = os.stat(real)
    key = hashlib.sha256(b"\0".join([
        source, real.encode(), str(stat.st_mtime_ns).encode(), str(stat.st_size).encode(),
        " ".join(CFLAGS).encode()])).hexdigest()[:24]
    out_dir = _cache_dir()
    target = out_dir / f"lane-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".lane-", suffix=".so.tmp", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise HostFuncUsageError(
                f"native host functions: compiling {SOURCE} with {compiler} failed "
                f"(exit {proc.returncode}):\n{proc.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent build renames a file just as good
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_lib_lock = threading.Lock()
_lib: list[ctypes.CDLL] = []
_lib_error: list[HostFuncUsageError] = []


def lane_library() -> ctypes.CDLL:
    """The compiled lane library (built and loaded on first call, then cached per process).

    Raises:
        HostFuncUsageError: no C compiler, or the compile failed (the reason is in the
            message; later calls raise the same error without retrying).
    """
    if _lib:
        return _lib[0]
    with _lib_lock:
        if _lib:
            return _lib[0]
        if _lib_error:
            raise _lib_error[0]
        try:
            path = _build(_compiler())
        except HostFuncUsageError as exc:
            _lib_error.append(exc)
            raise
        except (OSError, subprocess.SubprocessError) as exc:
            error = HostFuncUsageError(
                f"native host functions: building {SOURCE} into {_cache_dir()} failed: {exc}")
            _lib_error.append(error)
            raise error from exc
        lib = ctypes.CDLL(str(path))
        p, u64, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
        lib.hf_lane_create.restype = p
        lib.hf_lane_create.argtypes = []
        lib.hf_lane_push.restype = u64
        lib.hf_lane_push.argtypes = [p, p, p, p]
        lib.hf_lane_wait.restype = ctypes.c_int
        lib.hf_lane_wait.argtypes = [p, u64, i64]
        lib.hf_lane_enqueued.restype = u64
        lib.hf_lane_enqueued.argtypes = [p]
        lib.hf_lane_completed.restype = u64
        lib.hf_lane_completed.argtypes = [p]
        lib.hf_lane_close.restype = None
        lib.hf_lane_close.argtypes = [p, ctypes.c_int]
        lib.hf_lane_release.restype = None
        lib.hf_lane_release.argtypes = [p]
        _lib.append(lib)
        return lib


class Lane:
    """One C thread running native calls in order, for one HostStream (see ``csrc/lane.c``).

    ``push`` returns a ticket; ``wait(ticket)`` blocks (GIL released) until that call and every
    earlier one has returned. ``close`` ends the thread once its queue is empty (any number of
    times, from any thread); the lane stays readable after it. The C lane is freed when this
    object is collected, so no thread can call into freed memory.

    Raises:
        HostFuncUsageError: (constructor) the lane library cannot be built, or no thread.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lib = lane_library()
        handle = self._lib.hf_lane_create()
        if not handle:
            raise HostFuncUsageError(f"{name}: could not start a native lane thread")
        self._handle: int = handle
        # Freed when collected; not at interpreter exit, where weakref runs every finalizer
        # even for lanes still referenced (the exit hook of host_stream closes those).
        weakref.finalize(self, self._lib.hf_lane_release, handle).atexit = False
        self.enqueued = 0  # ticket of the latest push (pushes come under the stream's lock)
        self._reached = 0  # a ticket known to have returned

    def push(self, call: NativeCall) -> int:
        """Append ``call`` (and its ``release`` right behind it where one is given)."""
        ticket = int(self._lib.hf_lane_push(self._handle, call.fn, call.user_data,
                                            call.release or None))
        if ticket == 0:
            raise HostFuncUsageError(f"{self.name}'s native lane refused a call (closed or "
                                     f"out of memory)")
        self.enqueued = ticket
        return ticket

    def completed(self) -> int:
        """Number of calls that have returned."""
        return int(self._lib.hf_lane_completed(self._handle))

    def idle(self) -> bool:
        """Every call pushed so far has returned."""
        enqueued = self.enqueued
        return self.completed() >= enqueued

    def wait(self, ticket: int, timeout: float | None = None) -> None:
        """Block until call ``ticket`` has returned; the GIL is released while waiting.

        Raises:
            HostFuncTimeoutError: ``timeout`` seconds passed first.
        """
        if ticket <= self._reached:
            return
        ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        if not self._lib.hf_lane_wait(self._handle, ticket, ns):
            raise HostFuncTimeoutError(f"{self.name}'s native lane", timeout or 0.0)
        self._reached = max(self._reached, ticket)  # (a lost race only costs a C call)

    def close(self, wait: bool = True) -> None:
        """End the thread once its queue is empty; with ``wait``, return after it ended (GIL
        released while waiting)."""
        self._lib.hf_lane_close(self._handle, int(wait))


class AppendArgs(ctypes.Structure):
    """The ``user_data`` of :attr:`hostfunc.native.TestFunctions.append`."""

    _fields_ = [("log", ctypes.POINTER(ctypes.c_int64)),
                ("length", ctypes.POINTER(ctypes.c_int64)),
                ("value", ctypes.c_int64)]
