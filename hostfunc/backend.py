"""Which backend a launch goes to: CUDA where a CUDA device is present and torch's current stream
is a CUDA stream, the CPU stand-in otherwise (and whenever a HostStream is made current)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

from . import _context
from .host_stream import explicit_stream

__all__ = ["Backend", "active_backend", "cuda_available", "get_backend", "use_backend"]


@runtime_checkable
class Backend(Protocol):
    """What a backend provides: launch, capture query, and the wait behind ``drain``."""

    name: str

    def launch(self, fn: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        """Enqueue ``fn(*args, **kwargs)`` on the current stream (recorded into the graph while
        capturing)."""

    def is_capturing(self) -> bool:
        """True while the current stream records into a graph."""

    def wait_all(self, timeout: float | None) -> None:
        """Wait until every call launched so far has run (``timeout`` seconds at most; None: no
        limit)."""


_lock = threading.Lock()
_cuda_present: list[bool] = []       # filled once by cuda_available()
_backends: dict[str, Backend] = {}   # one instance per name, made on first use


def _detect_cuda() -> bool:
    try:
        from cuda.bindings import runtime
    except Exception:  # noqa: BLE001 — bindings absent or broken: no CUDA backend
        return False
    try:
        err, count = runtime.cudaGetDeviceCount()  # an error tuple, not a raise, without a GPU
        if int(err) != 0 or not count:
            return False
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def cuda_available() -> bool:
    """True when a CUDA device, the driver bindings and a CUDA build of torch are all present.

    Detected once per process (this initialises the CUDA runtime on a GPU machine) and cached.
    """
    if _cuda_present:  # the every-launch case: no lock once detected
        return _cuda_present[0]
    with _lock:
        if not _cuda_present:
            _cuda_present.append(_detect_cuda())
        return _cuda_present[0]


def get_backend(name: str) -> Backend:
    """The process's backend instance named ``"cpu"`` or ``"cuda"`` (created on first use)."""
    backend = _backends.get(name)  # (the lock only guards creation)
    if backend is not None:
        return backend
    with _lock:
        backend = _backends.get(name)
        if backend is None:
            if name == "cpu":
                from .cpu_backend import CpuBackend
                backend = CpuBackend()
            elif name == "cuda":
                from .cuda_backend import CudaBackend
                backend = CudaBackend()
            else:
                raise ValueError(f"unknown hostfunc backend {name!r}; expected 'cpu' or 'cuda'")
            _backends[name] = backend
        return backend


def active_backend() -> Backend:
    """The backend a launch on this thread goes to now.

    In order: the innermost :func:`use_backend` on this thread; the CPU stand-in if a HostStream
    was made current with ``use_stream``; CUDA if :func:`cuda_available`; else the CPU stand-in.
    """
    stack = _context.backends.stack
    if stack:
        return stack[-1]
    if explicit_stream() is not None or not cuda_available():
        return get_backend("cpu")
    return get_backend("cuda")


@contextmanager
def use_backend(backend: str | Backend) -> Iterator[Backend]:
    """Force this thread's launches, drains and capture queries to ``backend`` (a name or an
    instance, e.g. a ``CudaBackend`` with an injected driver) inside the block."""
    chosen = get_backend(backend) if isinstance(backend, str) else backend
    if not isinstance(chosen, Backend):
        raise TypeError(f"{chosen!r} does not implement the hostfunc Backend protocol")
    stack = _context.backends.stack
    stack.append(chosen)
    try:
        yield chosen
    finally:
        stack.pop()
