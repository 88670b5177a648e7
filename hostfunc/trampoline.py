"""The two C function pointers the CUDA driver calls: run an entry, hand an entry back.

Both are ``void fn(void *userData)`` ctypes callbacks created once and kept for the life of the
process (a pointer the driver still holds must never dangle). ``userData`` is a registry key, not
a pointer, so nothing the driver keeps refers to Python memory.

ctypes takes the GIL when a driver thread calls in and prints-and-drops any exception that
escapes, so neither function lets one escape: a callback's failure is kept by the registry for
the next drain.

UNVERIFIED (needs a GPU): a CUDA graph still alive when the interpreter finalizes may have its
user-object destructor called by the driver after Python can no longer give a foreign thread
the GIL; CPython then ends or parks that driver thread. Reset captured graphs before exit.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import traceback

from .registry import REGISTRY

__all__ = ["trampoline_addresses"]

HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _run_entry(user_data: int | None) -> None:
    try:
        REGISTRY.run(user_data or 0)
    except BaseException as exc:  # noqa: BLE001 — nothing may propagate into the driver
        _last_resort(exc, "running a host callback")


def _release_entry(user_data: int | None) -> None:
    # Called by the driver's user-object destructor thread when the last graph (or graph exec)
    # holding the entry is destroyed. It must not call CUDA nor drop tensors here: it only
    # queues the key; the next launch/drain/live_entries on a Python thread releases it.
    try:
        REGISTRY.defer_release(user_data or 0)
    except BaseException as exc:  # noqa: BLE001
        _last_resort(exc, "releasing a captured host callback")


def _last_resort(exc: BaseException, what: str) -> None:
    try:
        REGISTRY.record_error(f"<hostfunc trampoline: {what}>", exc)
    except BaseException:  # noqa: BLE001 — the registry itself failed: print, never raise
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


_lock = threading.Lock()
_kept: list[object] = []  # the ctypes callback objects; never emptied


def trampoline_addresses() -> tuple[int, int]:
    """Addresses of the (run, release) callbacks, created on first call and kept forever."""
    with _lock:
        if not _kept:
            _kept.extend([HOST_FN(_run_entry), HOST_FN(_release_entry)])
        run, release = _kept
    return _address(run), _address(release)


def _address(callback: object) -> int:
    address = ctypes.cast(callback, ctypes.c_void_p).value  # type: ignore[arg-type]
    assert address, "ctypes gave a NULL callback address"
    return address
