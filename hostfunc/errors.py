"""Named exceptions of hostfunc.

A host callback cannot return anything to the code that enqueued it, so every failure is turned
into one of these, carrying the name of the function involved and, where it applies, the driver
call and its result code. All derive from :class:`HostFuncBaseError`.
"""

from __future__ import annotations

import traceback as _traceback

__all__ = [
    "HostFuncBaseError",
    "HostFuncError",
    "HostFuncLaunchError",
    "HostFuncTimeoutError",
    "HostFuncUsageError",
]


class HostFuncBaseError(RuntimeError):
    """Base class of every error hostfunc raises on purpose."""


class HostFuncError(HostFuncBaseError):
    """A host callback raised; re-raised at the next :func:`hostfunc.drain` / ``synchronize``.

    Attributes:
        fn_name: qualified name of the callback that raised.
        traceback: the formatted traceback of the original exception, as text.
        later_errors: errors of other callbacks that failed before the same drain, oldest first;
            only the first failure is raised, the rest ride along here.

    ``__cause__`` is the original exception. Its frames are cleared once the traceback text has
    been taken, so that a kept error does not keep the callback's arguments (tensors) alive.
    """

    def __init__(self, fn_name: str, cause: BaseException, owner: object = None) -> None:
        self.fn_name = fn_name
        #: the object whose callback raised (a class that sets ``__hostfunc_owner__``, as
        #: the first argument of its method), or None; see :func:`hostfunc.check_errors`
        self.owner = owner
        self.traceback = "".join(
            _traceback.format_exception(type(cause), cause, cause.__traceback__))
        self.later_errors: tuple[HostFuncError, ...] = ()
        super().__init__(
            f"host callback {fn_name!r} raised {type(cause).__name__}: {cause}")
        self.__cause__ = cause
        self.__suppress_context__ = True
        if cause.__traceback__ is not None:
            _traceback.clear_frames(cause.__traceback__)


class HostFuncLaunchError(HostFuncBaseError):
    """Enqueueing a callback failed in the driver (or the stream was in a state that forbids it).

    Attributes:
        call: the driver entry point that failed, e.g. ``"cuGraphAddHostNode"``.
        result: the driver's result code (its enum name where known).
        code: the result as an int (``CUDA_ERROR_*`` value), or -1 when it has none.
        fn_name: the callback being enqueued.
    """

    def __init__(self, call: str, result: object, fn_name: str, detail: str = "") -> None:
        self.call = call
        self.result = result
        try:
            self.code = int(result)  # type: ignore[call-overload]  # a CUresult enum or int
        except (TypeError, ValueError):
            self.code = -1
        self.fn_name = fn_name
        name = getattr(result, "name", None) or repr(result)
        extra = f": {detail}" if detail else ""
        super().__init__(f"{call} failed with {name} while enqueueing {fn_name!r}{extra}")


class HostFuncTimeoutError(HostFuncBaseError, TimeoutError):
    """A wait (drain, stream or event synchronize) ran past its timeout.

    Attributes:
        what: what was being waited on (a stream or event name).
        timeout: the timeout in seconds.
    """

    def __init__(self, what: str, timeout: float) -> None:
        self.what = what
        self.timeout = timeout
        super().__init__(f"waiting on {what} timed out after {timeout:.3f} s")


class HostFuncUsageError(HostFuncBaseError):
    """The API was used in a way that cannot work, e.g. a stream waiting on itself."""
