"""A test helper: hold the GIL on another thread for a known window (for the tests that show a
native host function completing while Python is blocked)."""

from __future__ import annotations

import ctypes
import threading
import time


#: The native spin a GIL test's graph runs before the step it times, in ms: the holder thread
#: must stamp its window's start before the spin ends, which a garbage collection or a loaded
#: machine can delay by hundreds of ms; the window (2 s) leaves the step as much again.
LEAD_MS = 1000


def hold_gil(seconds: int, timeout: float = 30.0) -> tuple[int, int]:
    """On a new thread, hold the GIL for ``seconds`` (libc ``sleep`` through ``ctypes.PyDLL``,
    which keeps the GIL while it runs) and wait for it; return the window in CLOCK_MONOTONIC
    ns (``time.monotonic_ns``): from a stamp taken holding the GIL to ``seconds`` later (the
    sleep cannot end sooner; once it returns, the holder may lose the GIL to a waiting thread
    before it could stamp the end)."""
    window: list[int] = []

    def hold() -> None:
        libc = ctypes.PyDLL(None)
        window.append(time.monotonic_ns())
        libc.sleep(seconds)
        window.append(time.monotonic_ns())

    holder = threading.Thread(target=hold, name="gil-holder")
    holder.start()
    holder.join(timeout)
    assert len(window) == 2 and window[1] - window[0] >= seconds * 1_000_000_000, window
    return window[0], window[0] + seconds * 1_000_000_000
