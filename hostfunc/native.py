"""Native host functions: what a call is, its argument checks, and calling C from Python.

A native host function is a C function ``void fn(void *user_data)`` given by address. It runs
on a thread that does not hold the GIL and never takes it, so it completes while another Python
thread holds the GIL (see :func:`hostfunc.launch_native`). On CUDA the driver calls it as a host
node; on the CPU stand-in a stream's native lane does (:mod:`hostfunc.lane`, a C thread).

:func:`test_functions` gives the addresses of small native functions compiled with the lane,
for tests and demos. Importing this module loads neither ctypes nor the lane library.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import HostFuncUsageError

__all__ = ["NativeCall", "TestFunctions", "call_c", "check_native_args", "copy_function",
           "test_functions"]

_ADDRESS_MAX = 2 * (sys.maxsize + 1) - 1  # the largest pointer value


class NativeCall(NamedTuple):
    """One native host call: ``fn(user_data)``, with the optional ``retain``/``release`` pair
    that ties ``user_data``'s lifetime to the enqueued or captured call (0: none)."""

    fn: int
    user_data: int
    retain: int = 0
    release: int = 0


def check_native_args(fn: object, user_data: object, retain: object,
                      release: object) -> NativeCall:
    """Validate :func:`hostfunc.launch_native`'s arguments.

    Raises:
        HostFuncUsageError: an address is not an int, is zero or does not fit a pointer;
            ``user_data`` is not a pointer-sized int; only one of ``retain``/``release``.
    """
    if (type(fn) is int and 0 < fn <= _ADDRESS_MAX and retain is None and release is None
            and type(user_data) is int and 0 <= user_data <= _ADDRESS_MAX):
        return NativeCall(fn, user_data)  # the every-step case, checked without a closure

    def address(name: str, value: object) -> int:
        if type(value) is not int:  # bool is an int subclass; so are IntEnums: refuse both
            raise HostFuncUsageError(
                f"launch_native: {name} must be a C function address (int), got "
                f"{type(value).__name__} {value!r}")
        if not 0 < value <= _ADDRESS_MAX:
            raise HostFuncUsageError(
                f"launch_native: {name} must be a nonzero pointer-sized address, got {value:#x}")
        return value

    if (retain is None) != (release is None):
        given, missing = ("retain", "release") if release is None else ("release", "retain")
        raise HostFuncUsageError(
            f"launch_native: {given} was given without {missing}; give both or neither")
    if type(user_data) is not int or not 0 <= user_data <= _ADDRESS_MAX:
        raise HostFuncUsageError(
            f"launch_native: user_data must be a pointer-sized int (0 allowed), got "
            f"{type(user_data).__name__} {user_data!r}")
    return NativeCall(address("fn", fn), user_data,
                      0 if retain is None else address("retain", retain),
                      0 if release is None else address("release", release))


_host_fn: list[Callable[[int], Any]] = []  # ctypes.CFUNCTYPE(None, c_void_p), made on first use


def call_c(fn: int, user_data: int) -> None:
    """Call the C function at ``fn`` with ``user_data`` on this thread (the GIL is released
    during the call, as for every ctypes CFUNCTYPE call)."""
    if not _host_fn:
        import ctypes
        _host_fn.append(ctypes.CFUNCTYPE(None, ctypes.c_void_p))
    _host_fn[0](fn)(user_data)


@dataclass(frozen=True, slots=True)
class TestFunctions:
    """Addresses of the native functions compiled with the lane, for tests and demos only.

    Attributes:
        spin_ns: busy-waits (no sleep) for ``user_data`` nanoseconds.
        timestamp_ns: writes CLOCK_MONOTONIC nanoseconds (``time.monotonic_ns``) into the
            int64 that ``user_data`` points to.
        count_call, count_retain, count_release: add one to element 0, 1, 2 of the int64[3]
            that ``user_data`` points to (a retain/release pair and a call counter).
        append: ``user_data`` points to ``{int64 *log; int64 *length; int64 value}``;
            writes ``value`` at ``log[*length]`` and increments ``*length``.
    """

    __test__ = False  # not a pytest test class

    spin_ns: int
    timestamp_ns: int
    count_call: int
    count_retain: int
    count_release: int
    append: int


def _address(name: str) -> int:
    """The address of the lane library's C function ``name`` (builds the library if needed)."""
    import ctypes

    from .lane import lane_library
    return int(ctypes.cast(getattr(lane_library(), name), ctypes.c_void_p).value or 0)


def copy_function() -> int:
    """The address of a native host function that copies bytes: ``user_data`` points to
    ``{void *dst; const void *src; uint64 nbytes}`` (three uint64), which, like both buffers,
    must stay valid while a call may run (captured into a HostGraph:
    :meth:`~hostfunc.HostGraph.keep_alive`). A copy a HostGraph replays, as a CUDA graph
    replays its copy nodes, without the GIL.

    Raises:
        HostFuncUsageError: the lane library cannot be built (no C compiler).
    """
    return _address("hf_copy_bytes")


def test_functions() -> TestFunctions:
    """The addresses of the test and demo functions (builds the lane library if needed).

    Raises:
        HostFuncUsageError: the lane library cannot be built (no C compiler).
    """
    return TestFunctions(_address("hf_test_spin_ns"), _address("hf_test_timestamp_ns"),
                         _address("hf_test_count_call"), _address("hf_test_count_retain"),
                         _address("hf_test_count_release"), _address("hf_test_append"))


test_functions.__test__ = False  # type: ignore[attr-defined]
