"""The device-agnostic entry points: launch, the @hostfunc decorator, drain, and queries.

Code written against these runs unchanged on a CUDA stream (captured or not) and on the CPU
stand-in; :func:`hostfunc.backend.active_backend` decides which, per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MethodType
from typing import Any, Generic, ParamSpec, overload

from .backend import active_backend
from .registry import REGISTRY

__all__ = ["launch", "hostfunc", "HostFunction", "drain", "synchronize", "check_errors",
           "is_capturing", "live_entries"]

P = ParamSpec("P")

#: Wrappers applied to every launched callable, in order (``capgraph.testing.
#: record_host_callbacks`` adds one for its block); empty in normal use.
LAUNCH_WRAPPERS: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = []


def launch(fn: Callable[P, object], /, *args: P.args, **kwargs: P.kwargs) -> None:
    """Enqueue ``fn(*args, **kwargs)`` on the current stream; return at once.

    Eager (not capturing): the call runs once, after the work already on the stream, and its
    entry (function and arguments) is freed after it ran. Capturing (``torch.cuda.graph`` or
    :func:`hostfunc.capture`): the call is recorded into the graph and runs on every replay with
    these same argument objects, which stay alive exactly as long as the graph. Pass mutable
    holders (tensors, lists) to see new values at replay. Graph-safe.

    The GIL is released while the driver is called; the callback takes it to run. Anything the
    callback raises is re-raised by the next :func:`drain` as :class:`hostfunc.HostFuncError`.

    Raises:
        HostFuncLaunchError: the driver refused the launch (nothing was enqueued).
    """
    REGISTRY.collect()  # release what finished or what destroyed graphs handed back
    for wrap in LAUNCH_WRAPPERS:
        fn = wrap(fn)  # type: ignore[assignment]
    active_backend().launch(fn, args, kwargs)


def drain(timeout: float | None = None) -> None:
    """Wait until every callback enqueued so far has run, then re-raise the first callback error.

    On CUDA this synchronizes the current stream and every stream launched on since the last
    drain (graph replays count when launched on one of them); on the CPU stand-in, every
    HostStream. The GIL is released while waiting. While the current stream is capturing it
    does not wait (a host wait is illegal in a capture); pending errors are still raised.

    Args:
        timeout: seconds to wait at most; ``None`` waits as long as it takes.

    Raises:
        HostFuncError: a callback raised (``.fn_name``, ``.traceback``, ``__cause__``).
        HostFuncTimeoutError: ``timeout`` passed first.
    """
    REGISTRY.collect()
    active_backend().wait_all(timeout)
    REGISTRY.collect()
    REGISTRY.raise_pending()


synchronize = drain
"""Alias of :func:`drain`, spelled like ``torch.cuda.synchronize``."""


def check_errors() -> None:
    """Re-raise the first callback error seen so far without waiting for anything.

    Raises:
        HostFuncError: a callback raised since the last drain or check.
    """
    REGISTRY.collect()
    REGISTRY.raise_pending()


def is_capturing() -> bool:
    """True while the current stream (CUDA or HostStream) is being captured into a graph."""
    return active_backend().is_capturing()


def live_entries() -> int:
    """Number of enqueued or captured calls still held (for leak checks in tests).

    Entries handed back by finished eager callbacks and destroyed graphs are released first.
    A graph destroyed on CUDA hands its entries back from a driver thread, shortly after.
    """
    return REGISTRY.live()


class HostFunction(Generic[P]):
    """A function whose calls are enqueued as host callbacks (see :func:`hostfunc`).

    Calling it launches; it returns ``None`` at once. As a method it binds like a function
    (``obj.build()`` launches ``build(obj)``). The undecorated function is ``__wrapped__``.
    """

    def __init__(self, fn: Callable[P, object]) -> None:
        self.__wrapped__ = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        launch(self.__wrapped__, *args, **kwargs)

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> HostFunction[P]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., None]: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return MethodType(self, obj)


def hostfunc(fn: Callable[P, object]) -> HostFunction[P]:
    """Decorator: calling the decorated function (or method) enqueues it with :func:`launch`.

    Example::

        @hostfunc
        def build(self, batch): ...      # inside a class
        decoder.build(batch)             # enqueued on the current stream, returns None
    """
    return HostFunction(fn)
