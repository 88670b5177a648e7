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
from .errors import HostFuncUsageError
from .native import check_native_args
from .registry import REGISTRY

__all__ = ["launch", "launch_native", "hostfunc", "HostFunction", "drain", "synchronize",
           "check_errors", "is_capturing", "live_entries", "add_drain_hook", "remove_drain_hook",
           "record_error"]

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


def launch_native(fn: int, user_data: int, *, retain: int | None = None,
                  release: int | None = None) -> None:
    """Enqueue the C function ``fn(user_data)`` on the current stream; return at once.

    ``fn``, ``retain`` and ``release`` are addresses of C functions ``void f(void *user_data)``
    (for example read with ctypes from a loaded library); ``user_data`` is a pointer-sized int
    passed through unchanged. The call is ordered on the stream with the Python callbacks
    around it, on the same backend as :func:`launch`.

    ``fn`` runs on a thread that does not hold the GIL and never takes it: no Python runs
    between the stream reaching the call and ``fn`` returning, so it completes while another
    Python thread holds the GIL (on CUDA it is the driver's host node itself; on the CPU
    stand-in, the stream's native lane, a C thread). What ``fn`` does wrong is its own
    business: hostfunc cannot see it, and no registry entry is held (:func:`live_entries`).

    Eager (not capturing): runs once. Capturing: recorded as a host node that runs on every
    replay. Lifetime of ``user_data``: without ``retain``/``release`` the caller keeps it
    alive. With them, ``retain(user_data)`` runs now on this thread, and ``release(user_data)``
    once the work no longer needs it: captured, when the graph and all its instantiations are
    gone (CUDA: a user object whose destructor is ``release``; CPU stand-in:
    ``HostGraph.reset()`` or collection, after replays in flight finish); eager, right after
    ``fn`` ran, in stream order. ``release`` may run on any thread and must not need the GIL.

    Raises:
        HostFuncUsageError: an address is not an int or is zero, ``user_data`` is not a
            pointer-sized int, only one of ``retain``/``release`` was given, the backend runs
            no native functions, or (CPU stand-in) there is no C compiler to build the lane.
        HostFuncLaunchError: the driver refused the launch (nothing was enqueued, and a
            ``retain`` already done was undone with ``release``).
    """
    call = check_native_args(fn, user_data, retain, release)
    backend = active_backend()
    launch_call = getattr(backend, "launch_native", None)
    if launch_call is None:
        raise HostFuncUsageError(
            f"the active hostfunc backend {backend.name!r} ({type(backend).__name__}) does not "
            f"run native host functions")
    launch_call(call)


def drain(timeout: float | None = None, owner: object = None) -> None:
    """Wait until every callback enqueued so far has run, then re-raise the first callback error.

    On CUDA this synchronizes the current stream and every stream launched on since the last
    drain (graph replays count when launched on one of them); on the CPU stand-in, every
    HostStream. The GIL is released while waiting. While the current stream is capturing it
    does not wait (a host wait is illegal in a capture); pending errors are still raised.

    Args:
        timeout: seconds to wait at most; ``None`` waits as long as it takes.
        owner: raise only the errors of this owner and of none (see :func:`check_errors`).

    Raises:
        HostFuncError: a callback raised (``.fn_name``, ``.traceback``, ``__cause__``).
        HostFuncTimeoutError: ``timeout`` passed first.
    """
    REGISTRY.collect()
    active_backend().wait_all(timeout)
    _run_drain_hooks()
    REGISTRY.collect()
    REGISTRY.raise_pending(owner)


synchronize = drain
"""Alias of :func:`drain`, spelled like ``torch.cuda.synchronize``."""


def check_errors(owner: object = None) -> None:
    """Re-raise the first callback error seen so far without waiting for anything.

    Args:
        owner: only the errors of this owner's callbacks (a method of a class that sets
            ``__hostfunc_owner__ = True``, or recorded with this ``owner``) and those of no
            owner; other owners' errors stay kept for their own check or the next drain.

    Raises:
        HostFuncError: a callback raised since the last drain or check.
    """
    _run_drain_hooks()
    REGISTRY.collect()
    REGISTRY.raise_pending(owner)


#: what add_drain_hook registered, in order
_DRAIN_HOOKS: list[Callable[[], None]] = []


def add_drain_hook(hook: Callable[[], None]) -> None:
    """Have :func:`drain` (after its wait) and :func:`check_errors` call ``hook()`` before they
    raise pending errors: for work that runs outside hostfunc's view and leaves its failures
    for Python to read, such as a native host function (see :func:`launch_native`) whose
    owner turns what it recorded into :func:`record_error` calls. A hook that raises is
    reported as a callback error under its name."""
    _DRAIN_HOOKS.append(hook)


def remove_drain_hook(hook: Callable[[], None]) -> None:
    """Stop calling ``hook`` (a no-op if it is not registered)."""
    try:
        _DRAIN_HOOKS.remove(hook)
    except ValueError:
        pass


def record_error(fn_name: str, error: BaseException, owner: object = None) -> None:
    """Keep ``error`` for the next :func:`drain` / :func:`check_errors`, as if the callback
    ``fn_name`` had raised it (re-raised as :class:`HostFuncError` with ``error`` as its
    cause)."""
    REGISTRY.record_error(fn_name, error, owner)


def _run_drain_hooks() -> None:
    for hook in list(_DRAIN_HOOKS):
        REGISTRY.call(hook, (), {})


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
